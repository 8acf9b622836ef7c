//! What crosses the wire, read off a packet capture (tcpdump on the loopback interface) of a
//! whole P/D request — proxy, bootstrap look-ups, side-channel pull, data channel — run under the
//! cluster secret: the secret's bytes never appear; with TLS off, the request's KV and its pull
//! (D's data address) do (the capture sees both channels: the checks below are not vacuous);
//! with TLS on, not one 32-byte run of the KV nor the pull's address does, and the request still
//! gets the reference's tokens.
//!
//! Needs tcpdump and the right to capture (root or CAP_NET_RAW); without them the test is
//! reported as skipped, saying which. `PDFLOW_KEEP_CAPTURE=1` keeps the capture files (their
//! directory is printed) for a look with `tcpdump -r` or Wireshark.

use std::process::Stdio;
use std::time::Duration;

use pdflow_sim_engine::model::{fill_kv, Tokenizer};
use pdflow_sim_engine::EngineConfig;
use pdflow_tests::{completion, prompt, reference_tokens, token_ids, Cluster, ClusterSpec, EngineOpts};
use tokio::io::{AsyncBufReadExt, BufReader};

const SECRET: &str = "wire-capture-secret-7f3a9c1e5d2b8046";
const PROMPT_WORDS: usize = 48;

/// A running `tcpdump -i lo` writing every TCP packet whole to a file.
struct Capture {
    child: tokio::process::Child,
    file: std::path::PathBuf,
    /// What tcpdump says after it started (its closing counts).
    said: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

/// A finished capture: its bytes, and how many packets the kernel dropped before tcpdump read
/// them (a capture with drops proves nothing either way).
struct Captured {
    bytes: Vec<u8>,
    dropped: u64,
}

impl Capture {
    /// Starts the capture and waits until tcpdump listens; why not, when it cannot.
    async fn start(file: std::path::PathBuf) -> Result<Self, String> {
        let mut child = tokio::process::Command::new("tcpdump")
            // A 64 MiB buffer: a busy machine must not make the kernel drop what tcpdump is slow to read.
            .args(["-i", "lo", "--immediate-mode", "-B", "65536", "-U", "-s", "0", "-n", "-w"])
            .arg(&file)
            .arg("tcp")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot run tcpdump ({e}): install it (Debian: apt-get install tcpdump)"))?;
        let stderr = child.stderr.take().ok_or("tcpdump's stderr")?;
        let mut lines = BufReader::new(stderr).lines();
        let listening = tokio::time::timeout(Duration::from_secs(10), async {
            let mut said = Vec::new();
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("listening on") {
                    return Ok(());
                }
                said.push(line);
            }
            Err(said.join("; "))
        })
        .await;
        match listening {
            Ok(Ok(())) => {
                // Keep draining its stderr so it never blocks on a full pipe.
                let said = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
                let keep = said.clone();
                tokio::spawn(async move {
                    while let Ok(Some(line)) = lines.next_line().await {
                        eprintln!("tcpdump: {line}");
                        keep.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(line);
                    }
                });
                Ok(Self { child, file, said })
            }
            Ok(Err(said)) => Err(format!("tcpdump cannot capture on lo (needs root or CAP_NET_RAW): {said}")),
            Err(_) => Err("tcpdump did not start listening on lo within 10 s".into()),
        }
    }

    /// Stops tcpdump (it writes what it holds on SIGINT) and returns the capture.
    async fn finish(mut self) -> Captured {
        // The last packets reach tcpdump's buffer a moment after the request's answer.
        tokio::time::sleep(Duration::from_millis(300)).await;
        if let Some(pid) = self.child.id() {
            let _ = tokio::process::Command::new("kill").args(["-INT", &pid.to_string()]).status().await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
        // Its stderr's last lines arrive just after it exits.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let said = self.said.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let dropped = said
            .iter()
            .find_map(|l| l.strip_suffix(" packets dropped by kernel").and_then(|n| n.trim().parse().ok()))
            .unwrap_or(0);
        Captured { bytes: std::fs::read(&self.file).expect("the capture file"), dropped }
    }
}

/// The first 32 bytes of every (position, layer, head) slot of the prompt's KV: each a run the
/// simulated model writes contiguously into P's blocks, and so into D's over the data channel.
fn kv_runs(words: &str, cluster: &Cluster) -> Vec<Vec<u8>> {
    let shape = cluster.spec.shape;
    let tokens = Tokenizer { vocab_size: EngineConfig::default().vocab_size }.encode(words);
    let mut slot = vec![0u8; shape.slot_len()];
    let mut runs = Vec::new();
    for (pos, &token) in tokens.iter().enumerate() {
        for layer in 0..shape.num_layers {
            for head in 0..shape.num_kv_heads {
                fill_kv(token, pos, layer, head, &mut slot);
                runs.push(slot[..32].to_vec());
            }
        }
    }
    runs
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// What one captured request carried: the capture, the KV's runs, and D's data address as its
/// pull names it (the side channel is the only socket that carries it).
struct Request {
    bytes: Vec<u8>,
    kv_runs: Vec<Vec<u8>>,
    d_data_addr: String,
}

/// [`captured_one`], again (up to three times in all) while the kernel dropped packets.
async fn captured_request(tls: bool, seed: u64) -> Result<Request, String> {
    for attempt in 1..=3 {
        let (captured, request) = captured_one(tls, seed).await?;
        if captured.dropped == 0 {
            return Ok(request);
        }
        eprintln!("attempt {attempt}: the kernel dropped {} packets of the capture: again", captured.dropped);
    }
    panic!("every capture lost packets (tcpdump's drops): nothing can be concluded from it");
}

/// One request through a 1P1D cluster under the secret, captured.
async fn captured_one(tls: bool, seed: u64) -> Result<(Captured, Request), String> {
    let opts = EngineOpts { secret: Some(SECRET.to_string()), tls, tcp_only: true, ..EngineOpts::default() };
    let mut spec = ClusterSpec::one_p_one_d();
    spec.prefill = vec![opts.clone()];
    spec.decode = vec![opts];
    let cluster = Cluster::start(spec).await.expect("cluster starts");
    let dir = std::env::temp_dir().join(format!("pdflow-capture-{}-{seed}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("capture dir");
    let capture = match Capture::start(dir.join("wire.pcap")).await {
        Ok(c) => c,
        Err(why) => {
            cluster.shutdown().await;
            return Err(why);
        }
    };
    let words = prompt(PROMPT_WORDS, seed);
    let body = completion(&words, 4);
    let (status, answer) = cluster.post("/v1/completions", &body).await.expect("request");
    assert_eq!(status, 200, "{answer}");
    assert_eq!(token_ids(&answer), reference_tokens(cluster.spec.shape, &body).await);
    cluster.assert_blocks_at_baseline().await;
    let runs = kv_runs(&words, &cluster);
    let d_data_addr = cluster.endpoints.decode[0].data_addr.clone().expect("D's data address");
    cluster.shutdown().await;
    let captured = capture.finish().await;
    if std::env::var_os("PDFLOW_KEEP_CAPTURE").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("capture kept in {}", dir.display());
    }
    let bytes = captured.bytes.clone();
    Ok((captured, Request { bytes, kv_runs: runs, d_data_addr }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_wire_never_carries_the_secret_and_with_tls_carries_no_kv_and_no_pull() {
    // Plain: the KV and the pull are on the wire (the capture sees both channels), the secret not.
    let plain = match captured_request(false, 11).await {
        Ok(c) => c,
        Err(why) => {
            pdflow_testkit::skipped("the wire capture of a request", &why);
            return;
        }
    };
    assert!(!contains(&plain.bytes, SECRET.as_bytes()), "the secret crossed the wire");
    let seen = plain.kv_runs.iter().filter(|r| contains(&plain.bytes, r)).count();
    assert!(
        seen * 10 >= plain.kv_runs.len() * 9,
        "only {seen} of the request's {} KV runs are in the capture of a plain transfer: the capture missed the data channel",
        plain.kv_runs.len()
    );
    assert!(
        contains(&plain.bytes, plain.d_data_addr.as_bytes()),
        "the plain capture lacks the pull's data address: it missed the side channel"
    );

    // TLS on: the same request, another prompt; no KV run, no pull field and no secret in clear.
    let sealed = captured_request(true, 12).await.expect("the capture ran once already");
    assert!(!contains(&sealed.bytes, SECRET.as_bytes()), "the secret crossed the wire under TLS");
    let leaked = sealed.kv_runs.iter().filter(|r| contains(&sealed.bytes, r)).count();
    assert_eq!(leaked, 0, "{leaked} of {} KV runs crossed the wire in clear with TLS on", sealed.kv_runs.len());
    assert!(
        !contains(&sealed.bytes, sealed.d_data_addr.as_bytes()),
        "the pull (D's data address) crossed the side channel in clear with TLS on"
    );
    assert!(sealed.bytes.len() > PROMPT_WORDS * 4 * 2 * 64, "the TLS capture holds the transfer's records");
}
