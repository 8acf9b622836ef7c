//! The chaos matrix: every actor kind × every request step at which it is alive × the
//! fault kinds that apply, plus node kills of P, D and bootstrap mid-request, and the side-channel
//! message faults, and cuts of P's data connection during its write (step 29) after K payload
//! bytes. `quick` is a reduced subset with at least one cell per actor kind and fault kind.
//!
//! When an actor is alive (request steps 8–43): the long-lived ones (proxy, bootstrap, both
//! scheduler connectors, sender listener, receiver) throughout; a SendWorker from P's record of
//! the send (step 14) to its mark-sent (31); a PullTask from D's pull (21) to P's answer (30).
//! Kills fire at the beginning of every step at which the actor is alive, and at the end of the
//! steps it owns (where its own work has just happened).

use std::ops::RangeInclusive;

use pdflow_fault::{ActorKind, Fault, FaultAction, FaultPlan, NodeKind, Role, When};
use pdflow_observability::steps;
use serde::Serialize;

use pdflow_node::config::Deadlines;

/// The request's steps.
pub const REQUEST_STEPS: RangeInclusive<u8> = 8..=43;

/// One cell: one fault injected into one request.
#[derive(Debug, Clone, Serialize)]
pub struct CellSpec {
    /// What is hit: `send_worker`, `p.scheduler_connector`, `node.p`, …
    pub actor: String,
    pub step: u8,
    /// `kill@begin`, `kill@end`, `drop`, `corrupt`, `delay_ms@begin`, `kill_node@begin`,
    /// `cut_data@<K>`.
    pub fault: String,
    #[serde(skip)]
    pub plan: FaultPlan,
}

impl CellSpec {
    fn new(actor: String, fault: String, f: Fault) -> Self {
        Self { actor, step: f.step, fault, plan: FaultPlan { faults: vec![f] } }
    }

    /// `actor/step/fault`, the cell's name in tables and filters.
    pub fn name(&self) -> String {
        format!("{}/{:02}/{}", self.actor, self.step, self.fault)
    }
}

/// The actors a kill can target, with their role and label (scheduler connector twice).
pub fn targets() -> Vec<(ActorKind, Role, String)> {
    ActorKind::ACTORS
        .iter()
        .flat_map(|&k| match k.natural_side() {
            Some(role) => vec![(k, role, k.name().to_string())],
            None => vec![(k, Role::P, format!("p.{}", k.name())), (k, Role::D, format!("d.{}", k.name()))],
        })
        .collect()
}

/// The request steps at which `kind` (on `role`) is alive.
pub fn alive_steps(kind: ActorKind) -> RangeInclusive<u8> {
    match kind {
        ActorKind::SendWorker => steps::P_RECORD_SEND_PENDING.number..=steps::P_MARK_SENT.number,
        ActorKind::PullTask => steps::D_SEND_PULL_META.number..=steps::P_REPLY_FINISH.number,
        _ => REQUEST_STEPS,
    }
}

/// The request steps `kind` on `role` owns (its own work), where an end-of-step kill applies.
pub fn owned_steps(kind: ActorKind, role: Role) -> Vec<u8> {
    // An actor kind is the step catalogue's owner, a role its side.
    match kind {
        ActorKind::Bootstrap => return vec![steps::D_BOOTSTRAP_QUERY.number], // its server side
        ActorKind::PullTask => return vec![steps::D_SEND_PULL_META.number, steps::P_REPLY_FINISH.number], // 30: receive side
        _ => {}
    }
    steps::STEPS
        .iter()
        .filter(|s| REQUEST_STEPS.contains(&s.number) && s.owner == kind && s.side == role)
        .map(|s| s.number)
        .collect()
}

fn kill(kind: ActorKind, role: Role, label: &str, step: u8, when: When) -> CellSpec {
    let w = if when == When::Begin { "begin" } else { "end" };
    CellSpec::new(
        label.to_string(),
        format!("kill@{w}"),
        Fault::new(step, when, FaultAction::Kill { actor: kind, role: Some(role) }),
    )
}

fn node(node: NodeKind, step: u8) -> CellSpec {
    CellSpec::new(
        format!("node.{}", node.name()),
        "kill_node@begin".into(),
        Fault::new(step, When::Begin, FaultAction::KillNode { node }),
    )
}

fn message(step: u8, action: FaultAction) -> CellSpec {
    let sender = if step == steps::D_SEND_PULL_META.number { "pull_task" } else { "sender_listener" };
    let label = match &action {
        FaultAction::Delay { ms } => format!("delay_{ms}ms@begin"),
        a => a.label().to_string(),
    };
    CellSpec::new(sender.to_string(), label, Fault::new(step, When::Begin, action))
}

fn delay(actor: &str, step: u8, ms: u64) -> CellSpec {
    CellSpec::new(
        actor.to_string(),
        format!("delay_{ms}ms@begin"),
        Fault::new(step, When::Begin, FaultAction::Delay { ms }),
    )
}

/// The data link of P's write (step 29) is cut after it carried `after_bytes` bytes.
fn cut_data(after_bytes: u64) -> CellSpec {
    let f = Fault::new(steps::P_TRANSFER_WRITE.number, When::Begin, FaultAction::CutData { after_bytes });
    CellSpec::new("send_worker".into(), format!("cut_data@{after_bytes}"), f)
}

/// One byte of P's write (step 29) is altered on the link after `at_byte` bytes: D's block check
/// must catch it (the request recomputed or failed cleanly, never answered from altered KV).
fn flip_data(at_byte: u64) -> CellSpec {
    let f = Fault::new(steps::P_TRANSFER_WRITE.number, When::Begin, FaultAction::FlipData { at_byte });
    CellSpec::new("send_worker".into(), format!("flip_data@{at_byte}"), f)
}

/// The prompt length of a chaos request (`chaos::run` and the chaos tests send 40 tokens).
const CHAOS_PROMPT_TOKENS: usize = 40;

/// Where the data cuts fall in a chaos request's write (bytes P sends on the link: hello, fence
/// and batch header come before the payload): before the hello, inside the first layer's
/// descriptor, half-way, and a header's length before the last payload byte.
pub fn cut_points() -> [u64; 4] {
    let shape = super::CHAOS_SHAPE;
    let request_bytes = (CHAOS_PROMPT_TOKENS.div_ceil(shape.block_size) * shape.bytes_per_block()) as u64;
    [0, 4096, request_bytes / 2, request_bytes]
}

/// Steps at which node kills are tried in the full matrix (mid-request, each phase).
const NODE_KILL_STEPS: [u8; 13] = [9, 11, 15, 17, 19, 21, 22, 27, 29, 30, 34, 37, 40];

/// The matrix for these deadlines: one stall is longer than D's pull deadline (P writes after D
/// gave up), one delays D's pull past P's send expiry (P must refuse it at once).
pub fn cells(quick: bool, deadlines: &Deadlines) -> Vec<CellSpec> {
    let ms = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let long_delay_ms = ms(deadlines.pull_timeout) + 500;
    let past_expiry_ms = ms(deadlines.send_expiry) + 300;
    let mut out = vec![message(steps::D_SEND_PULL_META.number, FaultAction::Delay { ms: past_expiry_ms })];
    let side_channel = [steps::D_SEND_PULL_META.number, steps::P_REPLY_FINISH.number];
    if quick {
        let picks: [(&str, u8, When); 16] = [
            ("proxy", 8, When::Begin),
            ("proxy", 43, When::Begin),
            ("bootstrap", 20, When::Begin),
            ("p.scheduler_connector", 12, When::Begin),
            ("p.scheduler_connector", 26, When::End),
            ("p.scheduler_connector", 33, When::Begin),
            ("d.scheduler_connector", 17, When::End),
            ("d.scheduler_connector", 36, When::Begin),
            ("sender_listener", 21, When::Begin),
            ("sender_listener", 29, When::Begin),
            ("send_worker", 22, When::Begin),
            ("send_worker", 29, When::Begin),
            ("receiver", 19, When::End),
            ("receiver", 34, When::Begin),
            ("pull_task", 21, When::End),
            ("pull_task", 30, When::Begin),
        ];
        let all = targets();
        for (label, step, when) in picks {
            if let Some((kind, role, label)) = all.iter().find(|(_, _, l)| l == label) {
                out.push(kill(*kind, *role, label, step, when));
            }
        }
        for step in side_channel {
            out.push(message(step, FaultAction::Drop));
            out.push(message(step, FaultAction::Corrupt));
        }
        out.push(delay("send_worker", steps::P_TRANSFER_WRITE.number, long_delay_ms));
        out.push(node(NodeKind::P, steps::P_PULL_WAIT_READY.number));
        out.push(node(NodeKind::D, steps::P_TRANSFER_WRITE.number));
        out.push(node(NodeKind::Bootstrap, steps::D_BOOTSTRAP_QUERY.number));
        out.push(cut_data(cut_points()[1]));
        out.push(flip_data(cut_points()[2]));
        return out;
    }
    for (kind, role, label) in targets() {
        for step in alive_steps(kind) {
            out.push(kill(kind, role, &label, step, When::Begin));
        }
        for step in owned_steps(kind, role) {
            if alive_steps(kind).contains(&step) {
                out.push(kill(kind, role, &label, step, When::End));
            }
        }
    }
    for step in side_channel {
        out.push(message(step, FaultAction::Drop));
        out.push(message(step, FaultAction::Corrupt));
        out.push(message(step, FaultAction::Delay { ms: 300 }));
    }
    for (actor, step) in [("send_worker", 22), ("send_worker", 29), ("p.scheduler_connector", 26), ("receiver", 34)] {
        out.push(delay(actor, step, 300));
    }
    out.push(delay("send_worker", steps::P_TRANSFER_WRITE.number, long_delay_ms));
    for n in [NodeKind::P, NodeKind::D, NodeKind::Bootstrap] {
        for step in NODE_KILL_STEPS {
            out.push(node(n, step));
        }
    }
    out.extend(cut_points().into_iter().map(cut_data));
    out.push(flip_data(cut_points()[2]));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_and_fault_is_covered_and_every_plan_is_valid() {
        for quick in [true, false] {
            let cells = cells(quick, &crate::chaos::chaos_deadlines());
            for c in &cells {
                c.plan.validate().unwrap_or_else(|e| panic!("{}: {e:?}", c.name()));
            }
            for (_, _, label) in targets() {
                assert!(cells.iter().any(|c| c.actor == label), "{label} missing (quick: {quick})");
            }
            for fault in
                ["kill@begin", "kill@end", "drop", "corrupt", "kill_node@begin", "cut_data@4096", "flip_data@12288"]
            {
                assert!(cells.iter().any(|c| c.fault == fault), "{fault} missing (quick: {quick})");
            }
            let mut names: Vec<String> = cells.iter().map(CellSpec::name).collect();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), cells.len(), "cell names are unique");
        }
        assert_eq!(owned_steps(ActorKind::SchedulerConnector, Role::D), vec![16, 17, 18, 35, 36, 37, 41]);
        assert_eq!(owned_steps(ActorKind::SendWorker, Role::P), vec![14, 22, 27, 28, 29, 31]);
        // 40 tokens in blocks of 16: 3 blocks of 8 KiB.
        assert_eq!(cut_points(), [0, 4096, 12_288, 24_576]);
        let full = cells(false, &crate::chaos::chaos_deadlines());
        assert_eq!(full.iter().filter(|c| c.fault.starts_with("cut_data@") && c.step == 29).count(), 4);
    }
}
