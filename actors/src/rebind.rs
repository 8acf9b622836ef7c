//! Binding an HTTP listener that a restarted actor re-binds: the previous incarnation's server
//! closes its socket asynchronously, so a fixed port may stay busy for a moment. Owns no step.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::ActorError;

/// How long a fixed port is retried while it is still in use.
pub(crate) const REBIND_DEADLINE: Duration = Duration::from_secs(2);

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
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(source) => return Err(ActorError::Bind { what, addr: addr.to_string(), source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_port_freed_while_retrying_is_bound_and_a_held_one_fails_in_bounded_time() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = held.local_addr().expect("addr");
        let started = std::time::Instant::now();
        assert!(matches!(bind_http(addr, "test").await, Err(ActorError::Bind { .. })));
        assert!(started.elapsed() < REBIND_DEADLINE + Duration::from_secs(1));
        let freer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(held);
        });
        bind_http(addr, "test").await.expect("bound once the old socket is gone");
        freer.await.expect("joins");
    }
}
