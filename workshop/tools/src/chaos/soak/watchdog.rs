//! A soak that stops making progress says so and ends, instead of hanging for ever: a plain
//! thread — not a task, since a wedged runtime (its workers blocked in a lock) runs no task —
//! watches a heartbeat the soak beats at every answer and phase, and when it has not moved for
//! [`STALL`], prints the diagnosis, writes what is known (the counts and the RSS / fd series up to
//! then) where the report was to go, and exits the process with status 3.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::sampler::{self, Sample, Series};

/// No answer and no phase for this long is a stall: four times a request's client deadline
/// (15 s), and longer than any phase of the end (baseline, serving again) takes.
pub const STALL: Duration = Duration::from_secs(60);

/// The process's exit status after a stall.
pub const STALL_EXIT: i32 = 3;

/// What a stalled soak writes.
#[derive(Debug, Serialize)]
struct Stalled<'a> {
    passed: bool,
    stalled: bool,
    /// Seconds since the soak started when the watchdog gave up.
    stalled_at_s: f64,
    /// Seconds without an answer or a phase.
    silent_s: f64,
    /// Heartbeats before it: requests answered (warm-up included) and phases begun.
    heartbeats: u64,
    problems: Vec<String>,
    samples: &'a [Sample],
}

/// The running watchdog; dropped, it stops.
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Watches `beat`; on a stall writes to `report` (if any) and exits the process.
    pub fn start(
        started: Instant,
        beat: Arc<AtomicU64>,
        series: Arc<Mutex<Series>>,
        report: Option<PathBuf>,
    ) -> std::io::Result<Self> {
        Self::start_with(beat, STALL, move |silent, heartbeats| {
            stalled(started, silent, heartbeats, &series, report.as_deref())
        })
    }

    /// Watches `beat`; `on_stall` (given the silence and the heartbeats so far) runs once it has
    /// not moved for `stall`, and the watch ends.
    pub fn start_with(
        beat: Arc<AtomicU64>,
        stall: Duration,
        on_stall: impl FnOnce(Duration, u64) + Send + 'static,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let halt = stop.clone();
        let tick = (stall / 4).min(Duration::from_millis(500));
        let handle = std::thread::Builder::new().name("chaos-soak-watchdog".into()).spawn(move || {
            let (mut seen, mut since) = (beat.load(Ordering::Relaxed), Instant::now());
            while !halt.load(Ordering::Relaxed) {
                std::thread::sleep(tick);
                let now = beat.load(Ordering::Relaxed);
                if now != seen {
                    (seen, since) = (now, Instant::now());
                } else if since.elapsed() >= stall {
                    on_stall(since.elapsed(), seen);
                    return;
                }
            }
        })?;
        Ok(Self { stop, handle: Some(handle) })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn stalled(
    started: Instant,
    silent: Duration,
    heartbeats: u64,
    series: &Mutex<Series>,
    report: Option<&std::path::Path>,
) {
    let why = format!(
        "no request answered and no phase begun for {:.0} s: the cluster's runtime is wedged (all its workers blocked; `gdb -p {} -batch -ex 'thread apply all bt'` shows where)",
        silent.as_secs_f64(),
        std::process::id()
    );
    eprintln!("pdflow chaos soak: {why}");
    let mut samples = series.lock().unwrap_or_else(|p| p.into_inner()).samples.clone();
    samples.push(sampler::read_self(started.elapsed().as_secs_f64(), true));
    if let Some(path) = report {
        let stall = Stalled {
            passed: false,
            stalled: true,
            stalled_at_s: started.elapsed().as_secs_f64(),
            silent_s: silent.as_secs_f64(),
            heartbeats,
            problems: vec![why],
            samples: &samples,
        };
        match serde_json::to_string_pretty(&stall) {
            Ok(text) => match std::fs::write(path, text) {
                Ok(()) => eprintln!("what is known written to {}", path.display()),
                Err(e) => eprintln!("writing {}: {e}", path.display()),
            },
            Err(e) => eprintln!("serialising the stalled report: {e}"),
        }
    }
    std::process::exit(STALL_EXIT);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_silent_heartbeat_is_a_stall_and_a_beating_one_is_not() {
        let beat = Arc::new(AtomicU64::new(0));
        let fired = Arc::new(AtomicBool::new(false));
        let flag = fired.clone();
        let dog = Watchdog::start_with(beat.clone(), Duration::from_millis(200), move |_, n| {
            assert_eq!(n, 5);
            flag.store(true, Ordering::Relaxed);
        })
        .expect("thread starts");
        for _ in 0..5 {
            beat.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(60));
        }
        assert!(!fired.load(Ordering::Relaxed), "beating: no stall");
        std::thread::sleep(Duration::from_millis(600));
        assert!(fired.load(Ordering::Relaxed), "silent: a stall");
        drop(dog);
    }
}
