//! W3C trace context (`traceparent`): the ids that join P's and D's step spans to the proxy's
//! request trace (seed steps 8–43), and fresh random ids for spans and start-up traces.
//!
//! `00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>`; the all-zero ids are invalid.

use std::fmt;

/// A 16-byte trace id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TraceId(pub [u8; 16]);

/// An 8-byte span id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpanId(pub [u8; 8]);

impl TraceId {
    /// A random, valid trace id.
    pub fn random() -> Self {
        Self(*uuid::Uuid::new_v4().as_bytes())
    }
    /// Lower-case hex, 32 characters.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

impl SpanId {
    /// A random, valid (non-zero) span id.
    pub fn random() -> Self {
        let bytes = uuid::Uuid::new_v4().into_bytes();
        let mut id = [0u8; 8];
        id.copy_from_slice(&bytes[..8]);
        if id == [0; 8] {
            id[7] = 1;
        }
        Self(id)
    }
    /// Parses 16 lowercase or uppercase hex digits; `None` for anything else or all zeros.
    pub fn parse_hex(s: &str) -> Option<Self> {
        if s.len() != 16 {
            return None;
        }
        let mut out = [0u8; 8];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        (out != [0; 8]).then_some(Self(out))
    }

    /// Lower-case hex, 16 characters.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Display for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// A parsed `traceparent`: the trace and the span that is the parent of whoever receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub flags: u8,
}

impl TraceParent {
    /// Parses version 00 (and, per the spec, any later version's first four fields).
    /// Returns `None` for anything malformed or for all-zero ids.
    pub fn parse(s: &str) -> Option<Self> {
        let mut parts = s.trim().split('-');
        let version = parts.next()?;
        let trace = parts.next()?;
        let span = parts.next()?;
        let flags = parts.next()?;
        if version.len() != 2 || version.eq_ignore_ascii_case("ff") || (version == "00" && parts.next().is_some()) {
            return None;
        }
        let trace_id: [u8; 16] = unhex(trace)?;
        let span_id: [u8; 8] = unhex(span)?;
        let [flags]: [u8; 1] = unhex(flags)?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(Self { trace_id: TraceId(trace_id), span_id: SpanId(span_id), flags })
    }

    /// A new sampled context in a new trace.
    pub fn random() -> Self {
        Self { trace_id: TraceId::random(), span_id: SpanId::random(), flags: 1 }
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "00-{}-{}-{:02x}", self.trace_id, self.span_id, self.flags)
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    s
}

/// Parses exactly `2 * N` hex digits.
pub(crate) fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let s = s.as_bytes();
    if s.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| char::from(c).to_digit(16).and_then(|d| u8::try_from(d).ok());
    let mut out = [0u8; N];
    for (i, pair) in s.chunks_exact(2).enumerate() {
        out[i] = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn span_ids_parse_from_hex() {
        let id = SpanId::random();
        assert_eq!(SpanId::parse_hex(&id.to_hex()), Some(id));
        assert_eq!(SpanId::parse_hex("0000000000000000"), None);
        assert_eq!(SpanId::parse_hex("b7ad6b716920333"), None);
        assert_eq!(SpanId::parse_hex("b7ad6b71692033zz"), None);
    }

    #[test]
    fn parses_and_prints_the_w3c_example() {
        let s = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let tp = TraceParent::parse(s).expect("valid");
        assert_eq!(tp.trace_id.to_hex(), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(tp.span_id.to_hex(), "b7ad6b7169203331");
        assert_eq!(tp.flags, 1);
        assert_eq!(tp.to_string(), s);
    }

    #[test]
    fn rejects_malformed_and_zero_ids() {
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c8031zz-b7ad6b7169203331-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
        ] {
            assert!(TraceParent::parse(bad).is_none(), "{bad:?} accepted");
        }
    }

    #[test]
    fn random_contexts_round_trip() {
        let tp = TraceParent::random();
        assert_eq!(TraceParent::parse(&tp.to_string()), Some(tp));
    }
}
