//! The worker side of one engine, for one KV cache: the one place the worker actors are built and
//! supervised — for `pdflow serve`'s engine nodes, the demo, the chaos cells and vLLM's workers
//! (the Python bridge).
//!
//! Producing (kv_producer, kv_both): the Bootstrap when this worker launches it (seed step 2, P's
//! TP0), and the SenderListener (side channel + registration, steps 1, 3, 4) with the transfer
//! engine for its KV memory ([`crate::gpu_kv::producer_engine`]: same-host or tcp for host KV;
//! cuda-peer, cuda-ipc or cuda-staged for GPU KV).
//! Consuming (kv_consumer, kv_both): the tcp data server P writes into
//! ([`crate::gpu_kv::serve_kv_data`]; with GPU KV also the device offer and the staged receiver)
//! and the Receiver (step 5). `kv_both` runs both halves: it may prefill for a peer and load
//! from one.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU16;
use std::sync::Arc;
use std::time::Duration;

use kameo::prelude::*;
use kameo::supervision::RestartPolicy;
use pdflow_actors::fault_seam::{register_actor, ActorKind, Faults, Role};
use pdflow_actors::ranks::WorkerRank;
use pdflow_actors::receiver::{Receiver, ReceiverArgs};
use pdflow_actors::scheduler_connector::KvRole;
use pdflow_actors::sender_listener::{SenderListener, SenderListenerArgs};
use pdflow_actors::side_channel_auth::{ListenerAuth, PullAuth};
use pdflow_auth::PeerFilter;
use pdflow_kv::memory::KvCache;
use pdflow_transfer::tcp::{TcpConfig, TcpDataServer};
use tokio::sync::Notify;

use crate::bootstrap_node::BootstrapNode;
use crate::config::Deadlines;
use crate::gpu_kv::{producer_engine, serve_kv_data, Held, KvDataServing};
use crate::held_sends::HeldSends;
use crate::ports::WorkerPort;
use crate::supervisor::{NodeSupervisor, MAX_RESTARTS, RESTART_WINDOW};
use crate::{started, NodeError};

/// Registrations P tries with the bootstrap before its SenderListener gives up starting.
const REGISTER_ATTEMPTS: u32 = 8;
/// The first pause between two registration attempts (it doubles).
const REGISTER_BACKOFF: Duration = Duration::from_millis(100);

/// Where a producer's bootstrap is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootstrapPlacement {
    /// This worker launches it on this port of its host (seed step 2: P's TP0), and registers there.
    Launch { port: u16 },
    /// Register with an existing bootstrap at this URL (`pdflow bootstrap`, or TP0's).
    External { url: String },
    /// Do not register (tests of the engine alone).
    None,
}

impl BootstrapPlacement {
    /// The bootstrap's URL as peers reach it, when it is known before it starts.
    pub fn url(&self, host: &str) -> Option<String> {
        match self {
            BootstrapPlacement::Launch { port } if *port != 0 => Some(format!("http://{host}:{port}")),
            BootstrapPlacement::External { url } => Some(url.clone()),
            _ => None,
        }
    }
}

/// What the worker side of one engine needs.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    pub engine_id: String,
    pub role: KvRole,
    /// This worker's tensor and pipeline position, and the whole model's KV shape.
    pub rank: WorkerRank,
    /// The data-parallel rank of its engine: P's workers register under it at bootstrap.
    pub dp_rank: u32,
    /// Host every socket binds on (side channel, data server, a launched bootstrap).
    pub host: String,
    pub bootstrap: BootstrapPlacement,
    /// P's side-channel port (0: any); it holds the bound port once the SenderListener runs, so
    /// that a restarted SenderListener (or node) binds and registers the same address.
    pub side_channel: Arc<AtomicU16>,
    /// D's data-server port (0: any).
    pub data_port: u16,
    pub deadlines: Deadlines,
    pub tcp: TcpConfig,
    /// Record KV checksums on both sides of every transfer (steps 29 and 34).
    pub verify_checksums: bool,
    /// The fault seam its actors are offered to ([`pdflow_actors::fault_seam::no_faults`]: none).
    pub faults: Faults,
}

/// The running worker side of one engine.
pub struct Worker {
    pub sender_listener: Option<ActorRef<SenderListener>>,
    pub receiver: Option<ActorRef<Receiver>>,
    /// The bootstrap this worker launched.
    pub bootstrap: Option<BootstrapNode>,
    /// The bootstrap P registered with.
    pub bootstrap_url: Option<String>,
    /// Woken whenever a transfer settles (the engine's loop polls the connector then).
    pub events: Arc<Notify>,
    /// P: the requests whose blocks the engine holds for a send, reported sent at the
    /// deadlines' backstop if the actors never do.
    held_sends: Option<Arc<HeldSends>>,
    data_server: Option<TcpDataServer>,
    /// D's RDMA endpoint (`provider on device`), when it offers one-sided writes.
    rdma_endpoint: Option<String>,
    /// D's serving of GPU KV, while it serves: its registration as a GPU peer of this process
    /// and its staged receiver (GPU KV only).
    _gpu_serving: Vec<Held>,
}

impl Worker {
    /// Starts the worker actors of `spec.role` under `supervisor`, over `kv_cache`.
    pub async fn start_under(
        supervisor: &ActorRef<NodeSupervisor>,
        kv_cache: &Arc<KvCache>,
        spec: &WorkerSpec,
    ) -> Result<Self, NodeError> {
        // Without a secret: protected mode (loopback peers only), or the operator's opt-out.
        PeerFilter::announce(spec.tcp.secret.as_ref(), spec.tcp.insecure);
        let mut worker = Worker {
            sender_listener: None,
            receiver: None,
            bootstrap: None,
            bootstrap_url: None,
            events: Arc::new(Notify::new()),
            held_sends: spec.role.produces().then(|| Arc::new(HeldSends::new(spec.deadlines.held_backstop()))),
            data_server: None,
            rdma_endpoint: None,
            _gpu_serving: Vec::new(),
        };
        if spec.role.produces() {
            worker.start_producer(supervisor, kv_cache, spec).await?;
        }
        if spec.role.consumes() {
            worker.start_consumer(supervisor, kv_cache, spec).await?;
        }
        Ok(worker)
    }

    /// The bootstrap (if this worker launches it) and the SenderListener.
    async fn start_producer(
        &mut self,
        supervisor: &ActorRef<NodeSupervisor>,
        kv_cache: &Arc<KvCache>,
        spec: &WorkerSpec,
    ) -> Result<(), NodeError> {
        self.bootstrap_url = match &spec.bootstrap {
            BootstrapPlacement::Launch { port } => {
                let value = format!("{}:{port}", spec.host);
                let bind: SocketAddr = value.parse().map_err(|source| NodeError::InvalidAddress {
                    what: "the bootstrap HTTP server",
                    value,
                    source,
                })?;
                let node = BootstrapNode::start_under(
                    supervisor,
                    bind,
                    spec.tcp.secret.clone(),
                    spec.tcp.insecure,
                    &spec.faults,
                )
                .await?;
                let url = node.url();
                self.bootstrap = Some(node);
                Some(url)
            }
            BootstrapPlacement::External { url } => Some(url.clone()),
            BootstrapPlacement::None => None,
        };
        let args = SenderListenerArgs {
            engine_id: spec.engine_id.clone().into(),
            dp_rank: spec.dp_rank,
            rank: spec.rank,
            bind_host: spec.host.clone(),
            side_channel_port: spec.side_channel.clone(),
            bootstrap_url: self.bootstrap_url.clone(),
            kv_cache: kv_cache.clone(),
            transfer: producer_engine(kv_cache, &spec.tcp)?,
            ready_timeout: spec.deadlines.ready_timeout,
            send_expiry: spec.deadlines.send_expiry,
            register_attempts: REGISTER_ATTEMPTS,
            register_backoff: REGISTER_BACKOFF,
            events: self.events.clone(),
            verify_checksums: spec.verify_checksums,
            lineage: Default::default(),
            faults: spec.faults.clone(),
            auth: ListenerAuth::new(spec.tcp.secret.clone()).insecure(spec.tcp.insecure).with_tls(spec.tcp.tls.clone()),
        };
        let listener = SenderListener::supervise(supervisor, args)
            .restart_policy(RestartPolicy::Transient)
            .restart_limit(MAX_RESTARTS, RESTART_WINDOW)
            .spawn()
            .await;
        started("SenderListener", &listener).await?;
        register_actor(&spec.faults, ActorKind::SenderListener, Role::P, Vec::new(), &listener);
        self.sender_listener = Some(listener);
        Ok(())
    }

    /// The data server P writes into, and the Receiver.
    async fn start_consumer(
        &mut self,
        supervisor: &ActorRef<NodeSupervisor>,
        kv_cache: &Arc<KvCache>,
        spec: &WorkerSpec,
    ) -> Result<(), NodeError> {
        let KvDataServing { server, fence, held } =
            serve_kv_data(kv_cache, &spec.host, &format!("{}:{}", spec.host, spec.data_port), &spec.tcp).await?;
        self._gpu_serving.extend(held);
        self.rdma_endpoint = fence.remote().map(|r| r.endpoint());
        let args = ReceiverArgs {
            engine_id: spec.engine_id.clone().into(),
            rank: spec.rank,
            kv_cache: kv_cache.clone(),
            data_addr: server.local_addr().to_string(),
            pull_timeout: spec.deadlines.pull_timeout,
            bootstrap_timeout: spec.deadlines.bootstrap_timeout,
            events: self.events.clone(),
            verify_checksums: spec.verify_checksums,
            fence: Some(fence),
            faults: spec.faults.clone(),
            auth: PullAuth { secret: spec.tcp.secret.clone(), tls: spec.tcp.tls.clone() },
        };
        self.data_server = Some(server);
        let receiver = Receiver::supervise(supervisor, args)
            .restart_policy(RestartPolicy::Transient)
            .restart_limit(MAX_RESTARTS, RESTART_WINDOW)
            .spawn()
            .await;
        started("Receiver", &receiver).await?;
        register_actor(&spec.faults, ActorKind::Receiver, Role::D, Vec::new(), &receiver);
        self.receiver = Some(receiver);
        Ok(())
    }

    /// The engine's worker-role port over these actors.
    pub fn port(&self) -> WorkerPort {
        WorkerPort {
            listener: self.sender_listener.clone(),
            receiver: self.receiver.clone(),
            events: self.events.clone(),
            held_sends: self.held_sends.clone(),
        }
    }

    /// D's data server address (where P writes KV), if this worker consumes.
    /// D's RDMA endpoint (`provider on device`), when it offers one-sided writes.
    pub fn rdma_endpoint(&self) -> Option<&str> {
        self.rdma_endpoint.as_deref()
    }

    pub fn data_addr(&self) -> Option<SocketAddr> {
        self.data_server.as_ref().map(|d| d.local_addr())
    }

    /// Kills the actors at once, as a process kill would (their supervisor is killed by the node).
    pub fn kill_actors(&self) {
        if let Some(l) = &self.sender_listener {
            l.kill();
        }
        if let Some(r) = &self.receiver {
            r.kill();
        }
    }

    /// Stops what is not an actor of the supervisor: the launched bootstrap first (`kill`: at
    /// once), the data server last; the caller stops the supervisor in between.
    pub async fn stop_bootstrap(&mut self, kill: bool) {
        if let Some(b) = self.bootstrap.take() {
            if kill {
                b.kill().await;
            } else {
                b.shutdown().await;
            }
        }
    }

    /// Stops the data server (after the actors, which may still be writing into it).
    pub async fn stop_data_server(&mut self) {
        if let Some(d) = self.data_server.take() {
            d.shutdown().await;
        }
    }
}
