//! A thousand idle connections against P's side channel, P running with an open-file limit of
//! 1,024 (a common default): P holds at most its connection cap (512) of them, the rest are closed
//! at once; P's file descriptors stay within that cap over its baseline; the requests served
//! meanwhile through `pdflow proxy` return the single engine's tokens (D recomputes while the cap
//! is full: its pull's connection is closed, and so could be its abort, so P frees that request's
//! blocks at its send expiry, 4 s here); once the handshake deadline closes the idle ones, P's
//! descriptors are back at their baseline and D loads the KV from P again.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use pdflow_tests::processes::Proc;
use pdflow_tests::{completion, http_client, post, prompt, reference, token_ids, SMALL};
use tokio::net::{TcpSocket, TcpStream};

const SHAPE: &str = "4,2,16,16";
/// The side channel's default connection cap.
const CAP: usize = 512;

/// Open file descriptors of process `pid`.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// P's side-channel address, from its bootstrap's table.
async fn side_channel(client: &reqwest::Client, bootstrap: &str) -> SocketAddr {
    let table: serde_json::Value =
        client.get(format!("{bootstrap}/query")).send().await.expect("query").json().await.expect("JSON");
    let addr = table["0"]["worker_addr"]["0"]["0"].as_str().expect("P's worker 0 is registered").to_owned();
    addr.trim_start_matches("tcp://").parse().expect("host:port")
}

async fn connect_from(source: [u8; 4], to: SocketAddr) -> Option<TcpStream> {
    let socket = TcpSocket::new_v4().ok()?;
    socket.bind(SocketAddr::from((source, 0))).ok()?;
    socket.connect(to).await.ok()
}

/// Whether P closed `stream` (a read returns 0 or fails) within `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 256];
    let until = Instant::now() + within;
    loop {
        match tokio::time::timeout(until.saturating_duration_since(Instant::now()), stream.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => continue, // P's ZMTP greeting
            Err(_) => return false,
        }
    }
}

/// D's received transfers (`pdflow_transfer_blocks_count{side="d"}`).
async fn transfers_into(client: &reqwest::Client, d: &Proc) -> u64 {
    let text = client.get(format!("{}/metrics", d.url())).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .filter(|l| l.starts_with("pdflow_transfer_blocks_count{") && l.contains("side=\"d\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

async fn assert_served(client: &reqwest::Client, proxy: &Proc, seed: u64) {
    let body = completion(&prompt(120, seed), 8);
    let (status, answer) =
        post(client, &format!("{}/v1/completions", proxy.url()), &body).await.expect("the proxy answers");
    assert_eq!(status, 200, "{answer}");
    assert_eq!(token_ids(&answer), token_ids(&reference(SMALL, &body).await.expect("reference")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_idle_connections_leave_p_within_its_cap_and_serving() {
    let client = http_client();
    let handshake = Duration::from_secs(3);
    let limit = format!("side_channel.handshake_timeout={}", handshake.as_secs());
    let engine = |role: &'static str| ["serve", "--role", role, "--kv-shape", SHAPE, "--num-blocks", "128"];
    let mut p_args = engine("producer").to_vec();
    p_args.extend(["--bootstrap-port", "0", "--send-expiry", "4", "--limit", &limit]);
    let p = Proc::spawn_with_open_files("producer", &p_args, &[], Some(1024)).await.expect("P starts");
    let d = Proc::spawn("consumer", &engine("consumer"), &[]).await.expect("D starts");
    let bootstrap = format!("http://{}", p.ready["bootstrap_addr"].as_str().expect("P's bootstrap"));
    let bootstrap_port = bootstrap.rsplit(':').next().unwrap_or_default().to_owned();
    let proxy = Proc::proxy(&p, &bootstrap_port, &d).await.expect("the proxy starts");
    pdflow_tests::wait_healthy(&client, &proxy.url(), Duration::from_secs(10)).await.expect("the proxy is ready");
    let pid = p.child.id().expect("P's pid");
    let side = side_channel(&client, &bootstrap).await;

    assert_served(&client, &proxy, 1).await;
    let baseline = open_fds(pid);

    // A thousand connections from eight addresses (125 each: under the per-address cap of 128).
    let mut idle = Vec::new();
    for i in 0..1000u32 {
        let source = [127, 0, 1, 2 + (i % 8) as u8];
        idle.extend(connect_from(source, side).await);
    }
    assert_eq!(idle.len(), 1000, "every connection reached P's accept queue");
    // P accepts them from its queue: its descriptors, sampled for half the handshake deadline.
    let (mut peak, until) = (0, Instant::now() + handshake / 2);
    while Instant::now() < until {
        peak = peak.max(open_fds(pid));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (mut refused, mut held) = (0, Vec::new());
    for mut stream in idle {
        if closed_within(&mut stream, Duration::from_millis(1)).await {
            refused += 1;
        } else {
            held.push(stream);
        }
    }
    eprintln!("P: {baseline} descriptors before, at most {peak} with 1,000 connections ({refused} closed at once)");
    assert!(peak <= baseline + CAP + 16, "P held {peak} descriptors ({baseline} before, cap {CAP})");
    assert!(held.len() <= CAP && refused >= 1000 - CAP, "{} held, {refused} closed at once", held.len());
    assert!(peak >= baseline + CAP / 2, "P accepted few of them ({peak} descriptors): the test proves nothing");

    // Served meanwhile: the right tokens (D recomputes if its pull cannot connect).
    assert_served(&client, &proxy, 2).await;

    // The handshake deadline closes every idle one; P is back at its baseline and transfers again.
    for mut stream in held {
        assert!(closed_within(&mut stream, handshake * 4).await, "an idle connection outlived the handshake deadline");
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while open_fds(pid) > baseline + 8 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(open_fds(pid) <= baseline + 8, "P holds {} descriptors, {baseline} before", open_fds(pid));
    let before = transfers_into(&client, &d).await;
    assert_served(&client, &proxy, 3).await;
    assert_eq!(transfers_into(&client, &d).await, before + 1, "D loaded the request's KV from P");
    for engine in [&p, &d] {
        engine.assert_blocks_at_baseline(&client, "after the idle connections").await;
    }
}
