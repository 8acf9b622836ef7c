//! The C shim's functions (csrc/fabric_shim.c): libfabric's calls pdflow makes, as plain
//! functions. Only [`super::fabric`] calls them.

use std::ffi::{c_char, c_int, c_void};

/// The shim's opaque objects.
#[repr(C)]
pub struct PfDomain {
    _private: [u8; 0],
}
#[repr(C)]
pub struct PfListener {
    _private: [u8; 0],
}
#[repr(C)]
pub struct PfConn {
    _private: [u8; 0],
}
#[repr(C)]
pub struct PfConnReq {
    _private: [u8; 0],
}
#[repr(C)]
pub struct FidMr {
    _private: [u8; 0],
}

/// libfabric's `FI_EAGAIN`: a queue is full, retry after reading completions.
pub const FI_EAGAIN: c_int = 11;
/// libfabric's `FI_ENOKEY`: a registration asked for a key already in use.
pub const FI_ENOKEY: c_int = 266;
/// `FI_WRITE` / `FI_REMOTE_WRITE` access bits of a registration.
pub const FI_WRITE: u64 = 1 << 9;
pub const FI_REMOTE_WRITE: u64 = 1 << 13;
/// The registration mode bits pdflow runs every provider in.
pub const FI_MR_LOCAL: u64 = 1 << 2;
pub const FI_MR_VIRT_ADDR: u64 = 1 << 4;
pub const FI_MR_ALLOCATED: u64 = 1 << 5;
pub const FI_MR_PROV_KEY: u64 = 1 << 6;

extern "C" {
    pub fn pf_load(err: *mut c_char, n: usize) -> c_int;
    pub fn pf_strerror(code: c_int) -> *const c_char;
    pub fn pf_domain_open(
        prov: *const c_char,
        node: *const c_char,
        rdm: c_int,
        out: *mut *mut PfDomain,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    pub fn pf_domain_describe(
        d: *const PfDomain,
        prov: *mut c_char,
        prov_n: usize,
        dom: *mut c_char,
        dom_n: usize,
        mr_mode: *mut u64,
        max_msg: *mut u64,
        key_size: *mut u64,
    );
    pub fn pf_domain_close(d: *mut PfDomain);
    pub fn pf_listen(
        d: *mut PfDomain,
        out: *mut *mut PfListener,
        name: *mut c_void,
        namelen: *mut usize,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    pub fn pf_listener_close(l: *mut PfListener);
    pub fn pf_listener_wait(
        l: *mut PfListener,
        timeout_ms: c_int,
        req: *mut *mut PfConnReq,
        data: *mut c_void,
        data_len: *mut usize,
    ) -> c_int;
    pub fn pf_reject(l: *mut PfListener, req: *mut PfConnReq) -> c_int;
    pub fn pf_accept(
        l: *mut PfListener,
        req: *mut PfConnReq,
        timeout_ms: c_int,
        out: *mut *mut PfConn,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    pub fn pf_connect(
        d: *mut PfDomain,
        name: *const c_void,
        namelen: usize,
        data: *const c_void,
        data_len: usize,
        timeout_ms: c_int,
        out: *mut *mut PfConn,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    pub fn pf_rdm_open(
        d: *mut PfDomain,
        out: *mut *mut PfConn,
        name: *mut c_void,
        namelen: *mut usize,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    pub fn pf_rdm_reach(
        d: *mut PfDomain,
        name: *const c_void,
        namelen: usize,
        out: *mut *mut PfConn,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
    pub fn pf_conn_closed(c: *mut PfConn) -> c_int;
    pub fn pf_conn_close_ep(c: *mut PfConn);
    pub fn pf_conn_close(c: *mut PfConn);
    pub fn pf_mr_reg(
        d: *mut PfDomain,
        addr: *mut c_void,
        len: usize,
        access: u64,
        requested_key: u64,
        out: *mut *mut FidMr,
        key: *mut u64,
        desc: *mut *mut c_void,
    ) -> c_int;
    pub fn pf_mr_close(mr: *mut FidMr) -> c_int;
    pub fn pf_write(
        c: *mut PfConn,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        addr: u64,
        key: u64,
        ctx: u64,
    ) -> c_int;
    pub fn pf_poll(
        c: *mut PfConn,
        timeout_ms: c_int,
        ctxs: *mut u64,
        max: c_int,
        failed_ctx: *mut u64,
        err: *mut c_char,
        n: usize,
    ) -> c_int;
}
