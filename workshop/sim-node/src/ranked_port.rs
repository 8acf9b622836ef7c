//! The worker role of an engine sharded over ranks (tensor and pipeline parallel): the engine
//! calls one port, every rank's worker actors get the step's metadata, and a request counts as
//! sent or received only once every rank reported it — vLLM's `KVOutputAggregator`.
//!
//! Rules kept here: a D request fails when every rank has settled it and one of them failed (no
//! rank can still write into its blocks then); a P request is sent once every rank has sent its
//! share (each rank's blocks are held until then); a layer (vLLM's `save_kv_layer`, by global
//! index) goes to the ranks that hold it, as their local layer.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::{Arc, Mutex};

use futures::future::{join_all, BoxFuture, FutureExt};
use pdflow_messages::scheduler_connector::{ConnectorMetadata, ConnectorOutput, LayerSave, LoadFailure};
use pdflow_messages::RequestId;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use pdflow_node::ports::{ConnectorError, WorkerConnectorPort};

/// One rank's worker port and the global layers its cache holds.
pub struct RankPort {
    pub port: Arc<dyn WorkerConnectorPort>,
    pub layers: Range<usize>,
}

/// What the ranks reported of requests not yet settled on all of them.
#[derive(Default)]
struct Tally {
    sent: BTreeMap<RequestId, usize>,
    received: BTreeMap<RequestId, usize>,
    failed: BTreeMap<RequestId, (usize, LoadFailure)>,
}

/// The ranks behind one worker port.
pub struct RankedPort {
    ranks: Vec<RankPort>,
    tally: Mutex<Tally>,
    events: Arc<Notify>,
    /// Forward each rank's events to `events` (aborted on drop).
    relays: Vec<JoinHandle<()>>,
}

impl RankedPort {
    pub fn new(ranks: Vec<RankPort>) -> Self {
        let events = Arc::new(Notify::new());
        let relays = ranks
            .iter()
            .map(|r| {
                let (from, to) = (r.port.kv_events(), events.clone());
                tokio::spawn(async move {
                    loop {
                        from.notified().await;
                        to.notify_waiters();
                        to.notify_one();
                    }
                })
            })
            .collect();
        Self { ranks, tally: Mutex::new(Tally::default()), events, relays }
    }

    /// Folds one poll of every rank into the tally; returns what all ranks have settled.
    fn settle(&self, outputs: Vec<ConnectorOutput>) -> ConnectorOutput {
        let world = self.ranks.len();
        let mut tally = self.tally.lock().unwrap_or_else(|e| e.into_inner());
        for out in outputs {
            for r in out.finished_sending {
                *tally.sent.entry(r).or_default() += 1;
            }
            for r in out.finished_recving {
                *tally.received.entry(r).or_default() += 1;
            }
            for (r, failure) in out.failed_recving {
                let entry = tally.failed.entry(r).or_insert((0, failure));
                entry.0 += 1;
            }
        }
        let mut done = ConnectorOutput::default();
        let complete: Vec<RequestId> =
            tally.sent.iter().filter(|(_, n)| **n >= world).map(|(r, _)| r.clone()).collect();
        for r in complete {
            tally.sent.remove(&r);
            done.finished_sending.insert(r);
        }
        let settled: BTreeSet<RequestId> = tally
            .received
            .keys()
            .chain(tally.failed.keys())
            .filter(|r| {
                let ok = tally.received.get(*r).copied().unwrap_or(0);
                let failed = tally.failed.get(*r).map_or(0, |(n, _)| *n);
                ok + failed >= world
            })
            .cloned()
            .collect();
        for r in settled {
            tally.received.remove(&r);
            match tally.failed.remove(&r) {
                Some((_, failure)) => {
                    done.failed_recving.insert(r, failure);
                }
                None => {
                    done.finished_recving.insert(r);
                }
            }
        }
        done
    }
}

impl Drop for RankedPort {
    fn drop(&mut self) {
        for relay in &self.relays {
            relay.abort();
        }
    }
}

impl WorkerConnectorPort for RankedPort {
    fn start_load_kv(&self, meta: ConnectorMetadata) -> BoxFuture<'_, Result<(), ConnectorError>> {
        async move {
            let results = join_all(self.ranks.iter().map(|r| r.port.start_load_kv(meta.clone()))).await;
            results.into_iter().collect::<Result<Vec<()>, _>>().map(|_| ())
        }
        .boxed()
    }

    fn get_finished(&self) -> BoxFuture<'_, Result<ConnectorOutput, ConnectorError>> {
        async move {
            let outputs = join_all(self.ranks.iter().map(|r| r.port.get_finished())).await;
            let outputs = outputs.into_iter().collect::<Result<Vec<_>, _>>()?;
            Ok(self.settle(outputs))
        }
        .boxed()
    }

    fn kv_events(&self) -> Arc<Notify> {
        self.events.clone()
    }

    fn save_kv_layer(&self, layer: usize, reqs: &BTreeMap<RequestId, LayerSave>) {
        for r in self.ranks.iter().filter(|r| r.layers.contains(&layer)) {
            r.port.save_kv_layer(layer - r.layers.start, reqs);
        }
    }
}

#[cfg(test)]
mod tests {
    use pdflow_messages::scheduler_connector::LoadFailureCause;

    use super::*;
    use pdflow_node::ports::WorkerPort;

    /// Two ranks whose worker ports run no actors: only the tally is exercised.
    fn two_ranks() -> RankedPort {
        let rank = |layers| RankPort {
            port: Arc::new(WorkerPort {
                listener: None,
                receiver: None,
                events: Arc::new(Notify::new()),
                held_sends: None,
            }),
            layers,
        };
        RankedPort::new(vec![rank(0..2), rank(2..4)])
    }

    fn output(sent: &[&str], received: &[&str], failed: &[&str]) -> ConnectorOutput {
        ConnectorOutput {
            finished_sending: sent.iter().map(|r| (*r).into()).collect(),
            finished_recving: received.iter().map(|r| (*r).into()).collect(),
            failed_recving: failed
                .iter()
                .map(|r| ((*r).into(), LoadFailure::new(LoadFailureCause::KvMismatch, "rank's share differs")))
                .collect(),
        }
    }

    #[tokio::test]
    async fn a_request_is_sent_or_received_once_every_rank_reported_it() {
        let port = two_ranks();
        let first = port.settle(vec![output(&["p1"], &["d1"], &[]), output(&[], &[], &[])]);
        assert!(first.finished_sending.is_empty() && first.finished_recving.is_empty(), "one rank only");
        let second = port.settle(vec![output(&[], &[], &[]), output(&["p1"], &["d1"], &[])]);
        assert_eq!(second.finished_sending, BTreeSet::from(["p1".into()]));
        assert_eq!(second.finished_recving, BTreeSet::from(["d1".into()]));
        let third = port.settle(vec![output(&[], &[], &[]), output(&[], &[], &[])]);
        assert!(third.finished_sending.is_empty() && third.finished_recving.is_empty(), "reported once");
    }

    #[tokio::test]
    async fn one_rank_failing_fails_the_request_only_once_every_rank_settled_it() {
        let port = two_ranks();
        let first = port.settle(vec![output(&[], &[], &["d1"]), output(&[], &[], &[])]);
        assert!(first.failed_recving.is_empty(), "the other rank may still be writing its share");
        let second = port.settle(vec![output(&[], &[], &[]), output(&[], &["d1"], &[])]);
        assert!(second.finished_recving.is_empty());
        assert_eq!(second.failed_recving.keys().cloned().collect::<Vec<_>>(), vec![RequestId::from("d1")]);
    }
}
