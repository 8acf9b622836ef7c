//! The work a routed request charged its P and D ([`RouteDone`]), given back to the Proxy actor's
//! load counts when the request ends: when its flow ends before D answered, or when D's relayed
//! answer has been written out or abandoned (the guard lives in the relay).

use kameo::prelude::*;
use pdflow_messages::proxy::RouteDone;

use crate::proxy::Proxy;

/// Tells the Proxy actor [`RouteDone`] when dropped.
pub(super) struct RouteDoneGuard {
    proxy: ActorRef<Proxy>,
    done: RouteDone,
}

impl RouteDoneGuard {
    pub(super) fn new(proxy: ActorRef<Proxy>, done: RouteDone) -> Self {
        Self { proxy, done }
    }
}

impl Drop for RouteDoneGuard {
    fn drop(&mut self) {
        let (proxy, done) = (self.proxy.clone(), self.done);
        // A restarted actor counts from zero: a late `done` for it is harmless (counts saturate).
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = proxy.tell(done).await;
            });
        }
    }
}
