//! Tests of engines whose model is sharded over ranks ([`Engine::start_ranked`]): the single
//! engine's tokens and slot bytes, the refusal of ranks that do not match the configuration, and
//! one layer-wise save per global layer.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::topology::{RankLayout, Topology, TopologyError};
use pdflow_messages::kv_transfer_params::KvTransferParams;
use pdflow_messages::scheduler_connector::*;
use pdflow_messages::RequestId;
use tokio::sync::Notify;

use super::ranks_tests::{assert_same_slots, rank_caches};
use super::tests::{prompt, request, run, small_config, start};
use super::*;
use pdflow_connector::{Connector, ConnectorError, SchedulerConnectorPort, WorkerConnectorPort};

/// Four layers, two KV heads: room for pp 2 and for tp beyond the heads.
const FOUR_LAYERS: KvShape = KvShape { num_layers: 4, num_kv_heads: 2, head_dim: 4, dtype_bytes: 2, block_size: 4 };

fn config(budget: usize) -> EngineConfig {
    EngineConfig { shape: FOUR_LAYERS, ..small_config(32, budget) }
}

/// An engine over vLLM's tp × pp split of `config.shape`, each rank with a zeroed cache.
pub(crate) fn start_topology(
    config: EngineConfig,
    tp: usize,
    pp: usize,
    connector: Option<pdflow_connector::Connector>,
) -> EngineHandle {
    let shape = config.shape;
    let topology = Topology::uniform(tp, pp, shape.num_layers, shape.num_kv_heads).expect("a valid topology");
    let ranks = rank_caches(shape, &topology, config.num_blocks);
    Engine::start_ranked(config, ranks, connector).expect("the ranks match the configuration")
}

#[tokio::test]
async fn a_ranked_engine_samples_the_single_engine_s_tokens_and_holds_its_bytes() {
    for (tp, pp) in [(2, 1), (1, 2), (4, 2), (8, 1)] {
        for budget in [8192, 5] {
            let single = start(config(budget), None);
            let ranked = start_topology(config(budget), tp, pp, None);
            assert_eq!(ranked.rank_caches().len(), tp * pp);
            assert!(Arc::ptr_eq(ranked.kv_cache(), &ranked.rank_caches()[0].1));
            // The same requests in the same order: the same blocks, so the same bytes in each.
            for (id, n) in [("a", 13), ("b", 7)] {
                let want = run(&single, request(id, prompt(n), 5)).await;
                assert_eq!(run(&ranked, request(id, prompt(n), 5)).await, want, "tp {tp} pp {pp} budget {budget}");
            }
            let all: Vec<pdflow_messages::BlockId> = (0..32).collect();
            assert_same_slots(single.kv_cache(), &all, ranked.rank_caches(), &all);
            single.shutdown().await;
            ranked.shutdown().await;
        }
    }
}

#[tokio::test]
async fn start_ranked_refuses_ranks_that_do_not_match_the_configuration() {
    let tp2 = Topology::uniform(2, 1, 4, 2).expect("a valid topology");
    // Caches of 16 blocks for an engine of 32.
    let err = Engine::start_ranked(config(8192), rank_caches(FOUR_LAYERS, &tp2, 16), None).expect_err("refused");
    assert_eq!(err, RanksError::NumBlocks { rank: 0, got: 16, expected: 32 });
    // A configuration of 8 heads for ranks of 2.
    let eight = EngineConfig { shape: KvShape { num_kv_heads: 8, ..FOUR_LAYERS }, ..config(8192) };
    let err = Engine::start_ranked(eight, rank_caches(FOUR_LAYERS, &tp2, 32), None).expect_err("refused");
    assert_eq!(err, RanksError::Topology(TopologyError::Uncovered { layer: 0, head: 2 }));
    // Stage 1's rank alone: layers 0 and 1 have no holder.
    let stage1 =
        vec![(RankLayout { layers: 2..4, heads: 0..2 }, KvCache::new(KvShape { num_layers: 2, ..FOUR_LAYERS }, 32))];
    let err = Engine::start_ranked(config(8192), stage1, None).expect_err("refused");
    assert!(err.to_string().contains("layer 0"), "{err}");
}

/// A connector whose scheduler asks a layer-wise save of every scheduled request and whose worker
/// records the layers it is told of.
#[derive(Default)]
struct LayerWise {
    saved: Mutex<Vec<usize>>,
    events: Arc<Notify>,
}

impl SchedulerConnectorPort for LayerWise {
    fn get_num_new_matched_tokens(
        &self,
        _: GetNumNewMatchedTokens,
    ) -> BoxFuture<'_, Result<MatchedTokens, ConnectorError>> {
        Box::pin(async { Ok(MatchedTokens::none()) })
    }
    fn update_state_after_alloc(
        &self,
        _: UpdateStateAfterAlloc,
    ) -> BoxFuture<'_, Result<Option<KvTransferParams>, ConnectorError>> {
        Box::pin(async { Ok(None) })
    }
    fn build_connector_meta(
        &self,
        msg: BuildConnectorMeta,
    ) -> BoxFuture<'_, Result<ConnectorMetadata, ConnectorError>> {
        let reqs_to_save = msg
            .scheduled
            .into_iter()
            .map(|c| {
                let save = LayerSave {
                    transfer_id: "t".into(),
                    block_ids: c.block_ids,
                    computed_upto: c.computed_upto,
                    prompt_len: 0,
                };
                (c.request_id, save)
            })
            .collect();
        Box::pin(async move { Ok(ConnectorMetadata { reqs_to_save, ..Default::default() }) })
    }
    fn request_finished(&self, _: RequestFinished) -> BoxFuture<'_, Result<RequestFinishedReply, ConnectorError>> {
        Box::pin(async { Ok(RequestFinishedReply { delay_free_blocks: false, kv_transfer_params: None }) })
    }
    fn update_connector_output(&self, _: ConnectorOutput) -> BoxFuture<'_, Result<(), ConnectorError>> {
        Box::pin(async { Ok(()) })
    }
}

impl WorkerConnectorPort for LayerWise {
    fn start_load_kv(&self, _: ConnectorMetadata) -> BoxFuture<'_, Result<(), ConnectorError>> {
        Box::pin(async { Ok(()) })
    }
    fn get_finished(&self) -> BoxFuture<'_, Result<ConnectorOutput, ConnectorError>> {
        Box::pin(async { Ok(ConnectorOutput::default()) })
    }
    fn kv_events(&self) -> Arc<Notify> {
        self.events.clone()
    }
    fn save_kv_layer(&self, layer: usize, reqs: &BTreeMap<RequestId, LayerSave>) {
        assert!(!reqs.is_empty());
        self.saved.lock().expect("lock").push(layer);
    }
}

#[tokio::test]
async fn a_ranked_engine_saves_each_global_layer_once_per_step() {
    let want = run(&start(config(8192), None), request("ref", prompt(9), 3)).await;
    let connector = Arc::new(LayerWise::default());
    let ports = Connector { scheduler: connector.clone(), worker: connector.clone() };
    let ranked = start_topology(config(8192), 4, 2, Some(ports));
    assert_eq!(run(&ranked, request("r", prompt(9), 3)).await, want);
    // One prefill and two decode steps, each saving layers 0..4 once, in order.
    let saved = connector.saved.lock().expect("lock").clone();
    assert_eq!(saved, [0, 1, 2, 3].repeat(3));
}
