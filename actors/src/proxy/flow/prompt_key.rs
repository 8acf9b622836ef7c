//! A request's [`PromptKey`] for the routing policies (step 8): its prompt cut into chunks, each
//! hashed over the previous chunk's hash and its own content (a chain, as vLLM's block hashes),
//! so two prompts that share a prefix share their leading hashes. Only full chunks count, as only
//! full blocks are cached.
//!
//! - `prompt` as token ids (a list of integers): chunks of [`CHUNK_TOKENS`] ids; its tokens are
//!   counted exactly, and the ids kept ([`PromptKey::token_ids`]) for `kv_aware`, which matches
//!   them in each engine's block size against what its KV events said it holds;
//! - `prompt` as text, or a chat's `messages` (their roles and contents, in order): chunks of
//!   [`CHUNK_BYTES`] bytes, about [`CHUNK_TOKENS`] tokens of English text for a BPE tokenizer;
//!   its tokens estimated as bytes / [`BYTES_PER_TOKEN`].
//!
//! No tokenizer runs in the proxy: hashing the text costs a pass over its bytes, where tokenizing
//! would cost more than the proxy's whole step; the chunks then stand for approximately the same
//! prefixes the engines cache.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use pdflow_messages::proxy::PromptKey;
use serde_json::Value;

/// Token ids per chunk (vLLM's default block size).
pub const CHUNK_TOKENS: usize = 16;
/// Bytes per chunk of text.
pub const CHUNK_BYTES: usize = 64;
/// Bytes per token, estimated, for text.
pub const BYTES_PER_TOKEN: usize = 4;

/// The key of a completion (`chat`: false) or chat completion request.
pub fn prompt_key(request: &serde_json::Map<String, Value>, chat: bool) -> PromptKey {
    if chat {
        let mut text = String::new();
        for m in request.get("messages").and_then(Value::as_array).into_iter().flatten() {
            text.push_str(m.get("role").and_then(Value::as_str).unwrap_or_default());
            text.push('\n');
            match m.get("content") {
                Some(Value::String(s)) => text.push_str(s),
                Some(other) => text.push_str(&other.to_string()),
                None => {}
            }
            text.push('\n');
        }
        return of_text(&text);
    }
    match request.get("prompt") {
        Some(Value::String(s)) => of_text(s),
        Some(Value::Array(items)) if items.iter().all(Value::is_u64) => {
            let ids: Vec<u64> = items.iter().filter_map(Value::as_u64).collect();
            of_ids(&ids)
        }
        // A batch of prompts: routed by its first.
        Some(Value::Array(items)) => match items.first() {
            Some(Value::String(s)) => of_text(s),
            _ => PromptKey::default(),
        },
        _ => PromptKey::default(),
    }
}

fn of_text(text: &str) -> PromptKey {
    let chunks = chain(text.as_bytes().chunks_exact(CHUNK_BYTES));
    PromptKey { chunks, tokens: text.len().div_ceil(BYTES_PER_TOKEN), token_ids: None }
}

fn of_ids(ids: &[u64]) -> PromptKey {
    // Vocabulary ids fit in 32 bits; a prompt with a larger one is no engine's (no ids kept).
    let token_ids = ids.iter().map(|&id| u32::try_from(id).ok()).collect::<Option<Vec<u32>>>().map(Arc::from);
    PromptKey { chunks: chain(ids.chunks_exact(CHUNK_TOKENS)), tokens: ids.len(), token_ids }
}

/// Each chunk's hash over its parent's and its own content.
pub fn chain<T: Hash>(chunks: impl Iterator<Item = T>) -> Vec<u64> {
    let mut parent = 0u64;
    chunks
        .map(|chunk| {
            // SipHash with fixed keys: the same hashes in every run and every proxy.
            #[allow(deprecated)]
            let mut h = std::hash::SipHasher::new();
            parent.hash(&mut h);
            chunk.hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion(prompt: Value) -> serde_json::Map<String, Value> {
        serde_json::json!({"prompt": prompt}).as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn prompts_sharing_a_prefix_share_their_leading_chunks() {
        let shared = "You are a helpful assistant. ".repeat(10);
        let a = prompt_key(&completion(format!("{shared}What is 2+2?").into()), false);
        let b = prompt_key(&completion(format!("{shared}Name a prime.").into()), false);
        let common = shared.len() / CHUNK_BYTES;
        assert!(common >= 4);
        assert_eq!(a.chunks[..common], b.chunks[..common]);
        assert_eq!(a.tokens, (shared.len() + 12).div_ceil(BYTES_PER_TOKEN));
        let other = prompt_key(&completion(format!("x{shared}").into()), false);
        assert_ne!(other.chunks[0], a.chunks[0], "a different first byte changes every chunk after it");
    }

    #[test]
    fn token_ids_count_exactly_and_a_chat_hashes_its_messages() {
        let ids: Vec<u64> = (0..40).collect();
        let k = prompt_key(&completion(serde_json::json!(ids)), false);
        assert_eq!((k.tokens, k.chunks.len()), (40, 2));
        assert_eq!(k.token_ids.as_deref(), Some((0..40).collect::<Vec<u32>>().as_slice()), "the ids are kept");
        let chat = serde_json::json!({"messages": [{"role": "user", "content": "hi ".repeat(50)}]});
        let k = prompt_key(chat.as_object().expect("object"), true);
        assert!(k.chunks.len() >= 2 && k.tokens > 30 && k.token_ids.is_none(), "{k:?}");
        assert_eq!(prompt_key(&serde_json::Map::new(), false), PromptKey::default());
    }
}
