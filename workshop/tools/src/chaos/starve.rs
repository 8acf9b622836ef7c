//! `--starve N`: N threads that spin on the CPU for as long as a chaos run lasts, at the
//! scheduler's normal priority, in the chaos process itself — so the cluster under test competes
//! for the machine's cores with work that never yields (a noisy neighbour, a busy host).
//!
//! The threads stop and are joined when the [`Starvation`] guard is dropped.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Why the spinning threads could not be started.
#[derive(Debug, thiserror::Error)]
#[error("starting spinning thread {index} of {of}: {source}")]
pub struct StarveError {
    pub index: usize,
    pub of: usize,
    #[source]
    pub source: std::io::Error,
}

/// N busy threads; dropping the guard stops them.
pub struct Starvation {
    stop: Arc<AtomicBool>,
    spins: Arc<AtomicU64>,
    threads: Vec<JoinHandle<()>>,
}

impl Starvation {
    /// Starts `threads` spinning threads (none for 0).
    pub fn start(threads: usize) -> Result<Self, StarveError> {
        let stop = Arc::new(AtomicBool::new(false));
        let spins = Arc::new(AtomicU64::new(0));
        let mut guard = Self { stop: stop.clone(), spins: spins.clone(), threads: Vec::with_capacity(threads) };
        for index in 0..threads {
            let (stop, spins) = (stop.clone(), spins.clone());
            let handle = std::thread::Builder::new()
                .name(format!("chaos-starve-{index}"))
                .spawn(move || spin(&stop, &spins))
                .map_err(|source| StarveError { index, of: threads, source })?;
            guard.threads.push(handle);
        }
        Ok(guard)
    }

    /// How many threads spin.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Rounds of busy work done so far by all the threads (millions), a sign they did run.
    pub fn spun_millions(&self) -> u64 {
        self.spins.load(Ordering::Relaxed)
    }
}

/// Busy work that never sleeps or yields, until `stop`.
fn spin(stop: &AtomicBool, spins: &AtomicU64) {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..1_000_000 {
            x = std::hint::black_box(x.rotate_left(7) ^ 0xA5A5);
        }
        spins.fetch_add(1, Ordering::Relaxed);
    }
    std::hint::black_box(x);
}

impl Drop for Starvation {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spinning_threads_run_and_stop_on_drop() {
        let s = Starvation::start(2).expect("threads start");
        assert_eq!(s.threads(), 2);
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while s.spun_millions() == 0 && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(s.spun_millions() > 0, "the threads spin");
        drop(s);
        assert_eq!(Starvation::start(0).expect("none").threads(), 0);
    }
}
