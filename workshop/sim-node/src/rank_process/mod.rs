//! One process per rank (`pdflow serve --rank-processes`), as vLLM runs one worker process per
//! rank: the engine process keeps the scheduler, the scheduler-side connector and the simulated
//! forward; each rank's process runs that rank's worker actors with their own sockets (P's side
//! channel, D's data server) over the rank's KV cache. The cache lives in shared memory: the
//! engine's forward writes the rank's layers and heads there, as a GPU would, and the rank's
//! process reads and writes it for transfers. Killing a rank's process kills its sockets and
//! actors, as a worker's death does in vLLM; the engine then stops ([`RankProcess::exited`]).
//!
//! - [`RankProcess`] — the engine's handle on one rank's process: start, hello, ready, stop.
//! - [`remote_port`] — that rank's worker role as the engine calls it.
//! - [`child`] — the rank's process.
//! - [`shared_kv`], [`ipc`] — the shared cache and the socket's frames.

pub mod child;
pub mod ipc;
pub mod remote_port;
pub mod shared_kv;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use pdflow_messages::rank_process::{RankBootstrap, RankHello, RankMessage, RankReady};
use tokio::net::UnixListener;
use tokio::process::Command;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

pub use self::remote_port::RemoteWorkerPort;
use self::shared_kv::TempFile;

/// How long a rank's process may take to connect, and to read the engine's hello.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(30);
/// How long a rank's process may take to start its worker actors and report ready.
pub const READY_DEADLINE: Duration = Duration::from_secs(60);
/// How long a rank's process may take to stop once its socket is closed.
const EXIT_DEADLINE: Duration = Duration::from_secs(12);

/// Why a rank's process could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum RankProcessError {
    #[error("the rank processes' shared KV cache: {0}")]
    SharedKv(String),
    #[error("the socket between the engine and a rank's process: {0}")]
    Wire(String),
    #[error("timed out waiting for {0}")]
    Timeout(&'static str),
    #[error("could not start rank {rank}'s process: {why}")]
    Start { rank: u32, why: String },
}

/// How the engine starts its ranks' processes: this program, with the arguments it was served
/// with (each rank builds the engine's configuration from them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankLaunch {
    pub program: PathBuf,
    /// `serve …`, without the program name.
    pub serve_argv: Vec<String>,
}

/// A running rank's process.
pub struct RankProcess {
    pub rank: u32,
    pub ready: RankReady,
    pub port: Arc<RemoteWorkerPort>,
    /// Cancelled once the process has exited, for whatever reason.
    exited: CancellationToken,
    /// Cancelled when the engine stops the process on purpose.
    stopping: CancellationToken,
    kill: Option<oneshot::Sender<()>>,
}

/// What the engine tells a new rank beyond its configuration.
pub struct RankStart {
    pub engine_id: String,
    pub dp_rank: u32,
    pub rank: u32,
    pub kv_file: TempFile,
    pub bootstrap: RankBootstrap,
    pub side_channel_port: u16,
    /// Cancelled when the process exits unasked.
    pub lost: CancellationToken,
}

impl RankProcess {
    /// Starts the rank's process, sends it its hello and waits until its worker runs.
    pub async fn start(launch: &RankLaunch, start: RankStart) -> Result<Self, RankProcessError> {
        let rank = start.rank;
        let failed = |why: String| RankProcessError::Start { rank, why };
        let socket = std::env::temp_dir().join(format!(
            "pdflow-{}-rank{rank}-{}.sock",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        let listener = UnixListener::bind(&socket).map_err(|e| failed(format!("binding {}: {e}", socket.display())))?;
        let socket_file = shared_kv::TempFile { path: socket.clone() };
        let mut child = Command::new(&launch.program)
            .arg("rank-worker")
            .arg("--ipc")
            .arg(&socket)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| failed(format!("running {}: {e}", launch.program.display())))?;
        let stream = tokio::select! {
            accepted = tokio::time::timeout(HANDSHAKE_DEADLINE, listener.accept()) => accepted
                .map_err(|_| RankProcessError::Timeout("a rank's process to connect"))?
                .map_err(|e| failed(format!("accepting its connection: {e}")))?
                .0,
            status = child.wait() => return Err(failed(format!("it exited before connecting ({})", describe(status)))),
        };
        drop(socket_file);
        let (mut reader, mut writer) = stream.into_split();
        let hello = RankHello {
            serve_argv: launch.serve_argv.clone(),
            engine_id: start.engine_id,
            dp_rank: start.dp_rank,
            rank,
            kv_path: start.kv_file.path.to_string_lossy().into_owned(),
            bootstrap: start.bootstrap,
            side_channel_port: start.side_channel_port,
        };
        ipc::write_frame(&mut writer, &ipc::encode(&hello)?).await?;
        let first = tokio::select! {
            read = tokio::time::timeout(READY_DEADLINE, ipc::read_frame::<RankMessage>(&mut reader, "RankMessage")) =>
                read.map_err(|_| RankProcessError::Timeout("a rank's process to report ready"))??,
            status = child.wait() => return Err(failed(format!("it exited before it was ready ({})", describe(status)))),
        };
        let ready = match first {
            Some(RankMessage::Ready(ready)) => ready,
            Some(RankMessage::Failed(why)) => return Err(failed(why)),
            Some(other) => return Err(failed(format!("it sent {other:?} before it was ready"))),
            None => return Err(failed("it closed its socket before it was ready".into())),
        };
        // Both processes have the cache mapped: the file's name is no longer needed, and nothing
        // is left behind in /dev/shm whichever process dies.
        drop(start.kv_file);
        let port = Arc::new(RemoteWorkerPort::new(rank, reader, writer));
        let (exited, stopping) = (CancellationToken::new(), CancellationToken::new());
        let (kill, killed) = oneshot::channel();
        tokio::spawn(watch(rank, child, killed, exited.clone(), stopping.clone(), start.lost));
        Ok(Self { rank, ready, port, exited, stopping, kill: Some(kill) })
    }

    /// Cancelled once the process has exited (killed, crashed or stopped).
    pub fn exited(&self) -> CancellationToken {
        self.exited.clone()
    }

    /// Whether the engine is stopping it (its exit is then expected).
    pub fn stopping(&self) -> bool {
        self.stopping.is_cancelled()
    }

    /// Closes the rank's socket (it stops its actors and exits), killing it past a deadline.
    pub async fn stop(mut self) {
        self.stopping.cancel();
        self.port.close();
        if tokio::time::timeout(EXIT_DEADLINE, self.exited.cancelled()).await.is_err() {
            tracing::warn!(rank = self.rank, "the rank's process did not exit within {EXIT_DEADLINE:?}: killed");
            self.kill_now().await;
        }
    }

    /// Kills the rank's process at once.
    pub async fn kill_now(&mut self) {
        self.stopping.cancel();
        if let Some(kill) = self.kill.take() {
            let _ = kill.send(());
        }
        let _ = tokio::time::timeout(EXIT_DEADLINE, self.exited.cancelled()).await;
    }
}

/// Owns the child: reaps it when it exits (an unexpected exit is logged as the engine's loss)
/// or kills it when asked.
async fn watch(
    rank: u32,
    mut child: tokio::process::Child,
    killed: oneshot::Receiver<()>,
    exited: CancellationToken,
    stopping: CancellationToken,
    lost: CancellationToken,
) {
    let status = tokio::select! {
        status = child.wait() => status,
        _ = killed => {
            let _ = child.start_kill();
            child.wait().await
        }
    };
    if !stopping.is_cancelled() {
        tracing::error!(rank, status = %describe(status), "a rank's process exited: the engine cannot run without it and stops, as vLLM's engine does when a worker dies");
        lost.cancel();
    }
    exited.cancel();
}

fn describe(status: std::io::Result<std::process::ExitStatus>) -> String {
    match status {
        Ok(s) => s.to_string(),
        Err(e) => format!("status unknown: {e}"),
    }
}
