//! The Receiver's bootstrap look-up (seed step 20: vLLM's `handle_new_engine_id`) and the TP/PP
//! pairing of a D worker with P workers (step 21: vLLM's `receive_kv` rank mapping).

use std::collections::BTreeMap;
use std::time::Duration;

use pdflow_auth::http::Call;
use pdflow_auth::ClusterSecret;
use pdflow_messages::bootstrap::{QueryResponse, WorkerAddrs};
use pdflow_messages::lifecycle::TransferState;
use pdflow_messages::EngineId;

/// What one `/query` answered: every engine with its workers, and each worker's generation by
/// its address (workers that gave none are absent).
#[derive(Debug, Default)]
pub(crate) struct Answer {
    pub engines: BTreeMap<EngineId, WorkerAddrs>,
    pub generations: BTreeMap<String, u64>,
}

/// `GET {bootstrap_addr}/query`: every engine of the answer with its workers (signed, and its
/// answer checked, with a `secret`).
pub(crate) async fn query_bootstrap(
    http: &reqwest::Client,
    secret: Option<&ClusterSecret>,
    bootstrap_addr: &str,
    timeout: Duration,
) -> Result<Answer, String> {
    let base = bootstrap_addr.trim_end_matches('/');
    let url = if base.starts_with("http://") || base.starts_with("https://") {
        format!("{base}/query")
    } else {
        format!("http://{base}/query")
    };
    let call = async {
        let answer = crate::bootstrap_call::send(http, secret, Call::Query, &url, None).await?;
        let status = answer.status;
        if !status.is_success() {
            return Err(format!("GET {url} answered HTTP {status}: {}", answer.text()));
        }
        let body: QueryResponse =
            serde_json::from_slice(&answer.body).map_err(|e| format!("GET {url}: body is not a /query answer: {e}"))?;
        let mut answer = Answer::default();
        for entry in body.values() {
            let workers = entry.workers().map_err(|e| format!("GET {url}: {e}"))?;
            for addr in workers.values().flat_map(|pps| pps.values()) {
                let generation = entry.generation_of(addr);
                if generation != 0 {
                    answer.generations.insert(addr.clone(), generation);
                }
            }
            answer.engines.insert(entry.engine_id.clone(), workers);
        }
        Ok(answer)
    };
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| TransferState::LookingUp.passed(timeout, format!("GET {url} got no answer")).to_string())?
}

/// [`query_bootstrap`] until its answer names `engine_id`, within `timeout` in all: a bootstrap
/// that restarted (refusing connections, or with an empty table until P's next periodic
/// re-registration) is asked again every [`RETRY_EVERY`] rather than failing the requests queued
/// behind the look-up. Returns the last answer (or error) when the time is up.
pub(crate) async fn query_until_registered(
    http: &reqwest::Client,
    secret: Option<&ClusterSecret>,
    bootstrap_addr: &str,
    engine_id: &str,
    timeout: Duration,
) -> Result<Answer, String> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let result = query_bootstrap(http, secret, bootstrap_addr, left.max(Duration::from_millis(1))).await;
        let done = matches!(&result, Ok(answer) if answer.engines.contains_key(engine_id));
        if done || tokio::time::Instant::now() + RETRY_EVERY >= deadline {
            return result;
        }
        tokio::time::sleep(RETRY_EVERY).await;
    }
}

/// Pause between two look-ups of an engine the bootstrap does not (yet) name.
const RETRY_EVERY: Duration = Duration::from_millis(50);

/// One P worker this D worker pulls from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Peer {
    pub tp_rank: u32,
    pub pp_rank: u32,
    pub addr: String,
}

/// The P workers a D worker of rank `tp_rank` in a group of `tp_size` pairs with: with equal TP
/// sizes, the P worker of the same tp rank (every pp rank of it).
pub(crate) fn pair(engine_id: &str, workers: &WorkerAddrs, tp_rank: u32, tp_size: u32) -> Result<Vec<Peer>, String> {
    let p_tp_size = workers.len() as u32;
    if p_tp_size != tp_size {
        return Err(format!(
            "heterogeneous TP not supported yet: P engine {engine_id} has tp_size {p_tp_size}, this D worker has tp_size {tp_size}"
        ));
    }
    let pps = workers
        .get(&tp_rank)
        .filter(|pps| !pps.is_empty())
        .ok_or_else(|| format!("P engine {engine_id} registered no worker for tp_rank {tp_rank}"))?;
    Ok(pps.iter().map(|(pp, addr)| Peer { tp_rank, pp_rank: *pp, addr: addr.clone() }).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workers(tp: u32) -> WorkerAddrs {
        (0..tp).map(|t| (t, BTreeMap::from([(0, format!("tcp://h:{t}"))]))).collect()
    }

    #[test]
    fn equal_tp_pairs_rank_with_rank() {
        assert_eq!(
            pair("p", &workers(1), 0, 1).expect("pairs"),
            vec![Peer { tp_rank: 0, pp_rank: 0, addr: "tcp://h:0".into() }]
        );
        assert_eq!(pair("p", &workers(2), 1, 2).expect("pairs")[0].addr, "tcp://h:1");
    }

    #[test]
    fn heterogeneous_tp_is_refused_clearly() {
        let err = pair("p-engine", &workers(2), 0, 1).expect_err("refused");
        assert!(err.contains("heterogeneous TP not supported yet") && err.contains("p-engine"), "{err}");
    }
}
