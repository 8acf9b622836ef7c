//! Protected mode as a user meets it, with `pdflow` processes and this machine's non-loopback
//! address standing for another host (the engines bind it, or `0.0.0.0`, and a connection to it
//! comes from it; no root needed).
//!
//! - Without a cluster secret or `--insecure`, P and D bound on `0.0.0.0` serve a request through a
//!   proxy on loopback, while every one of their sockets — P's engine API, its bootstrap, its side
//!   channel, D's engine API, D's data server — closes a connection from the non-loopback address
//!   at accept, each counted in `/metrics` as `cause="not_loopback"`; and `--host` set to that
//!   address is refused at start-up, saying to set a secret or `--insecure`.
//! - With `--insecure` (or `PDFLOW_INSECURE=1`), P and D bound on that address serve a request end
//!   to end over it (the proxy's calls, D's look-up, the pull, P's tcp write all come from it).
//! - With the cluster secret, the same, and a call without the secret's proof is still refused.
//!
//! Skipped, saying why, on a machine with no non-loopback address.

use std::net::IpAddr;
use std::time::Duration;

use pdflow_tests::processes::{pdflow_bin, Proc};
use pdflow_tests::{completion, http_client, post, prompt, reference_tokens, token_ids, wait_healthy, SMALL};
use serde_json::Value;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

const SHAPE: &str = "4,2,16,16";
const WAIT: Duration = Duration::from_secs(5);

/// The loopback address of `ip`'s family.
fn loopback_of(ip: IpAddr) -> IpAddr {
    if ip.is_ipv4() {
        [127, 0, 0, 1].into()
    } else {
        std::net::Ipv6Addr::LOCALHOST.into()
    }
}

/// `ip:port` as a URL's authority (IPv6 in brackets).
fn at(ip: IpAddr, port: &str) -> String {
    match ip {
        IpAddr::V4(v4) => format!("{v4}:{port}"),
        IpAddr::V6(v6) => format!("[{v6}]:{port}"),
    }
}

/// The port of an announced `host:port` (or `tcp://host:port`).
fn port_of(addr: &str) -> String {
    addr.rsplit(':').next().unwrap_or_default().to_string()
}

/// `pdflow serve --role ROLE --host HOST …EXTRA`, small.
async fn engine(role: &str, host: &str, extra: &[&str], envs: &[(&str, &str)]) -> Proc {
    let mut args = vec!["serve", "--role", role, "--host", host, "--kv-shape", SHAPE, "--num-blocks", "128"];
    args.extend_from_slice(extra);
    Proc::spawn(role, &args, envs).await.unwrap_or_else(|e| panic!("{role} starts: {e:#}"))
}

/// A request through `proxy`, checked against the reference's tokens.
async fn request_served(proxy: &Proc) {
    let client = http_client();
    wait_healthy(&client, &proxy.url(), Duration::from_secs(20)).await.expect("the proxy sees P and D healthy");
    let body = completion(&prompt(200, 11), 8);
    let (status, answer) = post(&client, &format!("{}/v1/completions", proxy.url()), &body).await.expect("request");
    assert_eq!(status, 200, "{answer}");
    assert_eq!(token_ids(&answer), reference_tokens(SMALL, &body).await);
}

/// Whether a TCP connection from this host to `ip:port` is closed by the server before it sends a
/// byte (within [`WAIT`]; a server that serves the peer either speaks first — ZMTP — or waits for
/// the peer's first bytes past that bound).
async fn closed_at_accept(ip: IpAddr, port: &str) -> bool {
    let Ok(Ok(mut stream)) = tokio::time::timeout(WAIT, TcpStream::connect(at(ip, port))).await else {
        return false;
    };
    let mut buf = [0u8; 64];
    matches!(tokio::time::timeout(WAIT, stream.read(&mut buf)).await, Ok(Ok(0) | Err(_)))
}

/// Whether an HTTP `GET path` from `ip` to `ip:port` got no answer at all.
async fn http_unanswered(ip: IpAddr, port: &str, path: &str) -> bool {
    let client = reqwest::Client::builder().local_address(ip).no_proxy().timeout(WAIT).build().expect("client");
    client.get(format!("http://{}{path}", at(ip, port))).send().await.is_err()
}

/// `pdflow_auth_refusals_total{socket,cause="not_loopback"}` in the `/metrics` of the engine at
/// `url` (asked over loopback).
async fn not_loopback_refusals(url: &str, socket: &str) -> f64 {
    let text = http_client().get(format!("{url}/metrics")).send().await.expect("metrics").text().await.expect("text");
    let series = format!("pdflow_auth_refusals_total{{socket=\"{socket}\",cause=\"not_loopback\"}} ");
    text.lines().find_map(|l| l.strip_prefix(series.as_str())).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_a_secret_every_socket_closes_a_peer_off_loopback_and_loopback_is_served() {
    let Some(ip) = pdflow_testkit::non_loopback_ip_or_skip("processes: protected mode on every socket") else { return };
    let any = if ip.is_ipv4() { "0.0.0.0" } else { "::" };
    let producer = engine("producer", any, &["--bootstrap-port", "0"], &[]).await;
    let consumer = engine("consumer", any, &["--kv-load-failure-policy", "fail", "--transport", "tcp"], &[]).await;
    let bootstrap_port = port_of(producer.ready["bootstrap_addr"].as_str().expect("P launched its bootstrap"));
    let proxy = Proc::proxy(&producer, &bootstrap_port, &consumer).await.expect("proxy starts");
    request_served(&proxy).await;

    // P's side channel: where its bootstrap (asked over loopback) says it listens.
    let table: Value = http_client()
        .get(format!("http://{}/query", at(loopback_of(ip), &bootstrap_port)))
        .send()
        .await
        .expect("query")
        .json()
        .await
        .expect("a table");
    let side_channel = port_of(table["0"]["worker_addr"]["0"]["0"].as_str().expect("P's worker registered"));
    let p_api = port_of(&producer.url());
    let d_api = port_of(&consumer.url());
    let loopback = loopback_of(ip);
    let (p_url, d_url) = (format!("http://{}", at(loopback, &p_api)), format!("http://{}", at(loopback, &d_api)));
    let data = port_of(consumer.ready["data_addr"].as_str().expect("D's data server"));

    assert!(http_unanswered(ip, &p_api, "/health").await, "P's engine API served {ip}");
    assert!(http_unanswered(ip, &bootstrap_port, "/query").await, "P's bootstrap served {ip}");
    assert!(closed_at_accept(ip, &side_channel).await, "P's side channel served {ip}");
    assert!(http_unanswered(ip, &d_api, "/health").await, "D's engine API served {ip}");
    assert!(closed_at_accept(ip, &data).await, "D's data server served {ip}");
    for (url, socket) in [(&p_url, "engine"), (&p_url, "bootstrap"), (&p_url, "side_channel"), (&d_url, "engine")] {
        assert!(not_loopback_refusals(url, socket).await >= 1.0, "{url}: no {socket} refusal counted");
    }
    assert!(not_loopback_refusals(&d_url, "data").await >= 1.0, "D: no data refusal counted");
    request_served(&proxy).await;
    for p in [proxy, consumer, producer] {
        p.stop().await;
    }

    // An address no peer could use in protected mode: refused before anything binds.
    let out = tokio::process::Command::new(pdflow_bin().expect("pdflow"))
        .args(["serve", "--role", "consumer", "--host", &ip.to_string()])
        .output()
        .await
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && out.stdout.is_empty(), "started on {ip} in protected mode: {stderr}");
    assert!(
        stderr.contains("--host") && stderr.contains("--insecure") && stderr.contains("cluster secret"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_insecure_p_and_d_on_a_non_loopback_address_serve_each_other() {
    let Some(ip) = pdflow_testkit::non_loopback_ip_or_skip("processes: insecure serves non-loopback peers") else {
        return;
    };
    let host = ip.to_string();
    let producer = engine("producer", &host, &["--bootstrap-port", "0", "--insecure"], &[]).await;
    // The environment variable opts out as the flag does.
    let d_args = ["--kv-load-failure-policy", "fail", "--transport", "tcp"];
    let consumer = engine("consumer", &host, &d_args, &[("PDFLOW_INSECURE", "1")]).await;
    let bootstrap_port = port_of(producer.ready["bootstrap_addr"].as_str().expect("P launched its bootstrap"));
    let proxy = Proc::proxy(&producer, &bootstrap_port, &consumer).await.expect("proxy starts");
    request_served(&proxy).await;
    for p in [proxy, consumer, producer] {
        p.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_a_secret_p_and_d_on_a_non_loopback_address_serve_each_other_and_still_demand_proofs() {
    let Some(ip) = pdflow_testkit::non_loopback_ip_or_skip("processes: a secret serves non-loopback peers") else {
        return;
    };
    let dir =
        std::env::temp_dir().join(format!("pdflow-protected-{}-{}", std::process::id(), pdflow_tests::uuid_like()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("secret");
    std::fs::write(&file, "the-cluster-secret-0001\n").expect("secret written");
    let secret = ["--cluster-secret-file", file.to_str().expect("a UTF-8 path")];
    let host = ip.to_string();
    let producer = engine("producer", &host, &[&["--bootstrap-port", "0"][..], &secret].concat(), &[]).await;
    let d_args = [&["--kv-load-failure-policy", "fail", "--transport", "tcp"][..], &secret].concat();
    let consumer = engine("consumer", &host, &d_args, &[]).await;
    let bootstrap_port = port_of(producer.ready["bootstrap_addr"].as_str().expect("P launched its bootstrap"));
    let (p_url, d_url) = (producer.url(), consumer.url());
    let proxy_args =
        [&["proxy", "--port", "0", "--prefill", &p_url, &bootstrap_port, "--decode", &d_url][..], &secret].concat();
    let proxy = Proc::spawn("proxy", &proxy_args, &[]).await.expect("proxy starts");
    request_served(&proxy).await;
    // Served, and authenticated as ever: a look-up without the secret's proof is a 401.
    let unsigned =
        http_client().get(format!("http://{}/query", at(ip, &bootstrap_port))).send().await.expect("answered");
    assert_eq!(unsigned.status().as_u16(), 401);
    for p in [proxy, consumer, producer] {
        p.stop().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}
