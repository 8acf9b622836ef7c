//! D's side of the staged path: [`StagedReceiver`] listens for P's connections and, on each, checks
//! every offered destination against D's device regions (refusing the part before a byte is
//! received), then receives the payload chunk by chunk into a ring of pinned host buffers, copying
//! each chunk host→device on the connection's own CUDA stream while the next one arrives, and
//! answers `DONE` once the last copy completed.
//!
//! Owns D's side of seed step 29 on the cross-host GPU path (the bytes land in D's regions; step
//! 31's completion follows on the side channel as for any backend).

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use cudarc::driver::{sys, CudaStream};
use pdflow_messages::layout::RegionDesc;

use super::wire::{self, Reply};
use super::{chunk_len, chunk_pieces, ring, wait_event, Slot, StagedConfig, StagedError};
use crate::transfer::cuda::ipc::region_of;
use crate::transfer::cuda::{check, CudaContext, CudaError};

/// What a receiver shares with its connection threads.
struct Shared {
    ctx: Arc<CudaContext>,
    regions: Vec<RegionDesc>,
    config: StagedConfig,
    stop: AtomicBool,
    /// Clones of the live connections, shut down on stop.
    conns: Mutex<Vec<TcpStream>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// D's staged data server over its device regions. Stops (and joins its threads) on drop.
pub struct StagedReceiver {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

impl StagedReceiver {
    /// Listens on `addr` (e.g. `127.0.0.1:0`) for writes into `regions` (device memory of `ctx`'s
    /// GPU). `config.chunk_bytes` and `config.depth` size D's own staging rings.
    pub fn bind(ctx: &Arc<CudaContext>, regions: Vec<RegionDesc>, addr: &str, config: StagedConfig) -> Result<Self, StagedError> {
        let listener = TcpListener::bind(addr).map_err(|source| StagedError::Io { peer: addr.to_string(), source })?;
        let local_addr = listener.local_addr().map_err(|source| StagedError::Io { peer: addr.to_string(), source })?;
        let shared = Arc::new(Shared {
            ctx: ctx.clone(),
            regions,
            config: config.sane(),
            stop: AtomicBool::new(false),
            conns: Mutex::default(),
            threads: Mutex::default(),
        });
        let accept_shared = shared.clone();
        let accept = std::thread::Builder::new()
            .name("staged-accept".into())
            .spawn(move || accept_loop(listener, accept_shared))
            .map_err(|source| StagedError::Io { peer: addr.to_string(), source })?;
        Ok(Self { shared, local_addr, accept: Some(accept) })
    }

    /// Where P connects.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for StagedReceiver {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop with a connection of our own.
        let _ = TcpStream::connect(self.local_addr);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        for c in self.shared.conns.lock().unwrap_or_else(PoisonError::into_inner).drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        let threads: Vec<_> = self.shared.threads.lock().unwrap_or_else(PoisonError::into_inner).drain(..).collect();
        for h in threads {
            let _ = h.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(conn) = conn else { continue };
        let Ok(clone) = conn.try_clone() else { continue };
        shared.conns.lock().unwrap_or_else(PoisonError::into_inner).push(clone);
        let conn_shared = shared.clone();
        let spawned = std::thread::Builder::new().name("staged-recv".into()).spawn(move || {
            let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
            if let Err(e) = serve_conn(conn, &conn_shared) {
                if !conn_shared.stop.load(Ordering::SeqCst) {
                    tracing::warn!(peer = %peer, error = %e, "staged data connection closed on error");
                }
            }
        });
        if let Ok(h) = spawned {
            shared.threads.lock().unwrap_or_else(PoisonError::into_inner).push(h);
        }
    }
}

/// Why a part is refused: the first destination outside D's regions.
pub fn check_destinations(regions: &[RegionDesc], offered: &[(u64, u64)]) -> Result<(), String> {
    for (index, &(dst, len)) in offered.iter().enumerate() {
        region_of(regions, dst, len).map_err(|e| format!("descriptor {index}: destination is not in D's registered device memory: {e}"))?;
    }
    Ok(())
}

/// Serves requests on one connection until P closes it.
fn serve_conn(mut tcp: TcpStream, shared: &Shared) -> Result<(), StagedError> {
    let peer = tcp.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    let io = |source| StagedError::Io { peer: peer.clone(), source };
    tcp.set_nodelay(true).map_err(io)?;
    tcp.set_write_timeout(Some(shared.config.deadline)).map_err(io)?;
    shared.ctx.bind_to_thread().map_err(CudaError::from)?;
    let stream = shared.ctx.new_stream()?;
    let mut ring = ring(&shared.ctx, &shared.config)?;
    loop {
        // Idle between requests: no deadline until one begins.
        tcp.set_read_timeout(None).map_err(io)?;
        let offered = match wire::read_request(&mut tcp) {
            Ok(Some(offered)) => offered,
            Ok(None) => return Ok(()),
            Err(e) => return Err(StagedError::Protocol(e.to_string())),
        };
        tcp.set_read_timeout(Some(shared.config.deadline)).map_err(io)?;
        if let Err(reason) = check_destinations(&shared.regions, &offered) {
            wire::write_reply(&mut tcp, &Reply::Refused(reason)).map_err(io)?;
            continue;
        }
        wire::write_reply(&mut tcp, &Reply::Accepted).map_err(io)?;
        if !wire::read_go(&mut tcp).map_err(|e| StagedError::Protocol(e.to_string()))? {
            continue;
        }
        let until = Instant::now() + shared.config.deadline;
        match receive(&mut tcp, &peer, &stream, &mut ring, &offered, shared, until) {
            Ok(()) => wire::write_reply(&mut tcp, &Reply::Done).map_err(io)?,
            // The payload's remainder is still on the wire: report, then close the connection.
            Err(e @ (StagedError::Cuda(_) | StagedError::Timeout { .. })) => {
                let _ = wire::write_reply(&mut tcp, &Reply::Failed(e.to_string()));
                return Err(e);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Receives one accepted part's payload into D's regions (pipelined), and waits for the copies.
fn receive(tcp: &mut TcpStream, peer: &str, stream: &Arc<CudaStream>, ring: &mut [Slot], offered: &[(u64, u64)], shared: &Shared, until: Instant) -> Result<(), StagedError> {
    let deadline = shared.config.deadline;
    let chunks = chunk_pieces(offered.iter().copied(), shared.config.chunk_bytes as u64);
    let depth = ring.len();
    for (i, pieces) in chunks.iter().enumerate() {
        let slot = &mut ring[i % depth];
        if i >= depth {
            // The copy out of this buffer (chunk i - depth) must be done before it is overwritten.
            wait_event(&slot.done, until, deadline)?;
        }
        let len = chunk_len(pieces) as usize;
        tcp.read_exact(slot.buf.bytes_mut(len)).map_err(|source| StagedError::Io { peer: peer.to_string(), source })?;
        let base = slot.buf.as_mut_ptr();
        for p in pieces {
            // SAFETY: the destination lies in D's regions (checked before ACCEPTED); the source
            // is inside this buffer (chunk_pieces), which is not reused until `done` completes.
            check(unsafe { sys::cuMemcpyHtoDAsync_v2(p.addr, base.add(p.offset as usize).cast(), p.len as usize, stream.cu_stream()) })?;
        }
        slot.done.record(stream)?;
    }
    for slot in ring.iter() {
        wait_event(&slot.done, until, deadline)?;
    }
    Ok(())
}
