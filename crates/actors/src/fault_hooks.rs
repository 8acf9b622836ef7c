//! Registers actors as fault-injection targets (`pdflow_fault`): a weak
//! kameo ref whose `kill()` the fault layer calls. A no-op unless fault injection is enabled.
//! Owns no seed step.

use std::sync::Arc;

use kameo::prelude::*;
use pdflow_fault::{ActorKind, Registration, Role, Target};

/// Registers `actor` as a target of kind `kind` on `role`, serving `transfer_ids` (empty: all).
pub fn register_actor<A: Actor>(kind: ActorKind, role: Role, transfer_ids: Vec<String>, actor: &ActorRef<A>) {
    if !pdflow_fault::enabled() {
        return;
    }
    let (alive, kill) = (actor.downgrade(), actor.downgrade());
    pdflow_fault::register(Registration {
        target: Target::Actor(kind),
        role: Some(role),
        transfer_ids,
        alive: Box::new(move || alive.upgrade().is_some_and(|a| a.is_alive())),
        kill: Arc::new(move || {
            // No tracing here: this runs inside a layer callback, where an event would corrupt
            // the per-layer filter state of the span being created.
            if let Some(a) = kill.upgrade() {
                a.kill();
            }
        }),
    });
}
