//! What crosses the wire, read off a packet capture (tcpdump on the loopback interface) of a
//! whole P/D request — proxy, bootstrap look-ups, side-channel pull, data channel — run under the
//! cluster secret: the secret's bytes never appear; with the data channel plain, the request's KV
//! does (the capture sees the transfer: the check below is not vacuous); with TLS on, not one
//! 32-byte run of it does, and the request still gets the reference's tokens.
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
}

impl Capture {
    /// Starts the capture and waits until tcpdump listens; why not, when it cannot.
    async fn start(file: std::path::PathBuf) -> Result<Self, String> {
        let mut child = tokio::process::Command::new("tcpdump")
            .args(["-i", "lo", "--immediate-mode", "-U", "-s", "0", "-n", "-w"])
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
                tokio::spawn(async move {
                    while let Ok(Some(line)) = lines.next_line().await {
                        eprintln!("tcpdump: {line}");
                    }
                });
                Ok(Self { child, file })
            }
            Ok(Err(said)) => Err(format!("tcpdump cannot capture on lo (needs root or CAP_NET_RAW): {said}")),
            Err(_) => Err("tcpdump did not start listening on lo within 10 s".into()),
        }
    }

    /// Stops tcpdump (it writes what it holds on SIGINT) and returns the capture's bytes.
    async fn finish(mut self) -> Vec<u8> {
        // The last packets reach tcpdump's buffer a moment after the request's answer.
        tokio::time::sleep(Duration::from_millis(300)).await;
        if let Some(pid) = self.child.id() {
            let _ = tokio::process::Command::new("kill").args(["-INT", &pid.to_string()]).status().await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
        std::fs::read(&self.file).expect("the capture file")
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

/// One request through a 1P1D cluster under the secret, captured; the capture and the KV runs.
async fn captured_request(tls: bool, seed: u64) -> Result<(Vec<u8>, Vec<Vec<u8>>), String> {
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
    cluster.shutdown().await;
    let bytes = capture.finish().await;
    if std::env::var_os("PDFLOW_KEEP_CAPTURE").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("capture kept in {}", dir.display());
    }
    Ok((bytes, runs))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_wire_never_carries_the_secret_and_with_tls_carries_no_kv() {
    // The data channel plain: the KV is on the wire (the capture works), the secret is not.
    let (plain, runs) = match captured_request(false, 11).await {
        Ok(c) => c,
        Err(why) => {
            pdflow_telemetry::skip::skipped("the wire capture of a request", &why);
            return;
        }
    };
    assert!(!contains(&plain, SECRET.as_bytes()), "the secret crossed the wire");
    let seen = runs.iter().filter(|r| contains(&plain, r)).count();
    assert!(
        seen * 10 >= runs.len() * 9,
        "only {seen} of the request's {} KV runs are in the capture of a plain transfer: the capture missed the data channel",
        runs.len()
    );

    // TLS on: the same request, another prompt; no KV run and no secret on the wire.
    let (sealed, runs) = captured_request(true, 12).await.expect("the capture ran once already");
    assert!(!contains(&sealed, SECRET.as_bytes()), "the secret crossed the wire under TLS");
    let leaked = runs.iter().filter(|r| contains(&sealed, r)).count();
    assert_eq!(leaked, 0, "{leaked} of {} KV runs crossed the wire in clear with TLS on", runs.len());
    assert!(sealed.len() as u64 > (PROMPT_WORDS * 4 * 2 * 64) as u64, "the TLS capture holds the transfer's records");
}
