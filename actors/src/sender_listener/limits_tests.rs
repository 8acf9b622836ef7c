//! P's side channel under its limits ([`super::limits`]), over real sockets on 127.0.0.1, D played
//! by a DEALER or by raw TCP speaking ZMTP: an unfinished multipart message is cut once it passes
//! the per-message cap and P's memory stays bounded; a message of too many frames is cut;
//! connections past the caps (per peer address, per socket) are closed at once, those that finish
//! no handshake or no message are closed at their deadline, and a legitimate D is served
//! throughout; an abort naming too many ids is refused. Every cut is counted as a refusal.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use pdflow_messages::frame;
use pdflow_messages::sender_listener::{AbortPull, PullStatus, SideChannelAddr, SideChannelRequest, MAX_ABORT_IDS};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use zeromq::{DealerSocket, Socket, SocketSend, ZmqMessage};

use super::limits::{SideChannelLimits, MAX_MESSAGE_LEN};
use super::tests::{harness_with_auth, Harness, WAIT};
use crate::side_channel_auth::ListenerAuth;

const MIB: usize = 1 << 20;

/// A listener with `limits` and its side-channel address.
async fn harness(limits: SideChannelLimits) -> (Harness, SocketAddr) {
    let h = harness_with_auth(Duration::from_secs(30), ListenerAuth::default().with_limits(limits)).await;
    let addr = h.listener.ask(SideChannelAddr).await.expect("address");
    let addr = addr.trim_start_matches("tcp://").parse().expect("host:port");
    (h, addr)
}

/// `pdflow_auth_refusals_total{socket="side_channel",cause}` in this process.
fn refusals(cause: &str) -> f64 {
    let series = format!("pdflow_auth_refusals_total{{socket=\"side_channel\",cause=\"{cause}\"}} ");
    let text = pdflow_observability::metrics::global().render();
    text.lines().find_map(|l| l.strip_prefix(series.as_str())).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}

/// A raw TCP connection to `to` from `source`, an address of 127/8 (one peer address each).
async fn connect_from(source: [u8; 4], to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.bind(SocketAddr::from((source, 0))).expect("bind a loopback source");
    tokio::time::timeout(WAIT, socket.connect(to)).await.expect("connects in time").expect("connects")
}

/// What a D's DEALER sends first: a ZMTP 3.0 greeting (NULL mechanism), then READY.
fn handshake() -> Vec<u8> {
    let mut bytes = vec![0u8; 64];
    bytes[0] = 0xff;
    bytes[9] = 0x7f;
    bytes[10] = 3;
    bytes[12..16].copy_from_slice(b"NULL");
    let ready = [&[5u8][..], b"READY", &[11], b"Socket-Type", &6u32.to_be_bytes(), b"DEALER"].concat();
    bytes.extend_from_slice(&[0x04, ready.len() as u8]);
    bytes.extend_from_slice(&ready);
    bytes
}

/// The header of a message frame of `len` bytes (long form), `more` frames following.
fn frame_header(len: usize, more: bool) -> Vec<u8> {
    [&[0x02 | u8::from(more)][..], &(len as u64).to_be_bytes()].concat()
}

/// Reads until P closes the connection: the bytes P sent, and how long it stayed open; `None` if
/// it is still open after `bound`.
async fn until_closed(mut stream: TcpStream, bound: Duration) -> Option<(usize, Duration)> {
    let start = Instant::now();
    let mut got = 0;
    let mut buf = [0u8; 4096];
    tokio::time::timeout(bound, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return (got, start.elapsed()),
                Ok(n) => got += n,
            }
        }
    })
    .await
    .ok()
}

/// Sends a multipart message of `frames` frames of `frame_len` zero bytes, the last one never
/// sent; returns the bytes written before P closed the connection (`None`: P never did).
async fn unfinished_message(stream: &mut TcpStream, frames: usize, frame_len: usize) -> Option<usize> {
    let chunk = vec![0u8; MIB.min(frame_len)];
    let mut written = 0;
    for _ in 0..frames {
        if stream.write_all(&frame_header(frame_len, true)).await.is_err() {
            return Some(written);
        }
        let mut left = frame_len;
        while left > 0 {
            let n = left.min(chunk.len());
            if stream.write_all(&chunk[..n]).await.is_err() {
                return Some(written);
            }
            (written, left) = (written + n, left - n);
        }
    }
    None
}

/// The process's peak resident memory, in bytes (`VmHWM`).
fn peak_rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib = status.lines().find_map(|l| l.strip_prefix("VmHWM:")).expect("VmHWM");
    kib.trim().trim_end_matches("kB").trim().parse::<usize>().expect("a number of kB") * 1024
}

/// A pull of `xfer-{n}` over `h.dealer`, served in full: what P must still do after each attack.
async fn serves_a_pull(h: &mut Harness, n: u32) {
    let (p_req, d_req, xfer) = (format!("cmpl-p{n}"), format!("cmpl-d{n}"), format!("xfer-{n}"));
    let d_blocks = vec![2 * n, 2 * n + 1];
    h.record(&[(p_req.as_str(), xfer.as_str(), vec![3, 4])], &[]).await;
    let reqs = [(d_req.as_str(), xfer.as_str(), d_blocks.clone())];
    let pull = frame::encode(&h.pull(u64::from(n), &reqs, true)).expect("encodes");
    tokio::time::timeout(WAIT, h.dealer.send(ZmqMessage::from(pull))).await.expect("in time").expect("sent");
    let resp = h.recv().await;
    assert_eq!((resp.status, resp.ok_reqs), (PullStatus::Finish, vec![d_req.into()]), "{:?}", resp.error);
    h.assert_copied(&[3, 4], &d_blocks);
}

async fn fresh_dealer(addr: SocketAddr) -> DealerSocket {
    let mut dealer = DealerSocket::new();
    let endpoint = format!("tcp://{addr}");
    tokio::time::timeout(WAIT, dealer.connect(&endpoint)).await.expect("connects in time").expect("connects");
    dealer
}

const MEMORY_CHILD: &str = "PDFLOW_SIDE_CHANNEL_MEMORY_CHILD";

/// Runs the test `name` (of this module) alone in a child process, so that its peak memory is
/// P's and that test's only; true in the child, which then runs the test's body.
fn in_memory_child(name: &str) -> bool {
    if std::env::var_os(MEMORY_CHILD).is_some() {
        return true;
    }
    let name = format!("sender_listener::limits_tests::{name}");
    let exe = std::env::current_exe().expect("test binary");
    let out = std::process::Command::new(exe)
        .args(["--exact", &name, "--nocapture", "--test-threads=1"])
        .env(MEMORY_CHILD, "1")
        .output()
        .expect("child runs");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "child failed: {}\n{stdout}\n{stderr}", out.status);
    assert!(stdout.contains("1 passed"), "the child ran no test:\n{stdout}\n{stderr}");
    eprintln!("{}", stderr.lines().filter(|l| l.starts_with("memory:")).collect::<Vec<_>>().join("\n"));
    false
}

fn memory_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

#[test]
fn an_unfinished_multipart_message_is_cut_at_the_cap_and_p_memory_stays_bounded() {
    if !in_memory_child("an_unfinished_multipart_message_is_cut_at_the_cap_and_p_memory_stays_bounded") {
        return;
    }
    memory_runtime().block_on(async {
        let (mut h, addr) = harness(SideChannelLimits::default()).await;
        serves_a_pull(&mut h, 1).await;
        let before = (peak_rss(), refusals("message_too_large"));

        // The attack as measured: eight frames of 60 MiB of one message, never finished. The
        // first header already passes the cap: P closes before reading a byte of it.
        let mut attacker = connect_from([127, 0, 0, 1], addr).await;
        attacker.write_all(&handshake()).await.expect("handshake sent");
        let written = unfinished_message(&mut attacker, 8, 60 * MIB).await.expect("P closed the connection");
        assert!(written < 16 * MIB, "P read {written} bytes of a message over its cap");
        assert!(until_closed(attacker, WAIT).await.is_some(), "P kept the connection");

        // Under the cap frame by frame, over it in sum: 3 MiB frames, cut at the one that passes
        // 16 MiB in all (the sixth).
        let mut attacker = connect_from([127, 0, 0, 1], addr).await;
        attacker.write_all(&handshake()).await.expect("handshake sent");
        let written = unfinished_message(&mut attacker, 20, 3 * MIB).await.expect("P closed the connection");
        assert!(written < 40 * MIB, "P took {written} bytes of one message (cap {MAX_MESSAGE_LEN})");
        assert!(until_closed(attacker, WAIT).await.is_some(), "P kept the connection");

        let grown = peak_rss().saturating_sub(before.0);
        eprintln!("memory: P's peak grew by {} MiB (cap {} MiB)", grown / MIB, MAX_MESSAGE_LEN / MIB);
        assert!(grown < 2 * MAX_MESSAGE_LEN, "P's peak memory grew by {grown} bytes");
        assert!(refusals("message_too_large") >= before.1 + 2.0, "the cuts were not counted");
        serves_a_pull(&mut h, 2).await;
    });
}

/// Ten connections, each sending one 15 MiB frame of a message it never finishes, against a
/// 32 MiB budget for the whole socket: two are held, eight are cut at their frame's header; P's
/// memory grows by the budget, not by 150 MiB; a D's pull (inside its connection's allowance) is
/// served while the budget is spent, and the budget comes back when the holders close.
#[test]
fn unfinished_messages_of_many_connections_share_one_budget() {
    if !in_memory_child("unfinished_messages_of_many_connections_share_one_budget") {
        return;
    }
    memory_runtime().block_on(async {
        let budget = 32 * MIB;
        let limits = SideChannelLimits { max_unfinished_bytes: budget, ..SideChannelLimits::default() };
        let (mut h, addr) = harness(limits).await;
        serves_a_pull(&mut h, 1).await;
        let before = (peak_rss(), refusals("unfinished_bytes"));

        let (mut holders, mut cut) = (Vec::new(), 0);
        for _ in 0..10 {
            let mut attacker = connect_from([127, 0, 0, 1], addr).await;
            attacker.write_all(&handshake()).await.expect("handshake sent");
            match unfinished_message(&mut attacker, 1, 15 * MIB).await {
                None => holders.push(attacker),
                Some(written) => {
                    assert!(written < 15 * MIB, "P read all of a frame it refused");
                    assert!(until_closed(attacker, WAIT).await.is_some(), "P kept a connection it refused");
                    cut += 1;
                }
            }
        }
        assert_eq!((holders.len(), cut), (2, 8), "(held, cut) of ten 15 MiB unfinished messages, 32 MiB budget");
        let grown = peak_rss().saturating_sub(before.0);
        eprintln!("memory: P's peak grew by {} MiB (budget {} MiB)", grown / MIB, budget / MIB);
        assert!(grown < 2 * budget, "P's peak memory grew by {grown} bytes");
        assert!(refusals("unfinished_bytes") >= before.1 + 8.0, "the cuts were not counted");
        serves_a_pull(&mut h, 2).await;

        // The holders go away: their bytes are given back.
        drop(holders);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut again = connect_from([127, 0, 0, 1], addr).await;
        again.write_all(&handshake()).await.expect("handshake sent");
        assert!(
            unfinished_message(&mut again, 1, 15 * MIB).await.is_none(),
            "the closed connections' bytes were not given back to the budget"
        );
        serves_a_pull(&mut h, 3).await;
    });
}

#[tokio::test]
async fn a_message_of_too_many_frames_is_cut_and_counted() {
    let limits = SideChannelLimits { max_message_frames: 4, ..SideChannelLimits::default() };
    let (mut h, addr) = harness(limits).await;
    let before = refusals("too_many_frames");
    let mut attacker = connect_from([127, 0, 0, 1], addr).await;
    attacker.write_all(&handshake()).await.expect("handshake sent");
    let empty_frames = [0x01u8, 0].repeat(100_000);
    let _ = attacker.write_all(&empty_frames).await;
    assert!(until_closed(attacker, WAIT).await.is_some(), "P kept the connection");
    assert!(refusals("too_many_frames") > before, "the cut was not counted");
    serves_a_pull(&mut h, 1).await;
}

/// 300 idle connections from two addresses (and one that only completes its handshake) against
/// caps of 100 connections and 60 per address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_caps_are_closed_idle_ones_time_out_and_d_is_served() {
    let (handshake_timeout, idle) = (Duration::from_secs(2), Duration::from_secs(3));
    let limits = SideChannelLimits {
        max_connections: 100,
        max_connections_per_ip: 60,
        handshake_timeout,
        idle_timeout: Some(idle),
        ..SideChannelLimits::default()
    };
    let (mut h, addr) = harness(limits).await; // the harness's DEALER holds one connection
    let before = (refusals("too_many_connections"), refusals("idle_timeout"));

    // A peer that completes its handshake, then sends nothing: closed after the idle timeout.
    let mut quiet = connect_from([127, 0, 0, 4], addr).await;
    quiet.write_all(&handshake()).await.expect("handshake sent");
    let quiet = tokio::spawn(until_closed(quiet, idle * 3));

    // 150 from 127.0.0.2: 60 held (until their handshake deadline), 90 closed at once.
    let watch = |stream| tokio::spawn(until_closed(stream, handshake_timeout * 3));
    let mut from_2 = Vec::new();
    for _ in 0..150 {
        from_2.push(watch(connect_from([127, 0, 0, 2], addr).await));
    }
    // 127.0.0.1 is not that peer: a new D connection there is served meanwhile.
    let first_dealer = std::mem::replace(&mut h.dealer, fresh_dealer(addr).await);
    serves_a_pull(&mut h, 1).await;
    // 150 from 127.0.0.3: the socket holds 63 (60 + the quiet peer + two DEALERs), so 37 more.
    let mut from_3 = Vec::new();
    for _ in 0..150 {
        from_3.push(watch(connect_from([127, 0, 0, 3], addr).await));
    }

    let (mut held, mut refused) = (vec![0usize; 2], vec![0usize; 2]);
    for (i, watchers) in [from_2, from_3].into_iter().enumerate() {
        for watcher in watchers {
            let (bytes, open) = watcher.await.expect("watcher").expect("P closed every connection in time");
            if bytes == 0 {
                refused[i] += 1;
                assert!(open < handshake_timeout / 2, "a refused connection stayed open {open:?}");
            } else {
                held[i] += 1;
                assert_eq!(bytes, 64, "P sends its greeting, then waits for the peer's");
                assert!(open >= handshake_timeout - Duration::from_millis(300), "closed after only {open:?}");
            }
        }
    }
    assert_eq!((held, refused), (vec![60, 37], vec![90, 113]), "(held, refused) from 127.0.0.2 and 127.0.0.3");
    let (bytes, open) = quiet.await.expect("watcher").expect("P closed the quiet peer in time");
    assert!(bytes > 64 && open >= idle - Duration::from_millis(300), "quiet peer: {bytes} bytes, {open:?}");
    assert!(refusals("too_many_connections") >= before.0 + 203.0, "the refused connections were not counted");
    assert!(refusals("idle_timeout") >= before.1 + 98.0, "the timed-out connections were not counted");

    // Every slot given back: a new D is served.
    drop(first_dealer);
    h.dealer = fresh_dealer(addr).await;
    serves_a_pull(&mut h, 2).await;
}

#[tokio::test]
async fn an_abort_naming_too_many_ids_is_refused_and_counted() {
    let (mut h, _) = harness(SideChannelLimits::default()).await;
    let before = refusals("too_many_ids");
    let ids = (0..=MAX_ABORT_IDS).map(|i| format!("xfer-gone-{i}").into()).collect();
    let abort =
        frame::encode(&SideChannelRequest::Abort(AbortPull { pull_id: 9, transfer_ids: ids })).expect("encodes");
    tokio::time::timeout(WAIT, h.dealer.send(ZmqMessage::from(abort))).await.expect("in time").expect("sent");
    let resp = h.recv().await;
    assert_eq!((resp.status, resp.pull_id), (PullStatus::Error, 0));
    let error = resp.error.unwrap_or_default();
    assert!(error.contains(&format!("more than the {MAX_ABORT_IDS}")), "{error}");
    assert!(refusals("too_many_ids") > before, "the refusal was not counted");
    serves_a_pull(&mut h, 1).await;
}
