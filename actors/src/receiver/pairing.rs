//! The Receiver's pairing with P's workers (seed step 21: vLLM's `receive_kv` rank mapping): from
//! a bootstrap answer, the P workers a D worker of given TP/PP ranks pulls from. It owns none of
//! steps 5, 19, 20 and 34; the pulls (`pulls.rs`) use it.

use std::collections::BTreeMap;

use pdflow_kv::topology::pulled_by;
use pdflow_kv::topology::TopologyError;
use pdflow_messages::bootstrap::WorkerAddrs;

use crate::ranks::WorkerRank;

/// Why D worker cannot pair with P's workers (step 21); D's requests fail with this text.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PairError {
    /// Not every P worker has registered yet.
    #[error("P engine {engine_id} registered {registered} workers, not tp_size × pp_size = {tp} × {pp}: some P workers have not registered")]
    Incomplete { engine_id: String, registered: usize, tp: u32, pp: u32 },
    /// P's registered workers do not form a topology of the model.
    #[error("P engine {engine_id} (tp {tp}, pp {pp}): {source}")]
    PRanks { engine_id: String, tp: u32, pp: u32, source: TopologyError },
    /// This D worker's ranks do not form a topology of the model.
    #[error("this D worker's ranks (tp {tp}, pp {pp}): {source}")]
    DRanks { tp: u32, pp: u32, source: TopologyError },
    /// A P worker this D worker must pull from is not registered.
    #[error("P engine {engine_id} registered no worker for tp_rank {tp_rank}, pp_rank {pp_rank}")]
    MissingWorker { engine_id: String, tp_rank: u32, pp_rank: u32 },
}

/// One P worker this D worker pulls from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Peer {
    pub tp_rank: u32,
    pub pp_rank: u32,
    pub addr: String,
}

/// P's engine as its registered workers describe it: (tp_size, pp_size).
pub(crate) fn world(workers: &WorkerAddrs) -> (u32, u32) {
    let tp = workers.len() as u32;
    let pp = workers.values().map(|pps| pps.len()).max().unwrap_or(0) as u32;
    (tp, pp)
}

/// The P workers D worker `me` pulls from: for each (layer, KV head) it holds, one P worker
/// holding it ([`pdflow_kv::topology::pulled_by`]; with equal topologies, the worker of the same
/// ranks), plus an empty pull to any P replica no D worker reads, so that it frees its blocks.
pub(crate) fn pair(engine_id: &str, workers: &WorkerAddrs, me: &WorkerRank) -> Result<Vec<Peer>, PairError> {
    let (p_tp, p_pp) = world(workers);
    let registered: usize = workers.values().map(BTreeMap::len).sum();
    if p_tp == 0 || registered != (p_tp * p_pp) as usize {
        return Err(PairError::Incomplete { engine_id: engine_id.to_owned(), registered, tp: p_tp, pp: p_pp });
    }
    let p = me.engine_of(p_tp, p_pp).map_err(|source| PairError::PRanks {
        engine_id: engine_id.to_owned(),
        tp: p_tp,
        pp: p_pp,
        source,
    })?;
    let d = me.topology().map_err(|source| PairError::DRanks { tp: me.tp_size, pp: me.pp_size, source })?;
    pulled_by(&p, &d, me.index())
        .into_iter()
        .map(|index| {
            let (tp_rank, pp_rank) = (index as u32 % p_tp, index as u32 / p_tp);
            let addr = workers
                .get(&tp_rank)
                .and_then(|pps| pps.get(&pp_rank))
                .ok_or_else(|| PairError::MissingWorker { engine_id: engine_id.to_owned(), tp_rank, pp_rank })?;
            Ok(Peer { tp_rank, pp_rank, addr: addr.clone() })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdflow_kv::memory::KvShape;

    fn workers(tp: u32, pp: u32) -> WorkerAddrs {
        (0..tp).map(|t| (t, (0..pp).map(|p| (p, format!("tcp://h:{t}{p}"))).collect())).collect()
    }

    fn rank(tp_size: u32, tp_rank: u32, pp_size: u32, pp_rank: u32) -> WorkerRank {
        WorkerRank { tp_size, tp_rank, pp_size, pp_rank, model: KvShape::QWEN3_8B }
    }

    fn addrs(peers: Vec<Peer>) -> Vec<String> {
        peers.into_iter().map(|p| p.addr).collect()
    }

    #[test]
    fn equal_tp_pairs_rank_with_rank() {
        assert_eq!(addrs(pair("p", &workers(1, 1), &rank(1, 0, 1, 0)).expect("pairs")), vec!["tcp://h:00"]);
        assert_eq!(addrs(pair("p", &workers(2, 1), &rank(2, 1, 1, 0)).expect("pairs")), vec!["tcp://h:10"]);
    }

    #[test]
    fn heterogeneous_tp_and_pp_pull_from_every_holder() {
        // P tp 4 → D tp 2: D rank 1 holds heads 4..8, held by P ranks 2 and 3.
        assert_eq!(
            addrs(pair("p", &workers(4, 1), &rank(2, 1, 1, 0)).expect("pairs")),
            vec!["tcp://h:20", "tcp://h:30"]
        );
        // P tp 1 → D tp 4: every D rank pulls from P's one worker.
        assert_eq!(addrs(pair("p", &workers(1, 1), &rank(4, 3, 1, 0)).expect("pairs")), vec!["tcp://h:00"]);
        // P pp 2 → D pp 1: both stages.
        assert_eq!(
            addrs(pair("p", &workers(1, 2), &rank(1, 0, 1, 0)).expect("pairs")),
            vec!["tcp://h:00", "tcp://h:01"]
        );
    }

    #[test]
    fn a_partly_registered_engine_is_refused_clearly() {
        let mut w = workers(2, 2);
        w.get_mut(&1).expect("rank 1").remove(&1);
        let err = pair("p-engine", &w, &rank(1, 0, 1, 0)).expect_err("refused");
        assert!(matches!(&err, PairError::Incomplete { registered: 3, tp: 2, pp: 2, .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains("p-engine") && text.contains("have not registered"), "{text}");
    }
}
