//! Binary frames for pdflow's own wires: a 4-byte magic, a version byte, then a postcard body.
//!
//! Every decode failure is a typed [`FrameError`]: a garbage frame is answered, never a panic.

use serde::{de::DeserializeOwned, Serialize};

/// The first four bytes of every pdflow frame.
pub const MAGIC: [u8; 4] = *b"PDFL";
/// The frame version this build speaks.
/// Version 2: each request of a pull carries its own traceparent. Version 3: write-fence tokens.
/// Version 4: P worker generations in pulls and their answers. Version 5: D's pull deadline.
/// Version 6: D's pipeline stage in pulls (P plans each D rank's heads and layers).
/// Version 8: D's RDMA endpoint and remote keys in pulls.
pub const VERSION: u8 = 8;
/// The largest frame pdflow accepts (a pull for thousands of blocks is a few tens of KiB).
pub const MAX_FRAME_LEN: usize = 16 * 1024 * 1024;

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes is shorter than the 5-byte header (magic + version)")]
    TooShort { len: usize },
    #[error("frame does not start with pdflow's magic {MAGIC:?} (found {found:?}): the peer is not a pdflow peer")]
    BadMagic { found: [u8; 4] },
    #[error("frame version {found} is not supported (this build speaks version {expected}): upgrade the older peer")]
    UnsupportedVersion { found: u8, expected: u8 },
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    Oversize { len: usize, max: usize },
    #[error("frame body does not decode as {what}: {reason}")]
    Body { what: &'static str, reason: String },
    #[error("message could not be encoded: {0}")]
    Encode(String),
}

/// Encodes `msg` as a frame.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    let out = postcard::to_extend(msg, out).map_err(|e| FrameError::Encode(e.to_string()))?;
    if out.len() > MAX_FRAME_LEN {
        return Err(FrameError::Oversize { len: out.len(), max: MAX_FRAME_LEN });
    }
    Ok(out)
}

/// Decodes a frame into `T`; `what` names `T` in the error.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], what: &'static str) -> Result<T, FrameError> {
    if bytes.len() > MAX_FRAME_LEN {
        return Err(FrameError::Oversize { len: bytes.len(), max: MAX_FRAME_LEN });
    }
    if bytes.len() < MAGIC.len() + 1 {
        return Err(FrameError::TooShort { len: bytes.len() });
    }
    let mut found = [0u8; 4];
    found.copy_from_slice(&bytes[..4]);
    if found != MAGIC {
        return Err(FrameError::BadMagic { found });
    }
    if bytes[4] != VERSION {
        return Err(FrameError::UnsupportedVersion { found: bytes[4], expected: VERSION });
    }
    let (value, rest) =
        postcard::take_from_bytes::<T>(&bytes[5..]).map_err(|e| FrameError::Body { what, reason: e.to_string() })?;
    if !rest.is_empty() {
        return Err(FrameError::Body { what, reason: format!("{} trailing bytes", rest.len()) });
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_typed_errors() {
        let bytes = encode(&(7u32, "x".to_string())).expect("encodes");
        assert_eq!(decode::<(u32, String)>(&bytes, "pair"), Ok((7, "x".into())));
        assert_eq!(decode::<u32>(b"PD", "u32"), Err(FrameError::TooShort { len: 2 }));
        assert!(matches!(decode::<u32>(b"GARBAGE!", "u32"), Err(FrameError::BadMagic { .. })));
        let mut v2 = bytes.clone();
        v2[4] = 9;
        assert_eq!(
            decode::<(u32, String)>(&v2, "pair"),
            Err(FrameError::UnsupportedVersion { found: 9, expected: VERSION })
        );
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(matches!(decode::<(u32, String)>(&trailing, "pair"), Err(FrameError::Body { .. })));
        assert!(matches!(decode::<(u32, String)>(&bytes[..6], "pair"), Err(FrameError::Body { .. })));
    }
}
