//! The one seam through which a fault-injection tool reaches a node's actors. A node is given a
//! [`Faults`] handle ([`no_faults`] in production, where every hook is a no-op) and hands it to the
//! actors it starts; they consult it at the three moments a fault can change, and nowhere else:
//!
//! - when an actor starts, it is offered as a target ([`FaultSeam::register`]): a tool may kill it;
//! - before a side-channel frame of step 21 (D's pull) or 30 (P's answer) leaves
//!   ([`FaultSeam::outgoing`]): a tool may drop it or send other bytes;
//! - when step 29 takes its transfer engine ([`FaultSeam::data_engine`]): a tool may give one whose
//!   link fails mid-write.
//!
//! The plan language, the registry and the tracing layer that fires kills and delays at step
//! edges live with the tools (`pdflow-fault`), not here. Owns no seed step.

use std::sync::Arc;

use kameo::prelude::*;
use pdflow_kv::memory::RegionTable;
use pdflow_messages::TransferId;
use pdflow_transfer::TransferEngine;
use serde::{Deserialize, Serialize};

/// An actor kind (DESIGN §2); per-request kinds (SendWorker, PullTask) are matched by transfer_id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActorKind {
    /// The proxy actor (every request's flow asks it for a route).
    Proxy,
    Bootstrap,
    SchedulerConnector,
    SenderListener,
    SendWorker,
    Receiver,
    PullTask,
}

impl ActorKind {
    pub const ALL: [ActorKind; 7] = [
        ActorKind::Proxy,
        ActorKind::Bootstrap,
        ActorKind::SchedulerConnector,
        ActorKind::SenderListener,
        ActorKind::SendWorker,
        ActorKind::Receiver,
        ActorKind::PullTask,
    ];

    /// The snake_case name used in plans and reports.
    pub fn name(self) -> &'static str {
        match self {
            ActorKind::Proxy => "proxy",
            ActorKind::Bootstrap => "bootstrap",
            ActorKind::SchedulerConnector => "scheduler_connector",
            ActorKind::SenderListener => "sender_listener",
            ActorKind::SendWorker => "send_worker",
            ActorKind::Receiver => "receiver",
            ActorKind::PullTask => "pull_task",
        }
    }

    /// The side this kind lives on when it lives on one only (`None`: both, say which).
    pub fn natural_role(self) -> Option<Role> {
        match self {
            ActorKind::Proxy => Some(Role::Proxy),
            ActorKind::Bootstrap | ActorKind::SenderListener | ActorKind::SendWorker => Some(Role::P),
            ActorKind::Receiver | ActorKind::PullTask => Some(Role::D),
            ActorKind::SchedulerConnector => None,
        }
    }
}

/// Which participant an actor belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    P,
    D,
    Proxy,
}

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
