//! D's GPU KV as offered to P. [`DeviceOffer`] is the device export D's tcp data server
//! answers a P with GPU KV with: D's host identity, the CUDA IPC export of D's KV allocations and
//! regions, and the port of D's staged receiver. [`DeviceServing`] is D's side of it: it exports the
//! handles and runs the [`StagedReceiver`] over D's regions, under the pulls' write fence and D's
//! auth token.
//!
//! Owns D's side of seed step 29 for GPU KV: a cuda-ipc write lands by P's own kernel (D's data
//! server holds the pull's fence for it), a cuda-staged write through D's receiver.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ipc::{ExportedKv, IpcError};
use super::staged::{StagedAuth, StagedConfig, StagedError, StagedReceiver};
use crate::fence::WriteFence;
use pdflow_kv::memory::KvCache;

/// What D's data server answers P's device-export question with (postcard-encoded).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceOffer {
    /// D's host ([`crate::same_host::host_identity`]): CUDA IPC works within one host.
    pub host_id: String,
    /// D's KV allocations as CUDA IPC handles, and D's regions; `None` when D's memory cannot be
    /// exported (e.g. allocated with the driver's virtual memory API, as PyTorch's expandable
    /// segments are): then only the staged path reaches D.
    pub ipc: Option<ExportedKv>,
    /// The port of D's staged receiver, on the host P reached D's data server at.
    pub staged_port: Option<u16>,
}

impl DeviceOffer {
    pub fn encode(&self) -> Result<Vec<u8>, IpcError> {
        postcard::to_allocvec(self).map_err(|e| IpcError::Encode(e.to_string()))
    }

    /// Reads and checks an offer; the error says what is wrong with it.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let offer: Self = postcard::from_bytes(bytes)
            .map_err(|e| format!("D's device export cannot be read ({e}): is D a different pdflow version?"))?;
        if let Some(ipc) = &offer.ipc {
            ipc.validate().map_err(|e| format!("D's device export is inconsistent: {e}"))?;
        }
        Ok(offer)
    }

    /// D's staged receiver, given the address `data_addr` (`host:port`) P reached D's data server at.
    pub fn staged_addr(&self, data_addr: &str) -> Option<String> {
        let port = self.staged_port?;
        let host = data_addr.rsplit_once(':').map_or(data_addr, |(host, _)| host);
        Some(format!("{host}:{port}"))
    }
}

/// Why D could not serve its GPU KV.
#[derive(Debug, thiserror::Error)]
pub enum DeviceServingError {
    #[error("D's KV is in host memory: there is no GPU KV to serve")]
    HostMemory,
    #[error("exporting D's GPU KV for CUDA IPC: {0}")]
    Export(#[from] IpcError),
    #[error("starting D's staged receiver on {addr}: {source} (is --host an address of this machine?)")]
    Staged { addr: String, source: StagedError },
}

/// D's serving of its GPU KV: the staged receiver (stopped on drop) and the encoded offer.
pub struct DeviceServing {
    export: Vec<u8>,
    staged: StagedReceiver,
}

impl std::fmt::Debug for DeviceServing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceServing")
            .field("staged", &self.staged.local_addr())
            .field("export_bytes", &self.export.len())
            .finish()
    }
}

impl DeviceServing {
    /// Exports `cache`'s GPU KV and starts the staged receiver on `bind_host` (any port), each
    /// part of a write received only under a token open in `fence`, with what `auth` holds
    /// proven (token, cluster secret, TLS), one part at most `deadline` long.
    pub fn start(
        cache: &Arc<KvCache>,
        bind_host: &str,
        auth: StagedAuth,
        deadline: Duration,
        fence: Option<WriteFence>,
    ) -> Result<Self, DeviceServingError> {
        let kv = cache.device().ok_or(DeviceServingError::HostMemory)?;
        let ctx = kv.context();
        let regions = cache.regions();
        let ipc = match ExportedKv::export(&ctx, &regions) {
            Ok(ipc) => Some(ipc),
            Err(e) => {
                tracing::warn!(error = %e, "D's GPU KV cannot be exported for CUDA IPC: P on this host will write it by the staged path");
                None
            }
        };
        let addr = if bind_host.contains(':') { format!("[{bind_host}]:0") } else { format!("{bind_host}:0") };
        let config = StagedConfig { deadline, ..StagedConfig::default() };
        let staged = StagedReceiver::bind_guarded(&ctx, regions, &addr, config, fence, auth)
            .map_err(|source| DeviceServingError::Staged { addr: addr.clone(), source })?;
        // One ring per connection of a P's default write, pinned now rather than on P's first.
        staged.prepin(config.streams).map_err(|source| DeviceServingError::Staged { addr, source })?;
        let offer = DeviceOffer {
            host_id: crate::same_host::host_identity().to_string(),
            ipc,
            staged_port: Some(staged.local_addr().port()),
        };
        Ok(Self { export: offer.encode()?, staged })
    }

    /// The device export D's data server answers P with.
    pub fn export(&self) -> &[u8] {
        &self.export
    }

    /// Where D's staged receiver listens.
    pub fn staged_addr(&self) -> std::net::SocketAddr {
        self.staged.local_addr()
    }
}

#[cfg(test)]
mod tests {
    //! CPU-only: the offer's encoding, checks and the staged address P derives from it.
    use pdflow_messages::layout::RegionDesc;

    use super::*;
    use crate::cuda::ipc::{ExportedAllocation, IpcMemHandle, IPC_HANDLE_LEN};

    fn offer(handle_len: usize, region_len: u64) -> DeviceOffer {
        let ipc = ExportedKv {
            pid: 42,
            device: 1,
            allocations: vec![ExportedAllocation {
                handle: IpcMemHandle(vec![7; handle_len]),
                base_addr: 0x10000,
                len: 0x8000,
            }],
            regions: vec![RegionDesc { base_addr: 0x10000, len: region_len, block_len: 0x1000 }],
        };
        DeviceOffer { host_id: "host-a".into(), ipc: Some(ipc), staged_port: Some(7001) }
    }

    #[test]
    fn an_offer_round_trips_and_a_bad_one_is_refused_saying_why() {
        let good = offer(IPC_HANDLE_LEN, 0x8000);
        assert_eq!(DeviceOffer::decode(&good.encode().expect("encodes")).expect("decodes"), good);
        let staged_only = DeviceOffer { ipc: None, ..good.clone() };
        assert_eq!(DeviceOffer::decode(&staged_only.encode().expect("encodes")).expect("decodes"), staged_only);
        let err = DeviceOffer::decode(b"not an offer").expect_err("garbage");
        assert!(err.contains("cannot be read"), "{err}");
        let err = DeviceOffer::decode(&offer(3, 0x8000).encode().expect("encodes")).expect_err("short handle");
        assert!(err.contains("inconsistent"), "{err}");
        let err = DeviceOffer::decode(&offer(IPC_HANDLE_LEN, 0x9000).encode().expect("encodes"))
            .expect_err("region past its allocation");
        assert!(err.contains("inconsistent"), "{err}");
    }

    #[test]
    fn the_staged_receiver_is_on_the_host_p_reached_d_at() {
        let o = offer(IPC_HANDLE_LEN, 0x8000);
        assert_eq!(o.staged_addr("10.1.2.3:5000").as_deref(), Some("10.1.2.3:7001"));
        assert_eq!(o.staged_addr("[::1]:5000").as_deref(), Some("[::1]:7001"));
        assert_eq!(o.staged_addr("decode-0.local:5000").as_deref(), Some("decode-0.local:7001"));
        assert_eq!(DeviceOffer { staged_port: None, ..o }.staged_addr("10.1.2.3:5000"), None);
    }
}
