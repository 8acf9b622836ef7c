//! A rank's KV cache in shared memory: the engine process creates the file and its forward
//! writes the rank's layers there (the simulated engine's stand-in for the rank's GPU memory);
//! the rank's process maps the same file and serves it to peers (P's writes, D's data server).

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use pdflow_kv::memory::{KvCache, KvShape};

use super::RankProcessError;

/// A shared mapping, unmapped when the cache that owns it is dropped.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain shared bytes; the cache that owns the mapping governs access to them.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are the mapping `map_file` made, unmapped once, here.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// A file this process made (a rank's shared KV, the engine's socket to a rank), removed when
/// dropped; mappings of it stay valid.
pub struct TempFile {
    pub path: PathBuf,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The bytes a cache of `shape` × `num_blocks` needs: one region per layer.
fn cache_len(shape: KvShape, num_blocks: usize) -> Result<(usize, usize), RankProcessError> {
    let region = num_blocks.checked_mul(shape.block_len());
    let total = region.and_then(|r| r.checked_mul(shape.num_layers));
    match (region, total) {
        (Some(region), Some(total)) if total > 0 => Ok((region, total)),
        _ => Err(RankProcessError::SharedKv(format!(
            "{num_blocks} blocks of {} bytes over {} layers is not a cache size this host can map",
            shape.block_len(),
            shape.num_layers
        ))),
    }
}

/// Creates a zeroed shared cache for `shape` × `num_blocks` named after `tag`; returns the cache
/// (this process's mapping) and the file the rank's process opens.
pub fn create(shape: KvShape, num_blocks: usize, tag: &str) -> Result<(Arc<KvCache>, TempFile), RankProcessError> {
    let (_, total) = cache_len(shape, num_blocks)?;
    let dir = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let path = dir.join(format!("pdflow-{}-{tag}-{}.kv", std::process::id(), uuid::Uuid::new_v4().simple()));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| RankProcessError::SharedKv(format!("creating {}: {e}", path.display())))?;
    let guard = TempFile { path };
    file.set_len(total as u64).map_err(|e| {
        RankProcessError::SharedKv(format!(
            "sizing {} to {total} bytes: {e} (is /dev/shm large enough?)",
            guard.path.display()
        ))
    })?;
    let cache = map_file(&file, &guard.path, shape, num_blocks)?;
    Ok((cache, guard))
}

/// Maps the shared cache at `path` (made by [`create`] for the same shape and block count).
pub fn open(path: &Path, shape: KvShape, num_blocks: usize) -> Result<Arc<KvCache>, RankProcessError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| RankProcessError::SharedKv(format!("opening {}: {e}", path.display())))?;
    map_file(&file, path, shape, num_blocks)
}

fn map_file(
    file: &std::fs::File,
    path: &Path,
    shape: KvShape,
    num_blocks: usize,
) -> Result<Arc<KvCache>, RankProcessError> {
    use std::os::fd::AsRawFd;
    let (region, total) = cache_len(shape, num_blocks)?;
    let actual = file.metadata().map(|m| m.len()).unwrap_or(0);
    if actual != total as u64 {
        return Err(RankProcessError::SharedKv(format!(
            "{} holds {actual} bytes, but this rank's cache needs {total}: the engine and its rank disagree on the model",
            path.display()
        )));
    }
    // SAFETY: a fresh shared mapping of the whole file, checked for failure below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(RankProcessError::SharedKv(format!(
            "mapping {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        )));
    }
    let mapping = Mapping { ptr: ptr.cast(), len: total };
    let regions: Vec<(*mut u8, usize)> =
        (0..shape.num_layers).map(|layer| (mapping.ptr.wrapping_add(layer * region), region)).collect();
    // SAFETY: the regions are disjoint slices of the mapping, which the cache owns (and so keeps
    // mapped) for its whole life; the engine's block pool decides who touches which block.
    unsafe { KvCache::from_external(shape, num_blocks, &regions, Box::new(mapping)) }
        .map_err(|e| RankProcessError::SharedKv(format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_written_through_one_mapping_reads_back_through_another() {
        let shape = KvShape { num_layers: 2, num_kv_heads: 2, block_size: 4, head_dim: 8, dtype_bytes: 2 };
        let (engine, file) = create(shape, 3, "test").expect("created");
        let rank = open(&file.path, shape, 3).expect("opened");
        let slot: Vec<u8> = (0..shape.slot_len() as u8).collect();
        engine.write_slot(1, 2, 1, 3, &slot).expect("in range");
        let mut back = vec![0u8; shape.slot_len()];
        rank.read_slot(1, 2, 1, 3, &mut back).expect("in range");
        assert_eq!(back, slot);
        let path = file.path.clone();
        drop(file);
        assert!(!path.exists(), "the file goes with the engine's handle");
        assert!(open(&path, shape, 3).is_err());
        let other = KvShape { num_layers: 3, ..shape };
        let (_, again) = create(shape, 3, "test").expect("created");
        let err = open(&again.path, other, 3).expect_err("a cache of another size is refused");
        assert!(err.to_string().contains("disagree"), "{err}");
    }
}
