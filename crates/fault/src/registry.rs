//! The registry of fault targets: each node registers its actors (by kind, role and, for
//! per-request actors, the transfer ids they serve) and itself, with a kill handle. Entries hold
//! only weak handles (the caller's closures), and dead ones are pruned on every registration.

use std::sync::{Arc, Mutex};

use super::plan::{ActorKind, NodeKind, Role};

/// What a registration stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    Actor(ActorKind),
    Node(NodeKind),
}

/// One registered target.
pub struct Registration {
    pub target: Target,
    pub role: Option<Role>,
    /// Transfer ids a per-request actor serves (empty: serves all).
    pub transfer_ids: Vec<String>,
    /// Whether the target still exists.
    pub alive: Box<dyn Fn() -> bool + Send + Sync>,
    /// Kills it (kameo `kill()`, or the node's hard stop).
    pub kill: Arc<dyn Fn() + Send + Sync>,
}

static REGISTRY: Mutex<Vec<Registration>> = Mutex::new(Vec::new());

/// Registers a target; a no-op unless fault injection is enabled ([`super::enable`]).
pub fn register(registration: Registration) {
    if !super::enabled() {
        return;
    }
    let mut all = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    all.retain(|r| (r.alive)());
    all.push(registration);
}

/// Kills every live target of `target` (and `role`, if given) that serves `transfer_id`: a
/// long-lived actor (registered with no transfer ids) always does; a per-request one (SendWorker,
/// PullTask) only when it serves that transfer — a fault aimed at one request never kills the
/// workers of the others (all of them only when `transfer_id` is empty). Returns how many were
/// killed.
pub(super) fn kill(target: Target, role: Option<Role>, transfer_id: &str) -> usize {
    let mut all = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    all.retain(|r| (r.alive)());
    let serves = |r: &Registration| {
        transfer_id.is_empty() || r.transfer_ids.is_empty() || r.transfer_ids.iter().any(|t| t == transfer_id)
    };
    let victims: Vec<&Registration> =
        all.iter().filter(|r| r.target == target && (role.is_none() || r.role == role) && serves(r)).collect();
    let kills: Vec<Arc<dyn Fn() + Send + Sync>> = victims.iter().map(|r| r.kill.clone()).collect();
    drop(all);
    // Outside the lock: a kill may close spans, which come back through the layer.
    for kill in &kills {
        kill();
    }
    kills.len()
}

#[cfg(test)]
pub(super) fn clear() {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner()).clear();
}
