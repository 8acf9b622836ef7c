//! Test support for the data channel's tests over real sockets: D's data server over a cache of
//! its own, P's cache filled with bytes that differ by layer, block, head and slot, and what a
//! test checks afterwards (the plan's blocks landed, or D's memory untouched).

use std::sync::Arc;
use std::time::Duration;

use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::planner::{build_plan, TransferPlan};
use pdflow_messages::BlockId;

use super::{DataServerOptions, TcpConfig, TcpDataServer, TcpTransferEngine};
use crate::{TransferEngine, TransferError};

/// How long one write in these tests may take.
const BOUND: Duration = Duration::from_secs(20);
/// Blocks in each side's cache.
const BLOCKS: usize = 8;

/// P's filled cache, and D's empty one behind a data server.
pub(super) struct Side {
    pub(super) src: Arc<KvCache>,
    pub(super) dst: Arc<KvCache>,
    pub(super) server: TcpDataServer,
    pub(super) peer: String,
}

impl Side {
    /// D's data server for a cache of `shape`, serving as `options` say.
    pub(super) async fn start(shape: KvShape, options: DataServerOptions) -> Self {
        let (src, dst) = (KvCache::patterned(shape, BLOCKS, 0), KvCache::new(shape, BLOCKS));
        let server = TcpDataServer::bind_options("127.0.0.1:0".parse().expect("address"), dst.region_table(), options)
            .await
            .expect("binds");
        let peer = server.local_addr().to_string();
        Self { src, dst, server, peer }
    }

    /// P's engine over its cache.
    pub(super) fn engine(&self, config: TcpConfig) -> TcpTransferEngine {
        TcpTransferEngine::new(self.src.region_table(), config)
    }

    /// P's blocks `src` into D's `dst`.
    pub(super) fn plan(&self, src: &[BlockId], dst: &[BlockId]) -> TransferPlan {
        build_plan(&self.src.regions(), src, &self.dst.regions(), dst, true).expect("plannable")
    }

    /// Each `(src, dst)` block of D holds P's bytes.
    pub(super) fn landed(&self, pairs: &[(BlockId, BlockId)]) -> bool {
        pairs.iter().all(|&(s, d)| self.src.block_bytes(s).ok() == self.dst.block_bytes(d).ok())
    }

    /// Not one byte of D's blocks was written.
    pub(super) fn untouched(&self) -> bool {
        (0..BLOCKS as BlockId).all(|b| self.dst.block_bytes(b).expect("block").iter().all(|&x| x == 0))
    }

    pub(super) async fn write(&self, engine: &TcpTransferEngine, plan: &TransferPlan) -> Result<(), TransferError> {
        tokio::time::timeout(BOUND, engine.write(&self.peer, plan)).await.expect("bounded").map(|_| ())
    }
}

/// `pdflow_auth_refusals_total{socket="data",cause}` in this process's registry.
pub(crate) fn data_refusals(cause: &str) -> f64 {
    let series = format!("pdflow_auth_refusals_total{{socket=\"data\",cause=\"{cause}\"}} ");
    let text = pdflow_observability::metrics::global().render();
    text.lines().find_map(|l| l.strip_prefix(series.as_str())).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}
