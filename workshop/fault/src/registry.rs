//! A domain's fault targets: the actors its nodes offered through their seam (by kind, role and,
//! for per-request actors, the transfer ids they serve) and the nodes themselves, each with a kill
//! handle. Entries hold only weak handles, and dead ones are pruned on every registration.

use std::sync::{Arc, Mutex};

use pdflow_actors::fault_seam::{Killable, Role, Target};
use pdflow_messages::TransferId;

/// One registered target.
struct Registration {
    target: Target,
    role: Option<Role>,
    /// Transfer ids a per-request actor serves (empty: serves all).
    transfer_ids: Vec<TransferId>,
    killable: Killable,
}

/// The targets of one fault domain.
#[derive(Default)]
pub(crate) struct Registry {
    all: Mutex<Vec<Registration>>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Registration>> {
        // A list of weak handles: a panicking holder cannot break it.
        self.all.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn register(
        &self,
        target: Target,
        role: Option<Role>,
        transfer_ids: Vec<TransferId>,
        killable: Killable,
    ) {
        let mut all = self.lock();
        all.retain(|r| (r.killable.alive)());
        all.push(Registration { target, role, transfer_ids, killable });
    }

    /// Kills every live target of `target` (and `role`, if given) that serves `transfer_id`: a
    /// long-lived actor (registered with no transfer ids) always does; a per-request one
    /// (SendWorker, PullTask) only when it serves that transfer — a fault aimed at one request
    /// never kills the workers of the others (all of them only when `transfer_id` is empty).
    /// Returns how many were killed.
    pub(crate) fn kill(&self, target: Target, role: Option<Role>, transfer_id: &str) -> usize {
        let mut all = self.lock();
        all.retain(|r| (r.killable.alive)());
        let serves = |r: &Registration| {
            transfer_id.is_empty() || r.transfer_ids.is_empty() || r.transfer_ids.iter().any(|t| t == transfer_id)
        };
        let kills: Vec<Arc<dyn Fn() + Send + Sync>> = all
            .iter()
            .filter(|r| r.target == target && (role.is_none() || r.role == role) && serves(r))
            .map(|r| r.killable.kill.clone())
            .collect();
        drop(all);
        // Outside the lock: a kill may close spans, which come back through the layer.
        for kill in &kills {
            kill();
        }
        kills.len()
    }
}
