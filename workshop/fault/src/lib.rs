//! Fault injection for pdflow's chaos tools. A [`FaultPlan`] says which faults to inject at which
//! step; a [`FaultDomain`] holds one armed plan and the targets of the nodes it was given to. It
//! reaches those nodes only through their fault seam (`pdflow_actors::fault_seam`, which the
//! domain implements) and through its [`FaultLayer`], which watches step spans begin (created)
//! and end (closed). Production nodes get no domain: their seam does nothing, and no code of this
//! crate is in them.
//!
//! - kill: the registered actor's kameo `kill()` (its supervisor restarts the long-lived ones);
//! - delay: the thread that runs the step stalls (`std::thread::sleep`, a pause or slow peer);
//! - drop / corrupt: the side-channel message of steps 21 and 30 is not sent / sent with its frame
//!   header damaged — the seam's `outgoing` hook, just before the actor sends;
//! - cut_data: step 29's write goes through a [`CutLink`] that dies after K bytes — the seam's
//!   `data_engine` hook hands the SendWorker a [`CutEngine`] for that request;
//! - kill_node: the node's registered node handle (`pdflow serve|proxy|bootstrap`: the process
//!   exits at once; `pdflow chaos`: the runner stops the node hard and starts it again).
//!
//! Each domain is its own: two domains in one process share nothing. Owns no seed step; acts on
//! all of them.

mod cut_link;
mod layer;
pub mod plan;
mod registry;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pdflow_actors::fault_seam::{FaultSeam, Faults, Killable, Target};
use pdflow_kv::memory::RegionTable;
use pdflow_messages::TransferId;
use pdflow_transfer::tcp::TcpConfig;
use pdflow_transfer::TransferEngine;

pub use cut_link::{CutEngine, CutLink, LinkFault};
pub use layer::FaultLayer;
pub use pdflow_actors::fault_seam::{ActorKind, NodeKind, Role};
pub use plan::{Fault, FaultAction, FaultPlan, FaultPlanError, When, DATA_STEPS, ENV_FAULT_PLAN, MESSAGE_STEPS};
use registry::Registry;

/// One armed plan (or none) and the targets of the nodes it was given to.
pub struct FaultDomain {
    registry: Registry,
    /// A plan is armed: the layer and the seam's hooks consult it.
    armed: AtomicBool,
    active: Mutex<Option<Arc<FaultInjector>>>,
    /// The data channel's settings of the nodes (a cut write makes its own tcp engine with them).
    tcp: TcpConfig,
}

impl std::fmt::Debug for FaultDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultDomain").field("armed", &self.armed.load(Ordering::Relaxed)).finish_non_exhaustive()
    }
}

impl FaultDomain {
    /// A domain with no plan armed, for nodes whose data channel uses `tcp`.
    pub fn new(tcp: TcpConfig) -> Arc<Self> {
        Arc::new(Self { registry: Registry::default(), armed: AtomicBool::new(false), active: Mutex::new(None), tcp })
    }

    /// The seam to give this domain's nodes.
    pub fn seam(self: &Arc<Self>) -> Faults {
        self.clone()
    }

    /// The tracing layer that fires this domain's kills and delays at step edges.
    pub fn layer(self: &Arc<Self>) -> FaultLayer {
        FaultLayer { domain: self.clone() }
    }

    /// Registers a whole node as a `kill_node` target.
    pub fn register_node(&self, node: NodeKind, killable: Killable) {
        self.registry.register(Target::Node(node), None, Vec::new(), killable);
    }

    /// Arms `plan` (replacing any armed one) and returns its injector, to read what fired.
    pub fn arm(&self, plan: FaultPlan) -> Arc<FaultInjector> {
        let injector = Arc::new(FaultInjector::new(plan));
        *self.lock_active() = Some(injector.clone());
        self.armed.store(true, Ordering::Release);
        injector
    }

    /// Disarms the plan; returns it if one was armed.
    pub fn disarm(&self) -> Option<Arc<FaultInjector>> {
        self.armed.store(false, Ordering::Release);
        self.lock_active().take()
    }

    fn lock_active(&self) -> std::sync::MutexGuard<'_, Option<Arc<FaultInjector>>> {
        self.active.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn active(&self) -> Option<Arc<FaultInjector>> {
        if !self.armed.load(Ordering::Acquire) {
            return None;
        }
        self.lock_active().clone()
    }

    /// The drop / corrupt fault of `step` (21 or 30) for `request_id`, claimed if one applies.
    pub fn message_fault(&self, step: u8, request_id: &str) -> Option<MessageFault> {
        let injector = self.active()?;
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

    /// The cut of step 29's write for `request_id`, claimed if one applies: `Some(k)` means the
    /// link dies after `k` bytes (the smallest `k` when several faults apply).
    pub fn data_cut(&self, request_id: &str) -> Option<u64> {
        match self.data_fault(request_id)? {
            LinkFault::CutAfter(k) => Some(k),
            LinkFault::FlipAt(_) => None,
        }
    }

    /// What happens to step 29's link for `request_id`, claimed if a fault applies: a cut (the
    /// smallest when several apply; a cut wins over a flip) or one byte altered.
    pub fn data_fault(&self, request_id: &str) -> Option<LinkFault> {
        let injector = self.active()?;
        let step = plan::DATA_STEPS[0];
        let claimed = injector
            .take(step, None, request_id, |a| matches!(a, FaultAction::CutData { .. } | FaultAction::FlipData { .. }));
        let mut chosen: Option<LinkFault> = None;
        for (index, action) in claimed {
            let this = match action {
                FaultAction::CutData { after_bytes } => LinkFault::CutAfter(after_bytes),
                FaultAction::FlipData { at_byte } => LinkFault::FlipAt(at_byte),
                _ => continue,
            };
            injector.record(index, step, When::Begin, request_id, 0);
            chosen = Some(match (chosen, this) {
                (Some(LinkFault::CutAfter(a)), LinkFault::CutAfter(b)) => LinkFault::CutAfter(a.min(b)),
                (Some(cut @ LinkFault::CutAfter(_)), LinkFault::FlipAt(_)) => cut,
                (_, this) => this,
            });
        }
        match chosen {
            Some(LinkFault::CutAfter(after_bytes)) => {
                tracing::warn!(step, request_id, after_bytes, "fault injected: the data link will be cut")
            }
            Some(LinkFault::FlipAt(at_byte)) => {
                tracing::warn!(step, request_id, at_byte, "fault injected: the data link will alter one byte")
            }
            None => {}
        }
        chosen
    }
}

impl FaultSeam for FaultDomain {
    fn register(&self, target: Target, role: Option<Role>, transfer_ids: Vec<TransferId>, killable: Killable) {
        self.registry.register(target, role, transfer_ids, killable);
    }

    fn outgoing(&self, step: u8, request_id: &str, mut frame: Vec<u8>) -> Option<Vec<u8>> {
        match self.message_fault(step, request_id) {
            None => Some(frame),
            Some(MessageFault::Drop) => None,
            Some(MessageFault::Corrupt) => {
                corrupt_frame(&mut frame);
                Some(frame)
            }
        }
    }

    fn data_engine(
        &self,
        request_id: &str,
        local: &RegionTable,
        engine: &Arc<dyn TransferEngine>,
    ) -> Arc<dyn TransferEngine> {
        match self.data_fault(request_id) {
            Some(fault) => Arc::new(CutEngine::new(local.clone(), self.tcp.clone(), fault)),
            None => engine.clone(),
        }
    }
}

/// What the seam does with the side-channel message of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageFault {
    Drop,
    Corrupt,
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

    /// The layer's entry point: fire the kill / delay / kill_node faults of this step edge on
    /// `registry`'s targets.
    fn on_step(&self, registry: &Registry, step: u8, when: When, request_id: &str, transfer_id: &str) {
        // Message faults and data cuts are claimed by the actor that sends (message_fault, data_cut).
        let claimed = self.take(step, Some(when), request_id, |a| {
            !matches!(
                a,
                FaultAction::Drop | FaultAction::Corrupt | FaultAction::CutData { .. } | FaultAction::FlipData { .. }
            )
        });
        for (index, action) in claimed {
            let killed = match &action {
                FaultAction::Kill { actor, role } => {
                    let role = role.or(actor.natural_side());
                    registry.kill(Target::Actor(*actor), role, transfer_id)
                }
                FaultAction::KillNode { node } => registry.kill(Target::Node(*node), None, ""),
                FaultAction::Delay { ms } => {
                    self.record(index, step, when, request_id, 0);
                    std::thread::sleep(std::time::Duration::from_millis(*ms));
                    continue;
                }
                FaultAction::Drop
                | FaultAction::Corrupt
                | FaultAction::CutData { .. }
                | FaultAction::FlipData { .. } => 0,
            };
            // Recorded, not logged: a `tracing` event emitted from inside a layer callback would
            // corrupt the per-layer filter state of the span being created or closed.
            self.record(index, step, when, request_id, killed);
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod cut_link_tests;
