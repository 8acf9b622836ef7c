//! Bounded busy-polling of a socket (the receiving half of seed step 29 for small writes): wait
//! for bytes by peeking without blocking for a short, bounded time before sleeping in the kernel.
//!
//! A small write's latency on loopback or a fast link is a few microseconds of copying; waking a
//! thread that sleeps in `recv` costs tens of microseconds on a virtual machine. D's data
//! connection polls for the next request for [`SPIN_AFTER_ACK`] after it acked a batch (P's next
//! batch of a plan, or the next plan, usually follows at once), then sleeps. This is what the
//! kernel's own `SO_BUSY_POLL` does for drivers with NAPI; loopback has none, so it is done here.

use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// How long D's data connection polls for P's next request after acking a batch.
pub(crate) const SPIN_AFTER_ACK: Duration = Duration::from_micros(50);

/// Polls `fd` for up to `budget`: `true` as soon as a byte (or the peer's close, or an error the
/// next read will report) is there, `false` when the budget ran out with nothing to read.
pub(crate) fn readable_within(fd: RawFd, budget: Duration) -> bool {
    let until = Instant::now() + budget;
    let mut byte = 0u8;
    loop {
        // SAFETY: the caller owns the open socket `fd` for the whole call; `byte` is writable.
        // MSG_PEEK consumes nothing, MSG_DONTWAIT never blocks.
        let n = unsafe { libc::recv(fd, (&mut byte as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
        if n >= 0 {
            return true;
        }
        let kind = std::io::Error::last_os_error().kind();
        if kind != std::io::ErrorKind::WouldBlock && kind != std::io::ErrorKind::Interrupted {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        // Yield rather than spin: the thread this poll waits for may have been woken onto this
        // very core (loopback wakes the receiver where the sender runs).
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsRawFd;

    use super::*;

    #[test]
    fn readable_within_sees_bytes_closes_and_gives_up_on_silence() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
        let mut client = std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connects");
        let (server, _) = listener.accept().expect("accepts");
        let fd = server.as_raw_fd();
        assert!(!readable_within(fd, Duration::from_micros(200)), "nothing was sent yet");
        client.write_all(b"x").expect("writes");
        assert!(readable_within(fd, Duration::from_secs(5)), "a byte was sent");
        let mut rest = [0u8; 1];
        std::io::Read::read_exact(&mut &server, &mut rest).expect("reads the byte");
        drop(client);
        assert!(
            readable_within(fd, Duration::from_secs(5)),
            "the peer's close must end the poll (the read reports it)"
        );
    }
}
