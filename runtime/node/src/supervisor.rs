//! The root supervisor of one node. Children are supervised one-for-one, transient, with a
//! restart limit: an actor that dies abnormally (killed, panicked, failed) is restarted with the
//! same arguments and the same mailbox, so the refs the node handed out stay valid; one that stops
//! normally (the node shutting down) stays stopped; past the limit the node stops.

use std::time::Duration;

use kameo::error::Infallible;
use kameo::prelude::*;
use kameo::supervision::SupervisionStrategy;

/// Restarts allowed per child within [`RESTART_WINDOW`] before the node gives up.
pub const MAX_RESTARTS: u32 = 5;
/// The window of [`MAX_RESTARTS`].
pub const RESTART_WINDOW: Duration = Duration::from_secs(10);

/// One node's root supervisor.
#[derive(Debug)]
pub struct NodeSupervisor {
    pub name: String,
}

impl Actor for NodeSupervisor {
    type Args = String;
    type Error = Infallible;

    fn supervision_strategy() -> SupervisionStrategy {
        SupervisionStrategy::OneForOne
    }

    async fn on_start(name: Self::Args, _actor_ref: ActorRef<Self>) -> Result<Self, Self::Error> {
        Ok(Self { name })
    }
}
