//! Safe handles over the libfabric shim: a [`Domain`] (one provider on one interface, opened in
//! the registration modes a verbs NIC requires), a [`Listener`] (D's passive endpoint), a
//! [`Conn`] (one reliable connection) and an [`Mr`] (a registered memory region with its key).
//! Each handle keeps its domain alive; dropping a handle closes it. The domain is opened
//! thread-safe (`FI_THREAD_SAFE`), so handles are shared across threads.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::ffi;
use super::RdmaError;

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
}

// SAFETY: the domain is opened FI_THREAD_SAFE; the pointer is only closed in Drop.
unsafe impl Send for Domain {}
unsafe impl Sync for Domain {}

impl Domain {
    /// Opens `provider` (libfabric's name: `tcp`, `verbs`, …; empty: libfabric's choice) on the
    /// interface holding `node` (an IP address of this host).
    pub fn open(provider: &str, node: &str) -> Result<Arc<Self>, RdmaError> {
        load()?;
        let prov = CString::new(provider).map_err(|_| RdmaError::BadName { name: provider.to_string() })?;
        let node_c = CString::new(node).map_err(|_| RdmaError::BadName { name: node.to_string() })?;
        let mut ptr = std::ptr::null_mut();
        let mut err = [0u8; ERR_LEN];
        // SAFETY: the strings and buffers outlive the call; `ptr` is written on success.
        let rc = unsafe {
            ffi::pf_domain_open(prov.as_ptr(), node_c.as_ptr(), &mut ptr, err.as_mut_ptr().cast(), err.len())
        };
        if rc != 0 || ptr.is_null() {
            return Err(fail("opening the provider", rc, &err));
        }
        let (mut prov_buf, mut dom_buf) = ([0u8; 128], [0u8; 128]);
        let (mut mr_mode, mut max_msg) = (0u64, 0u64);
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
            );
        }
        Ok(Arc::new(Self { ptr, provider: err_text(&prov_buf), domain: err_text(&dom_buf), mr_mode, max_msg }))
    }

    /// Whether the domain runs in every registration mode a verbs NIC requires.
    pub fn nic_modes(&self) -> bool {
        let want = ffi::FI_MR_LOCAL | ffi::FI_MR_VIRT_ADDR | ffi::FI_MR_ALLOCATED | ffi::FI_MR_PROV_KEY;
        self.mr_mode & want == want
    }

    /// Registers `[addr, addr + len)` for `access` (`FI_WRITE` for a local source,
    /// `FI_REMOTE_WRITE` for a peer's target). The memory must stay valid while the [`Mr`] lives.
    pub fn register(self: &Arc<Self>, addr: u64, len: u64, access: u64) -> Result<Mr, RdmaError> {
        let len_usize = usize::try_from(len).map_err(|_| RdmaError::TooLarge { len })?;
        let (mut mr, mut key, mut desc) = (std::ptr::null_mut(), 0u64, std::ptr::null_mut());
        // SAFETY: the caller owns the memory for the Mr's life; out-pointers are valid.
        let rc =
            unsafe { ffi::pf_mr_reg(self.ptr, addr as *mut c_void, len_usize, access, &mut mr, &mut key, &mut desc) };
        if rc != 0 || mr.is_null() {
            return Err(RdmaError::Fabric { what: "registering memory", code: rc, detail: strerror(rc) });
        }
        Ok(Mr { ptr: mr, key, desc, addr, len, _domain: self.clone() })
    }

    /// Listens for connections on this domain's interface (any port).
    pub fn listen(self: &Arc<Self>) -> Result<Listener, RdmaError> {
        let mut ptr = std::ptr::null_mut();
        let mut name = vec![0u8; 256];
        let mut namelen = name.len();
        let mut err = [0u8; ERR_LEN];
        // SAFETY: buffers sized as given; `ptr` written on success.
        let rc = unsafe {
            ffi::pf_listen(
                self.ptr,
                &mut ptr,
                name.as_mut_ptr().cast(),
                &mut namelen,
                err.as_mut_ptr().cast(),
                err.len(),
            )
        };
        if rc != 0 || ptr.is_null() {
            return Err(fail("listening", rc, &err));
        }
        name.truncate(namelen);
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
        Ok(Conn { ptr, _domain: self.clone() })
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        // SAFETY: every handle holding the domain is gone (they keep an Arc of it).
        unsafe { ffi::pf_domain_close(self.ptr) }
    }
}

/// A registered region: its key (what a peer names to write it) and local descriptor.
#[derive(Debug)]
pub struct Mr {
    ptr: *mut ffi::FidMr,
    pub key: u64,
    desc: *mut c_void,
    pub addr: u64,
    pub len: u64,
    _domain: Arc<Domain>,
}

// SAFETY: a registration is an immutable handle in a thread-safe domain.
unsafe impl Send for Mr {}
unsafe impl Sync for Mr {}

impl Mr {
    /// Whether `[addr, addr + len)` lies inside this region.
    pub fn holds(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|end| end <= self.addr + self.len)
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: the region is closed once; its key is invalid from here on.
        let rc = unsafe { ffi::pf_mr_close(self.ptr) };
        if rc != 0 {
            tracing::warn!(key = self.key, "closing a memory registration failed: {}", strerror(rc));
        }
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
        Ok(Conn { ptr, _domain: self.domain.clone() })
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

/// One reliable connection (an RC queue pair on verbs).
#[derive(Debug)]
pub struct Conn {
    ptr: *mut ffi::PfConn,
    _domain: Arc<Domain>,
}

// SAFETY: the endpoint lives in a thread-safe domain; one writer uses it at a time (its pool).
unsafe impl Send for Conn {}
unsafe impl Sync for Conn {}

impl Conn {
    /// Posts one RDMA WRITE of local `[src, src + len)` (inside `local`) to the peer's
    /// `[dst, dst + len)` under `key`. `Ok(false)`: the queue is full, poll and post again.
    pub fn write(&self, local: &Mr, src: u64, len: u64, dst: u64, key: u64, ctx: u64) -> Result<bool, RdmaError> {
        if !local.holds(src, len) {
            return Err(RdmaError::NotRegistered { addr: src, len });
        }
        let len = usize::try_from(len).map_err(|_| RdmaError::TooLarge { len })?;
        // SAFETY: [src, src + len) lies inside `local`, registered and alive for this call; the
        // caller keeps it alive until the write completes (the engine holds its regions).
        let rc = unsafe { ffi::pf_write(self.ptr, src as *const c_void, len, local.desc, dst, key, ctx) };
        match rc {
            0 => Ok(true),
            rc if rc == -ffi::FI_EAGAIN => Ok(false),
            code => Err(RdmaError::Fabric { what: "posting a write", code, detail: strerror(code) }),
        }
    }

    /// Reads the completions that are ready (never waits).
    pub fn poll(&self) -> Polled {
        let mut ctxs = [0u64; 64];
        let mut failed = 0u64;
        let mut err = [0u8; ERR_LEN];
        // SAFETY: buffers sized as given.
        let rc =
            unsafe { ffi::pf_poll(self.ptr, ctxs.as_mut_ptr(), 64, &mut failed, err.as_mut_ptr().cast(), err.len()) };
        if rc >= 0 {
            Polled::Done(ctxs[..rc as usize].to_vec())
        } else {
            Polled::Failed { ctx: failed, code: rc, detail: err_text(&err) }
        }
    }

    /// Whether the peer closed the connection (or it broke).
    pub fn closed(&self) -> bool {
        // SAFETY: a live connection.
        unsafe { ffi::pf_conn_closed(self.ptr) == 1 }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // SAFETY: closed once; after this no byte moves through the endpoint.
        unsafe { ffi::pf_conn_close(self.ptr) }
    }
}
