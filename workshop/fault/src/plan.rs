//! The fault plan: a typed, serde (JSON) description of the faults to inject — kill an
//! actor when a step begins or ends, drop / delay / corrupt the side-channel message of a step,
//! cut P's data link after K bytes, kill a whole node — loaded from
//! `PDFLOW_FAULT_PLAN` (JSON text, or `@path` to a JSON file).
//!
//! ```json
//! {"faults": [
//!   {"step": 29, "when": "begin", "fault": "kill", "actor": "send_worker"},
//!   {"step": 17, "when": "end", "fault": "kill", "actor": "scheduler_connector", "role": "d"},
//!   {"step": 21, "fault": "drop"},
//!   {"step": 30, "fault": "corrupt", "request_id": "cmpl-42"},
//!   {"step": 22, "fault": "delay", "ms": 300},
//!   {"step": 27, "when": "end", "fault": "kill_node", "node": "p"},
//!   {"step": 29, "fault": "cut_data", "after_bytes": 65536}
//! ]}
//! ```
//!
//! `cut_data` acts on step 29 only (P's write into D's memory): the write goes over tcp through a
//! link that carries the first `after_bytes` bytes P sends on it — hello, fence, batch headers and
//! payload, over every stream of the write — then shuts every connection down both ways, as a
//! network cut or a crash of P mid-transfer would ([`crate::CutLink`]).
//!
//! Every fault fires once unless `times` says otherwise; `request_id` (a substring of the step
//! span's `pd.request_id`) limits it to one request. The plan is validated as a whole: every bad
//! fault is reported, with what to change.

use serde::{Deserialize, Serialize};

use pdflow_observability::steps;

/// The environment variable every node reads its plan from (JSON text, or `@path`).
pub const ENV_FAULT_PLAN: &str = "PDFLOW_FAULT_PLAN";

/// The steps whose span sends one side-channel message that `drop` / `corrupt` can act on:
/// 21 (D's pull request) and 30 (P's answer).
pub const MESSAGE_STEPS: [u8; 2] = [steps::D_SEND_PULL_META.number, steps::P_REPLY_FINISH.number];

/// The steps whose span moves KV bytes over the data connection, where `cut_data` acts: 29 (P's
/// write into D's memory).
pub const DATA_STEPS: [u8; 1] = [steps::P_TRANSFER_WRITE.number];

pub use pdflow_actors::fault_seam::{ActorKind, NodeKind, Role};

/// When, relative to the step's span, a fault fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum When {
    /// The step's span is created (the step starts).
    #[default]
    Begin,
    /// The step's span closes (the step ended).
    End,
}

/// What to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "fault", rename_all = "snake_case")]
pub enum FaultAction {
    /// `kameo` kill of every live actor of this kind (and role); per-request kinds only the one
    /// of the step's transfer_id when the step names one.
    Kill {
        actor: ActorKind,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        role: Option<Role>,
    },
    /// The step's side-channel message is not sent (steps 21, 30).
    Drop,
    /// The step's side-channel message is sent with its frame header damaged (steps 21, 30).
    Corrupt,
    /// The thread running the step stalls this long (a pause, a slow peer).
    Delay { ms: u64 },
    /// The whole node stops at once (a process kill).
    KillNode { node: NodeKind },
    /// P's data link is cut after it carried this many bytes of the step's write (step 29): the
    /// bytes before the cut reach D, then every connection of the write is shut down both ways.
    CutData { after_bytes: u64 },
    /// P's data link alters one byte of the step's write (step 29) — the one after the first
    /// `at_byte` bytes from P, counted over every connection of the write — and carries the rest
    /// untouched: a tamperer on the path. D's `verify_checksums` sees the block differ.
    FlipData { at_byte: u64 },
}

impl FaultAction {
    /// Short label for reports: `kill`, `drop`, `corrupt`, `delay`, `kill_node`, `cut_data`,
    /// `flip_data`.
    pub fn label(&self) -> &'static str {
        match self {
            FaultAction::Kill { .. } => "kill",
            FaultAction::Drop => "drop",
            FaultAction::Corrupt => "corrupt",
            FaultAction::Delay { .. } => "delay",
            FaultAction::KillNode { .. } => "kill_node",
            FaultAction::CutData { .. } => "cut_data",
            FaultAction::FlipData { .. } => "flip_data",
        }
    }
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

/// One fault.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fault {
    /// The step number (1–43, docs/steps.md).
    pub step: u8,
    #[serde(default)]
    pub when: When,
    /// Only for the request whose `pd.request_id` contains this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// How many times it fires (default 1).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub times: u32,
    #[serde(flatten)]
    pub action: FaultAction,
}

impl Fault {
    /// A fault that fires once, for any request.
    pub fn new(step: u8, when: When, action: FaultAction) -> Self {
        Self { step, when, request_id: None, times: 1, action }
    }
}

/// A whole plan.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultPlan {
    pub faults: Vec<Fault>,
}

/// Why a plan cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultPlanError {
    #[error("{ENV_FAULT_PLAN}: cannot read {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("{ENV_FAULT_PLAN} is not a fault plan: {reason} (expected {{\"faults\": [{{\"step\": 29, \"fault\": \"kill\", \"actor\": \"send_worker\"}}]}})")]
    Parse { reason: String },
    #[error("fault #{index}: {reason}")]
    Invalid { index: usize, reason: String },
}

impl FaultPlan {
    /// Parses and validates a plan from JSON text; every invalid fault is reported.
    pub fn from_json(text: &str) -> Result<Self, Vec<FaultPlanError>> {
        let plan: FaultPlan =
            serde_json::from_str(text).map_err(|e| vec![FaultPlanError::Parse { reason: e.to_string() }])?;
        plan.validate()?;
        Ok(plan)
    }

    /// `PDFLOW_FAULT_PLAN` through `get` (JSON text, or `@path`); `None` when unset or blank.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Self>, Vec<FaultPlanError>> {
        let Some(value) = get(ENV_FAULT_PLAN).filter(|v| !v.trim().is_empty()) else { return Ok(None) };
        let text = match value.trim().strip_prefix('@') {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| vec![FaultPlanError::Read { path: path.to_string(), reason: e.to_string() }])?,
            None => value,
        };
        Self::from_json(&text).map(Some)
    }

    /// From the process environment.
    pub fn from_env() -> Result<Option<Self>, Vec<FaultPlanError>> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// Every fault names a real step, a message step for drop/corrupt, step 29 (at its beginning)
    /// for cut_data, a role where one is needed.
    pub fn validate(&self) -> Result<(), Vec<FaultPlanError>> {
        let mut errors = Vec::new();
        for (index, f) in self.faults.iter().enumerate() {
            let mut bad = |reason: String| errors.push(FaultPlanError::Invalid { index, reason });
            if steps::by_number(f.step).is_none() {
                bad(format!("step {} does not exist (steps are 1-43: `pdflow demo` prints them)", f.step));
            }
            if f.times == 0 {
                bad("times 0 never fires: use at least 1 or remove the fault".into());
            }
            match &f.action {
                FaultAction::Drop | FaultAction::Corrupt if !MESSAGE_STEPS.contains(&f.step) => bad(format!(
                    "{} acts on a side-channel message: only steps {MESSAGE_STEPS:?} send one",
                    f.action.label()
                )),
                FaultAction::Kill { actor: ActorKind::Engine, .. } => {
                    bad("the engine is not an actor a plan can kill: kill one of its actors, or the node (kill_node)"
                        .into())
                }
                FaultAction::Kill { actor: ActorKind::SchedulerConnector, role: None } => {
                    bad("scheduler_connector lives on P and on D: add \"role\": \"p\" or \"d\"".into())
                }
                FaultAction::Kill { actor, role: Some(role) } if actor.natural_side().is_some_and(|r| r != *role) => {
                    bad(format!("{} does not run on role {role:?}", actor.name()))
                }
                FaultAction::Delay { ms } if *ms > 600_000 => {
                    bad(format!("delay of {ms} ms is longer than 10 minutes"))
                }
                FaultAction::CutData { .. } | FaultAction::FlipData { .. } if !DATA_STEPS.contains(&f.step) => {
                    bad(format!(
                        "{} acts on the data connection: only steps {DATA_STEPS:?} write over it",
                        f.action.label()
                    ))
                }
                FaultAction::CutData { .. } | FaultAction::FlipData { .. } if f.when == When::End => bad(format!(
                    "{} acts while the write runs: use \"when\": \"begin\" (the default)",
                    f.action.label()
                )),
                _ => {}
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_example_parses_and_round_trips() {
        let text = r#"{"faults": [
          {"step": 29, "when": "begin", "fault": "kill", "actor": "send_worker"},
          {"step": 17, "when": "end", "fault": "kill", "actor": "scheduler_connector", "role": "d"},
          {"step": 21, "fault": "drop"},
          {"step": 30, "fault": "corrupt", "request_id": "cmpl-42"},
          {"step": 22, "fault": "delay", "ms": 300},
          {"step": 27, "when": "end", "fault": "kill_node", "node": "p", "times": 2},
          {"step": 29, "fault": "cut_data", "after_bytes": 65536}
        ]}"#;
        let plan = FaultPlan::from_json(text).expect("valid");
        assert_eq!(plan.faults.len(), 7);
        assert_eq!(plan.faults[6], Fault::new(29, When::Begin, FaultAction::CutData { after_bytes: 65536 }));
        assert_eq!(plan.faults[6].action.label(), "cut_data");
        assert_eq!(
            plan.faults[0],
            Fault::new(29, When::Begin, FaultAction::Kill { actor: ActorKind::SendWorker, role: None })
        );
        assert_eq!(plan.faults[3].request_id.as_deref(), Some("cmpl-42"));
        assert_eq!(plan.faults[5].times, 2);
        let again = FaultPlan::from_json(&serde_json::to_string(&plan).expect("serialises")).expect("round trip");
        assert_eq!(again, plan);
    }

    #[test]
    fn every_bad_fault_is_reported() {
        let text = r#"{"faults": [
          {"step": 44, "fault": "delay", "ms": 1},
          {"step": 29, "fault": "drop"},
          {"step": 12, "fault": "kill", "actor": "scheduler_connector"},
          {"step": 12, "fault": "kill", "actor": "receiver", "role": "p"},
          {"step": 15, "fault": "kill", "actor": "engine"}
        ]}"#;
        let errors = FaultPlan::from_json(text).expect_err("invalid");
        assert_eq!(errors.len(), 5, "{errors:?}");
        assert!(errors[1].to_string().contains("[21, 30]"), "{}", errors[1]);
        assert!(errors[4].to_string().contains("not an actor a plan can kill"), "{}", errors[4]);
        assert!(FaultPlan::from_json(r#"{"faults": [{"step": 3, "fault": "explode"}]}"#).is_err());
    }

    #[test]
    fn env_accepts_text_or_a_path() {
        assert_eq!(FaultPlan::from_lookup(&|_| None), Ok(None));
        let json = r#"{"faults": [{"step": 21, "fault": "drop"}]}"#;
        let plan = FaultPlan::from_lookup(&|_| Some(json.to_string())).expect("valid").expect("some");
        assert_eq!(plan.faults[0].action, FaultAction::Drop);
        let path = std::env::temp_dir().join(format!("pdflow-plan-{}.json", std::process::id()));
        std::fs::write(&path, json).expect("writes");
        let from_file = FaultPlan::from_lookup(&|_| Some(format!("@{}", path.display()))).expect("valid");
        assert_eq!(from_file, Some(plan));
        let _ = std::fs::remove_file(&path);
        let missing = FaultPlan::from_lookup(&|_| Some("@/nonexistent/plan.json".into())).expect_err("unreadable");
        assert!(matches!(missing[0], FaultPlanError::Read { .. }));
    }
}
