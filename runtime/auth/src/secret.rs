//! The cluster secret: one or two keys (current, previous), each named by an id derived from it.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::error::SecretError;

/// The secret's value, in the environment (one key; a second line or `,` is not read here).
pub const ENV_SECRET: &str = "PDFLOW_CLUSTER_SECRET";
/// A file holding the secret: the current key on the first line, optionally the previous one on
/// the second (blank lines and `#` comments ignored).
pub const ENV_SECRET_FILE: &str = "PDFLOW_CLUSTER_SECRET_FILE";
/// The shortest key accepted, in bytes.
pub const MIN_SECRET_LEN: usize = 16;

/// A key's public name: the first 8 bytes of SHA-256 over a label and the key. It says which key
/// signed a proof without saying anything about the key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct KeyId(pub [u8; 8]);

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyId(")?;
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

pub(crate) struct Key {
    pub(crate) id: KeyId,
    pub(crate) bytes: Vec<u8>,
}

/// The keys this side holds: the first signs, any verifies. Cheap to clone; never printed.
#[derive(Clone)]
pub struct ClusterSecret {
    keys: Arc<Vec<Key>>,
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<KeyId> = self.keys.iter().map(|k| k.id).collect();
        f.debug_struct("ClusterSecret").field("key_ids", &ids).finish_non_exhaustive()
    }
}

/// Two secrets are equal when they hold the same keys (compared by their ids).
impl PartialEq for ClusterSecret {
    fn eq(&self, other: &Self) -> bool {
        self.keys.iter().map(|k| k.id).eq(other.keys.iter().map(|k| k.id))
    }
}

impl Eq for ClusterSecret {}

fn key_id(bytes: &[u8]) -> KeyId {
    let digest = Sha256::new().chain_update(b"pdflow/v1/key-id").chain_update(bytes).finalize();
    let mut id = [0u8; 8];
    id.copy_from_slice(&digest[..8]);
    KeyId(id)
}

impl ClusterSecret {
    /// The current key and, during a rotation, the previous one (still accepted).
    pub fn new(current: &[u8], previous: Option<&[u8]>) -> Result<Self, SecretError> {
        let mut keys = Vec::new();
        for (which, bytes) in [("current key", Some(current)), ("previous key", previous)] {
            let Some(bytes) = bytes else { continue };
            if bytes.len() < MIN_SECRET_LEN {
                return Err(SecretError::TooShort { which, len: bytes.len(), min: MIN_SECRET_LEN });
            }
            keys.push(Key { id: key_id(bytes), bytes: bytes.to_vec() });
        }
        Ok(Self { keys: Arc::new(keys) })
    }

    /// One key per line (current, then previous), trimmed; blank lines and `#` comments skipped.
    pub fn from_text(text: &str) -> Result<Self, SecretError> {
        let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
        match lines.as_slice() {
            [current] => Self::new(current.as_bytes(), None),
            [current, previous] => Self::new(current.as_bytes(), Some(previous.as_bytes())),
            other => Err(SecretError::KeyCount { found: other.len() }),
        }
    }

    pub fn from_file(path: &str) -> Result<Self, SecretError> {
        let text = std::fs::read_to_string(path).map_err(|source| SecretError::Read { path: path.into(), source })?;
        Self::from_text(&text)
    }

    /// From [`ENV_SECRET_FILE`] or [`ENV_SECRET`] as `get` reads them; `None` when neither is set.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Self>, SecretError> {
        let set = |name| get(name).filter(|v| !v.trim().is_empty());
        match (set(ENV_SECRET_FILE), set(ENV_SECRET)) {
            (Some(_), Some(_)) => Err(SecretError::Ambiguous(ENV_SECRET_FILE, ENV_SECRET)),
            (Some(path), None) => Self::from_file(path.trim()).map(Some),
            (None, Some(value)) => Self::new(value.trim().as_bytes(), None).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// From the process environment.
    pub fn from_env() -> Result<Option<Self>, SecretError> {
        Self::from_lookup(&|name| std::env::var(name).ok())
    }

    /// The id of the key that signs.
    pub fn key_id(&self) -> KeyId {
        self.signing().id
    }

    pub(crate) fn signing(&self) -> &Key {
        // `new` always stores the current key first.
        &self.keys[0]
    }

    /// Every held key, the signing one first.
    pub(crate) fn keys(&self) -> &[Key] {
        &self.keys
    }

    pub(crate) fn key(&self, id: KeyId) -> Option<&Key> {
        self.keys.iter().find(|k| k.id == id)
    }
}
