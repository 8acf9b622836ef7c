//! Whether D offers one-sided RDMA writes into its KV (seed step 29 over RDMA), and its endpoint:
//! with `transport: rdma` always — on the provider named by `rdma_provider` (`tcp;ofi_rxm` for
//! reliable datagram endpoints in software), else a NIC's (`verbs`, else `efa`), else libfabric's
//! software `tcp` provider — and with `transport: auto` only
//! when a NIC's provider (or the named one) opens on D's interface. GPU KV is not offered: the
//! device-memory registration (`FI_HMEM`) is not built.

use std::sync::Arc;

use pdflow_kv::memory::{KvCache, MemoryKind};
use pdflow_transfer::fence::RemoteAccess;
use pdflow_transfer::tcp::{RdmaMode, TcpConfig};

use super::NodeError;

/// D's RDMA target over `kv_cache` on `host`, when it is to offer one.
pub fn rdma_target(
    kv_cache: &Arc<KvCache>,
    host: &str,
    tcp: &TcpConfig,
) -> Result<Option<Arc<dyn RemoteAccess>>, NodeError> {
    if tcp.rdma == RdmaMode::Off || kv_cache.memory() != MemoryKind::Host {
        return Ok(None);
    }
    start(kv_cache, host, tcp)
}

#[cfg(feature = "rdma")]
fn start(kv_cache: &Arc<KvCache>, host: &str, tcp: &TcpConfig) -> Result<Option<Arc<dyn RemoteAccess>>, NodeError> {
    use pdflow_transfer::rdma::{hardware_provider, RdmaTarget};
    let required = tcp.rdma == RdmaMode::Required;
    let provider = match (&tcp.rdma_provider, hardware_provider(host)) {
        (Some(named), _) => named.clone(),
        (None, Ok(nic)) => nic,
        (None, Err(e)) if required => {
            tracing::info!("{e}; transport rdma runs on libfabric's software tcp provider");
            "tcp".to_string()
        }
        (None, Err(e)) => {
            tracing::debug!("RDMA not offered: {e}");
            return Ok(None);
        }
    };
    match RdmaTarget::start(&provider, host, tcp.secret.clone()) {
        Ok(target) => {
            // The KV lives as long as anything that could write it one-sided.
            target.hold_memory(kv_cache.region_table());
            tracing::info!(provider = %target.provider(), device = %target.device(), "D offers one-sided RDMA writes into its KV");
            Ok(Some(Arc::new(target)))
        }
        Err(e) if required => {
            Err(NodeError::TransferStart { engine: crate::TransferPart::RdmaEndpoint, source: Box::new(e) })
        }
        Err(e) => {
            tracing::warn!(provider = %provider, "RDMA not offered: {e}");
            Ok(None)
        }
    }
}

#[cfg(not(feature = "rdma"))]
fn start(kv_cache: &Arc<KvCache>, host: &str, tcp: &TcpConfig) -> Result<Option<Arc<dyn RemoteAccess>>, NodeError> {
    let _ = (kv_cache, host);
    match tcp.rdma {
        RdmaMode::Required => Err(NodeError::NoRdmaSupport),
        _ => Ok(None),
    }
}
