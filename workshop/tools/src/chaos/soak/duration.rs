//! `--duration` values of `pdflow chaos soak`: a whole number with a unit — `90s`, `30m`, `1h` —
//! or a plain number of seconds.

use std::time::Duration;

/// Why a `--duration` value is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("an empty duration: expected e.g. 90s, 30m or 1h")]
    Empty,
    #[error("{0:?}: expected a whole number followed by s, m or h (90s, 30m, 1h)")]
    Malformed(String),
    #[error("{0:?}: a soak needs a duration above zero")]
    Zero(String),
}

/// Parses `90s`, `30m`, `1h` or `90` (seconds).
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(DurationError::Empty);
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits.parse().map_err(|_| DurationError::Malformed(text.to_string()))?;
    let per = match unit.trim() {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return Err(DurationError::Malformed(text.to_string())),
    };
    if n == 0 {
        return Err(DurationError::Zero(text.to_string()));
    }
    n.checked_mul(per).map(Duration::from_secs).ok_or_else(|| DurationError::Malformed(text.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_minutes_hours_and_bad_values() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
        assert_eq!(parse_duration(""), Err(DurationError::Empty));
        assert!(matches!(parse_duration("1d"), Err(DurationError::Malformed(_))));
        assert!(matches!(parse_duration("m"), Err(DurationError::Malformed(_))));
        assert!(matches!(parse_duration("-5s"), Err(DurationError::Malformed(_))));
        assert!(matches!(parse_duration("0h"), Err(DurationError::Zero(_))));
    }
}
