//! `/metrics` for the rdma backend: `pdflow_rdma_connections{side,provider,device}`, the RDMA
//! connections each endpoint of this process holds (D: accepted; P: idle, ready for the next
//! plan), one sample per endpoint — which provider and device carry the one-sided writes.

use std::sync::{Mutex, OnceLock, Weak};

use pdflow_observability::metrics::{global, GaugeSample};

/// An endpoint that reports its connections.
pub(super) trait Endpoint: Send + Sync {
    /// `(side, provider, device, connections)`, one per domain.
    fn samples(&self) -> Vec<(&'static str, String, String, usize)>;
}

type Endpoints = Mutex<Vec<Weak<dyn Endpoint>>>;

fn endpoints() -> &'static Endpoints {
    static ENDPOINTS: OnceLock<Endpoints> = OnceLock::new();
    ENDPOINTS.get_or_init(|| {
        global().register_gauge(
            "pdflow_rdma_connections",
            "RDMA connections held, by side (d: accepted, p: idle), libfabric provider and device",
            || {
                let list = endpoints().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                list.iter()
                    .filter_map(Weak::upgrade)
                    .flat_map(|e| e.samples())
                    .map(|(side, provider, device, n)| GaugeSample {
                        labels: vec![("side", side.to_string()), ("provider", provider), ("device", device)],
                        value: n as f64,
                    })
                    .collect()
            },
        );
        Mutex::new(Vec::new())
    })
}

/// Reports `endpoint` at every scrape while it lives.
pub(super) fn register(endpoint: Weak<dyn Endpoint>) {
    let mut list = endpoints().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    list.retain(|e| e.strong_count() > 0);
    list.push(endpoint);
}
