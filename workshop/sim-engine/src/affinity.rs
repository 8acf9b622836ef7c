//! Pinning the engine's forward to a CPU of its own (step 15): on a GPU host the forward runs on
//! the GPU, apart from the cores the connector's threads and the network stack use; on a CPU host
//! `pdflow serve --forward-cpu N` gives it that separation, so that what the connector does beside
//! the forward (layer-wise writes) can be measured against the forward alone.

use std::io;

/// The calling thread pinned to one CPU; dropping it restores the thread's CPUs before.
#[derive(Debug)]
pub struct Pinned {
    #[cfg(target_os = "linux")]
    before: libc::cpu_set_t,
}

/// Pins the calling thread to `cpu` until the returned guard is dropped.
#[cfg(target_os = "linux")]
pub fn pin_current_thread(cpu: usize) -> io::Result<Pinned> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("CPU {cpu} is beyond the CPU set's size")));
    }
    let before = current_cpus()?;
    // SAFETY: `set` is a plain bitmask owned here; CPU_SET writes inside it (cpu < CPU_SETSIZE),
    // and sched_setaffinity(0, …) reads it for the calling thread only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(Pinned { before })
}

/// Whether a thread can be pinned to `cpu` here (tried on a scratch thread): what `--forward-cpu`
/// is checked with before the engine starts.
pub fn check_cpu(cpu: usize) -> io::Result<()> {
    std::thread::spawn(move || pin_current_thread(cpu).map(drop))
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the thread trying the CPU panicked")))
}

/// The calling thread's CPUs.
#[cfg(target_os = "linux")]
fn current_cpus() -> io::Result<libc::cpu_set_t> {
    // SAFETY: sched_getaffinity(0, …) fills `set`, a plain bitmask owned here, for the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(set)
    }
}

#[cfg(target_os = "linux")]
impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: restores the mask read from this thread when it was pinned.
        let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.before) };
        if rc != 0 {
            tracing::warn!(error = %io::Error::last_os_error(), "cannot restore a pinned thread's CPUs");
        }
    }
}

/// Pins the calling thread to `cpu` (not supported off Linux).
#[cfg(not(target_os = "linux"))]
pub fn pin_current_thread(cpu: usize) -> io::Result<Pinned> {
    Err(io::Error::new(io::ErrorKind::Unsupported, format!("pinning to CPU {cpu} needs Linux")))
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn cpus() -> Vec<usize> {
        let set = current_cpus().expect("this thread's CPUs");
        // SAFETY: CPU_ISSET reads inside the set (c < CPU_SETSIZE).
        (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
    }

    #[test]
    fn a_pinned_thread_runs_on_that_cpu_until_the_guard_drops() {
        std::thread::spawn(|| {
            let before = cpus();
            let pinned = pin_current_thread(0).expect("CPU 0 exists");
            assert_eq!(cpus(), vec![0]);
            drop(pinned);
            assert_eq!(cpus(), before);
        })
        .join()
        .expect("the pinned thread");
    }

    #[test]
    fn a_cpu_beyond_the_set_is_an_error() {
        assert!(pin_current_thread(1 << 20).is_err());
        assert!(check_cpu(1 << 20).is_err());
        assert!(check_cpu(0).is_ok());
    }
}
