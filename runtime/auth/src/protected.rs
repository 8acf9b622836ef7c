//! Protected mode: which peers a pdflow socket serves at all, decided here once for every socket.
//!
//! With a cluster secret, every peer is let in and then proves the secret (or is refused by the
//! socket's own checks). Without one, nothing can tell a peer from a stranger, so every pdflow
//! socket — the HTTP servers (bootstrap, proxy, engine API), P's side channel, D's data server —
//! serves loopback peers only (127.0.0.0/8, ::1), as Redis's protected mode does until a password
//! is set: a peer from any other address is closed at its accept, before a byte is read, counted
//! as `pdflow_auth_refusals_total{socket,cause="not_loopback"}` and logged once per peer address.
//! The operator opts out explicitly (`--insecure`, `"insecure": true` in
//! `kv_connector_extra_config`, or [`ENV_INSECURE`]`=1`), which is said at start-up as a warning.
//!
//! [`PeerFilter::new`] is the decision, [`PeerFilter::allows`] the rule and [`PeerFilter::admit`]
//! the refusal's count and log; each socket's owner holds a [`PeerFilter`] and asks it at accept
//! (the vendored zeromq, which cannot use this crate, is handed [`PeerFilter::allows`] as a
//! predicate). Owns no seed step: it guards the sockets of steps 4, 7, 20 (bootstrap), 8–10, 25,
//! 43 (proxy and engines), 21, 30 (side channel) and 29 (data channel).

use std::net::{IpAddr, SocketAddr};

use crate::error::Refusal;
use crate::refusals::{refused, Socket};
use crate::secret::{ClusterSecret, ENV_SECRET, ENV_SECRET_FILE};

/// Set to `1` (or `true`, `yes`, `on`) to serve non-loopback peers without a cluster secret.
pub const ENV_INSECURE: &str = "PDFLOW_INSECURE";

/// Which peers a socket serves. The default is [`PeerFilter::LoopbackOnly`]: a socket whose owner
/// forgot to decide stays closed to the network rather than open to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PeerFilter {
    /// Every peer: a cluster secret authenticates them, or the operator chose `insecure`.
    AnyPeer,
    /// Loopback peers only (127.0.0.0/8, ::1, and both as IPv4-mapped IPv6): protected mode.
    #[default]
    LoopbackOnly,
}

impl PeerFilter {
    /// The one decision: with a secret every peer may connect (and must prove it); without one,
    /// only loopback peers, unless the operator opted out (`insecure`).
    pub fn new(secret: Option<&ClusterSecret>, insecure: bool) -> Self {
        if secret.is_some() || insecure {
            PeerFilter::AnyPeer
        } else {
            PeerFilter::LoopbackOnly
        }
    }

    /// Whether a peer at `ip` is served.
    pub fn allows(self, ip: IpAddr) -> bool {
        match self {
            PeerFilter::AnyPeer => true,
            PeerFilter::LoopbackOnly => ip.to_canonical().is_loopback(),
        }
    }

    /// Whether the peer at `peer`, just accepted on `socket`, is served; a refused one is
    /// counted (`cause="not_loopback"`) and logged once per address. The caller closes it.
    pub fn admit(self, socket: Socket, peer: SocketAddr) -> bool {
        let allowed = self.allows(peer.ip());
        if !allowed {
            refused(socket, &peer.ip().to_canonical().to_string(), self.refusal());
        }
        allowed
    }

    /// Whether sockets bound on `host` could serve anyone: in protected mode, an address that is
    /// neither loopback nor unspecified (`0.0.0.0`, `::`) is refused before anything binds, since
    /// every connection to it — this host's own, such as P's registration with its bootstrap —
    /// would come from that address and be closed.
    pub fn check_bind(self, host: IpAddr) -> Result<(), ProtectedBindError> {
        if self.allows(host) || host.is_unspecified() {
            Ok(())
        } else {
            Err(ProtectedBindError { host })
        }
    }

    /// The refusal a peer this filter turns away is counted as.
    pub fn refusal(self) -> Refusal {
        Refusal::NotLoopback
    }

    /// Says once per process, at start-up, what `secret` and `insecure` mean for this process's
    /// sockets: nothing with a secret, a warning in protected mode (what is refused, how to serve
    /// other hosts) and one naming the risk when the operator opted out.
    pub fn announce(secret: Option<&ClusterSecret>, insecure: bool) {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| match (secret.is_some(), insecure) {
            (true, true) => tracing::info!("insecure is set but has no effect: a cluster secret is set, every peer must prove it"),
            (true, false) => {}
            (false, false) => tracing::warn!(
                "no cluster secret ({ENV_SECRET_FILE} or {ENV_SECRET}): protected mode, this process's pdflow sockets serve loopback peers only (127.0.0.0/8, ::1) and close every other connection at once; to serve other hosts, give every peer a cluster secret (--cluster-secret-file, {ENV_SECRET_FILE} or {ENV_SECRET}), or opt out with --insecure / {ENV_INSECURE}=1"
            ),
            (false, true) => tracing::warn!(
                "no cluster secret ({ENV_SECRET_FILE} or {ENV_SECRET}) and insecure is set: this process's pdflow sockets serve every peer that reaches them, unauthenticated; anyone who can reach these ports can register forged P workers at the bootstrap, read its table, pull KV (the prompts) and write D's blocks; set a cluster secret (--cluster-secret-file, {ENV_SECRET_FILE} or {ENV_SECRET}, e.g. `openssl rand -hex 32 > secret`) instead"
            ),
        });
    }
}

/// A bind address no peer could use in protected mode ([`PeerFilter::check_bind`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{host} is not a loopback address, and without a cluster secret pdflow serves loopback peers only (protected mode), so no connection to it would be served, not even this host's own: give every peer the cluster secret (--cluster-secret-file, {ENV_SECRET_FILE} or {ENV_SECRET}), bind 127.0.0.1 (or 0.0.0.0 to serve loopback peers on every interface), or opt out with --insecure / {ENV_INSECURE}=1")]
pub struct ProtectedBindError {
    pub host: IpAddr,
}

/// A value of [`ENV_INSECURE`] that is neither on nor off.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{ENV_INSECURE}={value:?}: expected 1, true, yes or on (serve non-loopback peers without a cluster secret), or 0, false, no, off or nothing")]
pub struct InsecureEnvError {
    pub value: String,
}

/// [`ENV_INSECURE`] as `get` reads it: off when unset or empty, an error for a value that is
/// neither on nor off (never a silent default).
pub fn insecure_from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<bool, InsecureEnvError> {
    let Some(value) = get(ENV_INSECURE) else { return Ok(false) };
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "" | "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(InsecureEnvError { value }),
    }
}

/// [`insecure_from_lookup`] over the process environment.
pub fn insecure_from_env() -> Result<bool, InsecureEnvError> {
    insecure_from_lookup(&|name| std::env::var(name).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("an IP address")
    }

    #[test]
    fn without_a_secret_only_loopback_peers_pass_unless_insecure() {
        let secret = ClusterSecret::from_text("0123456789abcdef-current").expect("valid secret");
        assert_eq!(PeerFilter::new(None, false), PeerFilter::LoopbackOnly);
        assert_eq!(PeerFilter::new(None, true), PeerFilter::AnyPeer);
        assert_eq!(PeerFilter::new(Some(&secret), false), PeerFilter::AnyPeer);
        assert_eq!(PeerFilter::default(), PeerFilter::LoopbackOnly, "undecided is closed");
        let protected = PeerFilter::LoopbackOnly;
        for loopback in ["127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "::ffff:127.0.0.1"] {
            assert!(protected.allows(ip(loopback)), "{loopback}");
        }
        for other in ["0.0.0.0", "10.0.0.1", "192.0.2.2", "128.0.0.1", "::", "fd00::2", "::ffff:10.0.0.1", "fe80::1"] {
            assert!(!protected.allows(ip(other)), "{other}");
            assert!(PeerFilter::AnyPeer.allows(ip(other)), "{other}");
        }
    }

    #[test]
    fn a_refused_peer_is_counted_as_not_loopback() {
        let metrics = pdflow_observability::metrics::global();
        let before = metrics.render();
        let peer: SocketAddr = "192.0.2.77:4000".parse().expect("address");
        assert!(!PeerFilter::LoopbackOnly.admit(Socket::Data, peer));
        assert!(PeerFilter::AnyPeer.admit(Socket::Data, peer));
        assert!(PeerFilter::LoopbackOnly.admit(Socket::Data, "127.0.0.1:9".parse().expect("address")));
        let line = r#"pdflow_auth_refusals_total{socket="data",cause="not_loopback"}"#;
        let count = |text: &str| -> u64 {
            text.lines().find_map(|l| l.strip_prefix(line).and_then(|v| v.trim().parse().ok())).unwrap_or(0)
        };
        assert!(count(&metrics.render()) > count(&before), "{}", metrics.render());
    }

    #[test]
    fn in_protected_mode_only_loopback_or_unspecified_binds_are_usable() {
        for ok in ["127.0.0.1", "0.0.0.0", "::", "::1"] {
            assert_eq!(PeerFilter::LoopbackOnly.check_bind(ip(ok)), Ok(()), "{ok}");
        }
        let err = PeerFilter::LoopbackOnly.check_bind(ip("192.0.2.2")).expect_err("unusable");
        assert!(err.to_string().contains("--insecure") && err.to_string().contains("cluster secret"), "{err}");
        assert_eq!(PeerFilter::AnyPeer.check_bind(ip("192.0.2.2")), Ok(()));
    }

    #[test]
    fn the_environment_says_on_or_off_or_is_an_error() {
        let with = |v: &'static str| move |name: &str| (name == ENV_INSECURE).then(|| v.to_string());
        assert_eq!(insecure_from_lookup(&|_| None), Ok(false));
        for on in ["1", "true", "YES", " on "] {
            assert_eq!(insecure_from_lookup(&with(on)), Ok(true), "{on}");
        }
        for off in ["", "0", "false", "No", "off"] {
            assert_eq!(insecure_from_lookup(&with(off)), Ok(false), "{off}");
        }
        let err = insecure_from_lookup(&with("maybe")).expect_err("not a switch");
        assert!(err.to_string().contains("PDFLOW_INSECURE=\"maybe\""), "{err}");
    }
}
