//! Registrations of one [`Domain`]: [`Mr`], and the keys it hands out — the provider's where it
//! chooses keys (`FI_MR_PROV_KEY` in force), else random 64-bit ones pdflow asks for; either way
//! no two live registrations of a domain share a key.

use std::collections::HashSet;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

use super::super::{ffi, RdmaError};
use super::{strerror, Domain};

/// Draws of a random key before a registration gives up (a collision is a 2^-64 event).
const KEY_TRIES: usize = 8;

impl Domain {
    /// A random key that fits the provider's key size (never zero).
    fn random_key(&self) -> Result<u64, RdmaError> {
        let mask = match self.key_size {
            1..=7 => (1u64 << (8 * self.key_size)) - 1,
            _ => u64::MAX,
        };
        loop {
            let key = getrandom::u64()
                .map_err(|e| RdmaError::Unavailable { reason: format!("no random memory keys: {e}") })?
                & mask;
            if key != 0 {
                return Ok(key);
            }
        }
    }

    fn reg_raw(&self, addr: u64, len: usize, access: u64, requested: u64) -> Result<(RawMr, u64), c_int> {
        let (mut mr, mut key, mut desc) = (std::ptr::null_mut(), 0u64, std::ptr::null_mut());
        // SAFETY: the caller owns the memory while the registration lives; out-pointers are valid.
        let rc = unsafe {
            ffi::pf_mr_reg(self.ptr, addr as *mut c_void, len, access, requested, &mut mr, &mut key, &mut desc)
        };
        match rc {
            0 if !mr.is_null() => Ok((RawMr { ptr: mr, desc }, key)),
            0 => Err(-ffi::FI_ENOKEY),
            rc => Err(rc),
        }
    }

    /// Whether the provider chooses keys: a probe registration asking for a random key gets
    /// another (the provider's) or that one.
    pub(super) fn probe_keys(&self) -> Result<bool, RdmaError> {
        let probe = Box::new([0u8; 64]);
        let requested = self.random_key()?;
        let (raw, key) = self
            .reg_raw(probe.as_ptr() as u64, probe.len(), ffi::FI_REMOTE_WRITE, requested)
            .map_err(|code| RdmaError::Fabric { what: "registering memory", code, detail: strerror(code) })?;
        raw.close();
        Ok(key != requested)
    }

    fn keys(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        // A set of numbers: a panicking holder leaves it consistent.
        self.keys.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers `[addr, addr + len)` for `access` (`FI_WRITE` for a local source,
    /// `FI_REMOTE_WRITE` for a peer's target) under a key no other live registration of this
    /// domain has. The memory must stay valid while the [`Mr`] lives.
    pub fn register(self: &Arc<Self>, addr: u64, len: u64, access: u64) -> Result<Mr, RdmaError> {
        let len_usize = usize::try_from(len).map_err(|_| RdmaError::TooLarge { len })?;
        let mut last = 0;
        for _ in 0..KEY_TRIES {
            // Asked for where the provider takes it; ignored where it chooses keys itself.
            let requested = self.random_key()?;
            let (raw, key) = match self.reg_raw(addr, len_usize, access, requested) {
                Ok(got) => got,
                Err(code) if code == -ffi::FI_ENOKEY && !self.provider_keys => {
                    last = code;
                    continue;
                }
                Err(code) => {
                    return Err(RdmaError::Fabric { what: "registering memory", code, detail: strerror(code) })
                }
            };
            if self.keys().insert(key) {
                return Ok(Mr { ptr: raw.ptr, key, desc: raw.desc, addr, len, domain: self.clone() });
            }
            // A key already in force: no two registrations share one.
            raw.close();
            last = -ffi::FI_ENOKEY;
            if self.provider_keys {
                break;
            }
        }
        Err(RdmaError::Fabric {
            what: "registering memory",
            code: last,
            detail: format!("no key unique in this domain ({})", strerror(last)),
        })
    }
}

/// A registration not yet handed out.
struct RawMr {
    ptr: *mut ffi::FidMr,
    desc: *mut c_void,
}

impl RawMr {
    fn close(self) {
        // SAFETY: never handed out; closed once.
        let rc = unsafe { ffi::pf_mr_close(self.ptr) };
        if rc != 0 {
            tracing::warn!("closing a memory registration failed: {}", strerror(rc));
        }
    }
}

/// A registered region: its key (what a peer names to write it) and local descriptor.
#[derive(Debug)]
pub struct Mr {
    ptr: *mut ffi::FidMr,
    pub key: u64,
    pub(super) desc: *mut c_void,
    pub addr: u64,
    pub len: u64,
    domain: Arc<Domain>,
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
        self.domain.keys().remove(&self.key);
    }
}
