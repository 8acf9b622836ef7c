//! The work a routed request charged its P and D, given back to the Proxy actor's load counts:
//! P's prefill when P's call ends ([`PrefillDone`]: the guard lives in P's task), the rest when
//! the request ends ([`RouteDone`]: when its flow ends before D answered, or when D's relayed
//! answer has been written out or abandoned; the guard lives in the relay).

use kameo::prelude::*;
use pdflow_messages::proxy::{PrefillDone, RouteDone};

use crate::proxy::Proxy;

/// Tells the Proxy actor its message when dropped, however the task holding it ends.
pub(super) struct TellOnDrop<M>
where
    Proxy: Message<M>,
    M: Copy + Send + 'static,
{
    proxy: ActorRef<Proxy>,
    msg: M,
}

/// [`RouteDone`] when the request ends.
pub(super) type RouteDoneGuard = TellOnDrop<RouteDone>;
/// [`PrefillDone`] when P's call ends.
pub(super) type PrefillDoneGuard = TellOnDrop<PrefillDone>;

impl<M> TellOnDrop<M>
where
    Proxy: Message<M>,
    M: Copy + Send + 'static,
{
    pub(super) fn new(proxy: ActorRef<Proxy>, msg: M) -> Self {
        Self { proxy, msg }
    }
}

impl<M> Drop for TellOnDrop<M>
where
    Proxy: Message<M>,
    M: Copy + Send + 'static,
{
    fn drop(&mut self) {
        let (proxy, msg) = (self.proxy.clone(), self.msg);
        // A restarted actor counts from zero: a late message for it is harmless (counts saturate).
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = proxy.tell(msg).await;
            });
        }
    }
}
