//! Same-run ceilings for `pdflow bench transfer`: what this machine can do at best with the same
//! bytes — a single-thread memcpy, and a plain tokio TCP sender/receiver over loopback with 1 and
//! 4 streams (no protocol, one large buffer per stream). Each run's process CPU time is measured
//! with its wall-clock time (both ends run in this process).

use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::bench::report::{Samples, Stopwatch};

/// How long one loopback run may take.
const RUN_DEADLINE: Duration = Duration::from_secs(30);

/// `runs` single-thread copies of `bytes` bytes (after `warmup` unmeasured ones).
pub fn memcpy_ms(bytes: usize, warmup: usize, runs: usize) -> Samples {
    let src: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![1u8; bytes];
    let mut samples = Samples::default();
    for i in 0..warmup + runs {
        let started = Stopwatch::start();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        if i >= warmup {
            samples.push(started.stop());
        }
    }
    samples
}

/// `runs` moves of `bytes` bytes over `streams` loopback TCP connections.
pub async fn loopback_tcp_ms(bytes: usize, streams: usize, warmup: usize, runs: usize) -> anyhow::Result<Samples> {
    let listener = TcpListener::bind("127.0.0.1:0").await.context("binding the loopback ceiling's listener")?;
    let addr = listener.local_addr()?;
    let share = bytes.div_ceil(streams);
    let mut senders = Vec::with_capacity(streams);
    let mut receivers = Vec::with_capacity(streams);
    for _ in 0..streams {
        let (connected, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (tx, (rx, _)) = (connected?, accepted?);
        tx.set_nodelay(true)?;
        senders.push(tx);
        receivers.push(rx);
    }
    let mut samples = Samples::default();
    let mut pairs: Vec<(TcpStream, TcpStream, Vec<u8>, Vec<u8>)> =
        senders.into_iter().zip(receivers).map(|(tx, rx)| (tx, rx, vec![7u8; share], vec![0u8; share])).collect();
    for i in 0..warmup + runs {
        let started = Stopwatch::start();
        let moves = pairs.drain(..).map(|(mut tx, mut rx, src, mut dst)| {
            tokio::spawn(async move {
                let send = tokio::spawn(async move { tx.write_all(&src).await.map(|_| (tx, src)) });
                rx.read_exact(&mut dst).await?;
                let (tx, src) = send.await.map_err(std::io::Error::other)??;
                Ok::<_, std::io::Error>((tx, rx, src, dst))
            })
        });
        let moved = tokio::time::timeout(RUN_DEADLINE, futures::future::join_all(moves))
            .await
            .context("loopback ceiling run timed out")?;
        for m in moved {
            pairs.push(m.context("loopback stream task failed")??);
        }
        if i >= warmup {
            samples.push(started.stop());
        }
    }
    Ok(samples)
}

/// Milliseconds of `runs` round trips of `bytes` bytes and a 15-byte answer (a small write and
/// its ack) over one loopback TCP connection between two blocking threads: the floor of a small
/// write over TCP on this machine without busy-polling on either side.
pub fn loopback_round_trip_ms(bytes: usize, warmup: usize, runs: usize) -> anyhow::Result<Samples> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("binding the round-trip ceiling's listener")?;
    let addr = listener.local_addr()?;
    let rounds = warmup + runs;
    // Connected first, so the accept finds the connection queued and returns at once.
    let mut c = std::net::TcpStream::connect(addr).context("connecting the round-trip ceiling")?;
    let (mut s, _) = listener.accept().context("accepting the round-trip ceiling's connection")?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(RUN_DEADLINE))?;
        let mut buf = vec![0u8; bytes];
        for _ in 0..rounds {
            s.read_exact(&mut buf)?;
            s.write_all(&[0u8; 15])?;
        }
        Ok(())
    });
    c.set_nodelay(true)?;
    c.set_read_timeout(Some(RUN_DEADLINE))?;
    let (msg, mut ack) = (vec![7u8; bytes], [0u8; 15]);
    let mut samples = Samples::default();
    for i in 0..rounds {
        let started = Stopwatch::start();
        c.write_all(&msg)?;
        c.read_exact(&mut ack)?;
        if i >= warmup {
            samples.push(started.stop());
        }
    }
    server.join().map_err(|_| anyhow::anyhow!("the round-trip ceiling's server thread panicked"))??;
    Ok(samples)
}
