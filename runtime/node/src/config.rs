//! Typed configuration, read once per process (CLI flags + the environment variables vLLM's
//! Mooncake users already set), every error reported before anything binds.
//!
//! | variable | meaning | vLLM default | pdflow default |
//! |---|---|---|---|
//! | `VLLM_MOONCAKE_BOOTSTRAP_PORT` | port of the bootstrap server P's TP0 launches | 8998 | 8998 |
//! | `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT` | seconds P waits for a request's prefill once D pulled, and keeps sent-ready blocks for a pull that never comes | 480 | 30 |
//!
//! pdflow's default deadline is seconds, not minutes: a request stuck for 480 s helps nobody.
//! Each error that a deadline causes names the deadline and how to change it.

use std::time::Duration;

/// Env var: the bootstrap port (vLLM's name).
pub const ENV_BOOTSTRAP_PORT: &str = "VLLM_MOONCAKE_BOOTSTRAP_PORT";
/// Env var: the abort-request timeout in seconds (vLLM's name).
pub const ENV_ABORT_REQUEST_TIMEOUT: &str = "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT";
/// The bootstrap port when nothing says otherwise (vLLM's default).
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;
/// pdflow's abort-request timeout when nothing says otherwise.
pub const DEFAULT_ABORT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A configuration error: which setting, what was wrong, what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{name}={value:?} is not valid: {reason}")]
    Invalid { name: String, value: String, reason: String },
}

/// Deadlines of the transfer path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// P: how long a pull waits for the request's prefill (`VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`).
    pub ready_timeout: Duration,
    /// P: how long sent-ready blocks wait for a pull before they are freed anyway.
    pub send_expiry: Duration,
    /// D: deadline of one side-channel exchange (vLLM: abort timeout + 60 s).
    pub pull_timeout: Duration,
    /// D: deadline of one bootstrap look-up.
    pub bootstrap_timeout: Duration,
}

impl Deadlines {
    /// Deadlines derived from one abort-request timeout, as vLLM derives them.
    pub fn from_abort_timeout(abort: Duration) -> Self {
        Self {
            ready_timeout: abort,
            send_expiry: abort,
            pull_timeout: abort + Duration::from_secs(5),
            bootstrap_timeout: Duration::from_secs(5),
        }
    }
}

impl Deadlines {
    /// How long an engine may hold blocks on the connector's behalf before it settles them as
    /// the connector would have (P's delayed free reported sent, D's load failed): longer than
    /// every deadline of the transfer path — D's look-up and exchange, P's send expiry or a
    /// pull's exchange — so that when it passes no write can still land.
    pub fn held_backstop(&self) -> Duration {
        self.send_expiry.max(self.pull_timeout) + self.bootstrap_timeout + Duration::from_secs(2)
    }
}

impl Default for Deadlines {
    fn default() -> Self {
        Self::from_abort_timeout(DEFAULT_ABORT_REQUEST_TIMEOUT)
    }
}

/// Reads a variable through `get` (the process environment in production, a map in tests).
fn parse_var<T: std::str::FromStr>(
    get: &dyn Fn(&str) -> Option<String>,
    name: &str,
    what: &str,
) -> Result<Option<T>, ConfigError> {
    match get(name) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Ok(None),
        Some(v) => v.trim().parse::<T>().map(Some).map_err(|_| ConfigError::Invalid {
            name: name.to_string(),
            value: v.clone(),
            reason: format!("expected {what}"),
        }),
    }
}

/// The vLLM environment variables pdflow honours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VllmEnv {
    pub bootstrap_port: u16,
    pub abort_request_timeout: Duration,
}

impl VllmEnv {
    /// From the process environment.
    pub fn from_env() -> Result<Self, Vec<ConfigError>> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// From any lookup; every error is collected, not just the first.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, Vec<ConfigError>> {
        let mut errors = Vec::new();
        let port = parse_var::<u16>(get, ENV_BOOTSTRAP_PORT, "a TCP port (1-65535)").unwrap_or_else(|e| {
            errors.push(e);
            None
        });
        let timeout =
            parse_var::<u64>(get, ENV_ABORT_REQUEST_TIMEOUT, "a whole number of seconds").unwrap_or_else(|e| {
                errors.push(e);
                None
            });
        if port == Some(0) {
            errors.push(ConfigError::Invalid {
                name: ENV_BOOTSTRAP_PORT.into(),
                value: "0".into(),
                reason: "expected a TCP port (1-65535)".into(),
            });
        }
        if timeout == Some(0) {
            errors.push(ConfigError::Invalid {
                name: ENV_ABORT_REQUEST_TIMEOUT.into(),
                value: "0".into(),
                reason: "a zero timeout fails every transfer; use at least 1".into(),
            });
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        Ok(Self {
            bootstrap_port: port.unwrap_or(DEFAULT_BOOTSTRAP_PORT),
            abort_request_timeout: timeout.map(Duration::from_secs).unwrap_or(DEFAULT_ABORT_REQUEST_TIMEOUT),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_variables_keep_their_meaning_and_report_every_error() {
        let env = VllmEnv::from_lookup(&|_| None).expect("defaults");
        assert_eq!(env.bootstrap_port, 8998);
        assert_eq!(env.abort_request_timeout, Duration::from_secs(30));
        let env = VllmEnv::from_lookup(&|k| match k {
            ENV_BOOTSTRAP_PORT => Some("9001".into()),
            ENV_ABORT_REQUEST_TIMEOUT => Some("480".into()),
            _ => None,
        })
        .expect("valid");
        assert_eq!((env.bootstrap_port, env.abort_request_timeout), (9001, Duration::from_secs(480)));
        let errors = VllmEnv::from_lookup(&|k| match k {
            ENV_BOOTSTRAP_PORT => Some("http".into()),
            ENV_ABORT_REQUEST_TIMEOUT => Some("-1".into()),
            _ => None,
        })
        .expect_err("both invalid");
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].to_string().contains(ENV_BOOTSTRAP_PORT));
    }
}
