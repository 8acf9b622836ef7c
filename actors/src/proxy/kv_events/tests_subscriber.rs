//! A subscriber against a scripted publisher (a real ZeroMQ PUB socket and replay ROUTER, the
//! sequence numbers and kept batches chosen by the test): replay on start, live batches, a gap
//! that cannot be filled, an engine that restarted, a malformed payload, and no replay socket.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use pdflow_observability::metrics;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::index::{EngineKv, PromptBlocks, MAX_BLOCKS};
use super::replay::END_SEQ;
use super::subscriber::Subscriber;
use super::KvEventSource;

const DEADLINE: Duration = Duration::from_secs(15);

/// A `BlockStored` batch in vLLM 0.33's form (block size 4, rank 0).
fn stored(hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u32>) -> Bytes {
    use rmp::encode as mp;
    let mut out = Vec::new();
    let _ = mp::write_array_len(&mut out, 3);
    let _ = mp::write_f64(&mut out, 1.0);
    let _ = mp::write_array_len(&mut out, 1);
    let _ = mp::write_map_len(&mut out, 5);
    let _ = mp::write_str(&mut out, "type");
    let _ = mp::write_str(&mut out, "BlockStored");
    let _ = mp::write_str(&mut out, "block_hashes");
    let _ = mp::write_array_len(&mut out, hashes.len() as u32);
    for &h in hashes {
        let _ = mp::write_uint(&mut out, h);
    }
    let _ = mp::write_str(&mut out, "parent_block_hash");
    let _ = match parent {
        Some(p) => mp::write_uint(&mut out, p).map(drop),
        None => mp::write_nil(&mut out).map_err(mp::ValueWriteError::InvalidMarkerWrite),
    };
    let _ = mp::write_str(&mut out, "token_ids");
    let _ = mp::write_array_len(&mut out, tokens.len() as u32);
    for t in tokens {
        let _ = mp::write_uint(&mut out, u64::from(t));
    }
    let _ = mp::write_str(&mut out, "block_size");
    let _ = mp::write_uint(&mut out, 4);
    let _ = mp::write_uint(&mut out, 0);
    out.into()
}

/// A publisher whose sequence numbers and kept batches the test sets.
struct Script {
    publish: PubSocket,
    endpoint: String,
    replay_endpoint: String,
    kept: Arc<Mutex<Vec<(u64, Bytes)>>>,
    _router: AbortOnDropHandle<()>,
}

impl Script {
    async fn start() -> Self {
        let mut publish = PubSocket::new();
        let endpoint = publish.bind("tcp://127.0.0.1:0").await.expect("PUB binds").to_string();
        let mut router = RouterSocket::new();
        let replay_endpoint = router.bind("tcp://127.0.0.1:0").await.expect("ROUTER binds").to_string();
        let kept: Arc<Mutex<Vec<(u64, Bytes)>>> = Arc::default();
        let served = kept.clone();
        let router = tokio::spawn(async move {
            while let Ok(request) = router.recv().await {
                let frames = request.into_vec();
                let start = u64::from_be_bytes(frames[2].as_ref().try_into().expect("8 bytes"));
                let batches: Vec<_> =
                    served.lock().expect("kept").iter().filter(|(s, _)| *s >= start).cloned().collect();
                for (seq, payload) in batches {
                    let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
                    let msg = vec![frames[0].clone(), Bytes::new(), Bytes::new(), seq, payload];
                    router.send(ZmqMessage::try_from(msg).expect("frames")).await.expect("replayed");
                }
                let end =
                    vec![frames[0].clone(), Bytes::new(), Bytes::new(), Bytes::from_static(&END_SEQ), Bytes::new()];
                router.send(ZmqMessage::try_from(end).expect("frames")).await.expect("end marker");
            }
        });
        Self { publish, endpoint, replay_endpoint, kept, _router: AbortOnDropHandle::new(router) }
    }

    /// Keeps `payload` as batch `seq` for replay.
    fn keep(&self, seq: u64, payload: &Bytes) {
        self.kept.lock().expect("kept").push((seq, payload.clone()));
    }

    /// Sends batch `seq` on the PUB socket.
    async fn send(&mut self, seq: u64, payload: &Bytes) {
        let msg = vec![Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
        self.publish.send(ZmqMessage::try_from(msg).expect("frames")).await.expect("published");
    }

    /// Keeps and sends batch `seq` until `seen` (a PUB socket drops what it sends before the
    /// subscription reached it; the same batch again is a duplicate to the subscriber).
    async fn publish_until(&mut self, seq: u64, payload: Bytes, seen: impl Fn() -> bool) {
        self.keep(seq, &payload);
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while !seen() {
            assert!(tokio::time::Instant::now() < deadline, "batch {seq} never reached the index");
            self.send(seq, &payload).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Blocks of `tokens` the engine holds (block size 4).
fn held(engine: &EngineKv, tokens: std::ops::Range<u32>) -> usize {
    engine.matched(None, &mut PromptBlocks::new(tokens.collect::<Vec<_>>().into())).blocks
}

async fn until(what: &str, f: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn counted(engine: &str, event: &str) -> f64 {
    let prefix = format!("pdflow_proxy_kv_stream_total{{engine=\"{engine}\",event=\"{event}\"}} ");
    metrics::global().render().lines().find_map(|l| l.strip_prefix(&prefix)?.parse().ok()).unwrap_or(0.0)
}

fn follow(script: &Script, engine_url: &str, replay: bool) -> (Arc<EngineKv>, CancellationToken) {
    let source = KvEventSource {
        engine_url: engine_url.into(),
        endpoint: script.endpoint.clone(),
        replay_endpoint: replay.then(|| script.replay_endpoint.clone()),
        topic: String::new(),
    };
    let engine = Arc::new(EngineKv::new(MAX_BLOCKS));
    let shutdown = CancellationToken::new();
    tokio::spawn(Subscriber::new(source, engine.clone()).run(shutdown.clone()));
    (engine, shutdown)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_on_start_clears_on_an_unfillable_gap_and_on_a_restart() {
    let engine_url = "http://test-replay:1";
    let mut script = Script::start().await;
    // Published before the subscriber came: only the replay has it.
    script.keep(0, &stored(&[1, 2], None, 0..8));
    let (engine, shutdown) = follow(&script, engine_url, true);
    until("the kept batch was replayed", || held(&engine, 0..9) == 2).await;

    script.publish_until(1, stored(&[3], Some(2), 8..12), || held(&engine, 0..13) == 3).await;

    // Batches 2..4 are lost and no longer kept: what the engine held is unknown, so forgotten.
    script.kept.lock().expect("kept").clear();
    script.publish_until(5, stored(&[9], None, 100..104), || held(&engine, 100..105) == 1).await;
    assert_eq!(held(&engine, 0..13), 0, "the index was cleared at the gap");
    assert_eq!(counted(engine_url, "cleared_gap"), 1.0);

    // The engine restarted: its sequence starts again, with other blocks.
    script.kept.lock().expect("kept").clear();
    script.publish_until(0, stored(&[20], None, 200..204), || held(&engine, 200..205) == 1).await;
    assert_eq!(held(&engine, 100..105), 0, "the index was cleared at the restart");
    assert!(counted(engine_url, "cleared_restart") >= 1.0);

    // A payload that is not a batch is counted and skipped; the next batch is taken.
    script.keep(1, &Bytes::from_static(b"\xc1"));
    script.send(1, &Bytes::from_static(b"\xc1")).await;
    script.publish_until(2, stored(&[21], Some(20), 204..208), || held(&engine, 200..209) == 2).await;
    assert!(counted(engine_url, "malformed") >= 1.0);
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_replay_socket_a_gap_clears_the_index() {
    let engine_url = "http://test-no-replay:1";
    let mut script = Script::start().await;
    let (engine, shutdown) = follow(&script, engine_url, false);
    script.publish_until(0, stored(&[1], None, 0..4), || held(&engine, 0..5) == 1).await;
    script.publish_until(1, stored(&[2], Some(1), 4..8), || held(&engine, 0..9) == 2).await;
    script.publish_until(3, stored(&[7], None, 50..54), || held(&engine, 50..55) == 1).await;
    assert_eq!(held(&engine, 0..9), 0, "batch 2 was missed: the index was cleared");
    assert_eq!(counted(engine_url, "cleared_gap"), 1.0);
    shutdown.cancel();
}
