//! A pull on P's side channel: checked (each request named once, D's layout known), tracked,
//! and each of its requests routed to its transfer's SendWorker (seed steps 21 receive side and
//! 22), then answered request by request as the SendWorkers settle (step 30).

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use kameo::prelude::*;
use pdflow_messages::frame;
use pdflow_messages::layout::KvLayout;
use pdflow_messages::rdma::{RdmaOffer, RemoteWriteGrant};
use pdflow_messages::send_worker::{DRank, ServePull};
use pdflow_messages::sender_listener::{
    BlockDigests, PullErr, PullErrorCause, PullReq, PullRequest, PullResponse, PullStatus,
};
use pdflow_messages::RequestId;
use pdflow_observability::{attrs, step_span, steps, Outcome};

use super::{lineage, InFlightPull, SenderListener, WRITE_MARGIN};

/// What every request of one pull is routed with.
struct RoutedPull<'a> {
    key: u64,
    layout: &'a KvLayout,
    data_addr: &'a str,
    traceparent: &'a Option<String>,
    write_by: Option<std::time::Instant>,
    d_rank: DRank,
    /// D's RDMA endpoint for this P worker, if it offered one.
    rdma: &'a Option<Box<RdmaOffer>>,
}

/// A pull must name at least one request, each once.
fn check_reqs(pull: &PullRequest) -> Result<(), String> {
    let mut d_reqs = BTreeSet::new();
    if pull.reqs.is_empty() || !pull.reqs.iter().all(|r| d_reqs.insert(r.d_req_id.as_str())) {
        return Err("a pull must name at least one request, each d_req_id once".into());
    }
    if pull.tp_rank >= pull.tp_size.max(1) || pull.pp_rank >= pull.pp_size.max(1) {
        // Nothing of P's KV belongs to such a rank: answering "ok" with 0 bytes would hide it.
        return Err(format!(
            "the pull comes from D rank tp {} of {}, pp {} of {}, which does not exist: nothing is written",
            pull.tp_rank, pull.tp_size, pull.pp_rank, pull.pp_size
        ));
    }
    Ok(())
}

impl SenderListener {
    pub(super) fn send(&self, identity: Bytes, response: &PullResponse) {
        let response = &PullResponse { p_generation: self.p_generation, ..response.clone() };
        match frame::encode(response) {
            Ok(body) => self.send_frame(identity, body, response.status != PullStatus::Continue),
            Err(e) => tracing::error!(error = %e, "cannot encode a side-channel response"),
        }
    }

    /// Sends the answer of `step` about D's request `d_req_id` through the node's fault seam.
    fn send_step(&self, step: u8, d_req_id: &str, identity: Bytes, response: &PullResponse) {
        let response = &PullResponse { p_generation: self.p_generation, ..response.clone() };
        match frame::encode(response) {
            Ok(body) => {
                let last = response.status != PullStatus::Continue;
                match self.args.faults.outgoing(step, d_req_id, body) {
                    Some(body) => self.send_frame(identity, body, last),
                    None if last => self.reply_nonces.remove(&identity),
                    None => {}
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot encode a side-channel response"),
        }
    }

    /// Sends an answer to D's pull task `identity`, sealed to its pull; after its `last` answer
    /// the pull's nonce is forgotten.
    fn send_frame(&self, identity: Bytes, body: Vec<u8>, last: bool) {
        let seal = self.args.auth.seal(&body, self.reply_nonces.get(&identity).as_ref());
        if last {
            self.reply_nonces.remove(&identity);
        }
        if self.replies.send((identity, body, seal)).is_err() {
            tracing::error!(addr = %self.addr, "side-channel writer is gone: response dropped");
        }
    }

    pub(super) fn mark_sent(&mut self, p_req_id: RequestId) {
        if self.finished_sending.insert(p_req_id) {
            self.args.events.notify_waiters();
            self.args.events.notify_one();
        }
    }

    /// Step 30: one request of a pull is settled: `Continue` while others remain, else `Finish`.
    pub(super) fn settle(&mut self, key: u64, d_req_id: &RequestId, result: Result<Vec<u64>, PullErr>) {
        let Some(pull) = self.pulls.get_mut(&key) else {
            tracing::debug!(d_req_id = %d_req_id, "outcome for a pull already answered");
            return;
        };
        let Some(transfer_id) = pull.remaining.remove(d_req_id) else { return };
        let last = pull.remaining.is_empty();
        let span =
            step_span!(steps::P_REPLY_FINISH, request_id = d_req_id.as_str(), transfer_id = transfer_id.as_str());
        span.record(attrs::ENGINE_ID, self.args.engine_id.as_str());
        let (ok_reqs, digests, err_reqs) = match result {
            Ok(digests) => {
                Outcome::Ok.record(&span);
                let digests = if digests.is_empty() {
                    vec![]
                } else {
                    vec![BlockDigests { d_req_id: d_req_id.clone(), digests }]
                };
                (vec![d_req_id.clone()], digests, vec![])
            }
            Err(err) => {
                Outcome::Failed(err.cause.label()).record(&span);
                (vec![], vec![], vec![err])
            }
        };
        let response = PullResponse {
            pull_id: pull.pull_id,
            status: if last { PullStatus::Finish } else { PullStatus::Continue },
            ok_reqs,
            digests,
            err_reqs,
            layout_id: Some(pull.layout_id),
            error: None,
            p_generation: self.p_generation,
        };
        let identity = pull.identity.clone();
        if last {
            self.pulls.remove(&key);
        }
        span.in_scope(|| self.send_step(steps::P_REPLY_FINISH.number, d_req_id, identity, &response));
    }

    /// Steps 21 (receive) and 22 (routing): check, track and route one pull.
    pub(super) async fn on_pull(&mut self, identity: Bytes, pull: PullRequest, me: &ActorRef<Self>) {
        let received = std::time::Instant::now();
        if let Err(why) = check_reqs(&pull) {
            tracing::warn!(pull_id = pull.pull_id, engine_id = %pull.engine_id, "{why}");
            self.send(identity, &PullResponse::error(pull.pull_id, why));
            return;
        }
        let mine = (self.args.rank.tp_size, self.args.rank.pp_size);
        if pull.p_world != mine {
            let why = format!(
                "D sees P as tp {} × pp {} but this P engine runs tp {} × pp {}: D looked P up before every P worker registered; it looks P up again",
                pull.p_world.0, pull.p_world.1, mine.0, mine.1
            );
            tracing::warn!(pull_id = pull.pull_id, engine_id = %pull.engine_id, "{why}");
            let err_reqs = pull
                .reqs
                .iter()
                .map(|r| PullErr {
                    d_req_id: r.d_req_id.clone(),
                    cause: PullErrorCause::LayoutMismatch,
                    detail: why.clone(),
                })
                .collect();
            self.send(identity, &PullResponse { err_reqs, ..PullResponse::error(pull.pull_id, why) });
            return;
        }
        let Some(layout) = self.pull_layout(&identity, &pull) else { return };
        // D gives the blocks up `deadline_ms` after it sent the pull (so at the latest that long
        // after now): P stops writing a margin before.
        let write_by = (pull.deadline_ms > 0).then(|| {
            let deadline = Duration::from_millis(pull.deadline_ms);
            received + deadline - WRITE_MARGIN.min(deadline / 2)
        });
        self.next_pull_key += 1;
        let key = self.next_pull_key;
        let remaining = pull.reqs.iter().map(|r| (r.d_req_id.clone(), r.transfer_id.clone())).collect();
        self.pulls.insert(key, InFlightPull { identity, pull_id: pull.pull_id, layout_id: pull.layout_id, remaining });
        tracing::debug!(pull_id = pull.pull_id, engine_id = %pull.engine_id, reqs = pull.reqs.len(), "pull received");
        let (data_addr, traceparent, p_generation, rdma) =
            (pull.data_addr, pull.traceparent, pull.p_generation, pull.rdma);
        let d_rank =
            DRank { tp_size: pull.tp_size, tp_rank: pull.tp_rank, pp_size: pull.pp_size, pp_rank: pull.pp_rank };
        for req in pull.reqs {
            let routed = RoutedPull {
                key,
                layout: &layout,
                data_addr: &data_addr,
                traceparent: &traceparent,
                write_by,
                d_rank,
                rdma: &rdma,
            };
            self.route(req, p_generation, routed, me).await;
        }
    }

    /// D's layout for this pull: the one it carries (cached), or the cached one its `layout_id`
    /// names. Neither: the pull is refused (D resends it with the full layout) and `None`.
    fn pull_layout(&mut self, identity: &Bytes, pull: &PullRequest) -> Option<KvLayout> {
        let layout_key = (pull.engine_id.clone(), pull.layout_id);
        if let Some(layout) = &pull.layout {
            self.layouts.insert(layout_key, layout.clone());
            return Some(layout.clone());
        }
        if let Some(layout) = self.layouts.get(&layout_key) {
            return Some(layout.clone());
        }
        let why = format!(
            "P has no cached layout {:#x} for engine {}: resend the pull with the full layout",
            pull.layout_id, pull.engine_id
        );
        tracing::warn!(pull_id = pull.pull_id, "{why}");
        // A restarted worker also forgot D's layout: its predecessor's transfers are refused as
        // such, not sent round again with the full layout.
        let err_reqs = pull
            .reqs
            .iter()
            .map(|r| {
                self.stale_generation(pull.p_generation, r).unwrap_or_else(|| PullErr {
                    d_req_id: r.d_req_id.clone(),
                    cause: PullErrorCause::UnknownLayout,
                    detail: why.clone(),
                })
            })
            .collect();
        let response = PullResponse { err_reqs, ..PullResponse::error(pull.pull_id, why) };
        self.send(identity.clone(), &response);
        None
    }

    /// Step 22 for one request of a pull: refused at once when it addressed a lost generation or
    /// a transfer already released, else handed to its transfer's SendWorker.
    async fn route(&mut self, req: PullReq, p_generation: u64, pull: RoutedPull<'_>, me: &ActorRef<Self>) {
        if let Some(err) = self.stale_generation(p_generation, &req) {
            return self.settle(pull.key, &req.d_req_id, Err(err));
        }
        if self.is_retired(&req.transfer_id) {
            let detail = format!(
                "P no longer holds the KV of transfer {}: it was sent already or expired before this pull",
                req.transfer_id
            );
            let err = PullErr { d_req_id: req.d_req_id.clone(), cause: PullErrorCause::Expired, detail };
            return self.settle(pull.key, &req.d_req_id, Err(err));
        }
        let worker = self.worker(&req.transfer_id, me).await;
        let serve = ServePull {
            pull_id: pull.key,
            d_req_id: req.d_req_id.clone(),
            transfer_id: req.transfer_id.clone(),
            block_ids: req.block_ids,
            data_addr: pull.data_addr.to_string(),
            layout: pull.layout.clone(),
            traceparent: req.traceparent.clone().or_else(|| pull.traceparent.clone()),
            fence: req.fence,
            d_rank: pull.d_rank,
            write_by: pull.write_by,
            rdma: pull
                .rdma
                .as_ref()
                .filter(|_| !req.remote.is_empty())
                .map(|offer| RemoteWriteGrant { offer: (**offer).clone(), regions: req.remote.clone() }),
        };
        if let Err(e) = worker.tell(serve).await {
            let err = PullErr {
                d_req_id: req.d_req_id.clone(),
                cause: PullErrorCause::TransferFailed,
                detail: format!("P's send worker is gone: {e}"),
            };
            self.settle(pull.key, &req.d_req_id, Err(err));
        }
    }

    /// The refusal of `req` when its pull addressed another generation of this worker, this
    /// incarnation does not know the transfer, and its record is gone: its ready went to an earlier
    /// incarnation, or the generation is not this engine's (the node restarted). A transfer an
    /// earlier incarnation never recorded ready is still to come: the pull waits (see [`lineage`]).
    fn stale_generation(&self, addressed: u64, req: &PullReq) -> Option<PullErr> {
        let elsewhere = addressed != 0 && addressed != self.p_generation;
        if !elsewhere || self.workers.contains_key(&req.transfer_id) || self.retired.contains_key(&req.transfer_id) {
            return None;
        }
        let why = match self.args.lineage.unknown(&req.transfer_id, addressed, self.p_generation) {
            lineage::Unknown::NotReadyYet => return None,
            lineage::Unknown::Lost { generation } => {
                format!("its ready went to generation {generation}, whose record went with it (the listener restarted)")
            }
            lineage::Unknown::ForeignGeneration => {
                "its KV went with the previous one (the worker restarted)".to_string()
            }
        };
        let detail = format!(
            "P worker {} is generation {}, the pull addressed generation {addressed}: transfer {} is unknown to this incarnation, {why}",
            self.addr, self.p_generation, req.transfer_id
        );
        Some(PullErr { d_req_id: req.d_req_id.clone(), cause: PullErrorCause::StaleGeneration, detail })
    }
}
