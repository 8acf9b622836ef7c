//! A msgpack value read from an engine's KV-event payload, bounded: borrowed strings and bytes,
//! nesting at most [`MAX_DEPTH`] deep, no length trusted beyond the bytes that are there. Part
//! of the `kv_aware` policy's input (inside step 8's routing); [`super::decode`] gives the values
//! their meaning.

use rmp::Marker;

/// Deepest nesting read (a batch is three levels deep; `extra_keys` adds two).
pub const MAX_DEPTH: usize = 8;

/// One msgpack value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value<'a> {
    Nil,
    Bool(bool),
    /// A non-negative integer.
    Uint(u64),
    /// A negative integer.
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(Vec<Value<'a>>),
    Map(Vec<(Value<'a>, Value<'a>)>),
    /// An extension type (no KV event uses one).
    Ext,
}

/// Why a payload is not one msgpack value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MsgpackError {
    #[error("the payload ends inside a msgpack value")]
    Truncated,
    #[error("msgpack marker 0xc1 is reserved")]
    Reserved,
    #[error("msgpack values nested deeper than {MAX_DEPTH}")]
    TooDeep,
    #[error("{0} bytes follow the payload's value")]
    Trailing(usize),
}

/// The one value `payload` holds.
pub fn parse(payload: &[u8]) -> Result<Value<'_>, MsgpackError> {
    let mut reader = Reader { rest: payload };
    let value = reader.value(0)?;
    match reader.rest.len() {
        0 => Ok(value),
        n => Err(MsgpackError::Trailing(n)),
    }
}

impl<'a> Value<'a> {
    /// The string's bytes, if a string (or bytes).
    pub fn as_bytes(&self) -> Option<&'a [u8]> {
        match self {
            Value::Str(s) | Value::Bin(s) => Some(s),
            _ => None,
        }
    }

    pub fn is_str(&self, s: &str) -> bool {
        matches!(self, Value::Str(v) if *v == s.as_bytes())
    }

    /// A map's value under the string key `key`.
    pub fn get(&self, key: &str) -> Option<&Value<'a>> {
        match self {
            Value::Map(entries) => entries.iter().find(|(k, _)| k.is_str(key)).map(|(_, v)| v),
            _ => None,
        }
    }
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        if self.rest.len() < n {
            return Err(MsgpackError::Truncated);
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn uint(&mut self, bytes: usize) -> Result<u64, MsgpackError> {
        Ok(self.take(bytes)?.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn int(&mut self, bytes: usize) -> Result<i64, MsgpackError> {
        let raw = self.uint(bytes)?;
        let shift = 64 - 8 * bytes as u32;
        // Sign-extends the `bytes`-wide two's complement value.
        Ok(((raw << shift) as i64) >> shift)
    }

    fn signed(&mut self, bytes: usize) -> Result<Value<'a>, MsgpackError> {
        let v = self.int(bytes)?;
        Ok(if v >= 0 { Value::Uint(v as u64) } else { Value::Int(v) })
    }

    fn len(&mut self, bytes: usize) -> Result<usize, MsgpackError> {
        usize::try_from(self.uint(bytes)?).map_err(|_| MsgpackError::Truncated)
    }

    fn value(&mut self, depth: usize) -> Result<Value<'a>, MsgpackError> {
        if depth > MAX_DEPTH {
            return Err(MsgpackError::TooDeep);
        }
        let marker = Marker::from_u8(self.take(1)?[0]);
        Ok(match marker {
            Marker::FixPos(n) => Value::Uint(n.into()),
            Marker::FixNeg(n) => Value::Int(n.into()),
            Marker::Null => Value::Nil,
            Marker::Reserved => return Err(MsgpackError::Reserved),
            Marker::False => Value::Bool(false),
            Marker::True => Value::Bool(true),
            Marker::U8 => Value::Uint(self.uint(1)?),
            Marker::U16 => Value::Uint(self.uint(2)?),
            Marker::U32 => Value::Uint(self.uint(4)?),
            Marker::U64 => Value::Uint(self.uint(8)?),
            Marker::I8 => self.signed(1)?,
            Marker::I16 => self.signed(2)?,
            Marker::I32 => self.signed(4)?,
            Marker::I64 => self.signed(8)?,
            Marker::F32 => Value::Float(f32::from_bits(self.uint(4)? as u32).into()),
            Marker::F64 => Value::Float(f64::from_bits(self.uint(8)?)),
            Marker::FixStr(n) => Value::Str(self.take(n.into())?),
            Marker::Str8 => self.string(1)?,
            Marker::Str16 => self.string(2)?,
            Marker::Str32 => self.string(4)?,
            Marker::Bin8 => self.bin(1)?,
            Marker::Bin16 => self.bin(2)?,
            Marker::Bin32 => self.bin(4)?,
            Marker::FixArray(n) => self.array(n.into(), depth)?,
            Marker::Array16 => {
                let n = self.len(2)?;
                self.array(n, depth)?
            }
            Marker::Array32 => {
                let n = self.len(4)?;
                self.array(n, depth)?
            }
            Marker::FixMap(n) => self.map(n.into(), depth)?,
            Marker::Map16 => {
                let n = self.len(2)?;
                self.map(n, depth)?
            }
            Marker::Map32 => {
                let n = self.len(4)?;
                self.map(n, depth)?
            }
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let n = self.len(1)?;
                self.ext(n)?
            }
            Marker::Ext16 => {
                let n = self.len(2)?;
                self.ext(n)?
            }
            Marker::Ext32 => {
                let n = self.len(4)?;
                self.ext(n)?
            }
        })
    }

    fn string(&mut self, len_bytes: usize) -> Result<Value<'a>, MsgpackError> {
        let n = self.len(len_bytes)?;
        Ok(Value::Str(self.take(n)?))
    }

    fn bin(&mut self, len_bytes: usize) -> Result<Value<'a>, MsgpackError> {
        let n = self.len(len_bytes)?;
        Ok(Value::Bin(self.take(n)?))
    }

    fn ext(&mut self, n: usize) -> Result<Value<'a>, MsgpackError> {
        // The type byte, then the data.
        self.take(1 + n)?;
        Ok(Value::Ext)
    }

    fn array(&mut self, n: usize, depth: usize) -> Result<Value<'a>, MsgpackError> {
        // Every element takes at least a byte: a length past the bytes left is a lie.
        if n > self.rest.len() {
            return Err(MsgpackError::Truncated);
        }
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(items))
    }

    fn map(&mut self, n: usize, depth: usize) -> Result<Value<'a>, MsgpackError> {
        if n.saturating_mul(2) > self.rest.len() {
            return Err(MsgpackError::Truncated);
        }
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let key = self.value(depth + 1)?;
            entries.push((key, self.value(depth + 1)?));
        }
        Ok(Value::Map(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_width_and_refuses_what_is_not_there() {
        let v = parse(b"\x95\xcd\x01\x00\xd0\xfe\xa2hi\xc4\x01\x07\x81\xa1k\xc3").expect("valid");
        let want = Value::Array(vec![
            Value::Uint(256),
            Value::Int(-2),
            Value::Str(b"hi"),
            Value::Bin(&[7]),
            Value::Map(vec![(Value::Str(b"k"), Value::Bool(true))]),
        ]);
        assert_eq!(v, want);
        assert_eq!(parse(b"\xd3\xff\xff\xff\xff\xff\xff\xff\xff"), Ok(Value::Int(-1)));
        assert_eq!(parse(b"\xd3\x00\x00\x00\x00\x00\x00\x00\x05"), Ok(Value::Uint(5)));
        assert_eq!(parse(b"\x92\x01"), Err(MsgpackError::Truncated));
        assert_eq!(parse(b"\xdd\xff\xff\xff\xff"), Err(MsgpackError::Truncated), "a huge length is not trusted");
        assert_eq!(parse(b"\xc1"), Err(MsgpackError::Reserved));
        assert_eq!(parse(b"\x01\x02"), Err(MsgpackError::Trailing(1)));
        assert_eq!(parse(&[0x91; 20]), Err(MsgpackError::TooDeep));
    }
}
