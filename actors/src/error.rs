//! The actors crate's error type: what went wrong, and what a user can do about it.

/// Errors of pdflow's actors.
#[derive(Debug, thiserror::Error)]
pub enum ActorError {
    #[error("cannot bind {what} on {addr}: {source} (is the port free?)")]
    Bind { what: &'static str, addr: String, source: std::io::Error },
    #[error("side-channel socket error on {addr}: {reason}")]
    SideChannel { addr: String, reason: String },
    #[error("bootstrap at {url} could not be reached after {attempts} attempts: {reason} (start `pdflow bootstrap` or check --bootstrap)")]
    BootstrapUnreachable { url: String, attempts: u32, reason: String },
    #[error("{0}")]
    Other(String),
}
