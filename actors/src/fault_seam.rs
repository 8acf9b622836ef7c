//! The one seam through which a fault-injection tool reaches a node's actors. It exists only with
//! the `fault-injection` feature, which the chaos tools and the tests enable and production builds
//! (the vLLM wheel, a release `pdflow`) leave off; without it [`Faults`] is an empty value whose
//! hooks compile to nothing, and no plan is ever read.
//!
//! With the feature, a node is given a [`Faults`] handle ([`no_faults`]: every hook a no-op) and
//! hands it to the actors it starts; they consult it at the three moments a fault can change, and
//! nowhere else:
//!
//! - when an actor starts, it is offered as a target ([`register_actor`]): a tool may kill it;
//! - before a side-channel frame of step 21 (D's pull) or 30 (P's answer) leaves
//!   (`outgoing`): a tool may drop it or send other bytes;
//! - when step 29 takes its transfer engine (`data_engine`): a tool may give one whose link fails
//!   mid-write.
//!
//! Targets are named by the step catalogue's owners and sides ([`ActorKind`] is
//! [`Owner`](pdflow_observability::steps::Owner), [`Role`] is
//! [`Side`](pdflow_observability::steps::Side)). The plan language, the registry and the tracing
//! layer that fires kills and delays at step edges live with the tools (`pdflow-fault`), not here.
//! Owns no seed step.

#[cfg(not(feature = "fault-injection"))]
pub use disabled::*;
#[cfg(feature = "fault-injection")]
pub use enabled::*;

/// The actor kinds a plan names: the step catalogue's owners.
pub use pdflow_observability::steps::Owner as ActorKind;
/// Which participant an actor belongs to: the step catalogue's sides.
pub use pdflow_observability::steps::Side as Role;
use serde::{Deserialize, Serialize};

/// A whole node (a process of `pdflow serve|proxy|bootstrap`, or a node of an in-process cluster).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeKind {
    P,
    D,
    Bootstrap,
    Proxy,
}

impl NodeKind {
    pub fn name(self) -> &'static str {
        match self {
            NodeKind::P => "p",
            NodeKind::D => "d",
            NodeKind::Bootstrap => "bootstrap",
            NodeKind::Proxy => "proxy",
        }
    }
}

#[cfg(feature = "fault-injection")]
mod enabled {
    use std::sync::Arc;

    use super::{ActorKind, NodeKind, Role};
    use kameo::prelude::*;
    use pdflow_kv::memory::RegionTable;
    use pdflow_messages::TransferId;
    use pdflow_transfer::TransferEngine;

    /// What a registration stands for.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum Target {
        Actor(ActorKind),
        Node(NodeKind),
    }

    /// Something a fault may kill: whether it still exists, and how to kill it. Holds only weak
    /// handles, so a registration never keeps its target alive.
    pub struct Killable {
        pub alive: Box<dyn Fn() -> bool + Send + Sync>,
        /// Kills it (kameo `kill()`, or a node's hard stop). Runs inside a tracing layer's callback:
        /// it must not emit tracing events.
        pub kill: Arc<dyn Fn() + Send + Sync>,
    }

    impl Killable {
        /// A kameo actor, by a weak ref.
        pub fn actor<A: Actor>(actor: &ActorRef<A>) -> Self {
            let (alive, kill) = (actor.downgrade(), actor.downgrade());
            Self {
                alive: Box::new(move || alive.upgrade().is_some_and(|a| a.is_alive())),
                kill: Arc::new(move || {
                    if let Some(a) = kill.upgrade() {
                        a.kill();
                    }
                }),
            }
        }
    }

    /// The hooks a fault-injection tool implements. Every default does nothing: an implementation
    /// overrides what it injects.
    pub trait FaultSeam: std::fmt::Debug + Send + Sync + 'static {
        /// `target` (on `role`, serving `transfer_ids`: empty means every transfer) has started.
        fn register(&self, target: Target, role: Option<Role>, transfer_ids: Vec<TransferId>, killable: Killable) {
            let _ = (target, role, transfer_ids, killable);
        }

        /// The encoded side-channel `frame` of `step` (21 or 30) for `request_id` is about to be sent:
        /// the bytes to send instead, `None` for nothing.
        fn outgoing(&self, step: u8, request_id: &str, frame: Vec<u8>) -> Option<Vec<u8>> {
            let _ = (step, request_id);
            Some(frame)
        }

        /// The engine step 29 writes `request_id`'s KV from `local` with: `engine` itself, or one
        /// whose link to D fails part-way.
        fn data_engine(
            &self,
            request_id: &str,
            local: &RegionTable,
            engine: &Arc<dyn TransferEngine>,
        ) -> Arc<dyn TransferEngine> {
            let _ = (request_id, local);
            engine.clone()
        }
    }

    /// A node's seam, shared by every actor it starts.
    pub type Faults = Arc<dyn FaultSeam>;

    /// The production seam: no hook does anything.
    #[derive(Debug, Clone, Copy, Default)]
    pub struct NoFaults;

    impl FaultSeam for NoFaults {}

    /// A seam that injects nothing.
    pub fn no_faults() -> Faults {
        Arc::new(NoFaults)
    }

    /// Offers `actor` to `faults` as a target of kind `kind` on `role`, serving `transfer_ids`.
    pub fn register_actor<A: Actor>(
        faults: &Faults,
        kind: ActorKind,
        role: Role,
        transfer_ids: Vec<TransferId>,
        actor: &ActorRef<A>,
    ) {
        faults.register(Target::Actor(kind), Some(role), transfer_ids, Killable::actor(actor));
    }
}

/// Production builds: no seam. Every hook is an inline no-op on an empty value, so the actors'
/// code is the same with and without the feature and nothing reaches them.
#[cfg(not(feature = "fault-injection"))]
mod disabled {
    use std::sync::Arc;

    use kameo::prelude::*;
    use pdflow_kv::memory::RegionTable;
    use pdflow_messages::TransferId;
    use pdflow_transfer::TransferEngine;

    use super::{ActorKind, Role};

    /// No seam: an empty value. Not `Copy`, as the feature's `Faults` (an `Arc`) is not: the
    /// actors clone it the same way in both builds.
    #[derive(Debug, Clone, Default)]
    pub struct Faults;

    impl Faults {
        /// The frame as it is: nothing is dropped or altered.
        #[inline(always)]
        pub fn outgoing(&self, _step: u8, _request_id: &str, frame: Vec<u8>) -> Option<Vec<u8>> {
            Some(frame)
        }

        /// The engine itself: no link fails.
        #[inline(always)]
        pub fn data_engine(
            &self,
            _request_id: &str,
            _local: &RegionTable,
            engine: &Arc<dyn TransferEngine>,
        ) -> Arc<dyn TransferEngine> {
            engine.clone()
        }
    }

    /// The only seam there is without the feature.
    #[inline(always)]
    pub fn no_faults() -> Faults {
        Faults
    }

    /// Nothing to offer the actor to.
    #[inline(always)]
    pub fn register_actor<A: Actor>(
        _faults: &Faults,
        _kind: ActorKind,
        _role: Role,
        _transfer_ids: Vec<TransferId>,
        _actor: &ActorRef<A>,
    ) {
    }
}
