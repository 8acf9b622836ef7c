//! Network namespaces for network faults ("network cuts between nodes that run in
//! their own network namespaces"): a typed, RAII topology of `ip netns` namespaces joined by veth
//! pairs, processes started inside them, and links that can be cut, restored and throttled.
//!
//! It owns no seed step: it is the ground the fault tests stand on. Seed steps it lets a test
//! break: 18–19 (D's bootstrap look-up), 21–22/30 (the side-channel pull), 29 (P's KV write to
//! D's data server) on a P↔D link; 9–11 (the proxy's calls to P and D) on a proxy↔engine link.
//!
//! # Model
//! - A [`Place`] is the root namespace (where the test itself runs) or a namespace this topology
//!   created ([`Ns`]). Each namespace gets a *service address* (a /32 on `lo`): bind a node's
//!   sockets there (`--host`) and every directly linked place reaches it.
//! - A [`Link`] is a veth pair between two places with a /30; each side routes the other side's
//!   service address over it. Places talk only over their direct link (nothing is forwarded), so
//!   cutting the P↔D link really separates P from D, while both still reach the root namespace.
//! - [`Topology::cut`] takes both ends down. Traffic between the two places is then *silently
//!   dropped* (a fallback route through a carrier-less "sink" veth, metric 4000): new connections
//!   hang in SYN and established ones stall — a real partition, which only deadlines end, not a
//!   fast "no route to host". [`Topology::restore`] brings both ends up and re-adds the routes.
//! - [`Topology::throttle`] / [`Topology::shape`] put a `tbf` qdisc on both ends (rate limit
//!   without `netem`).
//! - [`Topology::exec`] starts a process inside a namespace (`ip netns exec`), by default in its
//!   own UTS namespace with its own hostname, so the namespace also looks like a separate host
//!   (pdflow's same-host `process_vm_writev` path would otherwise bypass the network).
//! - Drop kills every process started here, then deletes the namespaces (which deletes every veth
//!   of the topology: each has an end inside one of them). It runs on panic too. Namespaces left
//!   by a killed test run (`pdfl-<pid>-…` of a dead pid) are swept by the next [`Topology::new`].
//!
//! Addresses: each topology takes one free /24 of 10.64.0.0/10 (chosen from the pid and a
//! counter, skipping prefixes the root namespace already routes); link k uses `.4k+1`/`.4k+2`,
//! namespace i's service address is `.200+i`.

use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Prefix of every namespace this module creates: `pdfl-<pid>-<topology>-<name>`.
const NS_PREFIX: &str = "pdfl-";
/// Metric of the fallback (black-hole) routes; the real routes have metric 0.
const SINK_METRIC: &str = "4000";
/// How long Drop waits for a killed process to exit before deleting its namespace anyway.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// At most this many links per topology (link k uses addresses `.4k+1`, `.4k+2` < 200).
const MAX_LINKS: usize = 49;
/// At most this many namespaces per topology (service addresses `.200`–`.254`).
const MAX_NAMESPACES: usize = 55;

static TOPOLOGIES: AtomicU32 = AtomicU32::new(0);

/// Why a topology could not be built or changed.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("network namespaces need root, and this process runs as uid {uid}: run as root (CI does) or skip the network tests")]
    NotRoot { uid: u32 },
    #[error("network namespaces are unavailable here: {reason}")]
    Unavailable { reason: String },
    #[error("could not run `{command}`: {source} (is iproute2 installed: `ip`, `tc`?)")]
    Spawn { command: String, source: std::io::Error },
    #[error("`{command}` failed ({status}): {stderr}")]
    Command { command: String, status: String, stderr: String },
    #[error("no free /24 in 10.64.0.0/10 for this topology: the root namespace routes all candidates (stale test namespaces? `ip netns list`)")]
    NoAddressSpace,
    #[error("a topology holds at most {max} {what}")]
    TooMany { what: &'static str, max: usize },
    #[error("namespace name {name:?}: use 1–8 characters of [a-z0-9]")]
    BadName { name: String },
    #[error("a link joins two different places; both ends are {place:?}")]
    SelfLink { place: Place },
    #[error("{place:?} is not an end of link {link:?}")]
    NotAnEnd { place: Place, link: Link },
    #[error("unexpected output of `{command}`: {detail}")]
    Parse { command: String, detail: String },
}

/// A namespace of a [`Topology`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ns(usize);

/// A veth link of a [`Topology`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Link(usize);

/// Where something runs: the root namespace or one of the topology's namespaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Place {
    Root,
    Ns(Ns),
}

impl From<Ns> for Place {
    fn from(ns: Ns) -> Self {
        Place::Ns(ns)
    }
}

/// Whether network namespaces can be used here: `Ok` when running as root and `ip netns add`
/// works; otherwise the reason (print it and skip). Probed once per process.
pub fn available() -> Result<(), String> {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            let uid = effective_uid().map_err(|e| e.to_string())?;
            if uid != 0 {
                return Err(NetnsError::NotRoot { uid }.to_string());
            }
            // Everything a topology uses, once, in a throw-away namespace: namespaces, veth,
            // tbf, and `unshare --uts` (each namespace's own hostname).
            let probe = format!("{NS_PREFIX}{}-probe", std::process::id());
            run("ip", ["netns", "add", probe.as_str()])
                .map_err(|e| format!("`ip netns add` does not work here: {e}"))?;
            let checks = || -> Result<(), String> {
                run("ip", ["-n", probe.as_str(), "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
                    .map_err(|e| format!("veth pairs do not work here: {e}"))?;
                run(
                    "tc",
                    [
                        "-n",
                        probe.as_str(),
                        "qdisc",
                        "add",
                        "dev",
                        "pa",
                        "root",
                        "tbf",
                        "rate",
                        "1mbit",
                        "burst",
                        "32kb",
                        "latency",
                        "100ms",
                    ],
                )
                .map_err(|e| format!("`tc … tbf` does not work here: {e}"))?;
                run("ip", ["netns", "exec", probe.as_str(), "unshare", "--uts", "--", "true"])
                    .map_err(|e| format!("`unshare --uts` does not work here: {e}"))?;
                Ok(())
            };
            let result = checks();
            let _ = run("ip", ["netns", "del", probe.as_str()]);
            result?;
            Ok(())
        })
        .clone()
}

/// The effective uid, from `/proc/self/status` (no libc here).
fn effective_uid() -> Result<u32, NetnsError> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|source| NetnsError::Spawn { command: "read /proc/self/status".into(), source })?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|rest| rest.split_whitespace().nth(1))
        .and_then(|u| u.parse().ok())
        .ok_or_else(|| NetnsError::Parse {
            command: "read /proc/self/status".into(),
            detail: "no effective uid on the Uid: line".into(),
        })
}

/// Runs a command to completion; its stdout on success.
fn run<I, S>(program: &str, args: I) -> Result<String, NetnsError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(|a| a.as_ref().to_os_string()).collect();
    let command = std::iter::once(program.to_string())
        .chain(args.iter().map(|a| a.to_string_lossy().into_owned()))
        .collect::<Vec<_>>()
        .join(" ");
    let out = Command::new(program)
        .args(&args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| NetnsError::Spawn { command: command.clone(), source })?;
    if !out.status.success() {
        return Err(NetnsError::Command {
            command,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Deletes the namespaces of test runs whose process is gone (a killed run never dropped its
/// topology).
fn sweep_stale() {
    let Ok(list) = run("ip", ["netns", "list"]) else { return };
    for line in list.lines() {
        let Some(name) = line.split_whitespace().next() else { continue };
        let Some(rest) = name.strip_prefix(NS_PREFIX) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = run("ip", ["netns", "del", name]);
        }
    }
}

struct NsState {
    name: String,
    service: Ipv4Addr,
}

struct LinkState {
    ends: [Place; 2],
    /// Interface names of the two ends (unique on the host: the root namespace holds some).
    devs: [String; 2],
    addrs: [Ipv4Addr; 2],
}

/// A network topology of namespaces and veth links; everything it made is removed on drop.
pub struct Topology {
    /// `pdfl-<pid>-<n>`: prefix of this topology's namespaces.
    tag: String,
    /// Short prefix of interface names (`pf<hex>`), unique on the host.
    ifprefix: String,
    /// The /24 this topology's addresses come from: `10.a.b.0`.
    net: [u8; 3],
    namespaces: Vec<NsState>,
    links: Vec<LinkState>,
    /// Places that have a sink veth for black-hole routes.
    sinks: Vec<Place>,
    children: Mutex<Vec<(String, u32, std::process::Child)>>,
}

impl std::fmt::Debug for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Topology")
            .field("tag", &self.tag)
            .field("net", &self.net)
            .field("namespaces", &self.namespaces.len())
            .field("links", &self.links.len())
            .finish()
    }
}

impl Topology {
    /// An empty topology (nothing is created until namespaces and links are added). Fails with
    /// the reason of [`available`] when namespaces cannot be used.
    pub fn new() -> Result<Self, NetnsError> {
        if let Err(reason) = available() {
            return Err(NetnsError::Unavailable { reason });
        }
        sweep_stale();
        let pid = std::process::id();
        let n = TOPOLOGIES.fetch_add(1, Ordering::Relaxed);
        let routes = run("ip", ["-4", "route", "show", "table", "all"])? + &run("ip", ["-4", "-o", "addr", "show"])?;
        let net = (0..64u32)
            .map(|k| (pid.wrapping_mul(64).wrapping_add(n.wrapping_mul(7)).wrapping_add(k)) % 16384)
            .map(|idx| [10u8, 64 + (idx >> 8) as u8, (idx & 0xff) as u8])
            .find(|[a, b, c]| !routes.contains(&format!("{a}.{b}.{c}.")))
            .ok_or(NetnsError::NoAddressSpace)?;
        let id = (u32::from(net[1] - 64) << 8) | u32::from(net[2]);
        Ok(Self {
            tag: format!("{NS_PREFIX}{pid}-{n}"),
            ifprefix: format!("pf{id:04x}"),
            net,
            namespaces: Vec::new(),
            links: Vec::new(),
            sinks: Vec::new(),
            children: Mutex::new(Vec::new()),
        })
    }

    fn ip(&self, i: u8) -> Ipv4Addr {
        Ipv4Addr::new(self.net[0], self.net[1], self.net[2], i)
    }

    /// Creates a namespace with `lo` up and its service address.
    pub fn add_namespace(&mut self, name: &str) -> Result<Ns, NetnsError> {
        if name.is_empty() || name.len() > 8 || !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()) {
            return Err(NetnsError::BadName { name: name.to_string() });
        }
        if self.namespaces.len() >= MAX_NAMESPACES {
            return Err(NetnsError::TooMany { what: "namespaces", max: MAX_NAMESPACES });
        }
        let full = format!("{}-{name}", self.tag);
        run("ip", ["netns", "add", full.as_str()])?;
        let service = self.ip(200 + self.namespaces.len() as u8);
        self.namespaces.push(NsState { name: full.clone(), service });
        run("ip", ["-n", full.as_str(), "link", "set", "lo", "up"])?;
        run("ip", ["-n", full.as_str(), "addr", "add", &format!("{service}/32"), "dev", "lo"])?;
        Ok(Ns(self.namespaces.len() - 1))
    }

    /// The namespace's full name (for `ip netns exec` by hand).
    pub fn ns_name(&self, ns: Ns) -> &str {
        &self.namespaces[ns.0].name
    }

    /// The namespace's service address: bind its sockets here; every linked place reaches it.
    pub fn addr(&self, ns: Ns) -> Ipv4Addr {
        self.namespaces[ns.0].service
    }

    /// The address of `place`'s end of `link`.
    pub fn link_addr(&self, link: Link, place: Place) -> Result<Ipv4Addr, NetnsError> {
        let l = &self.links[link.0];
        let side = l.ends.iter().position(|e| *e == place).ok_or(NetnsError::NotAnEnd { place, link })?;
        Ok(l.addrs[side])
    }

    /// `ip` arguments that run in `place`.
    fn ip_in(&self, place: Place, args: &[&str]) -> Result<String, NetnsError> {
        match place {
            Place::Root => run("ip", args),
            Place::Ns(ns) => run("ip", ["-n", self.ns_name(ns)].iter().chain(args)),
        }
    }

    fn tc_in(&self, place: Place, args: &[&str]) -> Result<String, NetnsError> {
        match place {
            Place::Root => run("tc", args),
            Place::Ns(ns) => run("tc", ["-n", self.ns_name(ns)].iter().chain(args)),
        }
    }

    /// The namespace that holds the peers of a place's sink (the root's sink peer lives in a
    /// namespace so that deleting the namespaces removes it).
    fn ensure_sink(&mut self, place: Place, holder: Ns) -> Result<(), NetnsError> {
        if self.sinks.contains(&place) {
            return Ok(());
        }
        let k = self.sinks.len();
        let (sink, peer) = (format!("{}s{k}", self.ifprefix), format!("{}t{k}", self.ifprefix));
        let holder_name = self.ns_name(holder).to_string();
        match place {
            Place::Root => run(
                "ip",
                [
                    "link",
                    "add",
                    "name",
                    sink.as_str(),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    peer.as_str(),
                    "netns",
                    holder_name.as_str(),
                ],
            )?,
            Place::Ns(ns) => {
                let n = self.ns_name(ns).to_string();
                run(
                    "ip",
                    [
                        "link",
                        "add",
                        "name",
                        sink.as_str(),
                        "netns",
                        n.as_str(),
                        "type",
                        "veth",
                        "peer",
                        "name",
                        peer.as_str(),
                        "netns",
                        n.as_str(),
                    ],
                )?
            }
        };
        self.sinks.push(place);
        // Up without ARP, its peer left down: no carrier, so whatever is routed here is dropped.
        self.ip_in(place, &["link", "set", sink.as_str(), "arp", "off", "up"])?;
        Ok(())
    }

    fn sink_dev(&self, place: Place) -> String {
        let k = self.sinks.iter().position(|p| *p == place).unwrap_or(0);
        format!("{}s{k}", self.ifprefix)
    }

    /// Joins two places with a veth pair and routes each one's service address over it.
    pub fn add_link(&mut self, a: impl Into<Place>, b: impl Into<Place>) -> Result<Link, NetnsError> {
        let (a, b) = (a.into(), b.into());
        if a == b {
            return Err(NetnsError::SelfLink { place: a });
        }
        if self.links.len() >= MAX_LINKS {
            return Err(NetnsError::TooMany { what: "links", max: MAX_LINKS });
        }
        let k = self.links.len();
        let devs = [format!("{}l{k}a", self.ifprefix), format!("{}l{k}b", self.ifprefix)];
        let addrs = [self.ip(4 * k as u8 + 1), self.ip(4 * k as u8 + 2)];
        let mut args: Vec<String> = vec!["link".into(), "add".into(), "name".into(), devs[0].clone()];
        if let Place::Ns(ns) = a {
            args.extend(["netns".into(), self.ns_name(ns).to_string()]);
        }
        args.extend(["type".into(), "veth".into(), "peer".into(), "name".into(), devs[1].clone()]);
        if let Place::Ns(ns) = b {
            args.extend(["netns".into(), self.ns_name(ns).to_string()]);
        }
        run("ip", &args)?;
        self.links.push(LinkState { ends: [a, b], devs: devs.clone(), addrs });
        let link = Link(k);
        let holder = match (a, b) {
            (Place::Ns(n), _) | (_, Place::Ns(n)) => n,
            (Place::Root, Place::Root) => return Err(NetnsError::SelfLink { place: a }),
        };
        for side in 0..2 {
            let place = [a, b][side];
            self.ensure_sink(place, holder)?;
            self.ip_in(place, &["addr", "add", &format!("{}/30", addrs[side]), "dev", devs[side].as_str()])?;
            // Black-hole fallbacks: while the link is cut, traffic to the other side is dropped
            // silently instead of failing fast with "network unreachable".
            let sink = self.sink_dev(place);
            let subnet = format!("{}/30", self.ip(4 * k as u8));
            self.ip_in(place, &["route", "add", subnet.as_str(), "dev", sink.as_str(), "metric", SINK_METRIC])?;
            if let Place::Ns(other) = [a, b][1 - side] {
                let svc = format!("{}/32", self.addr(other));
                self.ip_in(place, &["route", "add", svc.as_str(), "dev", sink.as_str(), "metric", SINK_METRIC])?;
            }
        }
        self.bring_up(link)?;
        Ok(link)
    }

    /// Both ends up, then the routes to each side's service address (a link taken down loses them).
    fn bring_up(&self, link: Link) -> Result<(), NetnsError> {
        let l = &self.links[link.0];
        for side in 0..2 {
            self.ip_in(l.ends[side], &["link", "set", l.devs[side].as_str(), "up"])?;
        }
        for side in 0..2 {
            if let Place::Ns(other) = l.ends[1 - side] {
                let svc = format!("{}/32", self.addr(other));
                let via = l.addrs[1 - side].to_string();
                self.ip_in(
                    l.ends[side],
                    &["route", "replace", svc.as_str(), "via", via.as_str(), "dev", l.devs[side].as_str(), "onlink"],
                )?;
            }
        }
        Ok(())
    }

    /// Cuts the link: both ends down. Traffic between its places is dropped silently until
    /// [`Topology::restore`].
    pub fn cut(&self, link: Link) -> Result<(), NetnsError> {
        let l = &self.links[link.0];
        for side in 0..2 {
            self.ip_in(l.ends[side], &["link", "set", l.devs[side].as_str(), "down"])?;
        }
        Ok(())
    }

    /// Restores a cut link (both ends up, routes back).
    pub fn restore(&self, link: Link) -> Result<(), NetnsError> {
        self.bring_up(link)
    }

    /// Limits the link to `bytes_per_sec` in each direction (`tbf` on both ends), with a burst of
    /// ~50 ms of traffic (at least 64 KiB so one GSO segment fits).
    pub fn throttle(&self, link: Link, bytes_per_sec: u64) -> Result<(), NetnsError> {
        self.shape(link, bytes_per_sec, (bytes_per_sec / 20).max(64 * 1024))
    }

    /// Shapes the link to `bytes_per_sec` in each direction with a token bucket of `burst` bytes
    /// (`tbf` on both ends; at least 64 KiB): a small burst makes the link's rate hold from the
    /// first byte, as a NIC's does.
    pub fn shape(&self, link: Link, bytes_per_sec: u64, burst: u64) -> Result<(), NetnsError> {
        let l = &self.links[link.0];
        let rate = format!("{}bit", bytes_per_sec.saturating_mul(8).max(8000));
        let burst = burst.max(64 * 1024).to_string();
        for side in 0..2 {
            self.tc_in(
                l.ends[side],
                &[
                    "qdisc",
                    "replace",
                    "dev",
                    l.devs[side].as_str(),
                    "root",
                    "tbf",
                    "rate",
                    rate.as_str(),
                    "burst",
                    burst.as_str(),
                    "latency",
                    "400ms",
                ],
            )?;
        }
        Ok(())
    }

    /// Removes a [`Topology::throttle`].
    pub fn unthrottle(&self, link: Link) -> Result<(), NetnsError> {
        let l = &self.links[link.0];
        for side in 0..2 {
            self.tc_in(l.ends[side], &["qdisc", "del", "dev", l.devs[side].as_str(), "root"])?;
        }
        Ok(())
    }

    /// Bytes `place`'s end of `link` has sent (its interface counter): a network-level sign
    /// that a transfer is under way.
    pub fn tx_bytes(&self, link: Link, place: Place) -> Result<u64, NetnsError> {
        let l = &self.links[link.0];
        let side = l.ends.iter().position(|e| *e == place).ok_or(NetnsError::NotAnEnd { place, link })?;
        let out = self.ip_in(place, &["-s", "-j", "link", "show", "dev", l.devs[side].as_str()])?;
        let v: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| NetnsError::Parse { command: "ip -s -j link show".into(), detail: e.to_string() })?;
        v[0]["stats64"]["tx"]["bytes"].as_u64().ok_or_else(|| NetnsError::Parse {
            command: "ip -s -j link show".into(),
            detail: format!("no stats64.tx.bytes in {out}"),
        })
    }

    /// A command that runs `program` in `place`: through `ip netns exec` and, for a namespace,
    /// `unshare --uts` with the namespace's name as hostname (its own "host"). Stdin is null,
    /// stdout piped; set the rest, then start it with [`Topology::exec`].
    pub fn command(&self, place: Place, program: impl AsRef<OsStr>) -> std::process::Command {
        let mut cmd = match place {
            Place::Root => Command::new(program),
            Place::Ns(ns) => {
                let mut c = Command::new("ip");
                c.args([
                    "netns",
                    "exec",
                    self.ns_name(ns),
                    "unshare",
                    "--uts",
                    "--",
                    "sh",
                    "-c",
                    "hostname \"$0\" && exec \"$@\"",
                ]);
                c.arg(self.ns_name(ns)).arg(program);
                c
            }
        };
        cmd.stdin(Stdio::null()).stdout(Stdio::piped());
        cmd
    }

    /// Starts a command made by [`Topology::command`]; the topology kills it on drop (or on
    /// [`Topology::kill`]). Returns its id for `kill` and its stdout.
    pub fn exec(
        &self,
        label: &str,
        mut cmd: std::process::Command,
    ) -> Result<(u32, Option<tokio::process::ChildStdout>), NetnsError> {
        let mut child = cmd.spawn().map_err(|source| NetnsError::Spawn { command: format!("{cmd:?}"), source })?;
        let pid = child.id();
        let stdout = match child.stdout.take() {
            Some(s) => Some(
                tokio::process::ChildStdout::from_std(s)
                    .map_err(|source| NetnsError::Spawn { command: format!("{label}: stdout"), source })?,
            ),
            None => None,
        };
        self.children.lock().unwrap_or_else(|p| p.into_inner()).push((label.to_string(), pid, child));
        Ok((pid, stdout))
    }

    /// Kills (SIGKILL) and reaps a process started by [`Topology::exec`]; bounded wait.
    pub fn kill(&self, pid: u32) {
        let mut children = self.children.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = children.iter().position(|(_, p, _)| *p == pid) {
            let (_, _, mut child) = children.remove(i);
            kill_and_reap(&mut child);
        }
    }
}

fn kill_and_reap(child: &mut std::process::Child) {
    let _ = child.kill();
    let until = Instant::now() + KILL_WAIT;
    while Instant::now() < until {
        match child.try_wait() {
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            _ => return,
        }
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        let children = std::mem::take(&mut *self.children.lock().unwrap_or_else(|p| p.into_inner()));
        for (_, _, mut child) in children {
            kill_and_reap(&mut child);
        }
        // Deleting a namespace deletes the veths inside it, and a veth's peer with it: every
        // link and sink of this topology has an end in one of them; root routes go with them.
        for ns in &self.namespaces {
            let _ = run("ip", ["netns", "del", ns.name.as_str()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_namespaces_talk_over_their_link_and_a_cut_blackholes_them() {
        if let Err(reason) = available() {
            pdflow_testkit::skipped("network namespaces test", &reason);
            return;
        }
        let mut t = Topology::new().expect("topology");
        let a = t.add_namespace("a").expect("ns a");
        let b = t.add_namespace("b").expect("ns b");
        let ab = t.add_link(a, b).expect("link");
        let names: Vec<String> = t.namespaces.iter().map(|n| n.name.clone()).collect();
        let connect = |timeout: &str| {
            let mut c = t.command(Place::Ns(a), "sh");
            let target = format!("{}", t.addr(b));
            c.args(["-c", &format!("timeout {timeout} bash -c 'exec 3<>/dev/tcp/{target}/9' 2>&1; echo rc=$?")]);
            c.output().expect("runs")
        };
        // Nobody listens on port 9: reachable means "connection refused" at once.
        let out = String::from_utf8_lossy(&connect("2").stdout).into_owned();
        assert!(out.contains("refused"), "reachable before the cut: {out}");
        t.cut(ab).expect("cut");
        let out = String::from_utf8_lossy(&connect("1").stdout).into_owned();
        assert!(out.contains("rc=124"), "black-holed (timeout, not refused) while cut: {out}");
        t.restore(ab).expect("restore");
        let out = String::from_utf8_lossy(&connect("2").stdout).into_owned();
        assert!(out.contains("refused"), "reachable after restore: {out}");
        t.throttle(ab, 1 << 20).expect("throttle");
        assert!(t.tx_bytes(ab, Place::Ns(a)).expect("counter") > 0);
        drop(t);
        let list = run("ip", ["netns", "list"]).expect("list");
        for n in names {
            assert!(!list.contains(&n), "{n} deleted on drop");
        }
    }
}
