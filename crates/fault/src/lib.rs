//! Fault injection: a [`FaultPlan`] says which faults to inject at which step; the
//! [`FaultLayer`] watches step spans begin (created) and end (closed) and fires the plan's
//! actions through a registry in which each node registers its actors by kind and role.
//!
//! Nothing here runs unless a plan is given: nodes register only once [`enable`] was called (a
//! plan was loaded, or `pdflow chaos` runs), the layer is installed only with a plan, and the
//! hooks the actors call ([`message_fault`], [`data_cut`]) return at once while no plan is armed.
//!
//! - kill: the registered actor's kameo `kill()` (its supervisor restarts the long-lived ones);
//! - delay: the thread that runs the step stalls (`std::thread::sleep`, a pause or slow peer);
//! - drop / corrupt: the side-channel message of steps 21 and 30 is not sent / sent with its frame
//!   header damaged — the sending actor asks [`message_fault`] just before it sends;
//! - cut_data: P's data connection is cut after K payload bytes of the step-29 write — the
//!   SendWorker asks [`data_cut`] just before it starts the write and hands K to the transfer
//!   engine in the plan (`TransferPlan::cut_after`); the tcp writer sends K bytes and shuts the
//!   connection down both ways;
//! - kill_node: the node's registered node handle (`pdflow serve|proxy|bootstrap`: the process
//!   exits at once; `pdflow chaos`: the runner stops the node hard and starts it again).
//!
//! Owns no seed step; acts on all of them.

mod layer;
pub mod plan;
mod registry;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub use layer::FaultLayer;
pub use plan::{
    ActorKind, Fault, FaultAction, FaultPlan, FaultPlanError, NodeKind, Role, When, DATA_STEPS, ENV_FAULT_PLAN,
    MESSAGE_STEPS,
};
pub use registry::{register, Registration, Target};

/// Registrations are recorded (a plan was loaded or a chaos run started).
static ENABLED: AtomicBool = AtomicBool::new(false);
/// A plan is armed: the layer and the message hooks consult it.
static ARMED: AtomicBool = AtomicBool::new(false);
static ACTIVE: Mutex<Option<Arc<FaultInjector>>> = Mutex::new(None);

/// Starts recording registrations (nodes started from now on can be targeted).
pub fn enable() {
    ENABLED.store(true, Ordering::Release);
}

/// Whether registrations are recorded.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Acquire)
}

/// Arms `plan` (replacing any armed one) and returns its injector, to read what fired.
pub fn arm(plan: FaultPlan) -> Arc<FaultInjector> {
    enable();
    let injector = Arc::new(FaultInjector::new(plan));
    *ACTIVE.lock().unwrap_or_else(|p| p.into_inner()) = Some(injector.clone());
    ARMED.store(true, Ordering::Release);
    injector
}

/// Disarms the plan; returns it if one was armed.
pub fn disarm() -> Option<Arc<FaultInjector>> {
    ARMED.store(false, Ordering::Release);
    ACTIVE.lock().unwrap_or_else(|p| p.into_inner()).take()
}

fn active() -> Option<Arc<FaultInjector>> {
    if !ARMED.load(Ordering::Acquire) {
        return None;
    }
    ACTIVE.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// What a sending actor does with the message of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageFault {
    Drop,
    Corrupt,
}

/// Asked by the actor that sends the side-channel message of `step` (21 or 30) for the request
/// `request_id`, just before it sends: `None` (no plan armed, or no fault for it) means send.
pub fn message_fault(step: u8, request_id: &str) -> Option<MessageFault> {
    let injector = active()?;
    let fault = injector.take(step, None, request_id, |a| matches!(a, FaultAction::Drop | FaultAction::Corrupt));
    fault.into_iter().find_map(|(index, action)| {
        let f = match action {
            FaultAction::Drop => MessageFault::Drop,
            FaultAction::Corrupt => MessageFault::Corrupt,
            _ => return None,
        };
        injector.record(index, step, When::Begin, request_id, 0);
        tracing::warn!(step, request_id, fault = ?f, "fault injected");
        Some(f)
    })
}

/// Asked by P's SendWorker just before it starts the step-29 write for the request `request_id`:
/// `Some(k)` means the data connection must be cut after `k` payload bytes of the plan (the
/// smallest `k` when several faults apply); `None` (no plan armed, or no fault for it) means write
/// normally.
pub fn data_cut(request_id: &str) -> Option<u64> {
    let injector = active()?;
    let step = plan::DATA_STEPS[0];
    let claimed = injector.take(step, None, request_id, |a| matches!(a, FaultAction::CutData { .. }));
    let mut cut: Option<u64> = None;
    for (index, action) in claimed {
        if let FaultAction::CutData { after_bytes } = action {
            injector.record(index, step, When::Begin, request_id, 0);
            cut = Some(cut.map_or(after_bytes, |c| c.min(after_bytes)));
        }
    }
    if let Some(after_bytes) = cut {
        tracing::warn!(step, request_id, after_bytes, "fault injected: the data connection will be cut");
    }
    cut
}

/// Damages a frame so that its receiver must refuse it (the magic's first byte is flipped).
pub fn corrupt_frame(bytes: &mut [u8]) {
    if let Some(b) = bytes.first_mut() {
        *b ^= 0xff;
    }
}

/// One fault that fired.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Fired {
    /// Index of the fault in the plan.
    pub index: usize,
    pub step: u8,
    pub when: When,
    pub request_id: String,
    /// Actors (or nodes) killed by it (0 for other faults).
    pub killed: usize,
    #[serde(skip)]
    pub at: Option<Instant>,
}

/// An armed plan: how many times each fault may still fire, and what fired.
#[derive(Debug)]
pub struct FaultInjector {
    plan: FaultPlan,
    remaining: Vec<AtomicU32>,
    fired: Mutex<Vec<Fired>>,
}

impl FaultInjector {
    fn new(plan: FaultPlan) -> Self {
        let remaining = plan.faults.iter().map(|f| AtomicU32::new(f.times)).collect();
        Self { plan, remaining, fired: Mutex::new(Vec::new()) }
    }

    pub fn plan(&self) -> &FaultPlan {
        &self.plan
    }

    /// Every fault that fired so far, in order.
    pub fn fired(&self) -> Vec<Fired> {
        self.fired.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Claims the faults of `step` (at `when`, `None` = any) for `request_id` whose action
    /// `wanted` accepts; each claim uses one of the fault's `times`.
    fn take(
        &self,
        step: u8,
        when: Option<When>,
        request_id: &str,
        wanted: impl Fn(&FaultAction) -> bool,
    ) -> Vec<(usize, FaultAction)> {
        let mut claimed = Vec::new();
        for (index, f) in self.plan.faults.iter().enumerate() {
            if f.step != step || when.is_some_and(|w| w != f.when) || !wanted(&f.action) {
                continue;
            }
            if f.request_id.as_deref().is_some_and(|want| !request_id.contains(want)) {
                continue;
            }
            let left = &self.remaining[index];
            if left.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).is_ok() {
                claimed.push((index, f.action.clone()));
            }
        }
        claimed
    }

    fn record(&self, index: usize, step: u8, when: When, request_id: &str, killed: usize) {
        let fired = Fired { index, step, when, request_id: request_id.to_string(), killed, at: Some(Instant::now()) };
        self.fired.lock().unwrap_or_else(|p| p.into_inner()).push(fired);
    }

    /// The layer's entry point: fire the kill / delay / kill_node faults of this step edge.
    fn on_step(&self, step: u8, when: When, request_id: &str, transfer_id: &str) {
        // Message faults and data cuts are claimed by the actor that sends (message_fault, data_cut).
        let claimed = self.take(step, Some(when), request_id, |a| {
            !matches!(a, FaultAction::Drop | FaultAction::Corrupt | FaultAction::CutData { .. })
        });
        for (index, action) in claimed {
            let killed = match &action {
                FaultAction::Kill { actor, role } => {
                    let role = role.or(actor.natural_role());
                    registry::kill(Target::Actor(*actor), role, transfer_id)
                }
                FaultAction::KillNode { node } => registry::kill(Target::Node(*node), None, ""),
                FaultAction::Delay { ms } => {
                    self.record(index, step, when, request_id, 0);
                    std::thread::sleep(std::time::Duration::from_millis(*ms));
                    continue;
                }
                FaultAction::Drop | FaultAction::Corrupt | FaultAction::CutData { .. } => 0,
            };
            // Recorded, not logged: a `tracing` event emitted from inside a layer callback would
            // corrupt the per-layer filter state of the span being created or closed.
            self.record(index, step, when, request_id, killed);
        }
    }
}

#[cfg(test)]
mod tests;
