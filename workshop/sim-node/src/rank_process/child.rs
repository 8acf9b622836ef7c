//! A rank's process (`pdflow rank-worker --ipc PATH`, started by its engine): it maps the rank's
//! KV cache, runs the rank's worker actors (P: SenderListener and, on rank 0, the bootstrap; D:
//! data server and Receiver), each with its own sockets, and answers the engine's worker-role
//! calls in order (seed steps 14, 19, 27, 32, 35). It ends when the engine closes the socket, and
//! dies with the engine (the kernel's parent-death signal).

use std::path::Path;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kameo::prelude::*;
use pdflow_messages::rank_process::{
    RankAnswer, RankBootstrap, RankCall, RankCallError, RankHello, RankMessage, RankReady, RankRequest,
};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

use super::{ipc, shared_kv, RankProcessError, HANDSHAKE_DEADLINE};
use crate::engine_node::EngineNodeConfig;
use crate::ranks::{rank_shape, worker_rank, RankTopology};
use pdflow_node::ports::WorkerConnectorPort;
use pdflow_node::supervisor::NodeSupervisor;
use pdflow_node::worker::{BootstrapPlacement, Worker, WorkerSpec};

/// How long the rank's actors may take to stop once the engine has gone.
const STOP_DEADLINE: Duration = Duration::from_secs(10);

/// A rank process connected to its engine, the engine's hello read.
pub struct RankChild {
    reader: OwnedReadHalf,
    writer: OwnedWriteHalf,
    pub hello: RankHello,
}

impl RankChild {
    /// Connects to the engine's socket at `ipc` and reads what the engine asks this rank to be.
    pub async fn connect(ipc: &Path) -> Result<Self, RankProcessError> {
        die_with_parent();
        let stream = tokio::time::timeout(HANDSHAKE_DEADLINE, UnixStream::connect(ipc))
            .await
            .map_err(|_| RankProcessError::Timeout("connecting to the engine"))?
            .map_err(|e| RankProcessError::Wire(format!("connecting to the engine at {}: {e}", ipc.display())))?;
        let (mut reader, writer) = stream.into_split();
        let hello = tokio::time::timeout(HANDSHAKE_DEADLINE, ipc::read_frame::<RankHello>(&mut reader, "RankHello"))
            .await
            .map_err(|_| RankProcessError::Timeout("the engine's hello"))??
            .ok_or_else(|| RankProcessError::Wire("the engine closed the socket before its hello".into()))?;
        Ok(Self { reader, writer, hello })
    }

    /// Tells the engine this rank cannot start, and why.
    pub async fn fail(mut self, why: String) {
        if let Ok(bytes) = ipc::encode(&RankMessage::Failed(why)) {
            let _ = ipc::write_frame(&mut self.writer, &bytes).await;
        }
    }

    /// Runs the rank's worker for `cfg` (the engine's configuration, from its arguments) until
    /// the engine closes the socket.
    pub async fn serve(mut self, mut cfg: EngineNodeConfig) -> Result<(), RankProcessError> {
        let rank = self.hello.rank as usize;
        cfg.engine.engine_id = self.hello.engine_id.clone();
        cfg.dp_rank = self.hello.dp_rank;
        let started = match start_worker(&self.hello, &cfg).await {
            Ok(started) => started,
            Err(e) => {
                self.fail(e.to_string()).await;
                return Err(e);
            }
        };
        let (mut worker, supervisor, side_channel, _kv) = started;
        let ready = RankReady {
            pid: std::process::id(),
            bootstrap_url: worker.bootstrap_url.clone(),
            launched_bootstrap: worker.bootstrap.as_ref().map(|b| b.addr.to_string()),
            data_addr: worker.data_addr().map(|a| a.to_string()),
            side_channel_port: side_channel.load(Ordering::Acquire),
        };
        ipc::write_frame(&mut self.writer, &ipc::encode(&RankMessage::Ready(ready))?).await?;
        tracing::info!(rank, "rank worker ready");

        let (outbox, mut inbox) = mpsc::channel::<Vec<u8>>(1024);
        let mut writer = self.writer;
        let writing = tokio::spawn(async move {
            while let Some(bytes) = inbox.recv().await {
                if ipc::write_frame(&mut writer, &bytes).await.is_err() {
                    break;
                }
            }
        });
        let events = worker.events.clone();
        let event_outbox = outbox.clone();
        let relaying = tokio::spawn(async move {
            let Ok(bytes) = ipc::encode(&RankMessage::KvEvent) else { return };
            loop {
                events.notified().await;
                if event_outbox.send(bytes.clone()).await.is_err() {
                    break;
                }
            }
        });
        let port = worker.port();
        let ended = loop {
            let request = match ipc::read_frame::<RankRequest>(&mut self.reader, "RankRequest").await {
                Ok(Some(request)) => request,
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            };
            let answer = match request.call {
                RankCall::SaveKvLayer { layer, reqs } => {
                    port.save_kv_layer(layer as usize, &reqs);
                    continue;
                }
                RankCall::StartLoadKv(meta) => port.start_load_kv(meta).await.map(|()| RankAnswer::Done),
                RankCall::GetFinished => port.get_finished().await.map(RankAnswer::Finished),
            };
            let answer = answer.map_err(RankCallError::from);
            let bytes = ipc::encode(&RankMessage::Reply { id: request.id, answer })?;
            if outbox.send(bytes).await.is_err() {
                break Ok(());
            }
        };
        tracing::info!(rank, "the engine closed the rank's socket: stopping");
        relaying.abort();
        writing.abort();
        let stop = async {
            worker.stop_bootstrap(false).await;
            let _ = supervisor.stop_gracefully().await;
            supervisor.wait_for_shutdown().await;
            worker.stop_data_server().await;
        };
        if tokio::time::timeout(STOP_DEADLINE, stop).await.is_err() {
            tracing::warn!(rank, "the rank's actors did not stop within {STOP_DEADLINE:?}");
        }
        ended
    }
}

type Started = (Worker, ActorRef<NodeSupervisor>, Arc<AtomicU16>, Arc<pdflow_kv::memory::KvCache>);

/// Maps the rank's cache and starts its worker actors.
async fn start_worker(hello: &RankHello, cfg: &EngineNodeConfig) -> Result<Started, RankProcessError> {
    let rank = hello.rank as usize;
    let layouts =
        RankTopology::layouts(cfg).map_err(|e| RankProcessError::Start { rank: hello.rank, why: e.to_string() })?;
    let layout = layouts.get(rank).ok_or_else(|| RankProcessError::Start {
        rank: hello.rank,
        why: format!("the engine has {} ranks", layouts.len()),
    })?;
    let kv = shared_kv::open(Path::new(&hello.kv_path), rank_shape(cfg.engine.shape, layout), cfg.engine.num_blocks)?;
    let supervisor = NodeSupervisor::spawn(format!("engine-{}-rank-{rank}", cfg.engine.engine_id));
    let bootstrap = match &hello.bootstrap {
        RankBootstrap::Launch { port } => BootstrapPlacement::Launch { port: *port },
        RankBootstrap::External { url } => BootstrapPlacement::External { url: url.clone() },
        RankBootstrap::None => BootstrapPlacement::None,
    };
    let side_channel = Arc::new(AtomicU16::new(hello.side_channel_port));
    let spec = WorkerSpec {
        engine_id: cfg.engine.engine_id.clone(),
        role: cfg.role,
        rank: worker_rank(cfg.parallel, cfg.engine.shape, rank),
        dp_rank: cfg.dp_rank,
        host: cfg.host.clone(),
        bootstrap,
        side_channel: side_channel.clone(),
        data_port: 0,
        deadlines: cfg.deadlines,
        tcp: cfg.tcp.clone(),
        verify_checksums: cfg.verify_checksums,
        faults: cfg.faults.clone(),
    };
    let worker = Worker::start_under(&supervisor, &kv, &spec)
        .await
        .map_err(|e| RankProcessError::Start { rank: hello.rank, why: e.to_string() })?;
    Ok((worker, supervisor, side_channel, kv))
}

/// The kernel kills this process when its engine dies (Linux), so no rank outlives it.
fn die_with_parent() {
    // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number and touches no memory.
    let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) };
    if rc != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "could not tie the rank's life to its engine's");
    }
}
