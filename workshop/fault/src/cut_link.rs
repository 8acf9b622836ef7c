//! `cut_data`: a data link that dies part-way through P's write (seed step 29), made of real
//! sockets. [`CutLink`] is a TCP relay in front of D's data server that forwards what P sends
//! until it has carried K bytes — counted over every connection of the write, hello, fence, batch
//! headers and payload alike — then shuts every connection down both ways, on P's side and on D's,
//! and closes any connection made after: D reads a batch torn mid-way and end-of-stream, P's write
//! fails on a dead socket. D's answers travel back untouched.
//!
//! `flip_data` is the same relay altering one byte instead (the one after the first K bytes from
//! P, over every connection) and carrying everything else: a tamperer on the path.
//!
//! [`CutEngine`] is the transfer engine a fault seam hands step 29 for a request given such a
//! fault: a tcp engine of its own (never the node's pool, so no connection of another request is
//! touched, and a cut is never retried on a pooled one) writing through a fresh link per write.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use futures::future::BoxFuture;
use pdflow_kv::memory::RegionTable;
use pdflow_kv::planner::TransferPlan;
use pdflow_transfer::tcp::{TcpConfig, TcpTransferEngine};
use pdflow_transfer::{TransferEngine, TransferError, TransferStats};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinSet;

/// Bytes a relay moves per read.
const CHUNK: usize = 64 * 1024;
/// How long the relay waits to reach D's data server for one of P's connections.
const CONNECT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// A relay to one data server that cuts after `after_bytes` bytes from P; stops when dropped.
pub struct CutLink {
    addr: SocketAddr,
    state: Arc<LinkState>,
    accept: tokio::task::JoinHandle<()>,
}

/// What a link does to P's write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkFault {
    /// Carries this many bytes from P, then dies (`cut_data`).
    CutAfter(u64),
    /// Alters the byte after this many from P and carries the rest (`flip_data`).
    FlipAt(u64),
}

struct LinkState {
    /// Bytes from P the link may still carry.
    budget: AtomicU64,
    cut: AtomicBool,
    on_cut: Notify,
    /// With `flip_data`, the position (over every connection) of the byte to alter.
    flip_at: Option<u64>,
    /// Bytes from P carried so far, over every connection.
    carried: AtomicU64,
}

impl LinkState {
    /// Takes up to `want` bytes of the budget; the last byte taken cuts the link.
    fn take(&self, want: u64) -> u64 {
        let mut granted = 0;
        let _ = self.budget.fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
            granted = left.min(want);
            Some(left - granted)
        });
        granted
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::Release);
        self.on_cut.notify_waiters();
    }

    fn is_cut(&self) -> bool {
        self.cut.load(Ordering::Acquire)
    }
}

impl CutLink {
    /// Starts a relay on 127.0.0.1 to the data server at `to`, cutting after `after_bytes` bytes.
    pub async fn start(to: &str, after_bytes: u64) -> std::io::Result<Self> {
        Self::with_fault(to, LinkFault::CutAfter(after_bytes)).await
    }

    /// Starts a relay on 127.0.0.1 to the data server at `to` that does `fault` to P's bytes.
    pub async fn with_fault(to: &str, fault: LinkFault) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (budget, flip_at) = match fault {
            LinkFault::CutAfter(k) => (k, None),
            LinkFault::FlipAt(k) => (u64::MAX, Some(k)),
        };
        let state = Arc::new(LinkState {
            budget: AtomicU64::new(budget),
            cut: AtomicBool::new(false),
            on_cut: Notify::new(),
            flip_at,
            carried: AtomicU64::new(0),
        });
        if budget == 0 {
            state.cut();
        }
        let accept = tokio::spawn(accept_loop(listener, to.to_string(), state.clone()));
        Ok(Self { addr, state, accept })
    }

    /// Where P connects instead of D's data server.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether the link has been cut.
    pub fn is_cut(&self) -> bool {
        self.state.is_cut()
    }
}

impl Drop for CutLink {
    fn drop(&mut self) {
        // Ends every relayed connection with it (the accept loop owns their tasks).
        self.accept.abort();
    }
}

async fn accept_loop(listener: TcpListener, to: String, state: Arc<LinkState>) {
    let mut conns = JoinSet::new();
    loop {
        let Ok((p_side, _)) = listener.accept().await else { return };
        if state.is_cut() {
            shut(p_side).await;
            continue;
        }
        let Ok(Ok(d_side)) = tokio::time::timeout(CONNECT_DEADLINE, TcpStream::connect(&to)).await else {
            shut(p_side).await;
            continue;
        };
        let _ = (p_side.set_nodelay(true), d_side.set_nodelay(true));
        conns.spawn(relay(p_side, d_side, state.clone()));
        while conns.try_join_next().is_some() {}
    }
}

/// One connection: P's bytes go to D within the budget, D's come back; both sockets are shut down
/// once the link is cut.
async fn relay(p_side: TcpStream, d_side: TcpStream, state: Arc<LinkState>) {
    let (mut p_read, mut p_write) = p_side.into_split();
    let (mut d_read, mut d_write) = d_side.into_split();
    let to_d = async {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match p_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let granted = usize::try_from(state.take(n as u64)).unwrap_or(n);
            let start = state.carried.fetch_add(granted as u64, Ordering::AcqRel);
            if let Some(at) = state.flip_at.filter(|&at| at >= start && at < start + granted as u64) {
                // The position lies in this read (checked just above): at - start < granted.
                buf[(at - start) as usize] ^= 0xff;
            }
            if d_write.write_all(&buf[..granted]).await.is_err() {
                return;
            }
            if granted < n || state.budget.load(Ordering::Acquire) == 0 {
                state.cut();
                return;
            }
        }
    };
    let to_p = async {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match d_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if p_write.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    tokio::select! {
        _ = async { tokio::join!(to_d, to_p) } => {}
        _ = wait_cut(&state) => {}
    }
    // Both ways, on both sides: D reads end-of-stream mid-batch, P can neither send nor receive.
    let p_side = p_read.reunite(p_write);
    let d_side = d_read.reunite(d_write);
    for side in [p_side, d_side].into_iter().flatten() {
        shut(side).await;
    }
}

async fn wait_cut(state: &LinkState) {
    loop {
        let notified = state.on_cut.notified();
        if state.is_cut() {
            return;
        }
        notified.await;
    }
}

async fn shut(stream: TcpStream) {
    if let Ok(std) = stream.into_std() {
        let _ = std.shutdown(std::net::Shutdown::Both);
    }
}

/// Step 29's engine for a request given `cut_data` or `flip_data`: every write goes over tcp
/// through a fresh [`CutLink`] doing `fault`.
pub struct CutEngine {
    tcp: TcpTransferEngine,
    fault: LinkFault,
}

impl CutEngine {
    pub fn new(local: RegionTable, config: TcpConfig, fault: LinkFault) -> Self {
        Self { tcp: TcpTransferEngine::new(local, config), fault }
    }

    async fn write_cut(&self, peer: &str, plan: &TransferPlan) -> Result<TransferStats, TransferError> {
        let link = CutLink::with_fault(peer, self.fault)
            .await
            .map_err(|source| TransferError::Connect { peer: peer.to_string(), source })?;
        let result = self.tcp.write(&link.addr().to_string(), plan).await;
        match (result, self.fault) {
            // A cut past the write's last byte still cuts the link before D's last ack reaches P.
            (Ok(_), LinkFault::CutAfter(after)) if link.is_cut() => {
                Err(TransferError::Io { peer: peer.to_string(), source: cut_error(after) })
            }
            (result, _) => result,
        }
    }
}

fn cut_error(after_bytes: u64) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        format!("the data link was cut after {after_bytes} bytes (fault injection: cut_data)"),
    )
}

impl TransferEngine for CutEngine {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn write<'a>(
        &'a self,
        peer: &'a str,
        plan: &'a TransferPlan,
    ) -> BoxFuture<'a, Result<TransferStats, TransferError>> {
        Box::pin(self.write_cut(peer, plan))
    }
}
