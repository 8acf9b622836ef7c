//! A batch of KV events in vLLM 0.33's msgpack form, as its `msgspec` encoder writes it.
//!
//! `KVEventBatch` is `array_like`: `[ts, events, data_parallel_rank]` (a float64, an array, an
//! int or nil). Each event is a tagged struct that is *not* `array_like` in vLLM 0.33: a map
//! whose first key is `"type"` (the class name), then the fields in declaration order, fields
//! left at their default omitted (`omit_defaults`):
//!
//! - `BlockStored`: `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`,
//!   `medium`, `lora_name` (always present), then `group_idx` (the block pool sets it: 0);
//!   `extra_keys`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`, `locality`,
//!   `ownership`, `session_id`, `lookahead_token_ids` are `None` here, so omitted;
//! - `BlockRemoved`: `block_hashes`, `medium`, then `group_idx`;
//! - `AllBlocksCleared`: no field.
//!
//! Integers take msgpack's shortest form, as msgspec writes them; so do map headers, but for
//! `BlockStored`'s (a map16 header, as msgspec writes for a struct of more than 15 fields).

use rmp::encode::{self as mp, ValueWriteError};

use super::{KvEvent, KvEventBatch, MEDIUM};

/// The KV-cache group of every event (one group: a dense model).
const GROUP_IDX: u64 = 0;

/// The msgpack payload of one batch (the third frame of a published message).
pub fn encode_batch(batch: &KvEventBatch) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 64);
    // Writing to a Vec cannot fail.
    let _ = write_batch(&mut out, batch);
    out
}

fn write_batch(out: &mut Vec<u8>, batch: &KvEventBatch) -> Result<(), ValueWriteError> {
    mp::write_array_len(out, 3)?;
    mp::write_f64(out, batch.ts)?;
    mp::write_array_len(out, batch.events.len() as u32)?;
    for event in &batch.events {
        write_event(out, event)?;
    }
    match batch.data_parallel_rank {
        Some(rank) => {
            mp::write_uint(out, u64::from(rank))?;
        }
        None => mp::write_nil(out).map_err(ValueWriteError::InvalidMarkerWrite)?,
    }
    Ok(())
}

fn write_event(out: &mut Vec<u8>, event: &KvEvent) -> Result<(), ValueWriteError> {
    match event {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size } => {
            // msgspec sizes a struct's map header by its field count before omitting defaults:
            // `BlockStored`'s 15 fields and tag take a map16 header even for 9 entries.
            out.push(0xde);
            out.extend_from_slice(&9u16.to_be_bytes());
            tag(out, "BlockStored")?;
            mp::write_str(out, "block_hashes")?;
            hashes(out, block_hashes)?;
            mp::write_str(out, "parent_block_hash")?;
            match parent_block_hash {
                Some(h) => {
                    mp::write_uint(out, *h)?;
                }
                None => nil(out)?,
            }
            mp::write_str(out, "token_ids")?;
            mp::write_array_len(out, token_ids.len() as u32)?;
            for &t in token_ids {
                mp::write_uint(out, u64::from(t))?;
            }
            mp::write_str(out, "block_size")?;
            mp::write_uint(out, *block_size as u64)?;
            mp::write_str(out, "lora_id")?;
            nil(out)?;
            mp::write_str(out, "medium")?;
            mp::write_str(out, MEDIUM)?;
            mp::write_str(out, "lora_name")?;
            nil(out)?;
            mp::write_str(out, "group_idx")?;
            mp::write_uint(out, GROUP_IDX)?;
        }
        KvEvent::BlockRemoved { block_hashes } => {
            mp::write_map_len(out, 4)?;
            tag(out, "BlockRemoved")?;
            mp::write_str(out, "block_hashes")?;
            hashes(out, block_hashes)?;
            mp::write_str(out, "medium")?;
            mp::write_str(out, MEDIUM)?;
            mp::write_str(out, "group_idx")?;
            mp::write_uint(out, GROUP_IDX)?;
        }
        KvEvent::AllBlocksCleared => {
            mp::write_map_len(out, 1)?;
            tag(out, "AllBlocksCleared")?;
        }
    }
    Ok(())
}

fn tag(out: &mut Vec<u8>, name: &str) -> Result<(), ValueWriteError> {
    mp::write_str(out, "type")?;
    mp::write_str(out, name)
}

fn hashes(out: &mut Vec<u8>, hashes: &[u64]) -> Result<(), ValueWriteError> {
    mp::write_array_len(out, hashes.len() as u32)?;
    for &h in hashes {
        mp::write_uint(out, h)?;
    }
    Ok(())
}

fn nil(out: &mut Vec<u8>) -> Result<(), ValueWriteError> {
    mp::write_nil(out).map_err(ValueWriteError::InvalidMarkerWrite)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes vLLM 0.33's `msgspec.msgpack.encode(KVEventBatch(...))` writes for the same
    /// batch (`BlockStored` and `BlockRemoved` with `group_idx=0`, as its block pool sets it).
    #[test]
    fn encodes_as_vllm_does() {
        let batch = KvEventBatch {
            ts: 1.5,
            events: vec![
                KvEvent::BlockStored {
                    block_hashes: vec![1, 2],
                    parent_block_hash: None,
                    token_ids: vec![1, 2, 3],
                    block_size: 16,
                },
                KvEvent::BlockRemoved { block_hashes: vec![3] },
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(0),
        };
        let want = b"\x93\xcb?\xf8\x00\x00\x00\x00\x00\x00\x93\xde\x00\x09\xa4type\xabBlockStored\xacblock_hashes\x92\x01\x02\xb1parent_block_hash\xc0\xa9token_ids\x93\x01\x02\x03\xaablock_size\x10\xa7lora_id\xc0\xa6medium\xa3GPU\xa9lora_name\xc0\xa9group_idx\x00\x84\xa4type\xacBlockRemoved\xacblock_hashes\x91\x03\xa6medium\xa3GPU\xa9group_idx\x00\x81\xa4type\xb0AllBlocksCleared\x00";
        assert_eq!(encode_batch(&batch), want.to_vec());
        let empty = KvEventBatch { ts: 1.5, events: Vec::new(), data_parallel_rank: None };
        assert_eq!(encode_batch(&empty), b"\x93\xcb?\xf8\x00\x00\x00\x00\x00\x00\x90\xc0".to_vec());
    }
}
