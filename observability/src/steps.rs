//! The catalogue of the seed's 43 steps (docs/steps.md): number, short name, owner, side.
//!
//! Steps 1–7 are start-up (one trace per node); 8–43 are one client request. Owners are the
//! actors (ARCHITECTURE.md lists them); `Engine` marks the engine's own work (forward passes,
//! outputs).

use serde::{Deserialize, Serialize};

/// Who owns a step: one of the actors, or the engine. In plans and reports it is named in
/// snake_case (`send_worker`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Owner {
    Proxy,
    Bootstrap,
    SchedulerConnector,
    SenderListener,
    SendWorker,
    Receiver,
    PullTask,
    Engine,
}

impl Owner {
    /// The actors (every owner but the engine).
    pub const ACTORS: [Owner; 7] = [
        Owner::Proxy,
        Owner::Bootstrap,
        Owner::SchedulerConnector,
        Owner::SenderListener,
        Owner::SendWorker,
        Owner::Receiver,
        Owner::PullTask,
    ];

    /// The snake_case name used in plans and reports.
    pub fn name(self) -> &'static str {
        match self {
            Owner::Proxy => "proxy",
            Owner::Bootstrap => "bootstrap",
            Owner::SchedulerConnector => "scheduler_connector",
            Owner::SenderListener => "sender_listener",
            Owner::SendWorker => "send_worker",
            Owner::Receiver => "receiver",
            Owner::PullTask => "pull_task",
            Owner::Engine => "engine",
        }
    }

    /// The side this owner lives on when it lives on one only (`None`: both P and D).
    pub fn natural_side(self) -> Option<Side> {
        match self {
            Owner::Proxy => Some(Side::Proxy),
            Owner::Bootstrap | Owner::SenderListener | Owner::SendWorker => Some(Side::P),
            Owner::Receiver | Owner::PullTask => Some(Side::D),
            Owner::SchedulerConnector | Owner::Engine => None,
        }
    }
}

/// Which participant a step runs on (snake_case in plans: `p`, `d`, `proxy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    Proxy,
    P,
    D,
}

/// One step of the timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Step {
    pub number: u8,
    pub short_name: &'static str,
    /// `step.NN.short_name`, the span's name.
    pub span_name: &'static str,
    pub owner: Owner,
    pub side: Side,
    /// Who does it, as docs/steps.md says.
    pub who: &'static str,
    /// What happens, as docs/steps.md says.
    pub what: &'static str,
}

pub const ENGINE_INIT: Step = Step {
    number: 1,
    short_name: "engine_init",
    span_name: "step.01.engine_init",
    owner: Owner::SenderListener,
    side: Side::P,
    who: "P worker",
    what: "transfer engine initialised, sender loop started",
};
pub const BOOTSTRAP_START: Step = Step {
    number: 2,
    short_name: "bootstrap_start",
    span_name: "step.02.bootstrap_start",
    owner: Owner::Bootstrap,
    side: Side::P,
    who: "P TP0 worker",
    what: "bootstrap server listening",
};
pub const REGISTER_KV_CACHES: Step = Step {
    number: 3,
    short_name: "register_kv_caches",
    span_name: "step.03.register_kv_caches",
    owner: Owner::SenderListener,
    side: Side::P,
    who: "P worker",
    what: "KV cache memory registered with the transfer engine",
};
pub const BOOTSTRAP_REGISTER: Step = Step {
    number: 4,
    short_name: "bootstrap_register",
    span_name: "step.04.bootstrap_register",
    owner: Owner::SenderListener,
    side: Side::P,
    who: "P worker → bootstrap",
    what: "POST /register with engine_id and side-channel address",
};
pub const CONSUMER_INIT: Step = Step {
    number: 5,
    short_name: "consumer_init",
    span_name: "step.05.consumer_init",
    owner: Owner::Receiver,
    side: Side::D,
    who: "D worker",
    what: "engine initialised, KV registered, receiver loop started",
};
pub const PROXY_HEALTH: Step = Step {
    number: 6,
    short_name: "proxy_health",
    span_name: "step.06.proxy_health",
    owner: Owner::Proxy,
    side: Side::Proxy,
    who: "proxy → P",
    what: "GET /health until P answers",
};
pub const PROXY_QUERY: Step = Step {
    number: 7,
    short_name: "proxy_query",
    span_name: "step.07.proxy_query",
    owner: Owner::Proxy,
    side: Side::Proxy,
    who: "proxy → bootstrap",
    what: "GET /query, P's engine_id recorded",
};
pub const CLIENT_REQUEST: Step = Step {
    number: 8,
    short_name: "client_request",
    span_name: "step.08.client_request",
    owner: Owner::Proxy,
    side: Side::Proxy,
    who: "client → proxy",
    what: "POST /v1/completions arrives",
};
pub const DISPATCH_PREFILL: Step = Step {
    number: 9,
    short_name: "dispatch_prefill",
    span_name: "step.09.dispatch_prefill",
    owner: Owner::Proxy,
    side: Side::Proxy,
    who: "proxy → P",
    what: "background request: max_tokens 1, do_remote_decode",
};
pub const DISPATCH_DECODE: Step = Step {
    number: 10,
    short_name: "dispatch_decode",
    span_name: "step.10.dispatch_decode",
    owner: Owner::Proxy,
    side: Side::Proxy,
    who: "proxy → D",
    what: "request with do_remote_prefill, bootstrap address, engine_id",
};
pub const P_ADD_REQUEST: Step = Step {
    number: 11,
    short_name: "p_add_request",
    span_name: "step.11.p_add_request",
    owner: Owner::SchedulerConnector,
    side: Side::P,
    who: "P",
    what: "request created with its kv_transfer_params",
};
pub const P_SCHEDULE_ALLOC: Step = Step {
    number: 12,
    short_name: "p_schedule_alloc",
    span_name: "step.12.p_schedule_alloc",
    owner: Owner::SchedulerConnector,
    side: Side::P,
    who: "P scheduler",
    what: "blocks allocated; update_state_after_alloc records the pending send",
};
pub const P_META_PENDING_SEND: Step = Step {
    number: 13,
    short_name: "p_meta_pending_send",
    span_name: "step.13.p_meta_pending_send",
    owner: Owner::SchedulerConnector,
    side: Side::P,
    who: "P scheduler → worker",
    what: "connector metadata with reqs_to_send, empty block list",
};
pub const P_RECORD_SEND_PENDING: Step = Step {
    number: 14,
    short_name: "p_record_send_pending",
    span_name: "step.14.p_record_send_pending",
    owner: Owner::SendWorker,
    side: Side::P,
    who: "P worker",
    what: "SendBlockMeta created, ready not set",
};
pub const P_PREFILL_FORWARD: Step = Step {
    number: 15,
    short_name: "p_prefill_forward",
    span_name: "step.15.p_prefill_forward",
    owner: Owner::Engine,
    side: Side::P,
    who: "P worker",
    what: "prefill forward pass, one token sampled",
};
pub const D_ADD_REQUEST: Step = Step {
    number: 16,
    short_name: "d_add_request",
    span_name: "step.16.d_add_request",
    owner: Owner::SchedulerConnector,
    side: Side::D,
    who: "D",
    what: "request created with do_remote_prefill",
};
pub const D_SCHEDULE_REMOTE: Step = Step {
    number: 17,
    short_name: "d_schedule_remote",
    span_name: "step.17.d_schedule_remote",
    owner: Owner::SchedulerConnector,
    side: Side::D,
    who: "D scheduler",
    what: "matched tokens = prompt (async), blocks allocated, WAITING_FOR_REMOTE_KVS",
};
pub const D_META_RECV: Step = Step {
    number: 18,
    short_name: "d_meta_recv",
    span_name: "step.18.d_meta_recv",
    owner: Owner::SchedulerConnector,
    side: Side::D,
    who: "D scheduler → worker",
    what: "connector metadata with reqs_to_recv",
};
pub const D_START_LOAD: Step = Step {
    number: 19,
    short_name: "d_start_load",
    span_name: "step.19.d_start_load",
    owner: Owner::Receiver,
    side: Side::D,
    who: "D worker",
    what: "start_load_kv hands the pull to the receiver",
};
pub const D_BOOTSTRAP_QUERY: Step = Step {
    number: 20,
    short_name: "d_bootstrap_query",
    span_name: "step.20.d_bootstrap_query",
    owner: Owner::Receiver,
    side: Side::D,
    who: "D worker → bootstrap",
    what: "GET /query for P worker addresses (first time per engine)",
};
pub const D_SEND_PULL_META: Step = Step {
    number: 21,
    short_name: "d_send_pull_meta",
    span_name: "step.21.d_send_pull_meta",
    owner: Owner::PullTask,
    side: Side::D,
    who: "D worker → P worker",
    what: "pull request with D's block ids and memory layout",
};
pub const P_PULL_WAIT_READY: Step = Step {
    number: 22,
    short_name: "p_pull_wait_ready",
    span_name: "step.22.p_pull_wait_ready",
    owner: Owner::SendWorker,
    side: Side::P,
    who: "P worker",
    what: "regions prepared, waiting for ready",
};
pub const P_REQUEST_FINISHED: Step = Step {
    number: 23,
    short_name: "p_request_finished",
    span_name: "step.23.p_request_finished",
    owner: Owner::SchedulerConnector,
    side: Side::P,
    who: "P scheduler",
    what: "length-capped finish, blocks kept (delayed free)",
};
pub const P_ENGINE_OUTPUT: Step = Step {
    number: 24,
    short_name: "p_engine_output",
    span_name: "step.24.p_engine_output",
    owner: Owner::Engine,
    side: Side::P,
    who: "P scheduler → API",
    what: "the one output token",
};
pub const P_HTTP_DONE: Step = Step {
    number: 25,
    short_name: "p_http_done",
    span_name: "step.25.p_http_done",
    owner: Owner::Proxy,
    side: Side::Proxy,
    who: "P API → proxy",
    what: "HTTP 200, discarded by the proxy",
};
pub const P_META_SEND_BLOCKS: Step = Step {
    number: 26,
    short_name: "p_meta_send_blocks",
    span_name: "step.26.p_meta_send_blocks",
    owner: Owner::SchedulerConnector,
    side: Side::P,
    who: "P scheduler → worker",
    what: "reqs_to_send with the block ids",
};
pub const P_RECORD_SEND_READY: Step = Step {
    number: 27,
    short_name: "p_record_send_ready",
    span_name: "step.27.p_record_send_ready",
    owner: Owner::SendWorker,
    side: Side::P,
    who: "P worker",
    what: "block ids and expiry recorded, ready set",
};
pub const P_BUILD_TRANSFER: Step = Step {
    number: 28,
    short_name: "p_build_transfer",
    span_name: "step.28.p_build_transfer",
    owner: Owner::SendWorker,
    side: Side::P,
    who: "P worker",
    what: "src/dst/length descriptors computed and coalesced",
};
pub const P_TRANSFER_WRITE: Step = Step {
    number: 29,
    short_name: "p_transfer_write",
    span_name: "step.29.p_transfer_write",
    owner: Owner::SendWorker,
    side: Side::P,
    who: "P worker → D memory",
    what: "the KV bytes written into D's blocks",
};
pub const P_REPLY_FINISH: Step = Step {
    number: 30,
    short_name: "p_reply_finish",
    span_name: "step.30.p_reply_finish",
    owner: Owner::SenderListener,
    side: Side::P,
    who: "P worker → D worker",
    what: "side-channel reply FINISH with ok_reqs",
};
pub const P_MARK_SENT: Step = Step {
    number: 31,
    short_name: "p_mark_sent",
    span_name: "step.31.p_mark_sent",
    owner: Owner::SendWorker,
    side: Side::P,
    who: "P worker",
    what: "request added to finished_sending",
};
pub const P_REPORT_SENT: Step = Step {
    number: 32,
    short_name: "p_report_sent",
    span_name: "step.32.p_report_sent",
    owner: Owner::SchedulerConnector,
    side: Side::P,
    who: "P worker → scheduler",
    what: "finished_sending reported",
};
pub const P_FREE_BLOCKS: Step = Step {
    number: 33,
    short_name: "p_free_blocks",
    span_name: "step.33.p_free_blocks",
    owner: Owner::SchedulerConnector,
    side: Side::P,
    who: "P scheduler",
    what: "delayed blocks freed",
};
pub const D_PULL_RESULT: Step = Step {
    number: 34,
    short_name: "d_pull_result",
    span_name: "step.34.d_pull_result",
    owner: Owner::Receiver,
    side: Side::D,
    who: "D worker",
    what: "pull result processed, request finished_recving",
};
pub const D_REPORT_RECV: Step = Step {
    number: 35,
    short_name: "d_report_recv",
    span_name: "step.35.d_report_recv",
    owner: Owner::SchedulerConnector,
    side: Side::D,
    who: "D worker → scheduler",
    what: "finished_recving reported",
};
pub const D_MARK_RECV: Step = Step {
    number: 36,
    short_name: "d_mark_recv",
    span_name: "step.36.d_mark_recv",
    owner: Owner::SchedulerConnector,
    side: Side::D,
    who: "D scheduler",
    what: "request marked as received",
};
pub const D_RESUME: Step = Step {
    number: 37,
    short_name: "d_resume",
    span_name: "step.37.d_resume",
    owner: Owner::SchedulerConnector,
    side: Side::D,
    who: "D scheduler",
    what: "blocks cached, computed tokens = prompt − 1, back to WAITING",
};
pub const D_SCHEDULE_FIRST: Step = Step {
    number: 38,
    short_name: "d_schedule_first",
    span_name: "step.38.d_schedule_first",
    owner: Owner::Engine,
    side: Side::D,
    who: "D scheduler",
    what: "one token scheduled at the last prompt position",
};
pub const D_FIRST_TOKEN: Step = Step {
    number: 39,
    short_name: "d_first_token",
    span_name: "step.39.d_first_token",
    owner: Owner::Engine,
    side: Side::D,
    who: "D worker",
    what: "forward pass, first output token",
};
pub const D_DECODE: Step = Step {
    number: 40,
    short_name: "d_decode",
    span_name: "step.40.d_decode",
    owner: Owner::Engine,
    side: Side::D,
    who: "D worker",
    what: "the remaining decode steps (one span around the loop)",
};
pub const D_REQUEST_FINISHED: Step = Step {
    number: 41,
    short_name: "d_request_finished",
    span_name: "step.41.d_request_finished",
    owner: Owner::SchedulerConnector,
    side: Side::D,
    who: "D scheduler",
    what: "finished, blocks freed at once",
};
pub const D_HTTP_RESPONSE: Step = Step {
    number: 42,
    short_name: "d_http_response",
    span_name: "step.42.d_http_response",
    owner: Owner::Engine,
    side: Side::D,
    who: "D API → proxy",
    what: "the completion response",
};
pub const PROXY_RESPONSE: Step = Step {
    number: 43,
    short_name: "proxy_response",
    span_name: "step.43.proxy_response",
    owner: Owner::Proxy,
    side: Side::Proxy,
    who: "proxy → client",
    what: "forwarded to the client",
};

/// All 43 steps, in order; `STEPS[n - 1].number == n`.
pub const STEPS: [Step; 43] = [
    ENGINE_INIT,
    BOOTSTRAP_START,
    REGISTER_KV_CACHES,
    BOOTSTRAP_REGISTER,
    CONSUMER_INIT,
    PROXY_HEALTH,
    PROXY_QUERY,
    CLIENT_REQUEST,
    DISPATCH_PREFILL,
    DISPATCH_DECODE,
    P_ADD_REQUEST,
    P_SCHEDULE_ALLOC,
    P_META_PENDING_SEND,
    P_RECORD_SEND_PENDING,
    P_PREFILL_FORWARD,
    D_ADD_REQUEST,
    D_SCHEDULE_REMOTE,
    D_META_RECV,
    D_START_LOAD,
    D_BOOTSTRAP_QUERY,
    D_SEND_PULL_META,
    P_PULL_WAIT_READY,
    P_REQUEST_FINISHED,
    P_ENGINE_OUTPUT,
    P_HTTP_DONE,
    P_META_SEND_BLOCKS,
    P_RECORD_SEND_READY,
    P_BUILD_TRANSFER,
    P_TRANSFER_WRITE,
    P_REPLY_FINISH,
    P_MARK_SENT,
    P_REPORT_SENT,
    P_FREE_BLOCKS,
    D_PULL_RESULT,
    D_REPORT_RECV,
    D_MARK_RECV,
    D_RESUME,
    D_SCHEDULE_FIRST,
    D_FIRST_TOKEN,
    D_DECODE,
    D_REQUEST_FINISHED,
    D_HTTP_RESPONSE,
    PROXY_RESPONSE,
];

/// The step with this number, if there is one.
pub fn by_number(number: u8) -> Option<&'static Step> {
    STEPS.get(usize::from(number).checked_sub(1)?)
}

/// The step whose span has this name.
pub fn by_span_name(name: &str) -> Option<&'static Step> {
    STEPS.iter().find(|s| s.span_name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalogue_is_numbered_and_named_as_steps_md() {
        for (i, s) in STEPS.iter().enumerate() {
            assert_eq!(usize::from(s.number), i + 1);
            assert_eq!(s.span_name, format!("step.{:02}.{}", s.number, s.short_name));
        }
        assert_eq!(by_number(29).map(|s| s.short_name), Some("p_transfer_write"));
        assert_eq!(by_span_name("step.43.proxy_response").map(|s| s.number), Some(43));
        assert!(by_number(0).is_none() && by_number(44).is_none());
    }
}
