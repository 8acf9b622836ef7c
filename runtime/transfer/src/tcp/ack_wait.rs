//! How P waits for D's ack of a small batch (the tail of seed step 29): by polling the socket for
//! a short, bounded time before parking on the reactor.
//!
//! A small write's latency on loopback or a fast link is a few microseconds of copying and one
//! round trip; what dominates is waking a parked thread when the ack arrives (tens of
//! microseconds on a virtual machine). For a batch of at most [`SPIN_MAX_BYTES`], P peeks at the
//! socket without blocking for up to [`SPIN_BUDGET`]; an ack that is complete by then is consumed
//! and parsed at once, and anything else — no ack yet, a partial one, an error — leaves the bytes
//! where they are for the ordinary asynchronous read. Only whole acks are consumed here, so the
//! stream never loses its framing.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use futures::FutureExt;
use tokio::net::TcpStream;

use super::stream::DataStream;
use super::wire::{self, Ack, WireError};

/// Batches up to this size are waited for by polling first: the ack of a larger one comes after
/// the kernel has copied its bytes (milliseconds), where polling would only burn a core.
pub(crate) const SPIN_MAX_BYTES: u64 = 512 * 1024;
/// How long P polls for the ack before it parks.
pub(crate) const SPIN_BUDGET: Duration = Duration::from_micros(150);
/// An ack with a reason of up to this many bytes can be consumed by the fast path.
const PEEK_BYTES: usize = 15 + 256;

/// Reads the next ack: for a batch of `batch_bytes` ≤ [`SPIN_MAX_BYTES`], first by polling (see
/// the module docs), then — or for a larger batch, or over TLS, at once — by the asynchronous read.
pub(crate) async fn read_ack(stream: &mut DataStream, batch_bytes: u64) -> Result<Ack, WireError> {
    if let Some(plain) = stream.plain().filter(|_| batch_bytes <= SPIN_MAX_BYTES) {
        if let Some(ack) = poll_for_ack(plain, SPIN_BUDGET) {
            return ack;
        }
    }
    wire::read_ack(stream).await
}

/// Peeks for a whole ack for up to `budget`; consumes and parses it when it is there.
fn poll_for_ack(stream: &TcpStream, budget: Duration) -> Option<Result<Ack, WireError>> {
    let fd = stream.as_raw_fd();
    let mut buf = [0u8; PEEK_BYTES];
    let until = Instant::now() + budget;
    loop {
        // SAFETY: `fd` is the open socket `stream` owns for the whole call; `buf` is writable
        // for its length. MSG_DONTWAIT: never blocks; MSG_PEEK: consumes nothing.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT) };
        if n > 0 {
            let n = usize::try_from(n).ok()?;
            let whole = whole_ack_len(&buf[..n])?;
            // SAFETY: as above; the `whole` bytes are already queued (just peeked), so this
            // returns them without blocking.
            let got = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), whole, libc::MSG_DONTWAIT) };
            if usize::try_from(got).ok() != Some(whole) {
                // Cannot happen for bytes just peeked on a stream only this task reads; the
                // asynchronous read would then see a torn stream, so report it here.
                let e = std::io::Error::other(format!("read {got} of an ack's {whole} peeked bytes"));
                return Some(Err(WireError::Io(e)));
            }
            return wire::read_ack(&mut &buf[..whole]).now_or_never();
        }
        if n == 0 {
            // The peer closed: the asynchronous read reports it with its usual error.
            return None;
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::WouldBlock && err.kind() != std::io::ErrorKind::Interrupted {
            return None;
        }
        if Instant::now() >= until {
            return None;
        }
        // Yield rather than spin: the thread this poll waits for may have been woken onto this
        // very core (loopback wakes the receiver where the sender runs).
        std::thread::yield_now();
    }
}

/// The length of the whole ack at the start of `peeked`, if all of it is there and fits.
fn whole_ack_len(peeked: &[u8]) -> Option<usize> {
    let head = peeked.get(..15)?;
    let whole = 15 + usize::from(u16::from_le_bytes([head[13], head[14]]));
    (whole <= peeked.len()).then_some(whole)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    async fn pair() -> (DataStream, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (DataStream::Plain(client.expect("connect")), accepted.expect("accept").0)
    }

    fn sock(p: &DataStream) -> &TcpStream {
        p.plain().expect("a plain connection")
    }

    async fn encoded(ack: &Ack) -> Vec<u8> {
        let mut out = Vec::new();
        wire::write_ack(&mut out, ack).await.expect("encode");
        out
    }

    #[tokio::test]
    async fn acks_already_there_are_read_by_polling_and_the_stream_keeps_its_framing() {
        let (mut p, mut d) = pair().await;
        let first = Ack::Ok { batch_id: 7 };
        let second = Ack::Refused { batch_id: 8, reason: "fence 3 is closed".into() };
        let mut bytes = encoded(&first).await;
        bytes.extend(encoded(&second).await);
        d.write_all(&bytes).await.expect("send");
        // Both acks are queued: the first poll takes exactly one, the second the next one.
        let deadline = Duration::from_secs(2);
        assert_eq!(poll_for_ack(sock(&p), deadline).expect("first ack polled").expect("parses"), first);
        assert_eq!(read_ack(&mut p, 32 * 1024).await.expect("second ack"), second);
    }

    #[tokio::test]
    async fn an_ack_split_across_writes_is_left_to_the_asynchronous_read() {
        let (mut p, mut d) = pair().await;
        let ack = encoded(&Ack::Ok { batch_id: 42 }).await;
        d.write_all(&ack[..6]).await.expect("first part");
        d.flush().await.expect("flush");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(poll_for_ack(sock(&p), Duration::from_millis(1)).is_none(), "a partial ack is not consumed");
        let rest = ack[6..].to_vec();
        let finish = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            d.write_all(&rest).await.expect("rest");
            d
        });
        assert_eq!(read_ack(&mut p, 32 * 1024).await.expect("whole ack"), Ack::Ok { batch_id: 42 });
        drop(finish.await);
    }

    #[tokio::test]
    async fn a_long_refusal_and_a_closed_peer_go_to_the_asynchronous_read() {
        let (mut p, mut d) = pair().await;
        let long = Ack::Refused { batch_id: 1, reason: "x".repeat(900) };
        d.write_all(&encoded(&long).await).await.expect("send");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(poll_for_ack(sock(&p), Duration::from_millis(1)).is_none(), "too long for the peek buffer");
        assert!(matches!(read_ack(&mut p, 1024).await.expect("read"), Ack::Refused { batch_id: 1, .. }));
        drop(d);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(poll_for_ack(sock(&p), Duration::from_millis(1)).is_none());
        assert!(read_ack(&mut p, 1024).await.is_err(), "a closed peer is an error");
    }
}
