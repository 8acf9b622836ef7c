//! Safe handles over the libfabric shim: a [`Domain`] (one provider on one interface, opened in
//! the registration modes a verbs NIC requires, with connected or reliable datagram endpoints
//! as its provider offers: [`EndpointKind`]), a [`Listener`] (D's passive endpoint), a [`Conn`]
//! (one reliable connection, or one datagram endpoint and the peer it writes to) and an [`Mr`]
//! (a registered memory region with its key). Each handle keeps its domain alive; dropping a
//! handle closes it. The domain is opened thread-safe (`FI_THREAD_SAFE`), so handles are shared
//! across threads.
//!
//! Keys: every registration is unique in its domain. Where the provider chooses keys
//! (`FI_MR_PROV_KEY` in force: verbs, efa, tcp) they are its own; where it ignores that mode (the
//! software `tcp;ofi_rxm`, which runs its core domain in none of the modes pdflow sets) pdflow asks
//! for random 64-bit keys and re-draws one already in use.

use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use super::ffi;
use super::{endpoint_kind, EndpointKind, RdmaError};

mod registration;
pub use registration::Mr;

const ERR_LEN: usize = 512;

fn err_text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn strerror(code: c_int) -> String {
    // SAFETY: pf_strerror returns a static string (libfabric's table, or the shim's own).
    unsafe { CStr::from_ptr(ffi::pf_strerror(code)) }.to_string_lossy().into_owned()
}

fn fail(what: &'static str, code: c_int, buf: &[u8]) -> RdmaError {
    let detail = err_text(buf);
    let detail = if detail.is_empty() { strerror(code) } else { detail };
    RdmaError::Fabric { what, code, detail }
}

fn millis(d: Duration) -> c_int {
    c_int::try_from(d.as_millis()).unwrap_or(c_int::MAX)
}

/// Opens libfabric (once per process): `Err` says why the backend is unavailable here.
pub fn load() -> Result<(), RdmaError> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let mut err = [0u8; ERR_LEN];
            // SAFETY: the buffer outlives the call and its length is given.
            let rc = unsafe { ffi::pf_load(err.as_mut_ptr().cast::<c_char>(), err.len()) };
            if rc == 0 {
                Ok(())
            } else {
                Err(format!(
                    "libfabric could not be opened ({}): install it (Debian/Ubuntu: libfabric1)",
                    err_text(&err)
                ))
            }
        })
        .clone()
        .map_err(|reason| RdmaError::Unavailable { reason })
}

/// One provider's fabric and domain on one interface.
#[derive(Debug)]
pub struct Domain {
    ptr: *mut ffi::PfDomain,
    /// The provider libfabric chose (`tcp`, `verbs`, `efa`, …).
    pub provider: String,
    /// Its domain: the NIC (`mlx5_0`) or, for a software provider, the interface (`lo`).
    pub domain: String,
    /// The registration mode bits the domain runs in.
    pub mr_mode: u64,
    /// The largest single write the endpoint takes.
    pub max_msg: u64,
    /// Connected or reliable datagram endpoints.
    pub kind: EndpointKind,
    /// Whether the provider chooses the keys (`FI_MR_PROV_KEY` in force), found by a probe
    /// registration at open: `false` when it took the key pdflow asked for.
    pub provider_keys: bool,
    /// Whether remote addresses are virtual addresses (`FI_MR_VIRT_ADDR` in force) rather than
    /// offsets into each region. libfabric's software registration map takes both modes from one
    /// mode word, so a provider that ignored `FI_MR_PROV_KEY` ignored this too.
    pub virt_addr: bool,
    /// Bytes of a key.
    key_size: u64,
    /// The keys of this domain's live registrations.
    keys: Mutex<HashSet<u64>>,
}

// SAFETY: the domain is opened FI_THREAD_SAFE; the pointer is only closed in Drop.
unsafe impl Send for Domain {}
unsafe impl Sync for Domain {}

impl Domain {
    /// Opens `provider` (libfabric's name: `tcp`, `verbs`, `efa`, `tcp;ofi_rxm`, …; empty:
    /// libfabric's choice) on the interface holding `node` (an IP address of this host), with
    /// the endpoint kind [`endpoint_kind`] names for it.
    pub fn open(provider: &str, node: &str) -> Result<Arc<Self>, RdmaError> {
        load()?;
        let kind = endpoint_kind(provider);
        let prov = CString::new(provider).map_err(|_| RdmaError::BadName { name: provider.to_string() })?;
        let node_c = CString::new(node).map_err(|_| RdmaError::BadName { name: node.to_string() })?;
        let mut ptr = std::ptr::null_mut();
        let mut err = [0u8; ERR_LEN];
        // SAFETY: the strings and buffers outlive the call; `ptr` is written on success.
        let rc = unsafe {
            ffi::pf_domain_open(
                prov.as_ptr(),
                node_c.as_ptr(),
                c_int::from(kind == EndpointKind::ReliableDatagram),
                &mut ptr,
                err.as_mut_ptr().cast(),
                err.len(),
            )
        };
        if rc != 0 || ptr.is_null() {
            return Err(fail("opening the provider", rc, &err));
        }
        let (mut prov_buf, mut dom_buf) = ([0u8; 128], [0u8; 128]);
        let (mut mr_mode, mut max_msg, mut key_size) = (0u64, 0u64, 0u64);
        // SAFETY: `ptr` is a live domain; the buffers are sized as given.
        unsafe {
            ffi::pf_domain_describe(
                ptr,
                prov_buf.as_mut_ptr().cast(),
                prov_buf.len(),
                dom_buf.as_mut_ptr().cast(),
                dom_buf.len(),
                &mut mr_mode,
                &mut max_msg,
                &mut key_size,
            );
        }
        let mut domain = Self {
            ptr,
            provider: err_text(&prov_buf),
            domain: err_text(&dom_buf),
            mr_mode,
            max_msg,
            kind,
            provider_keys: true,
            virt_addr: true,
            key_size,
            keys: Mutex::new(HashSet::new()),
        };
        domain.provider_keys = domain.probe_keys()?;
        domain.virt_addr = domain.provider_keys;
        Ok(Arc::new(domain))
    }

    /// Whether the domain runs in every registration mode a verbs NIC requires, and the provider
    /// honours them.
    pub fn nic_modes(&self) -> bool {
        let want = ffi::FI_MR_LOCAL | ffi::FI_MR_VIRT_ADDR | ffi::FI_MR_ALLOCATED | ffi::FI_MR_PROV_KEY;
        self.mr_mode & want == want && self.provider_keys && self.virt_addr
    }

    /// The address a peer names to write `dst` inside its granted region starting at
    /// `region_addr`: the virtual address itself, or the offset into the region (see
    /// [`Domain::virt_addr`]). Both ends run the same provider; a mismatch is refused by the
    /// target's range check, never written elsewhere.
    pub fn remote_address(&self, region_addr: u64, dst: u64) -> u64 {
        if self.virt_addr {
            dst
        } else {
            dst.saturating_sub(region_addr)
        }
    }

    /// Opens a reliable datagram endpoint that peers write to (D's, for one P worker); returns it
    /// with its address.
    pub fn open_datagram(self: &Arc<Self>) -> Result<(Conn, Vec<u8>), RdmaError> {
        let (ptr, name) = self.open_named("opening a reliable datagram endpoint", ffi::pf_rdm_open)?;
        Ok((Conn::new(ptr, self.clone()), name))
    }

    /// Calls `open`, a shim function that opens an endpoint of this domain and writes its
    /// address: the endpoint and the address.
    fn open_named<T>(
        &self,
        what: &'static str,
        open: unsafe extern "C" fn(
            *mut ffi::PfDomain,
            *mut *mut T,
            *mut c_void,
            *mut usize,
            *mut c_char,
            usize,
        ) -> c_int,
    ) -> Result<(*mut T, Vec<u8>), RdmaError> {
        let mut ptr = std::ptr::null_mut();
        let mut name = vec![0u8; 256];
        let mut namelen = name.len();
        let mut err = [0u8; ERR_LEN];
        // SAFETY: `open` is a shim function of this signature; the domain is alive (self); the
        // buffers are sized as given; `ptr` is written on success.
        let rc = unsafe {
            open(self.ptr, &mut ptr, name.as_mut_ptr().cast(), &mut namelen, err.as_mut_ptr().cast(), err.len())
        };
        if rc != 0 || ptr.is_null() {
            return Err(fail(what, rc, &err));
        }
        name.truncate(namelen.min(name.len()));
        Ok((ptr, name))
    }

    /// A reliable datagram endpoint that writes to the one named `name` (P's, for one D
    /// endpoint). Nothing is sent and nothing checked: there is no connect step.
    pub fn reach(self: &Arc<Self>, name: &[u8]) -> Result<Conn, RdmaError> {
        let mut ptr = std::ptr::null_mut();
        let mut err = [0u8; ERR_LEN];
        // SAFETY: `name` is read for its length (libfabric copies the address); `ptr` written on
        // success.
        let rc = unsafe {
            ffi::pf_rdm_reach(self.ptr, name.as_ptr().cast(), name.len(), &mut ptr, err.as_mut_ptr().cast(), err.len())
        };
        if rc != 0 || ptr.is_null() {
            return Err(fail("addressing D's RDMA endpoint", rc, &err));
        }
        Ok(Conn::new(ptr, self.clone()))
    }

    /// Listens for connections on this domain's interface (any port).
    pub fn listen(self: &Arc<Self>) -> Result<Listener, RdmaError> {
        let (ptr, name) = self.open_named("listening", ffi::pf_listen)?;
        Ok(Listener { ptr, name, domain: self.clone() })
    }

    /// Connects to the listener named `name`, presenting `data` (at most 56 bytes, what a verbs
    /// connection request carries), within `timeout`.
    pub fn connect(self: &Arc<Self>, name: &[u8], data: &[u8], timeout: Duration) -> Result<Conn, RdmaError> {
        let mut ptr = std::ptr::null_mut();
        let mut err = [0u8; ERR_LEN];
        // SAFETY: buffers sized as given; `ptr` written on success.
        let rc = unsafe {
            ffi::pf_connect(
                self.ptr,
                name.as_ptr().cast(),
                name.len(),
                data.as_ptr().cast(),
                data.len(),
                millis(timeout),
                &mut ptr,
                err.as_mut_ptr().cast(),
                err.len(),
            )
        };
        if rc != 0 || ptr.is_null() {
            return Err(fail("connecting to D's RDMA endpoint", rc, &err));
        }
        Ok(Conn::new(ptr, self.clone()))
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        // SAFETY: every handle holding the domain is gone (they keep an Arc of it).
        unsafe { ffi::pf_domain_close(self.ptr) }
    }
}

/// A connection request at a [`Listener`], with the data the peer presented.
#[derive(Debug)]
pub struct ConnRequest {
    ptr: *mut ffi::PfConnReq,
    pub data: Vec<u8>,
}

// SAFETY: the request is handed from the waiting thread to the one that answers it, never shared.
unsafe impl Send for ConnRequest {}

/// D's passive endpoint: its `name` goes to P (inside the sealed pull).
#[derive(Debug)]
pub struct Listener {
    ptr: *mut ffi::PfListener,
    pub name: Vec<u8>,
    domain: Arc<Domain>,
}

// SAFETY: the listener is used from one accepting thread at a time (the target's), and closed in Drop.
unsafe impl Send for Listener {}
unsafe impl Sync for Listener {}

impl Listener {
    /// The next connection request, waiting at most `timeout`.
    pub fn wait(&self, timeout: Duration) -> Result<Option<ConnRequest>, RdmaError> {
        let mut req = std::ptr::null_mut();
        let mut data = vec![0u8; 256];
        let mut len = data.len();
        // SAFETY: buffers sized as given; `req` written when 1 is returned.
        let rc =
            unsafe { ffi::pf_listener_wait(self.ptr, millis(timeout), &mut req, data.as_mut_ptr().cast(), &mut len) };
        match rc {
            1 if !req.is_null() => {
                data.truncate(len);
                Ok(Some(ConnRequest { ptr: req, data }))
            }
            0 | 1 => Ok(None),
            code => Err(RdmaError::Fabric { what: "waiting for connections", code, detail: strerror(code) }),
        }
    }

    /// Accepts `req` (waits at most `timeout` for the connection to stand).
    pub fn accept(&self, req: ConnRequest, timeout: Duration) -> Result<Conn, RdmaError> {
        let mut ptr = std::ptr::null_mut();
        let mut err = [0u8; ERR_LEN];
        // SAFETY: `req` is consumed by the call (freed there); buffers sized as given.
        let rc =
            unsafe { ffi::pf_accept(self.ptr, req.ptr, millis(timeout), &mut ptr, err.as_mut_ptr().cast(), err.len()) };
        if rc != 0 || ptr.is_null() {
            return Err(fail("accepting a connection", rc, &err));
        }
        Ok(Conn::new(ptr, self.domain.clone()))
    }

    /// Refuses `req`.
    pub fn reject(&self, req: ConnRequest) {
        // SAFETY: `req` is consumed by the call.
        let rc = unsafe { ffi::pf_reject(self.ptr, req.ptr) };
        if rc != 0 {
            tracing::debug!("rejecting a connection request: {}", strerror(rc));
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // SAFETY: closed once.
        unsafe { ffi::pf_listener_close(self.ptr) }
    }
}

/// What [`Conn::poll`] read.
#[derive(Debug, PartialEq, Eq)]
pub enum Polled {
    /// The contexts of the writes completed (delivered).
    Done(Vec<u64>),
    /// A write failed (refused by the peer, or the connection broke): the connection is unusable.
    Failed { ctx: u64, code: c_int, detail: String },
}

/// A connection's shim object: its endpoint and queues. The queues outlive the endpoint while a
/// [`ConnProgress`] waits on them.
#[derive(Debug)]
struct Queues {
    ptr: *mut ffi::PfConn,
    ep_closed: AtomicBool,
    _domain: Arc<Domain>,
}

// SAFETY: the endpoint and queues live in a thread-safe domain; the endpoint is closed once
// (guarded by `ep_closed`), the rest in Drop.
unsafe impl Send for Queues {}
unsafe impl Sync for Queues {}

impl Queues {
    fn poll(&self, timeout: Duration) -> Polled {
        let mut ctxs = [0u64; 64];
        let mut failed = 0u64;
        let mut err = [0u8; ERR_LEN];
        // SAFETY: the queues are alive (self); buffers sized as given.
        let rc = unsafe {
            ffi::pf_poll(
                self.ptr,
                millis(timeout),
                ctxs.as_mut_ptr(),
                64,
                &mut failed,
                err.as_mut_ptr().cast(),
                err.len(),
            )
        };
        match usize::try_from(rc) {
            Ok(n) => Polled::Done(ctxs[..n.min(ctxs.len())].to_vec()),
            Err(_) => Polled::Failed { ctx: failed, code: rc, detail: err_text(&err) },
        }
    }

    fn close_ep(&self) {
        if !self.ep_closed.swap(true, Ordering::AcqRel) {
            // SAFETY: the endpoint is closed once; the queues stay valid.
            unsafe { ffi::pf_conn_close_ep(self.ptr) }
        }
    }
}

impl Drop for Queues {
    fn drop(&mut self) {
        // SAFETY: the last holder: the endpoint (if still open) and the queues are closed once.
        unsafe { ffi::pf_conn_close(self.ptr) }
    }
}

/// One reliable connection (an RC queue pair on verbs), or one reliable datagram endpoint (with,
/// on the writer's side, the one peer it writes to). Dropping it closes its endpoint at once:
/// from then on no byte moves through it.
#[derive(Debug)]
pub struct Conn {
    queues: Arc<Queues>,
}

impl Conn {
    fn new(ptr: *mut ffi::PfConn, domain: Arc<Domain>) -> Self {
        Self { queues: Arc::new(Queues { ptr, ep_closed: AtomicBool::new(false), _domain: domain }) }
    }

    /// Posts one RDMA WRITE of local `[src, src + len)` (inside `local`) to the peer's
    /// `[dst, dst + len)` under `key`. `Ok(false)`: the queue is full, poll and post again.
    pub fn write(&self, local: &Mr, src: u64, len: u64, dst: u64, key: u64, ctx: u64) -> Result<bool, RdmaError> {
        if !local.holds(src, len) {
            return Err(RdmaError::NotRegistered { addr: src, len });
        }
        let len = usize::try_from(len).map_err(|_| RdmaError::TooLarge { len })?;
        // SAFETY: [src, src + len) lies inside `local`, registered and alive for this call; the
        // caller keeps it alive until the write completes (the engine holds its regions).
        let rc = unsafe { ffi::pf_write(self.queues.ptr, src as *const c_void, len, local.desc, dst, key, ctx) };
        match rc {
            0 => Ok(true),
            rc if rc == -ffi::FI_EAGAIN => Ok(false),
            code => Err(RdmaError::Fabric { what: "posting a write", code, detail: strerror(code) }),
        }
    }

    /// Reads the completions that are ready, waiting up to `timeout` for the first (zero: not at
    /// all). Waiting drives a software provider's progress.
    pub fn poll(&self, timeout: Duration) -> Polled {
        self.queues.poll(timeout)
    }

    /// Whether the peer closed the connection (or it broke); never for a datagram endpoint.
    pub fn closed(&self) -> bool {
        // SAFETY: the queues are alive.
        unsafe { ffi::pf_conn_closed(self.queues.ptr) == 1 }
    }

    /// A handle that waits on this connection's queues from another thread (D's progress for a
    /// software provider); it ends when the connection is dropped.
    pub fn progress(&self) -> ConnProgress {
        ConnProgress { queues: self.queues.clone() }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.queues.close_ep();
    }
}

/// Waits on a connection's queues (see [`Conn::progress`]).
#[derive(Debug)]
pub struct ConnProgress {
    queues: Arc<Queues>,
}

impl ConnProgress {
    /// Waits up to `timeout` for completions; `false` once the connection is closed or broken.
    pub fn wait(&self, timeout: Duration) -> bool {
        if self.queues.ep_closed.load(Ordering::Acquire) {
            return false;
        }
        !matches!(self.queues.poll(timeout), Polled::Failed { .. })
    }
}
