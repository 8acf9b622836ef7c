//! The same-host path of seed step 29: when P and D run on one host (the seed's own setup), P
//! writes the plan straight into D's memory with cross-memory attach (`process_vm_writev`): one
//! kernel copy per byte, no sockets.
//!
//! Safety rules (the same as D's data server applies to TCP writes):
//! - P learns D's pid, host identity, canary and region table from D's data server (after the
//!   authenticated hello, see [`super::tcp::wire::HostInfo`]);
//! - the pid is trusted only after P reads D's random canary back from that pid
//!   ([`verify_canary`]) — which also proves the kernel lets P access D — before every write;
//! - every destination descriptor is checked against D's advertised regions before anything is
//!   written ([`check_destinations`]): a plan with one range outside them is refused whole.
//!
//! Kernel refusals (`EPERM`, `EACCES`, `ESRCH`, `ENOSYS`) are reported as
//! [`SameHostError::Unavailable`] so the automatic engine falls back to TCP.

use std::io::IoSliceMut;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use pdflow_messages::layout::RegionDesc;

use pdflow_kv::memory::{RegionError, RegionTable};
use pdflow_kv::planner::Descriptor;

/// The most iovecs one `process_vm_writev` is given on each side (Linux's IOV_MAX).
const MAX_IOVECS: usize = 1024;
/// The most bytes one call moves, so a cancelled write stops soon.
const MAX_BYTES_PER_CALL: u64 = 32 << 20;
/// Plans smaller than this are written by one thread.
const MIN_BYTES_PER_THREAD: u64 = 8 << 20;
/// Plans up to this size are written on the calling thread (one system call of tens of
/// microseconds at most): handing them to a blocking thread and waking the caller back would
/// cost more than the copy.
const INLINE_MAX_BYTES: u64 = 256 * 1024;
/// Bytes of the canary a data server exposes.
pub const CANARY_LEN: usize = 32;

/// Whether the automatic engine may use the same-host path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SameHostMode {
    /// Use it when D is on this host and the kernel allows it; TCP otherwise.
    #[default]
    Auto,
    /// Never: always TCP.
    Off,
    /// Only: a write that cannot go the same-host way fails (benchmarks, tests).
    Required,
}

/// Why a same-host write did not happen.
#[derive(Debug, thiserror::Error)]
pub enum SameHostError {
    #[error("destination {0}")]
    OutOfRegion(RegionError),
    #[error("the kernel refuses cross-memory access to pid {pid} ({source}): falling back to tcp is safe")]
    Unavailable { pid: i32, source: std::io::Error },
    #[error("process_vm_writev to pid {pid} failed after {done} bytes: {source}")]
    Failed { pid: i32, done: u64, source: std::io::Error },
    #[error("the write was cancelled")]
    Cancelled,
    #[error("the write to pid {pid} passed its deadline after {done} bytes; every writing thread has stopped")]
    DeadlinePassed { pid: i32, done: u64 },
}

/// This host's identity as far as pids are concerned: boot id, hostname and pid namespace. Two
/// processes with equal identities can name each other by pid.
pub fn host_identity() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
        let ns = std::fs::read_link("/proc/self/ns/pid").map(|p| p.display().to_string()).unwrap_or_default();
        let boot = read("/proc/sys/kernel/random/boot_id");
        if boot.is_empty() || ns.is_empty() {
            // Without both, never claim to be on the same host as anyone.
            return format!("unknown-{}", uuid::Uuid::new_v4());
        }
        format!("{boot}/{}/{ns}", read("/proc/sys/kernel/hostname"))
    })
}

/// Fresh random canary bytes (kept alive by the data server for its whole life).
pub fn new_canary() -> Box<[u8]> {
    let (a, b) = uuid::Uuid::new_v4().as_u64_pair();
    let (c, d) = uuid::Uuid::new_v4().as_u64_pair();
    [a, b, c, d].iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// A data server P may write directly, as it described itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SameHostPeer {
    pub pid: i32,
    pub canary_addr: u64,
    pub canary: Vec<u8>,
    pub regions: Vec<RegionDesc>,
}

/// Reads the peer's canary back through the kernel: `Ok(true)` when `pid` is the process that
/// answered (and the kernel allows access), `Ok(false)` when the bytes differ (another process).
pub fn verify_canary(peer: &SameHostPeer) -> Result<bool, SameHostError> {
    let mut got = vec![0u8; peer.canary.len()];
    let len = got.len();
    let local = [IoSliceMut::new(&mut got)];
    let remote = [libc::iovec { iov_base: peer.canary_addr as *mut libc::c_void, iov_len: len }];
    // SAFETY: the local iovec points at `got`, which outlives the call; the remote one is only
    // dereferenced by the kernel, inside the peer's address space, with its own checks.
    let n = unsafe { libc::process_vm_readv(peer.pid, local.as_ptr().cast::<libc::iovec>(), 1, remote.as_ptr(), 1, 0) };
    if n < 0 {
        let source = std::io::Error::last_os_error();
        return match source.raw_os_error() {
            Some(libc::EFAULT) => Ok(false),
            _ => Err(classify(peer.pid, 0, source)),
        };
    }
    Ok(n as usize == len && got == peer.canary)
}

/// Checks every destination range against the peer's regions; nothing may be written otherwise.
pub fn check_destinations(regions: &[RegionDesc], descriptors: &[Descriptor]) -> Result<(), SameHostError> {
    for d in descriptors {
        let inside = d
            .dst
            .checked_add(d.len)
            .is_some_and(|end| regions.iter().any(|r| d.dst >= r.base_addr && end <= r.base_addr + r.len));
        if !inside {
            return Err(SameHostError::OutOfRegion(RegionError::OutOfRegion { addr: d.dst, len: d.len }));
        }
    }
    Ok(())
}

/// Writes `descriptors` (sources checked against `local`, destinations against the peer's
/// regions, here) into the peer, over up to `threads` blocking threads, until `deadline`. Returns
/// the bytes written. It returns only once every thread has stopped — at the deadline or after an
/// error, the others stop between system calls and are waited for — so that when it reports a
/// failure, no byte of this write can land in the peer any more.
///
/// `keep` lives as long as the last writing thread: the caller passes D's fence hold, whose
/// connection then closes only once no thread can write any more, even when this future is
/// dropped mid-write (P's actor killed) while a system call is still copying.
pub async fn write<K: Send + Sync + 'static>(
    peer: &SameHostPeer,
    local: &RegionTable,
    descriptors: &[Descriptor],
    threads: usize,
    deadline: tokio::time::Instant,
    keep: Arc<K>,
) -> Result<u64, SameHostError> {
    check_destinations(&peer.regions, descriptors)?;
    for d in descriptors {
        local.check_host(d.src, d.len).map_err(SameHostError::OutOfRegion)?;
    }
    let bytes: u64 = descriptors.iter().map(|d| d.len).sum();
    if bytes <= INLINE_MAX_BYTES {
        // Nothing is written at or past the deadline; the one call that starts before it ends
        // within microseconds.
        if tokio::time::Instant::now() >= deadline {
            return Err(SameHostError::DeadlinePassed { pid: peer.pid, done: 0 });
        }
        return write_blocking(peer.pid, descriptors, &AtomicBool::new(false));
    }
    let threads = usize::try_from(bytes / MIN_BYTES_PER_THREAD).unwrap_or(usize::MAX).clamp(1, threads.max(1));
    let cancel = Arc::new(AtomicBool::new(false));
    // Stops the blocking threads between calls if this future is dropped.
    struct CancelOnDrop(Arc<AtomicBool>);
    impl Drop for CancelOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    let _guard = CancelOnDrop(cancel.clone());
    let shares = super::tcp::split_by_bytes(descriptors, threads);
    let mut tasks = tokio::task::JoinSet::new();
    for share in shares {
        let (pid, local, cancel, keep) = (peer.pid, local.clone(), cancel.clone(), keep.clone());
        // `local` keeps P's memory alive for as long as the thread may read it, `keep` D's fence.
        tasks.spawn_blocking(move || {
            let _keep = (local, keep);
            write_blocking(pid, &share, &cancel)
        });
    }
    let (mut written, mut first_error, mut timed_out) = (0, None, false);
    loop {
        let done = tokio::select! {
            done = tasks.join_next() => done,
            _ = tokio::time::sleep_until(deadline), if !timed_out => {
                timed_out = true;
                cancel.store(true, Ordering::Release);
                continue;
            }
        };
        let Some(done) = done else { break };
        let result = done.map_err(|e| SameHostError::Failed {
            pid: peer.pid,
            done: written,
            source: std::io::Error::other(e.to_string()),
        });
        match result.and_then(|r| r) {
            Ok(n) => written += n,
            Err(SameHostError::Cancelled) => {}
            Err(e) => {
                // Stop the other threads too, and wait for them before reporting.
                cancel.store(true, Ordering::Release);
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None if timed_out => Err(SameHostError::DeadlinePassed { pid: peer.pid, done: written }),
        None => Ok(written),
    }
}

/// The system-call loop: up to [`MAX_IOVECS`] descriptors (and [`MAX_BYTES_PER_CALL`]) a call,
/// resuming after partial writes. The caller has checked every range.
fn write_blocking(pid: i32, descriptors: &[Descriptor], cancel: &AtomicBool) -> Result<u64, SameHostError> {
    let mut done = 0u64;
    let (mut index, mut offset) = (0usize, 0u64);
    while index < descriptors.len() {
        if cancel.load(Ordering::Acquire) {
            return Err(SameHostError::Cancelled);
        }
        let (mut local, mut remote) = (Vec::with_capacity(MAX_IOVECS), Vec::with_capacity(MAX_IOVECS));
        let mut batch_bytes = 0u64;
        let (mut i, mut off) = (index, offset);
        while i < descriptors.len() && local.len() < MAX_IOVECS && batch_bytes < MAX_BYTES_PER_CALL {
            let d = descriptors[i];
            let take = (d.len - off).min(MAX_BYTES_PER_CALL - batch_bytes);
            local.push(libc::iovec { iov_base: (d.src + off) as *mut libc::c_void, iov_len: take as usize });
            remote.push(libc::iovec { iov_base: (d.dst + off) as *mut libc::c_void, iov_len: take as usize });
            batch_bytes += take;
            off += take;
            if off == d.len {
                i += 1;
                off = 0;
            }
        }
        // SAFETY: the local iovecs lie inside P's registered regions (checked by the caller; the
        // memory is kept alive by the caller's region table); the remote ones are dereferenced by
        // the kernel only, inside D's address space, and were checked against D's regions.
        let n = unsafe {
            libc::process_vm_writev(
                pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        if n < 0 {
            return Err(classify(pid, done, std::io::Error::last_os_error()));
        }
        if n == 0 {
            return Err(SameHostError::Failed {
                pid,
                done,
                source: std::io::Error::new(std::io::ErrorKind::WriteZero, "no byte written"),
            });
        }
        // Advance by what was written (a short count resumes inside a descriptor).
        let mut left = n as u64;
        done += left;
        while left > 0 {
            let rest = descriptors[index].len - offset;
            if left >= rest {
                left -= rest;
                index += 1;
                offset = 0;
            } else {
                offset += left;
                left = 0;
            }
        }
    }
    Ok(done)
}

fn classify(pid: i32, done: u64, source: std::io::Error) -> SameHostError {
    match source.raw_os_error() {
        // Rewriting the same bytes over TCP after a partial write is safe.
        Some(libc::EPERM | libc::EACCES | libc::ESRCH | libc::ENOSYS) => SameHostError::Unavailable { pid, source },
        _ => SameHostError::Failed { pid, done, source },
    }
}
