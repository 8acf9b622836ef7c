//! Prefix-cache block hashes, as vLLM v1 computes them with `--prefix-caching-hash-algo
//! sha256_cbor` (`vllm/v1/core/kv_cache_utils.py`: `hash_block_tokens`, `NONE_HASH`).
//!
//! A full block's hash is SHA-256 over the canonical CBOR encoding of the tuple
//! `(parent_hash, token_ids, extra_keys)`: the parent block's 32-byte hash (the first block's
//! parent is `NONE_HASH`), the block's token ids, and `None` (no LoRA, multimodal input or cache
//! salt here). `NONE_HASH` is SHA-256 over CBOR of the seed string `"vllm-none-hash"`, vLLM's
//! fixed seed for cryptographic hashes when `PYTHONHASHSEED` is unset. Each hash thus names a
//! whole prefix, and two engines (or this engine and a real vLLM with `sha256_cbor`) give the
//! same prompt the same hashes. KV events carry a hash as vLLM does by default
//! (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`): its last 8 bytes, big-endian ([`BlockHash::external`]).

use sha2::{Digest, Sha256};

/// vLLM's seed for `NONE_HASH` when `PYTHONHASHSEED` is unset and the hash is cryptographic.
pub const NONE_HASH_SEED: &str = "vllm-none-hash";

/// The hash of one full block and, through its parent, of every block before it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockHash({:016x})", self.external())
    }
}

impl BlockHash {
    /// The hash KV events and routers see: the last 8 bytes, big-endian (vLLM's
    /// `maybe_convert_block_hash` with integer block hashes, its default).
    pub fn external(&self) -> u64 {
        let mut tail = [0u8; 8];
        tail.copy_from_slice(&self.0[24..]);
        u64::from_be_bytes(tail)
    }

    /// The parent of a request's first block: SHA-256 over CBOR of [`NONE_HASH_SEED`].
    pub fn none_hash() -> Self {
        let mut cbor = Vec::with_capacity(NONE_HASH_SEED.len() + 1);
        cbor_head(&mut cbor, 3, NONE_HASH_SEED.len() as u64);
        cbor.extend_from_slice(NONE_HASH_SEED.as_bytes());
        Self(Sha256::digest(&cbor).into())
    }

    /// The hash of a full block of `tokens` after the block hashed `parent` (`None`: the first).
    pub fn of_block(parent: Option<&BlockHash>, tokens: &[u32]) -> Self {
        let parent = parent.copied().unwrap_or_else(Self::none_hash);
        let mut cbor = Vec::with_capacity(40 + tokens.len() * 5);
        cbor_head(&mut cbor, 4, 3);
        cbor_head(&mut cbor, 2, 32);
        cbor.extend_from_slice(&parent.0);
        cbor_head(&mut cbor, 4, tokens.len() as u64);
        for &t in tokens {
            cbor_head(&mut cbor, 0, u64::from(t));
        }
        // `extra_keys`: None.
        cbor.push(0xf6);
        Self(Sha256::digest(&cbor).into())
    }

    /// The chained hashes of every full block of `tokens`, continuing after `known` (the hashes of
    /// the blocks before): the new ones only.
    pub fn extend_chain(known: &[BlockHash], tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
        let mut out: Vec<BlockHash> = Vec::new();
        if block_size == 0 {
            return out;
        }
        let full = tokens.len() / block_size;
        for i in known.len()..full {
            let parent = out.last().or(known.last());
            out.push(Self::of_block(parent, &tokens[i * block_size..(i + 1) * block_size]));
        }
        out
    }
}

/// A canonical CBOR head: major type `major`, argument `value` in its shortest form.
fn cbor_head(out: &mut Vec<u8>, major: u8, value: u64) {
    let m = major << 5;
    match value {
        0..=23 => out.push(m | value as u8),
        24..=0xff => out.extend_from_slice(&[m | 24, value as u8]),
        0x100..=0xffff => {
            out.push(m | 25);
            out.extend_from_slice(&(value as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(m | 26);
            out.extend_from_slice(&(value as u32).to_be_bytes());
        }
        _ => {
            out.push(m | 27);
            out.extend_from_slice(&value.to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(h: &BlockHash) -> String {
        h.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Values from vLLM 0.33's own `hash_block_tokens(sha256_cbor, …)` after
    /// `init_none_hash(sha256_cbor)` with `PYTHONHASHSEED` unset.
    #[test]
    fn hashes_equal_vllms_sha256_cbor() {
        assert_eq!(hex(&BlockHash::none_hash()), "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0");
        let h1 = BlockHash::of_block(None, &[1, 2, 3, 4]);
        assert_eq!(hex(&h1), "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111");
        assert_eq!(h1.external(), 9_561_501_211_280_363_793);
        let h2 = BlockHash::of_block(Some(&h1), &[5, 300, 70_000, 1 << 31]);
        assert_eq!(hex(&h2), "fff95c8b2843f1e96093e85446cdb8d2846bb0699fbf0c4633b8902ad89bfca8");
        assert_eq!(h2.external(), 3_726_887_205_346_213_032);
        let h3 = BlockHash::of_block(None, &(0..30).collect::<Vec<u32>>());
        assert_eq!(hex(&h3), "f6a5f4ddf6e5ec7f3886bab64b5cb401d015dd72ef7b451362e675f3cf7dc0a2");
    }

    #[test]
    fn a_chain_covers_full_blocks_only_and_extends() {
        let tokens: Vec<u32> = (0..11).collect();
        let first = BlockHash::extend_chain(&[], &tokens[..6], 4);
        assert_eq!(first.len(), 1);
        let rest = BlockHash::extend_chain(&first, &tokens, 4);
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0], BlockHash::of_block(Some(&first[0]), &[4, 5, 6, 7]));
        assert_eq!([first, rest].concat(), BlockHash::extend_chain(&[], &tokens, 4));
    }
}
