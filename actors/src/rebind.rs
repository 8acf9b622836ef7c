//! Binding an HTTP listener that a restarted actor re-binds: the previous incarnation's server
//! closes its socket asynchronously, so a fixed port may stay busy for a moment. Owns no step.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::ActorError;

/// How long a fixed port is retried while it is still in use.
pub(crate) const REBIND_DEADLINE: Duration = Duration::from_secs(2);

/// The pause between two attempts to bind a port in use.
pub(crate) const REBIND_RETRY_EVERY: Duration = Duration::from_millis(20);

/// Binds `addr`; a fixed port that is in use is retried until [`REBIND_DEADLINE`].
pub(crate) async fn bind_http(addr: SocketAddr, what: &'static str) -> Result<TcpListener, ActorError> {
    let until = tokio::time::Instant::now() + REBIND_DEADLINE;
    loop {
        match TcpListener::bind(addr).await {
            Ok(listener) => return Ok(listener),
            Err(e)
                if addr.port() != 0
                    && e.kind() == std::io::ErrorKind::AddrInUse
                    && tokio::time::Instant::now() < until =>
            {
                tokio::time::sleep(REBIND_RETRY_EVERY).await;
            }
            Err(source) => return Err(ActorError::Bind { what, addr: addr.to_string(), source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the paused clock (binding is a plain syscall, no I/O is awaited), so the deadline is
    /// checked exactly: a held port is given up at [`REBIND_DEADLINE`], not before and not a retry
    /// later; a port freed meanwhile is bound at the first retry after it is freed.
    #[tokio::test(start_paused = true)]
    async fn a_port_freed_while_retrying_is_bound_and_a_held_one_fails_at_the_deadline() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = held.local_addr().expect("addr");
        let started = tokio::time::Instant::now();
        let bound = tokio::time::timeout(REBIND_DEADLINE * 2, bind_http(addr, "test")).await;
        assert!(matches!(bound, Ok(Err(ActorError::Bind { .. }))), "{bound:?}");
        let waited = started.elapsed();
        assert!(
            waited >= REBIND_DEADLINE && waited <= REBIND_DEADLINE + REBIND_RETRY_EVERY,
            "gave up after {waited:?}"
        );

        let freed_after = Duration::from_millis(100);
        let freer = tokio::spawn(async move {
            tokio::time::sleep(freed_after).await;
            drop(held);
        });
        let started = tokio::time::Instant::now();
        tokio::time::timeout(REBIND_DEADLINE, bind_http(addr, "test"))
            .await
            .expect("bound before the deadline")
            .expect("bound once the old socket is gone");
        let waited = started.elapsed();
        assert!(waited >= freed_after && waited <= freed_after + REBIND_RETRY_EVERY, "bound after {waited:?}");
        freer.await.expect("joins");
    }
}
