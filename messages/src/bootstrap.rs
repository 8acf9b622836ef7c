//! Bootstrap bodies, compatible with vLLM's Mooncake bootstrap server (steps 4, 7, 20).
//!
//! `POST /register` takes a [`RegisterWorker`]; `GET /query` answers a [`QueryResponse`]:
//! `{"<dp>": {"engine_id": …, "worker_addr": {"<tp>": {"<pp>": "tcp://…"}}}}`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::EngineId;

/// One P worker's registration (seed step 4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterWorker {
    pub engine_id: EngineId,
    pub dp_rank: u32,
    pub tp_rank: u32,
    pub pp_rank: u32,
    /// The worker's side-channel address, `tcp://host:port`.
    pub addr: String,
    /// The worker's generation: a new, larger one each time the worker starts, so that
    /// a restarted worker replaces its previous incarnation here and D's pulls addressed to the
    /// previous one are refused at once. 0: not given (vLLM's Mooncake workers), never replaces.
    #[serde(default)]
    pub generation: u64,
}

/// One data-parallel engine's entry in `/query`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct EngineEntry {
    pub engine_id: EngineId,
    /// tp_rank → pp_rank → side-channel address (keys are decimal strings, as in vLLM's JSON).
    pub worker_addr: BTreeMap<String, BTreeMap<String, String>>,
    /// tp_rank → pp_rank → the worker's generation (pdflow's addition: absent from vLLM's JSON
    /// when no worker gave one).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub worker_generation: BTreeMap<String, BTreeMap<String, u64>>,
}

/// The header of pdflow's `/query` answers saying, in milliseconds, how long the bootstrap's table
/// has been filling (since it started). P re-registers every second, so once it is a few seconds
/// old an engine it does not name is not registered; a younger table may still be refilling after
/// a restart. Not part of the proven answer: a forged value can only make D fail or wait a
/// look-up, as dropping the answer could.
pub const TABLE_AGE_HEADER: &str = "x-pdflow-table-age-ms";

/// `GET /query`: dp_rank (decimal string) → entry.
pub type QueryResponse = BTreeMap<String, EngineEntry>;

/// One engine's workers, keyed by numbers: tp_rank → pp_rank → address (D's cache, step 20).
pub type WorkerAddrs = BTreeMap<u32, BTreeMap<u32, String>>;

/// Why a `/query` answer cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BootstrapBodyError {
    #[error("bootstrap /query has a non-numeric rank key `{0}`")]
    BadRank(String),
}

impl EngineEntry {
    /// The entry's workers with numeric ranks.
    pub fn workers(&self) -> Result<WorkerAddrs, BootstrapBodyError> {
        let rank = |k: &String| k.parse::<u32>().map_err(|_| BootstrapBodyError::BadRank(k.clone()));
        let mut out = WorkerAddrs::new();
        for (tp, pps) in &self.worker_addr {
            let tp_rank = rank(tp)?;
            for (pp, addr) in pps {
                out.entry(tp_rank).or_default().insert(rank(pp)?, addr.clone());
            }
        }
        Ok(out)
    }

    /// The generation of the worker at `addr` (0: not given).
    pub fn generation_of(&self, addr: &str) -> u64 {
        self.worker_addr
            .iter()
            .flat_map(|(tp, pps)| pps.iter().filter(|(_, a)| a.as_str() == addr).map(move |(pp, _)| (tp, pp)))
            .find_map(|(tp, pp)| self.worker_generation.get(tp).and_then(|g| g.get(pp)).copied())
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_query_body_parses() {
        let body = r#"{"0": {"engine_id": "6c1f", "worker_addr": {"0": {"0": "tcp://10.0.0.1:41235"}}}}"#;
        let q: QueryResponse = serde_json::from_str(body).expect("seed body parses");
        let workers = q["0"].workers().expect("numeric ranks");
        assert_eq!(workers[&0][&0], "tcp://10.0.0.1:41235");
        assert_eq!(q["0"].generation_of("tcp://10.0.0.1:41235"), 0, "vLLM's bodies carry no generation");
    }

    #[test]
    fn generations_travel_beside_the_addresses_and_stay_out_of_vllm_shaped_bodies() {
        let body = r#"{"0": {"engine_id": "p", "worker_addr": {"0": {"0": "tcp://h:1"}}, "worker_generation": {"0": {"0": 7}}}}"#;
        let q: QueryResponse = serde_json::from_str(body).expect("parses");
        assert_eq!(q["0"].generation_of("tcp://h:1"), 7);
        assert_eq!(q["0"].generation_of("tcp://h:2"), 0);
        let plain = EngineEntry {
            engine_id: "p".into(),
            worker_addr: q["0"].worker_addr.clone(),
            worker_generation: BTreeMap::new(),
        };
        assert!(!serde_json::to_string(&plain).expect("json").contains("generation"));
        let w: RegisterWorker = serde_json::from_str(
            r#"{"engine_id": "p", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"}"#,
        )
        .expect("a vLLM registration parses");
        assert_eq!(w.generation, 0);
    }
}

/// Ask the Bootstrap actor for its whole table, as `GET /query` answers it (steps 7, 20).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueryEngines;

/// Ask the Bootstrap actor for the address its HTTP server is bound to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BootstrapAddr;

/// Why bootstrap refused a [`RegisterWorker`] (HTTP 400, `{"error": "<message>"}`).
///
/// An identical re-registration is not a conflict: P retries `/register` and must get 200.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterRejected {
    #[error("dp_rank {dp_rank} already belongs to engine `{registered}`, engine `{offered}` cannot register on it (a stale engine is registered: restart bootstrap, or give each engine its own dp_rank)")]
    EngineIdMismatch { dp_rank: u32, registered: String, offered: String },
    #[error("worker dp_rank={dp_rank} tp_rank={tp_rank} pp_rank={pp_rank} is already registered at {registered}, not {offered} (two workers with the same ranks?)")]
    AddrConflict { dp_rank: u32, tp_rank: u32, pp_rank: u32, registered: String, offered: String },
    #[error("worker dp_rank={dp_rank} tp_rank={tp_rank} pp_rank={pp_rank} of generation {offered} is older than the registered generation {registered}: a previous incarnation of a restarted worker is still running — stop it")]
    StaleGeneration { dp_rank: u32, tp_rank: u32, pp_rank: u32, registered: u64, offered: u64 },
    /// Without a cluster secret: a registration changing a worker that another peer address
    /// registered (a takeover, or a worker that moved to another host).
    #[error("worker dp_rank={dp_rank} tp_rank={tp_rank} pp_rank={pp_rank} is registered at {registered} by {registered_from}; without a cluster secret only {registered_from} may replace it, not {from} (a restarted worker registers from its own host; to let workers register from anywhere, give every peer the cluster secret: --cluster-secret-file, PDFLOW_CLUSTER_SECRET_FILE or PDFLOW_CLUSTER_SECRET)")]
    NotTheRegistrant {
        dp_rank: u32,
        tp_rank: u32,
        pp_rank: u32,
        registered: String,
        registered_from: String,
        from: String,
    },
    /// Without a cluster secret: a new worker (a new dp, tp or pp rank) from a peer address that
    /// registered no worker here.
    #[error("worker dp_rank={dp_rank} tp_rank={tp_rank} pp_rank={pp_rank} is not registered and {from} has registered no worker with this bootstrap; without a cluster secret a new worker (a new data-parallel, tensor or pipeline rank) is accepted only from an address that already registered one (its engine's host). To register workers from other hosts, give every peer the cluster secret: --cluster-secret-file, PDFLOW_CLUSTER_SECRET_FILE or PDFLOW_CLUSTER_SECRET")]
    NewWorkerFromUnknownPeer { dp_rank: u32, tp_rank: u32, pp_rank: u32, from: String },
}

impl RegisterRejected {
    /// A registration refused because, without a cluster secret, it would take a worker or a
    /// data-parallel rank over from another peer address (HTTP 403; the others are conflicts, 400).
    pub fn is_takeover(&self) -> bool {
        matches!(self, Self::NotTheRegistrant { .. } | Self::NewWorkerFromUnknownPeer { .. })
    }
}

/// A registration as the Bootstrap actor receives it over HTTP: the body, and the peer IP
/// address it came from (without a cluster secret, the only thing that tells registrants apart).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisterFrom {
    pub worker: RegisterWorker,
    pub peer: std::net::IpAddr,
}
