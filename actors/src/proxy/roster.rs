//! The proxy's roster: the engines of both pools as the last change left them (tombstones
//! included, with their KV-event endpoints and what discovery knows of them), so that a restarted
//! Proxy actor — and, with a file (`pdflow proxy --roster-file`), a restarted proxy process —
//! starts from the engines the admin API and discovery added, drained and removed, rather than
//! from its command line.
//!
//! The file is JSON ([`FORMAT`]), rewritten whole on every change: written beside itself, then
//! renamed over the old one, so a crash mid-write leaves the previous roster. A file that does not
//! parse stops the proxy at start with an error naming it; one that cannot be written is logged
//! and the change stands in memory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use pdflow_messages::proxy::EngineState;
use pdflow_messages::EngineId;
use serde::{Deserialize, Serialize};

use super::discovery::Known;
use super::kv_events::KvEventSource;

/// The roster file's format version; a file of another is refused.
pub const FORMAT: u32 = 1;

/// The engines a restarted Proxy actor starts from: shared by every incarnation's arguments,
/// written by each change to the pools, and kept in a file when given one.
#[derive(Debug, Clone, Default)]
pub struct Roster {
    saved: Arc<Mutex<Option<Saved>>>,
    file: Option<Arc<PathBuf>>,
}

/// What a [`Roster`] keeps: each pool's engines in index order, tombstones included, and what
/// discovery knows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Saved {
    pub format: u32,
    pub prefill: Vec<SavedPrefill>,
    pub decode: Vec<SavedDecode>,
    pub discovered: HashMap<EngineId, Known>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct SavedPrefill {
    pub url: String,
    pub bootstrap_port: u16,
    pub state: EngineState,
    pub kv_events: Vec<KvEventSource>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct SavedDecode {
    pub url: String,
    pub state: EngineState,
    pub kv_events: Vec<KvEventSource>,
}

/// Why a roster file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RosterError {
    #[error("cannot read the roster file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("the roster file {path} is not a pdflow roster ({source}); move it away to start from the command line's engines")]
    Parse { path: PathBuf, source: serde_json::Error },
    #[error("the roster file {path} is of format {found}, this pdflow reads format {FORMAT}")]
    Format { path: PathBuf, found: u32 },
}

impl Roster {
    /// A roster kept in `path` too: holding the engines an earlier process saved there, if the
    /// file exists (the proxy then starts from them, not from its command line).
    pub fn in_file(path: impl Into<PathBuf>) -> Result<Self, RosterError> {
        let path = path.into();
        let saved = match std::fs::read(&path) {
            Ok(bytes) => {
                let saved: Saved = serde_json::from_slice(&bytes)
                    .map_err(|source| RosterError::Parse { path: path.clone(), source })?;
                if saved.format != FORMAT {
                    return Err(RosterError::Format { path, found: saved.format });
                }
                Some(saved)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => return Err(RosterError::Read { path, source }),
        };
        Ok(Self { saved: Arc::new(Mutex::new(saved)), file: Some(Arc::new(path)) })
    }

    /// The file the roster is kept in, if any.
    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref().map(PathBuf::as_path)
    }

    /// Whether an earlier change (or process, through the file) saved engines to start from.
    pub fn holds_engines(&self) -> bool {
        self.load().is_some_and(|s| !s.prefill.is_empty() || !s.decode.is_empty() || !s.discovered.is_empty())
    }

    /// What the last change saved (none yet: the command line's engines).
    pub(super) fn load(&self) -> Option<Saved> {
        self.saved.lock().ok().and_then(|s| s.clone())
    }

    /// Keeps `saved`, in memory and in the file.
    pub(super) fn store(&self, saved: Saved) {
        if let Some(path) = &self.file {
            if let Err(e) = write_atomically(path, &saved) {
                tracing::warn!(path = %path.display(), error = %e, "roster: cannot write the file; a restarted proxy would not start from this change");
            }
        }
        if let Ok(mut slot) = self.saved.lock() {
            *slot = Some(saved);
        }
    }
}

/// Writes `saved` to `path` through a file beside it, renamed over it.
fn write_atomically(path: &Path, saved: &Saved) -> std::io::Result<()> {
    let json = serde_json::to_vec_pretty(saved).map_err(std::io::Error::other)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, json)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saved() -> Saved {
        Saved {
            format: FORMAT,
            prefill: vec![SavedPrefill {
                url: "http://127.0.0.1:8010".into(),
                bootstrap_port: 8998,
                state: EngineState::Draining,
                kv_events: vec![],
            }],
            decode: vec![SavedDecode {
                url: "http://127.0.0.1:8020".into(),
                state: EngineState::Removed,
                kv_events: vec![],
            }],
            discovered: HashMap::new(),
        }
    }

    #[test]
    fn a_roster_file_outlives_the_process_that_wrote_it() {
        let dir = std::env::temp_dir().join(format!("pdflow-roster-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let path = dir.join("roster.json");
        let _ = std::fs::remove_file(&path);
        let first = Roster::in_file(&path).expect("no file yet");
        assert_eq!(first.load(), None, "no file: the command line's engines");
        first.store(saved());
        let again = Roster::in_file(&path).expect("the file parses");
        assert_eq!(again.load(), Some(saved()));
        assert!(!dir.join("roster.json.tmp").exists(), "the file beside it was renamed");

        std::fs::write(&path, b"{\"format\": 1, \"prefill\": [").expect("write");
        let err = Roster::in_file(&path).expect_err("a torn file");
        assert!(err.to_string().contains("roster.json") && err.to_string().contains("move it away"), "{err}");
        let mut other = serde_json::to_value(saved()).expect("json");
        other["format"] = 2.into();
        std::fs::write(&path, other.to_string()).expect("write");
        let err = Roster::in_file(&path).expect_err("a future format");
        assert!(matches!(err, RosterError::Format { found: 2, .. }), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
