//! How P connects to and writes into D's data servers ([`TcpConfig`]): streams per peer,
//! deadlines, the transfer token, the cluster secret and TLS, protected mode's opt-out, the
//! same-host and GPU paths. Owns no
//! seed step; step 29's engine ([`super::TcpTransferEngine`]) is built from it.

use std::time::Duration;

use pdflow_auth::{ClusterSecret, PeerFilter, TlsIdentity};

use crate::same_host::SameHostMode;

/// How P connects to and writes into D's data servers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpConfig {
    /// Connections one plan is spread over (at most), and idle connections kept per peer.
    pub streams_per_peer: usize,
    /// Deadline for connecting and exchanging the hello with a peer.
    pub connect_timeout: Duration,
    /// Deadline for one whole `write` (every byte sent and acknowledged).
    pub write_timeout: Duration,
    /// The token D's data server expects, if it expects one.
    pub auth_token: Option<String>,
    /// The cluster secret: with it, P writes only to a data server that proves it holds it, and
    /// proves it in turn.
    pub secret: Option<ClusterSecret>,
    /// TLS on every data connection, with the secret's identity (D's data server must have it
    /// too). The same-host path, which never leaves the host, is not affected.
    pub tls: Option<TlsIdentity>,
    /// Whether the automatic engine ([`crate::AutoTransferEngine`]) may write a peer on
    /// the same host directly (`process_vm_writev`); the tcp engine alone ignores it.
    pub same_host: SameHostMode,
    /// Which path the engine for GPU KV takes to a D with GPU KV (feature `cuda`).
    pub gpu_path: crate::GpuPath,
    /// Without a secret, serve non-loopback peers anyway (the operator's explicit opt-out of
    /// protected mode: `--insecure`, `"insecure": true`, `PDFLOW_INSECURE=1`). No effect with a
    /// secret. Read by every socket the engine binds, through [`TcpConfig::peers`].
    pub insecure: bool,
    /// One-sided RDMA writes (the `rdma` feature): D offers its endpoint in pulls and P writes
    /// through it ([`RdmaMode`]).
    pub rdma: RdmaMode,
    /// The libfabric provider for RDMA (`verbs`, `tcp`, …); `None`: a NIC's provider
    /// when one opens (and, with [`RdmaMode::Required`], the software `tcp` provider otherwise).
    pub rdma_provider: Option<String>,
}

/// Whether transfers use one-sided RDMA writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaMode {
    /// Never (`transport: tcp`).
    Off,
    /// D offers RDMA when a NIC's provider opens on its interface (or the provider named in
    /// `rdma_provider` does); P writes one-sided when D offered and P opens the same provider,
    /// over tcp otherwise (`transport: auto`).
    Auto,
    /// D always offers (on the software provider when no NIC's opens) and P writes only
    /// one-sided: a pull without D's grant fails (`transport: rdma`).
    Required,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            streams_per_peer: 4,
            connect_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(30),
            auth_token: None,
            secret: None,
            tls: None,
            same_host: SameHostMode::Auto,
            gpu_path: crate::GpuPath::Auto,
            insecure: false,
            rdma: RdmaMode::Auto,
            rdma_provider: None,
        }
    }
}

/// Why TLS cannot be turned on.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("TLS on the data channel needs the cluster secret (its certificates are made from it): set PDFLOW_CLUSTER_SECRET_FILE or PDFLOW_CLUSTER_SECRET, or turn `tls` off")]
    NoSecret,
    #[error(transparent)]
    Identity(#[from] pdflow_auth::TlsError),
}

impl TcpConfig {
    /// Which peers the engine's sockets serve ([`PeerFilter::new`]: all with a secret or
    /// `insecure`, loopback only otherwise).
    pub fn peers(&self) -> PeerFilter {
        PeerFilter::new(self.secret.as_ref(), self.insecure)
    }

    /// Turns TLS on every data connection on (with the cluster secret's identity) or off; set
    /// the secret first.
    pub fn set_tls(&mut self, on: bool) -> Result<(), TlsSetupError> {
        self.tls = match (on, &self.secret) {
            (false, _) => None,
            (true, None) => return Err(TlsSetupError::NoSecret),
            (true, Some(secret)) => Some(TlsIdentity::from_secret(secret)?),
        };
        Ok(())
    }
}
