//! What a peer may make a pdflow socket hold, as the operator sets it: [`LimitSettings`], one
//! override per limit over the defaults of the code that binds each socket (the HTTP servers' and
//! P's side channel's). Set with `--limit KEY=VALUE` on `pdflow serve`, `proxy` and `bootstrap`,
//! and with `"limits": {"KEY": VALUE}` in the bridge's `kv_connector_extra_config`; the keys are
//! [`KEYS`]. A value the key cannot take is refused with the key, the value and what it takes.
//!
//! The settings are the process's, like its open-file limit: [`install`] once at start-up, before
//! any socket binds; every socket's defaults read them ([`process`]). Owns no seed step.

use std::sync::OnceLock;
use std::time::Duration;

static PROCESS: OnceLock<LimitSettings> = OnceLock::new();

/// Makes `settings` the process's limits (every socket bound after this takes them); true when
/// they are in force. A second call with other settings changes nothing and returns false (the
/// settings in force: [`process`]).
pub fn install(settings: LimitSettings) -> bool {
    *PROCESS.get_or_init(|| settings) == settings
}

/// The process's limits ([`install`]ed; none set: every default).
pub fn process() -> LimitSettings {
    PROCESS.get().copied().unwrap_or_default()
}

/// Every key, with the unit it takes.
pub const KEYS: &[(&str, Unit)] = &[
    ("http.header_timeout", Unit::Seconds),
    ("http.body_timeout", Unit::Seconds),
    ("http.idle_timeout", Unit::Seconds),
    ("http.max_connections", Unit::Count),
    ("http.max_connections_per_peer", Unit::Count),
    ("side_channel.max_message_bytes", Unit::Bytes),
    ("side_channel.max_message_frames", Unit::Count),
    ("side_channel.max_unfinished_bytes", Unit::Bytes),
    ("side_channel.unbudgeted_bytes_per_connection", Unit::Bytes),
    ("side_channel.max_connections", Unit::Count),
    ("side_channel.max_connections_per_peer", Unit::Count),
    ("side_channel.handshake_timeout", Unit::Seconds),
    ("side_channel.idle_timeout", Unit::Seconds),
];

/// What a key's value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// A positive number of seconds (`10`, `2.5`).
    Seconds,
    /// A whole number of at least 1.
    Count,
    /// A whole number of bytes, at least 1, optionally with a binary suffix (`64KiB`, `16MiB`,
    /// `1GiB`).
    Bytes,
}

impl Unit {
    fn describe(self) -> &'static str {
        match self {
            Unit::Seconds => "a positive number of seconds",
            Unit::Count => "a whole number of at least 1",
            Unit::Bytes => "a number of bytes of at least 1, optionally with KiB, MiB or GiB",
        }
    }
}

/// Why a limit setting is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    #[error("`{0}` is not KEY=VALUE (e.g. http.header_timeout=10)")]
    NotKeyValue(String),
    #[error("unknown limit `{key}`; known limits: {}", known_keys())]
    UnknownKey { key: String },
    #[error("limit `{key}` = `{value}`: expected {}", unit.describe())]
    BadValue { key: String, value: String, unit: Unit },
}

fn known_keys() -> String {
    KEYS.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
}

/// The limits the operator set; `None`: the socket's default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimitSettings {
    pub http_header_timeout: Option<Duration>,
    pub http_body_timeout: Option<Duration>,
    pub http_idle_timeout: Option<Duration>,
    pub http_max_connections: Option<usize>,
    pub http_max_connections_per_peer: Option<usize>,
    pub side_channel_max_message_bytes: Option<usize>,
    pub side_channel_max_message_frames: Option<usize>,
    pub side_channel_max_unfinished_bytes: Option<usize>,
    pub side_channel_unbudgeted_bytes_per_connection: Option<usize>,
    pub side_channel_max_connections: Option<usize>,
    pub side_channel_max_connections_per_peer: Option<usize>,
    pub side_channel_handshake_timeout: Option<Duration>,
    pub side_channel_idle_timeout: Option<Duration>,
}

impl LimitSettings {
    /// Whether no limit is set.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Settings from `KEY=VALUE` items (`--limit`, repeatable); every refused item in the error
    /// list, so that a user fixes them all at once.
    pub fn parse<'a>(items: impl IntoIterator<Item = &'a str>) -> Result<Self, Vec<LimitError>> {
        let mut settings = Self::default();
        let mut errors = Vec::new();
        for item in items {
            let result = match item.split_once('=') {
                Some((key, value)) => settings.set(key.trim(), value.trim()),
                None => Err(LimitError::NotKeyValue(item.to_owned())),
            };
            errors.extend(result.err());
        }
        if errors.is_empty() {
            Ok(settings)
        } else {
            Err(errors)
        }
    }

    /// Sets `key` to `value` (a number, or bytes with a suffix; see [`Unit`]).
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), LimitError> {
        let Some(&(_, unit)) = KEYS.iter().find(|(k, _)| *k == key) else {
            return Err(LimitError::UnknownKey { key: key.to_owned() });
        };
        let bad = || LimitError::BadValue { key: key.to_owned(), value: value.to_owned(), unit };
        let seconds = || parse_seconds(value).ok_or_else(bad);
        let count = || parse_count(value).ok_or_else(bad);
        let bytes = || parse_bytes(value).ok_or_else(bad);
        match key {
            "http.header_timeout" => self.http_header_timeout = Some(seconds()?),
            "http.body_timeout" => self.http_body_timeout = Some(seconds()?),
            "http.idle_timeout" => self.http_idle_timeout = Some(seconds()?),
            "http.max_connections" => self.http_max_connections = Some(count()?),
            "http.max_connections_per_peer" => self.http_max_connections_per_peer = Some(count()?),
            "side_channel.max_message_bytes" => self.side_channel_max_message_bytes = Some(bytes()?),
            "side_channel.max_message_frames" => self.side_channel_max_message_frames = Some(count()?),
            "side_channel.max_unfinished_bytes" => self.side_channel_max_unfinished_bytes = Some(bytes()?),
            "side_channel.unbudgeted_bytes_per_connection" => {
                self.side_channel_unbudgeted_bytes_per_connection = Some(bytes()?)
            }
            "side_channel.max_connections" => self.side_channel_max_connections = Some(count()?),
            "side_channel.max_connections_per_peer" => self.side_channel_max_connections_per_peer = Some(count()?),
            "side_channel.handshake_timeout" => self.side_channel_handshake_timeout = Some(seconds()?),
            "side_channel.idle_timeout" => self.side_channel_idle_timeout = Some(seconds()?),
            _ => return Err(LimitError::UnknownKey { key: key.to_owned() }),
        }
        Ok(())
    }
}

fn parse_seconds(value: &str) -> Option<Duration> {
    let secs: f64 = value.parse().ok()?;
    (secs.is_finite() && secs > 0.0).then(|| Duration::try_from_secs_f64(secs).ok()).flatten()
}

fn parse_count(value: &str) -> Option<usize> {
    value.parse::<usize>().ok().filter(|&n| n >= 1)
}

fn parse_bytes(value: &str) -> Option<usize> {
    let (number, scale) = [("GiB", 1usize << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)]
        .iter()
        .find_map(|(suffix, scale)| value.strip_suffix(suffix).map(|n| (n.trim(), *scale)))
        .unwrap_or((value, 1));
    number.parse::<usize>().ok()?.checked_mul(scale).filter(|&n| n >= 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_takes_its_unit_and_refuses_what_it_cannot_take() {
        let s = LimitSettings::parse([
            "http.header_timeout=2.5",
            "http.max_connections=100",
            "side_channel.max_unfinished_bytes=32MiB",
            "side_channel.unbudgeted_bytes_per_connection = 4096",
        ])
        .expect("valid settings");
        assert_eq!(s.http_header_timeout, Some(Duration::from_millis(2500)));
        assert_eq!(s.http_max_connections, Some(100));
        assert_eq!(s.side_channel_max_unfinished_bytes, Some(32 << 20));
        assert_eq!(s.side_channel_unbudgeted_bytes_per_connection, Some(4096));
        assert_eq!(s.http_idle_timeout, None);
        for (key, _) in KEYS {
            assert!(LimitSettings::default().set(key, "7").is_ok(), "{key} takes 7");
            assert!(LimitSettings::default().set(key, "0").is_err(), "{key} refuses 0");
            assert!(LimitSettings::default().set(key, "-1").is_err(), "{key} refuses -1");
        }
        let errors =
            LimitSettings::parse(["http.header_timeout=inf", "nope=1", "side_channel.max_connections", "x=1KiB"])
                .expect_err("refused");
        assert_eq!(errors.len(), 4, "{errors:?}");
        let text = errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n");
        assert!(text.contains("http.header_timeout") && text.contains("positive number of seconds"), "{text}");
        assert!(text.contains("unknown limit `nope`") && text.contains("side_channel.idle_timeout"), "{text}");
        assert!(text.contains("is not KEY=VALUE"), "{text}");
    }
}
