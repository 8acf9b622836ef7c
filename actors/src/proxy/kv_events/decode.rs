//! One KV-event batch as vLLM publishes it (`vllm/distributed/kv_events.py`), read from its
//! msgpack payload: `[ts, events, data_parallel_rank]`, each event a map whose `type` names it
//! (vLLM 0.33), or — as older vLLM wrote them — an array whose first item names it and whose
//! fields follow in declaration order. Part of the `kv_aware` policy's input (step 8's routing).
//!
//! A block hash is an integer (vLLM's default) or bytes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`:
//! the last 8 bytes are taken, as vLLM takes them for its integers). An event type this proxy
//! does not know is kept as [`KvEvent::Other`] and ignored; a batch that is not of this shape is
//! an error (logged and counted by the subscriber).

use super::msgpack::{self, MsgpackError, Value};

/// The storage medium of the engine's own prefix cache (vLLM's `MEDIUM_GPU`, its block pool's
/// medium on every platform).
pub const DEVICE_MEDIUM: &str = "GPU";

/// One event, as far as routing needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks entered the cache (or, in vLLM's `full` report mode, were reused from it):
    /// their engine hashes in prompt order, the hash of the block before the first (`None`: they
    /// start the prompt), their tokens, the block size, their KV-cache group (`group_idx`, none:
    /// 0), and whether the index may take them (the device's cache, no LoRA, no extra hash keys).
    Stored {
        block_hashes: Vec<u64>,
        parent: Option<u64>,
        token_ids: Vec<u32>,
        block_size: usize,
        group: u32,
        plain: bool,
    },
    /// Blocks of a KV-cache group left the cache (`device`: the device's cache, not a lower
    /// tier's).
    Removed { block_hashes: Vec<u64>, group: u32, device: bool },
    /// Every block left the cache.
    AllCleared,
    /// An event type this proxy does not know.
    Other,
}

/// One step's events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvBatch {
    pub events: Vec<KvEvent>,
    /// The engine's data-parallel rank (vLLM's publisher always sets it; none: 0).
    pub data_parallel_rank: u32,
}

/// Why a payload is not a KV-event batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error(transparent)]
    Msgpack(#[from] MsgpackError),
    #[error("a batch is [ts, events, data_parallel_rank]: {0}")]
    NotBatch(&'static str),
    #[error("event {index}: {reason}")]
    Event { index: usize, reason: &'static str },
}

/// The batch in `payload`.
pub fn decode_batch(payload: &[u8]) -> Result<KvBatch, DecodeError> {
    let Value::Array(items) = msgpack::parse(payload)? else { return Err(DecodeError::NotBatch("not an array")) };
    let (events, rank) = match items.as_slice() {
        [_ts, events] => (events, None),
        [_ts, events, rank, ..] => (events, Some(rank)),
        _ => return Err(DecodeError::NotBatch("fewer than two items")),
    };
    let Value::Array(events) = events else { return Err(DecodeError::NotBatch("events are not an array")) };
    let data_parallel_rank = match rank {
        None | Some(Value::Nil) => 0,
        Some(Value::Uint(r)) => u32::try_from(*r).map_err(|_| DecodeError::NotBatch("data_parallel_rank too large"))?,
        Some(_) => return Err(DecodeError::NotBatch("data_parallel_rank is not an integer")),
    };
    let events = events
        .iter()
        .enumerate()
        .map(|(index, e)| event(e).map_err(|reason| DecodeError::Event { index, reason }))
        .collect::<Result<_, _>>()?;
    Ok(KvBatch { events, data_parallel_rank })
}

/// An event's fields by name, from a map or (older vLLM) an array in declaration order.
struct Fields<'v, 'a> {
    value: &'v Value<'a>,
    /// The field names in declaration order, for the array form.
    order: &'static [&'static str],
}

impl<'v, 'a> Fields<'v, 'a> {
    fn get(&self, name: &str) -> Option<&'v Value<'a>> {
        match self.value {
            Value::Map(_) => self.value.get(name),
            Value::Array(items) => {
                let at = self.order.iter().position(|n| *n == name)?;
                // The tag comes first.
                items.get(at + 1)
            }
            _ => None,
        }
    }
}

const STORED: &[&str] = &["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"];
const REMOVED: &[&str] = &["block_hashes", "medium"];

fn event(value: &Value<'_>) -> Result<KvEvent, &'static str> {
    let tag = match value {
        Value::Map(_) => value.get("type").ok_or("a map without `type`")?,
        Value::Array(items) => items.first().ok_or("an empty array")?,
        _ => return Err("neither a map nor an array"),
    };
    let tag = tag.as_bytes().ok_or("its type is not a string")?;
    Ok(match tag {
        b"BlockStored" => {
            let f = Fields { value, order: STORED };
            let block_hashes = hashes(f.get("block_hashes"))?;
            let parent = match f.get("parent_block_hash") {
                None | Some(Value::Nil) => None,
                Some(h) => Some(hash(h).ok_or("parent_block_hash is not a hash")?),
            };
            let token_ids = match f.get("token_ids") {
                Some(Value::Array(ids)) => ids
                    .iter()
                    .map(|t| match t {
                        Value::Uint(t) => u32::try_from(*t).ok(),
                        _ => None,
                    })
                    .collect::<Option<Vec<u32>>>()
                    .ok_or("a token id is not a 32-bit unsigned integer")?,
                _ => return Err("token_ids is not an array"),
            };
            let block_size = match f.get("block_size") {
                Some(Value::Uint(n)) if *n > 0 => usize::try_from(*n).map_err(|_| "block_size too large")?,
                _ => return Err("block_size is not a positive integer"),
            };
            let set = |name: &str| f.get(name).is_some_and(|v| *v != Value::Nil);
            let extra_keys = match f.get("extra_keys") {
                Some(Value::Array(keys)) => keys.iter().any(|k| *k != Value::Nil),
                Some(Value::Nil) | None => false,
                Some(_) => true,
            };
            let plain = on_device(f.get("medium")) && !set("lora_id") && !set("lora_name") && !extra_keys;
            KvEvent::Stored { block_hashes, parent, token_ids, block_size, group: group(&f)?, plain }
        }
        b"BlockRemoved" => {
            let f = Fields { value, order: REMOVED };
            KvEvent::Removed {
                block_hashes: hashes(f.get("block_hashes"))?,
                group: group(&f)?,
                device: on_device(f.get("medium")),
            }
        }
        b"AllBlocksCleared" => KvEvent::AllCleared,
        _ => KvEvent::Other,
    })
}

/// The event's KV-cache group (`group_idx`; none: 0).
fn group(f: &Fields<'_, '_>) -> Result<u32, &'static str> {
    match f.get("group_idx") {
        None | Some(Value::Nil) => Ok(0),
        Some(Value::Uint(g)) => u32::try_from(*g).map_err(|_| "group_idx too large"),
        Some(_) => Err("group_idx is not an integer"),
    }
}

/// Whether `medium` is the engine's own cache (none given: it is).
fn on_device(medium: Option<&Value<'_>>) -> bool {
    match medium {
        None | Some(Value::Nil) => true,
        Some(m) => m.as_bytes().is_some_and(|m| m.eq_ignore_ascii_case(DEVICE_MEDIUM.as_bytes())),
    }
}

fn hashes(value: Option<&Value<'_>>) -> Result<Vec<u64>, &'static str> {
    match value {
        Some(Value::Array(items)) => items.iter().map(hash).collect::<Option<_>>().ok_or("a block hash is not a hash"),
        _ => Err("block_hashes is not an array"),
    }
}

/// A block hash: an integer (a negative one as its 64 bits), or the last 8 bytes of a byte
/// string, big-endian.
fn hash(value: &Value<'_>) -> Option<u64> {
    match value {
        Value::Uint(h) => Some(*h),
        Value::Int(h) => Some(*h as u64),
        Value::Bin(b) | Value::Str(b) if !b.is_empty() => {
            let tail = &b[b.len().saturating_sub(8)..];
            Some(tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes vLLM 0.33's msgspec encoder writes for a batch of a `BlockStored`, a
    /// `BlockRemoved` and an `AllBlocksCleared` (the simulated engine's encoder test holds the
    /// same bytes).
    const VLLM_BATCH: &[u8] = b"\x93\xcb?\xf8\x00\x00\x00\x00\x00\x00\x93\xde\x00\x09\xa4type\xabBlockStored\xacblock_hashes\x92\x01\x02\xb1parent_block_hash\xc0\xa9token_ids\x93\x01\x02\x03\xaablock_size\x10\xa7lora_id\xc0\xa6medium\xa3GPU\xa9lora_name\xc0\xa9group_idx\x00\x84\xa4type\xacBlockRemoved\xacblock_hashes\x91\x03\xa6medium\xa3GPU\xa9group_idx\x00\x81\xa4type\xb0AllBlocksCleared\x00";

    #[test]
    fn reads_vllms_batch() {
        let batch = decode_batch(VLLM_BATCH).expect("a batch");
        assert_eq!(batch.data_parallel_rank, 0);
        assert_eq!(
            batch.events,
            vec![
                KvEvent::Stored {
                    block_hashes: vec![1, 2],
                    parent: None,
                    token_ids: vec![1, 2, 3],
                    block_size: 16,
                    group: 0,
                    plain: true
                },
                KvEvent::Removed { block_hashes: vec![3], group: 0, device: true },
                KvEvent::AllCleared,
            ]
        );
    }

    #[test]
    fn reads_the_array_form_byte_hashes_and_a_rank() {
        // [1.0, [["BlockStored", [h"..01", 5], 9, [7], 1, nil, "GPU"], ["BlockRemoved", [5], "CPU"]], 3]
        let payload = b"\x93\xcb?\xf0\x00\x00\x00\x00\x00\x00\x92\x97\xabBlockStored\x92\xc4\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01\x05\x09\x91\x07\x01\xc0\xa3GPU\x93\xacBlockRemoved\x91\x05\xa3CPU\x03";
        let batch = decode_batch(payload).expect("a batch");
        assert_eq!(batch.data_parallel_rank, 3);
        assert_eq!(
            batch.events,
            vec![
                KvEvent::Stored {
                    block_hashes: vec![1, 5],
                    parent: Some(9),
                    token_ids: vec![7],
                    block_size: 1,
                    group: 0,
                    plain: true
                },
                KvEvent::Removed { block_hashes: vec![5], group: 0, device: false },
            ]
        );
    }

    #[test]
    fn lora_blocks_are_not_plain_and_unknown_events_are_kept_aside() {
        // [0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1,
        //       "lora_name": "a", "group_idx": 2}, {"type": "Future"}], nil]
        let payload = b"\x93\x00\x92\x86\xa4type\xabBlockStored\xacblock_hashes\x91\x01\xa9token_ids\x91\x01\xaablock_size\x01\xa9lora_name\xa1a\xa9group_idx\x02\x81\xa4type\xa6Future\xc0";
        let batch = decode_batch(payload).expect("a batch");
        assert!(matches!(batch.events[0], KvEvent::Stored { plain: false, group: 2, .. }));
        assert_eq!(batch.events[1], KvEvent::Other);
    }

    #[test]
    fn refuses_what_is_not_a_batch() {
        assert!(matches!(decode_batch(b"\x01"), Err(DecodeError::NotBatch(_))));
        assert!(matches!(decode_batch(b"\x92\x00\x91\x01"), Err(DecodeError::Event { index: 0, .. })));
        assert!(matches!(decode_batch(&VLLM_BATCH[..40]), Err(DecodeError::Msgpack(MsgpackError::Truncated))));
        // A BlockStored whose token id does not fit 32 bits.
        let payload = b"\x93\x00\x91\x84\xa4type\xabBlockStored\xacblock_hashes\x91\x01\xa9token_ids\x91\xcf\x00\x00\x00\x01\x00\x00\x00\x00\xaablock_size\x01\xc0";
        assert!(matches!(decode_batch(payload), Err(DecodeError::Event { index: 0, .. })));
    }
}
