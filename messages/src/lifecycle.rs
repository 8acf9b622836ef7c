//! The lifecycle of one request's transfer on each side, as explicit states. Every
//! state a request can wait in is bounded by a named, configurable [`Deadline`], and an error a
//! deadline causes names the side, the state and the deadline ([`DeadlinePassed`]). Owns no step:
//! the actors that own the steps keep their requests in these states — P's SendWorker per
//! transfer (steps 22, 27, 29), D's Receiver per request (steps 20, 21–34), and the engine's
//! scheduler behind both (`WAITING_FOR_REMOTE_KVS`, delayed free) as the last backstop.
//!
//! ```text
//! P:  (pull first) waiting_for_prefill ──ready──▶ held_for_pull ──pull──▶ writing ──▶ sent
//!                        │ ready_timeout               │ send_expiry         │ write_timeout
//!                        ▼                             ▼                     ▼
//!                  NACK ReadyTimeout             blocks freed          NACK TransferFailed
//! D:  looking_up ──/query──▶ pulling ──P answers──▶ received
//!         │ bootstrap_timeout  │ pull_timeout, or P's NACK
//!         ▼                    ▼
//!       failed          draining_fence ──fence closed──▶ failed (policy: recompute | fail)
//! ```

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Which engine a state belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Side {
    P,
    D,
}

/// A state a request's transfer waits in, on one side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferState {
    /// P: D's pull arrived before P's prefill finished (seed step 22).
    WaitingForPrefill,
    /// P: prefill done, the blocks held for D's pull (delayed free, step 27).
    HeldForPull,
    /// P: writing D's blocks (step 29).
    Writing,
    /// P, in the engine: blocks held for a send the connector has not reported (backstop).
    DelayedFree,
    /// D: looking P's workers up at bootstrap (step 20).
    LookingUp,
    /// D: the pull is sent, P's answer awaited (steps 21–30).
    Pulling,
    /// D: the pull failed; batches still landing are being stopped before the blocks are given
    /// back (the write fence).
    DrainingFence,
    /// D, in the engine: `WAITING_FOR_REMOTE_KVS`, held for the connector (backstop).
    WaitingForRemoteKvs,
}

/// The deadline that bounds a state, as its setting is named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Deadline {
    ReadyTimeout,
    SendExpiry,
    WriteTimeout,
    BootstrapTimeout,
    PullTimeout,
    FenceDrain,
    KvStateTimeout,
}

impl Deadline {
    /// The setting's name, as in `kv_connector_extra_config` and the README.
    pub fn name(self) -> &'static str {
        match self {
            Deadline::ReadyTimeout => "ready_timeout",
            Deadline::SendExpiry => "send_expiry",
            Deadline::WriteTimeout => "write_timeout",
            Deadline::BootstrapTimeout => "bootstrap_timeout",
            Deadline::PullTimeout => "pull_timeout",
            Deadline::FenceDrain => "fence_drain",
            Deadline::KvStateTimeout => "kv_state_timeout",
        }
    }

    /// How a user changes it.
    pub fn how_to_change(self) -> &'static str {
        match self {
            Deadline::ReadyTimeout => {
                "raise it if prefills are slow: `pdflow serve --ready-timeout`, or the abort timeout (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, extra-config abort_request_timeout_s)"
            }
            Deadline::SendExpiry => "`pdflow serve --send-expiry`, or the abort timeout (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT)",
            Deadline::WriteTimeout => "the transfer engine's write deadline (extra-config write_timeout_s)",
            Deadline::BootstrapTimeout => "`pdflow serve --bootstrap-timeout` (extra-config bootstrap_timeout_s); is the bootstrap server up?",
            Deadline::PullTimeout => "`pdflow serve --pull-timeout` (extra-config pull_timeout_s); is P up and reachable?",
            Deadline::FenceDrain => "fixed; a data server that does not stop a batch within it is reported anyway",
            Deadline::KvStateTimeout => "derived: max(send expiry, pull timeout) + bootstrap timeout + 2 s",
        }
    }
}

impl TransferState {
    pub const ALL: [TransferState; 8] = [
        TransferState::WaitingForPrefill,
        TransferState::HeldForPull,
        TransferState::Writing,
        TransferState::DelayedFree,
        TransferState::LookingUp,
        TransferState::Pulling,
        TransferState::DrainingFence,
        TransferState::WaitingForRemoteKvs,
    ];

    pub fn side(self) -> Side {
        match self {
            TransferState::WaitingForPrefill
            | TransferState::HeldForPull
            | TransferState::Writing
            | TransferState::DelayedFree => Side::P,
            TransferState::LookingUp
            | TransferState::Pulling
            | TransferState::DrainingFence
            | TransferState::WaitingForRemoteKvs => Side::D,
        }
    }

    /// The snake_case name used in errors and traces.
    pub fn name(self) -> &'static str {
        match self {
            TransferState::WaitingForPrefill => "waiting_for_prefill",
            TransferState::HeldForPull => "held_for_pull",
            TransferState::Writing => "writing",
            TransferState::DelayedFree => "delayed_free",
            TransferState::LookingUp => "looking_up",
            TransferState::Pulling => "pulling",
            TransferState::DrainingFence => "draining_fence",
            TransferState::WaitingForRemoteKvs => "waiting_for_remote_kvs",
        }
    }

    /// The deadline that bounds this state.
    pub fn deadline(self) -> Deadline {
        match self {
            TransferState::WaitingForPrefill => Deadline::ReadyTimeout,
            TransferState::HeldForPull => Deadline::SendExpiry,
            TransferState::Writing => Deadline::WriteTimeout,
            TransferState::LookingUp => Deadline::BootstrapTimeout,
            TransferState::Pulling => Deadline::PullTimeout,
            TransferState::DrainingFence => Deadline::FenceDrain,
            TransferState::DelayedFree | TransferState::WaitingForRemoteKvs => Deadline::KvStateTimeout,
        }
    }

    /// The error of a request that stayed in this state `after` its deadline; `what` says what did
    /// not happen ("P's prefill for transfer x did not finish").
    pub fn passed(self, after: Duration, what: impl Into<String>) -> DeadlinePassed {
        DeadlinePassed { state: self, after, what: what.into() }
    }
}

/// A request stayed in `state` past its deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadlinePassed {
    pub state: TransferState,
    pub after: Duration,
    pub what: String,
}

impl fmt::Display for DeadlinePassed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let deadline = self.state.deadline();
        write!(
            f,
            "{}: {:?}'s request was in state `{}` past its {} of {:.1}s ({})",
            self.what,
            self.state.side(),
            self.state.name(),
            deadline.name(),
            self.after.as_secs_f64(),
            deadline.how_to_change()
        )
    }
}

impl std::error::Error for DeadlinePassed {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_has_a_side_a_deadline_and_an_error_that_names_both() {
        for state in TransferState::ALL {
            let e = state.passed(Duration::from_millis(1500), "it did not happen").to_string();
            assert!(e.starts_with("it did not happen: "), "{e}");
            assert!(e.contains(&format!("`{}`", state.name())), "{e}");
            assert!(e.contains(state.deadline().name()) && e.contains("1.5s"), "{e}");
            assert!(e.contains(&format!("{:?}'s request", state.side())), "{e}");
            let json = serde_json::to_string(&state).expect("json");
            assert_eq!(json, format!("\"{}\"", state.name()), "serde and name() agree");
        }
        assert_eq!(TransferState::WaitingForPrefill.side(), Side::P);
        assert_eq!(TransferState::Pulling.deadline(), Deadline::PullTimeout);
    }
}
