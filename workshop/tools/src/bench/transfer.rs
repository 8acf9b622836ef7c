//! `pdflow bench transfer`: the seed request's KV (Qwen3-8B, 63 blocks, P 17..=79 → D 512..=574,
//! 148,635,648 B) moved P→D — seed steps 19–35 for the transfer — through the real actors (P's
//! SenderListener and SendWorkers, D's Receiver and PullTasks, the ZeroMQ side channel, D's data
//! server, the bootstrap look-up) and the transfer engine under test, all in this process over
//! 127.0.0.1. Rows (median/min/max over `--runs` after `--warmup`; D's bytes checked against P's
//! once per mode with `KvCache::blocks_checksum`):
//!
//! - `actors seed coalesced` at concurrency 1 and 8 (8 requests in one step), timed from
//!   `StartLoadKv` to `GetFinishedRecving` reporting them; the first (cold) pull separately;
//! - `engine …` rows call `TransferEngine::write` directly: the coalesced plan (36 descriptors), the
//!   uncoalesced one (2,268 × 64 KiB — the SendWorker always coalesces, so this plan is measured at
//!   the engine level), and one 32 KiB write's latency, back to back and after 1 ms idle (D's
//!   connection thread then sleeps in the kernel instead of polling);
//! - same-run ceilings: single-thread memcpy of the same bytes, plain loopback TCP (1 and 4
//!   streams), and for the 32 KiB write one round trip (32 KiB out, a 15-byte answer back)
//!   between two blocking threads;
//! - with `--compare-mooncake`, Mooncake's TransferEngine over TCP (`tests/peers/mooncake_tcp.py`)
//!   and the ratios pdflow/Mooncake.
//!
//! `--backend rdma` (a build with the `rdma` feature) runs the same rows one-sided through
//! libfabric, as a node with `--transport rdma` does: D's `RdmaTarget` behind D's write fence,
//! granting each pull's block runs under the pull's fence token (the plan carries the grant to P's
//! engine) and revoking them when the fence closes cleanly after the write; the engine rows do
//! what D's Receiver does around each write, outside the timed write, and `rdma grant + revoke`
//! rows time that part of D's work alone. On libfabric's software `tcp` provider (the default
//! `--rdma-provider`) the bytes go through the kernel's TCP: the rows measure the CPU cost of the
//! path, not a NIC.
//!
//! Every row except Mooncake's also reports the process's CPU time per run (`cpu ms`: all
//! threads, P's and D's, which share this process), median over the runs. A row whose first run
//! shows its runs would not fit in a minute (`ROW_BUDGET`) runs fewer times and names how many.

mod ceilings;
mod harness;
mod mooncake;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_kv::planner::{build_plan, contiguous_runs, Descriptor, TransferPlan};
use pdflow_messages::rdma::RemoteWriteGrant;
use pdflow_messages::BlockId;
use pdflow_transfer::fence::WriteFence;
use pdflow_transfer::same_host::SameHostMode;
use pdflow_transfer::tcp::{DataServerOptions, RdmaMode, TcpConfig, TcpDataServer};
use pdflow_transfer::{AutoTransferEngine, TransferEngine};

use super::report::{self, Row, Sample, Samples, Stopwatch};
use harness::ActorPair;
use pdflow_node::BootstrapNode;

const SHAPE: KvShape = KvShape::QWEN3_8B;
/// P's blocks in the seed (steps 25–27) and D's (step 16).
const P_BLOCKS: std::ops::RangeInclusive<BlockId> = 17..=79;
const D_BLOCKS: std::ops::RangeInclusive<BlockId> = 512..=574;
const P_NUM_BLOCKS: usize = 80;
const D_NUM_BLOCKS: usize = 1024;
const CONCURRENT: usize = 8;
const SMALL_WRITE: u64 = 32 * 1024;
/// The pause before each write of the "after idle" row: longer than D's busy-poll window.
const IDLE_GAP: Duration = Duration::from_millis(1);
/// The wall-clock time a row's warm-up and measured runs may take together, judged from its first
/// (unmeasured) run: a slower row runs fewer times and says so in its name.
const ROW_BUDGET: Duration = Duration::from_secs(60);
/// P's write deadline in the rdma rows: a bench measures how long a write takes instead of
/// cutting it at the node's default (30 s), which the uncoalesced plan's 2,268 one-sided writes
/// can exceed on libfabric's software provider.
const RDMA_WRITE_TIMEOUT: Duration = Duration::from_secs(600);
/// The P worker D grants the engine rows' blocks to (D keys its connect tokens by P worker).
const P_WORKER: &str = "bench-p-worker";
/// Why `--backend rdma` cannot run in a build without the `rdma` feature.
const NO_RDMA_BUILD: &str = "--backend rdma: this pdflow was built without the rdma backend (build it with \
                             `cargo build --release -p pdflow --features rdma`)";

/// Which transfer backend P uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// The tcp backend only.
    Tcp,
    /// The same-host path only (`process_vm_writev`); fails if unavailable.
    SameHost,
    /// What a node uses: same-host when possible, tcp otherwise.
    Auto,
    /// One-sided RDMA writes through libfabric into the blocks D granted (`--rdma-provider`;
    /// a build with `--features rdma`); fails if the provider does not open here.
    Rdma,
}

impl Backend {
    fn mode(self) -> SameHostMode {
        match self {
            Backend::Tcp | Backend::Rdma => SameHostMode::Off,
            Backend::SameHost => SameHostMode::Required,
            Backend::Auto => SameHostMode::Auto,
        }
    }

    /// P writes only one-sided for `rdma` (`--transport rdma`), never for the others.
    fn rdma(self) -> RdmaMode {
        match self {
            Backend::Rdma => RdmaMode::Required,
            _ => RdmaMode::Off,
        }
    }
}

/// Which authentication the rows run under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AuthArg {
    /// No cluster secret (every socket open).
    Off,
    /// A cluster secret on every socket: signed bootstrap calls, sealed pulls, proven hellos.
    On,
    /// The secret and TLS on the data channel (tcp rows only: the same-host path has no wire).
    Tls,
    /// Off and on, one after the other in this run: the rows with the secret are named `… (auth)`.
    Both,
    /// Off, on and TLS in this run: the TLS rows are named `… (tls)`.
    All,
}

/// One mode's settings: the secret, and TLS on top of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct AuthMode {
    secret: bool,
    tls: bool,
}

impl AuthMode {
    const OFF: Self = Self { secret: false, tls: false };
    const ON: Self = Self { secret: true, tls: false };
    const TLS: Self = Self { secret: true, tls: true };

    /// The suffix of the rows' names.
    fn suffix(self) -> &'static str {
        match (self.secret, self.tls) {
            (_, true) => " (tls)",
            (true, false) => " (auth)",
            (false, false) => "",
        }
    }
}

impl AuthArg {
    fn modes(self) -> Vec<AuthMode> {
        match self {
            AuthArg::Off => vec![AuthMode::OFF],
            AuthArg::On => vec![AuthMode::ON],
            AuthArg::Tls => vec![AuthMode::TLS],
            AuthArg::Both => vec![AuthMode::OFF, AuthMode::ON],
            AuthArg::All => vec![AuthMode::OFF, AuthMode::ON, AuthMode::TLS],
        }
    }
}

/// The secret the `(auth)` rows run under (a bench's own; nothing leaves this process).
fn bench_secret() -> anyhow::Result<pdflow_auth::ClusterSecret> {
    let key: String = pdflow_auth::nonce().iter().chain(&pdflow_auth::nonce()).map(|b| format!("{b:02x}")).collect();
    Ok(pdflow_auth::ClusterSecret::from_text(&key)?)
}

/// Options of `pdflow bench transfer`.
#[derive(Debug, Clone, clap::Args)]
pub struct Options {
    /// Write the rows as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Measured runs per row (median, min, max over them).
    #[arg(long, default_value_t = 15)]
    pub runs: usize,
    /// Unmeasured runs before each row's measured ones.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Also run Mooncake's TransferEngine over TCP (tests/peers/mooncake_tcp.py) and report ratios.
    #[arg(long)]
    pub compare_mooncake: bool,
    /// The backends to measure, one after the other in this run (`tcp,rdma`, or the flag
    /// repeated); without it tcp and same-host, and rdma too in a build with the rdma feature
    /// where `--rdma-provider` opens.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub backend: Vec<Backend>,
    /// The libfabric provider of the rdma rows: `tcp` (software, any host) or a NIC's (`verbs`,
    /// with `--rdma-host` on its interface).
    #[arg(long, default_value = "tcp")]
    pub rdma_provider: String,
    /// The address whose interface D's RDMA endpoint opens and listens on.
    #[arg(long, default_value = "127.0.0.1")]
    pub rdma_host: String,
    /// TCP streams per peer (the tcp backend's `streams_per_peer`).
    #[arg(long, default_value_t = TcpConfig::default().streams_per_peer)]
    pub streams: usize,
    /// Skip the actor rows (engine rows and ceilings only).
    #[arg(long)]
    pub engine_only: bool,
    /// Run with the cluster secret off, on, with TLS too, or several in one run (`both`: off and
    /// on; `all`: off, on and TLS) — the overhead of authentication and of encryption.
    #[arg(long, value_enum, default_value = "off")]
    pub auth: AuthArg,
    /// `cuda`: the same request GPU to GPU (one process, separate processes over CUDA IPC, and
    /// the staged cross-host path), each with its same-run ceiling (feature `cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: crate::demo::DemoDevice,
    /// Internal: run as the CUDA IPC part's D process on this GPU.
    #[arg(long, hide = true)]
    pub ipc_peer: Option<usize>,
}

/// Runs the benchmark; prints the table; writes the JSON.
pub async fn run(opts: Options) -> anyhow::Result<()> {
    if opts.runs == 0 {
        bail!("--runs must be at least 1");
    }
    if opts.device == crate::demo::DemoDevice::Cuda || opts.ipc_peer.is_some() {
        return run_on_gpus(opts).await;
    }
    let backends = backends(&opts)?;
    let p_blocks: Vec<BlockId> = P_BLOCKS.collect();
    let bytes = (p_blocks.len() * SHAPE.bytes_per_block()) as u64;
    let p_cache = KvCache::new(SHAPE, P_NUM_BLOCKS);
    fill(&p_cache, &p_blocks);
    let d_cache = KvCache::new(SHAPE, D_NUM_BLOCKS);
    let mut rows = Vec::new();
    let mut result = Ok(());
    'modes: for backend in &backends {
        for mode in opts.auth.modes() {
            if mode.tls && matches!(backend, Backend::SameHost | Backend::Rdma) {
                // The same-host path never touches a socket, and one-sided writes have no TLS
                // layer: there is nothing for TLS to cover.
                continue;
            }
            let secret = if mode.secret { Some(bench_secret()?) } else { None };
            let suffix = mode.suffix();
            eprintln!("bench transfer: {backend:?}{suffix} …");
            // D's fence holds D's RDMA target for the rdma rows, as `serve_kv_data` builds it.
            let fence = match backend {
                Backend::Rdma => Some(rdma_fence(&opts, secret.clone())?),
                _ => None,
            };
            let mut config = TcpConfig {
                same_host: backend.mode(),
                rdma: backend.rdma(),
                rdma_provider: (*backend == Backend::Rdma).then(|| opts.rdma_provider.clone()),
                streams_per_peer: opts.streams.max(1),
                secret: secret.clone(),
                ..TcpConfig::default()
            };
            if *backend == Backend::Rdma {
                config.write_timeout = RDMA_WRITE_TIMEOUT;
            }
            config.set_tls(mode.tls)?;
            let d_server = TcpDataServer::bind_options(
                "127.0.0.1:0".parse()?,
                d_cache.region_table(),
                DataServerOptions {
                    secret: secret.clone(),
                    tls: config.tls.clone(),
                    offer_same_host: true,
                    fence: fence.clone(),
                    ..DataServerOptions::default()
                },
            )
            .await?;
            let d_addr = d_server.local_addr().to_string();
            let tls = config.tls.clone();
            let engine = Arc::new(AutoTransferEngine::new(p_cache.region_table(), config));
            // One bootstrap per P engine (a bootstrap serves one engine per dp rank).
            let bootstrap = BootstrapNode::start_with(
                "127.0.0.1:0".parse()?,
                secret.clone(),
                false,
                &pdflow_actors::fault_seam::no_faults(),
            )
            .await?;
            let setup = Setup {
                engine: &engine,
                p_cache: &p_cache,
                d_cache: &d_cache,
                d_addr: &d_addr,
                bootstrap: &bootstrap,
                p_blocks: &p_blocks,
                secret: secret.as_ref(),
                tls: tls.as_ref(),
                fence: fence.as_ref(),
            };
            let first = rows.len();
            let measured = measure_backend(&opts, *backend, &setup, &mut rows).await;
            for row in &mut rows[first..] {
                row.name.push_str(suffix);
            }
            bootstrap.shutdown().await;
            d_server.shutdown().await;
            if let Err(e) = measured {
                result = Err(e.context(format!("backend {backend:?}{suffix}")));
                break 'modes;
            }
        }
    }
    result?;

    eprintln!("bench transfer: ceilings …");
    let memcpy = tokio::task::spawn_blocking({
        let (warmup, runs) = (opts.warmup, opts.runs);
        move || ceilings::memcpy_ms(bytes as usize, warmup, runs)
    })
    .await?;
    rows.push(report::row_cpu("ceiling memcpy (1 thread)", Some("memcpy"), None, Some(1), Some(bytes), &memcpy));
    for streams in [1, 4] {
        let samples = ceilings::loopback_tcp_ms(bytes as usize, streams, opts.warmup, opts.runs).await?;
        rows.push(report::row_cpu(
            &format!("ceiling loopback tcp ({streams} stream{})", if streams > 1 { "s" } else { "" }),
            Some("tokio-tcp"),
            None,
            Some(1),
            Some(bytes),
            &samples,
        ));
    }
    let round_trip = tokio::task::spawn_blocking({
        let (warmup, runs) = (opts.warmup.max(10), (opts.runs * 10).max(100));
        move || ceilings::loopback_round_trip_ms(SMALL_WRITE as usize, warmup, runs)
    })
    .await??;
    rows.push(report::row_cpu(
        "ceiling loopback round trip 32 KiB + ack",
        Some("blocking-tcp"),
        Some("single"),
        Some(1),
        Some(SMALL_WRITE),
        &round_trip,
    ));

    if opts.compare_mooncake {
        eprintln!("bench transfer: mooncake …");
        let theirs = mooncake::rows(opts.runs, opts.warmup).await;
        let ratios = ratio_rows(&rows, &theirs);
        rows.extend(theirs);
        rows.extend(ratios);
    }
    print!("{}", report::render(&rows));
    if let Some(path) = &opts.json {
        report::write_json(path, &rows).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("bench transfer: rows written to {}", path.display());
    }
    Ok(())
}

/// The backends this run measures: `--backend`'s (each once, in order), or tcp and same-host,
/// and rdma where this build has it and its provider opens.
fn backends(opts: &Options) -> anyhow::Result<Vec<Backend>> {
    let rdma_here = || pdflow_transfer::rdma_runs_here(&opts.rdma_provider, &opts.rdma_host);
    if opts.backend.is_empty() {
        let mut all = vec![Backend::Tcp, Backend::SameHost];
        if cfg!(feature = "rdma") {
            match rdma_here() {
                Ok(()) => all.push(Backend::Rdma),
                Err(why) => eprintln!("bench transfer: no rdma rows: {why}"),
            }
        }
        return Ok(all);
    }
    let mut chosen = Vec::new();
    for b in &opts.backend {
        if !chosen.contains(b) {
            chosen.push(*b);
        }
    }
    if chosen.contains(&Backend::Rdma) {
        if !cfg!(feature = "rdma") {
            bail!(NO_RDMA_BUILD);
        }
        rdma_here().map_err(|why| {
            anyhow!(
                "--backend rdma: libfabric's {:?} provider does not open on {}: {why}",
                opts.rdma_provider,
                opts.rdma_host
            )
        })?;
    }
    Ok(chosen)
}

/// D's write fence holding D's RDMA target (`--rdma-provider` on `--rdma-host`, under `secret`),
/// as a node with `--transport rdma` builds it.
#[cfg(feature = "rdma")]
fn rdma_fence(opts: &Options, secret: Option<pdflow_auth::ClusterSecret>) -> anyhow::Result<WriteFence> {
    let target = pdflow_transfer::rdma::RdmaTarget::start(&opts.rdma_provider, &opts.rdma_host, secret)
        .with_context(|| format!("D's RDMA endpoint ({} on {})", opts.rdma_provider, opts.rdma_host))?;
    eprintln!(
        "bench transfer: D's RDMA endpoint: {} on {} ({})",
        target.provider(),
        target.device(),
        if target.nic_modes() { "a verbs NIC's registration modes" } else { "the provider's own registration modes" }
    );
    Ok(WriteFence::new().with_remote(Arc::new(target)))
}

#[cfg(not(feature = "rdma"))]
fn rdma_fence(_opts: &Options, _secret: Option<pdflow_auth::ClusterSecret>) -> anyhow::Result<WriteFence> {
    bail!(NO_RDMA_BUILD)
}

/// What one backend's measurements run on.
struct Setup<'a> {
    engine: &'a Arc<AutoTransferEngine>,
    p_cache: &'a Arc<KvCache>,
    d_cache: &'a Arc<KvCache>,
    d_addr: &'a str,
    bootstrap: &'a BootstrapNode,
    p_blocks: &'a [BlockId],
    /// The cluster secret every socket runs under (none: no authentication).
    secret: Option<&'a pdflow_auth::ClusterSecret>,
    /// TLS on the side channel and the data channel.
    tls: Option<&'a pdflow_auth::TlsIdentity>,
    /// D's write fence, holding D's RDMA target (the rdma backend only).
    fence: Option<&'a WriteFence>,
}

/// Fence tokens of the engine rows' pulls: even, as D's Receiver takes odd ones.
static NEXT_TOKEN: AtomicU64 = AtomicU64::new(2);

/// One pull's one-sided write access to D's blocks (the rdma backend): its fence token and grant.
struct Granted<'a> {
    fence: &'a WriteFence,
    token: u64,
    grant: Arc<RemoteWriteGrant>,
}

impl<'a> Granted<'a> {
    /// D's side of a pull as D's Receiver does it: opens a fence token and grants the P worker
    /// the byte runs of `d_blocks` in every region of D's KV, under that token.
    fn open(fence: &'a WriteFence, d_cache: &KvCache, d_blocks: &[BlockId]) -> anyhow::Result<Self> {
        let remote = fence.remote().context("D's fence holds no RDMA target")?;
        let token = NEXT_TOKEN.fetch_add(2, Ordering::Relaxed);
        fence.open(token);
        let runs = contiguous_runs(d_blocks, d_blocks);
        let ranges: Vec<(u64, u64)> = d_cache
            .regions()
            .iter()
            .flat_map(|r| runs.iter().map(move |&(s, n)| (r.block_addr(d_blocks[s]), n as u64 * r.block_len)))
            .collect();
        let regions = match remote.grant(token, P_WORKER, &ranges) {
            Ok(regions) => regions,
            Err(e) => {
                fence.close_now(token);
                bail!("D could not register blocks for one-sided writes: {e}");
            }
        };
        let grant = RemoteWriteGrant { offer: remote.offer(P_WORKER), regions };
        Ok(Self { fence, token, grant: Arc::new(grant) })
    }

    /// `plan` under this pull's token, carrying its grant (as P's SendWorker builds it).
    fn plan(&self, plan: &TransferPlan) -> TransferPlan {
        TransferPlan { fence: self.token, grant: Some(self.grant.clone()), ..plan.clone() }
    }

    /// Closes the token: cleanly (the keys revoked, P's connection kept) after a write P
    /// completed, at once (P's connections closed too) otherwise.
    fn close(self, clean: bool) {
        if clean {
            self.fence.close_clean(self.token);
        } else {
            self.fence.close_now(self.token);
        }
    }
}

async fn measure_backend(
    opts: &Options,
    backend: Backend,
    setup: &Setup<'_>,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let Setup { engine, p_cache, d_cache, d_addr, p_blocks, fence, .. } = *setup;
    let bytes = (p_blocks.len() * SHAPE.bytes_per_block()) as u64;
    let seed_d: Vec<BlockId> = D_BLOCKS.collect();
    if !opts.engine_only {
        let tag = format!("{backend:?}").to_lowercase();
        measure_actors(opts, &tag, setup, rows).await?;
    }

    // The engine alone: the coalesced plan, the uncoalesced one, a 32 KiB write.
    let label = |engine: &AutoTransferEngine| engine.backend_for(d_addr).to_string();
    for (coalesce, plan_name, row_name) in [
        (true, "coalesced", "engine seed coalesced (36 desc)"),
        (false, "uncoalesced", "engine seed uncoalesced (2,268 desc)"),
    ] {
        let plan = build_plan(&p_cache.regions(), p_blocks, &d_cache.regions(), &seed_d, coalesce)?;
        zero(d_cache, &seed_d);
        let first = timed_write(setup, &plan, &seed_d, Duration::ZERO).await?;
        verify(p_cache, p_blocks, d_cache, &seed_d, row_name)?;
        let (row_opts, row_name) = within_budget(opts, first, row_name);
        let samples = repeat(&row_opts, || timed_write(setup, &plan, &seed_d, Duration::ZERO)).await?;
        rows.push(report::row_cpu(&row_name, Some(&label(engine)), Some(plan_name), Some(1), Some(bytes), &samples));
    }
    let (src, dst) =
        (p_cache.regions()[0].block_addr(*P_BLOCKS.start()), d_cache.regions()[0].block_addr(*D_BLOCKS.start()));
    let small = TransferPlan {
        descriptors: vec![Descriptor { src, dst, len: SMALL_WRITE }],
        fence: 0,
        write_by: None,
        grant: None,
    };
    let small_opts = Options { runs: (opts.runs * 10).max(100), warmup: opts.warmup.max(10), ..opts.clone() };
    // D grants the request's one block (every region), as for a one-block request.
    let small_d = &seed_d[..1];
    let samples = repeat(&small_opts, || timed_write(setup, &small, small_d, Duration::ZERO)).await?;
    rows.push(report::row_cpu(
        "engine 32 KiB write",
        Some(&label(engine)),
        Some("single"),
        Some(1),
        Some(SMALL_WRITE),
        &samples,
    ));
    // The same write after the connections sat idle for a millisecond: D's connection thread has
    // stopped polling and sleeps in the kernel, so this one pays its wake-up.
    let samples = repeat(&small_opts, || timed_write(setup, &small, small_d, IDLE_GAP)).await?;
    rows.push(report::row_cpu(
        "engine 32 KiB write after 1 ms idle",
        Some(&label(engine)),
        Some("single"),
        Some(1),
        Some(SMALL_WRITE),
        &samples,
    ));
    if let Some(fence) = fence {
        // D's part of each pull that the write rows leave out: registering the pull's block runs
        // (a grant) and, after P's write, revoking them.
        for (row_name, blocks, row_opts) in [
            ("rdma grant + revoke, seed blocks (D)", &seed_d[..], opts),
            ("rdma grant + revoke, 1 block (D)", small_d, &small_opts),
        ] {
            let samples = repeat(row_opts, || async {
                let watch = Stopwatch::start();
                Granted::open(fence, d_cache, blocks)?.close(true);
                Ok(watch.stop())
            })
            .await?;
            let regions = format!("{} regions", d_cache.regions().len() * contiguous_runs(blocks, blocks).len());
            rows.push(report::row_cpu(row_name, Some("rdma"), Some(&regions), Some(1), None, &samples));
        }
    }
    Ok(())
}

/// `--device cuda`: the GPU benches, on a blocking thread (they wait on the GPU).
#[cfg(feature = "cuda")]
async fn run_on_gpus(opts: Options) -> anyhow::Result<()> {
    tokio::task::spawn_blocking(move || match opts.ipc_peer {
        Some(device) => super::gpu::serve_peer(device),
        None => super::gpu::run(opts.runs.max(20), opts.json.as_deref()).map(|_| ()),
    })
    .await
    .context("the GPU bench's thread ended abnormally")?
}

#[cfg(not(feature = "cuda"))]
async fn run_on_gpus(_opts: Options) -> anyhow::Result<()> {
    bail!("--device cuda: this pdflow was built without GPU support (build it with `cargo build --release --features cuda`)")
}

/// The actor rows: concurrency 1 (the cold first pull, then measured runs) and 8.
async fn measure_actors(opts: &Options, tag: &str, setup: &Setup<'_>, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let Setup { engine, p_cache, d_cache, d_addr, bootstrap, p_blocks, secret, tls, fence } = *setup;
    let bytes = (p_blocks.len() * SHAPE.bytes_per_block()) as u64;
    let transfer: Arc<dyn TransferEngine> = engine.clone();
    let pair = ActorPair::start(
        tag,
        bootstrap,
        p_cache,
        transfer,
        d_cache,
        (d_addr.to_string(), fence.cloned()),
        (secret.cloned(), tls.cloned()),
    )
    .await?;
    let result = async {
        // Concurrency 1: the seed's blocks. The first pull (bootstrap look-up, side-channel
        // connect, D's full layout) is cold; it also checks the bytes.
        let seed_d: Vec<BlockId> = D_BLOCKS.collect();
        zero(d_cache, &seed_d);
        let cold = pair.transfer(p_blocks, std::slice::from_ref(&seed_d)).await?;
        verify(p_cache, p_blocks, d_cache, &seed_d, "actors c=1")?;
        let name = engine.backend_for(d_addr).to_string();
        rows.push(report::row_cpu(
            "actors seed first pull (cold)",
            Some(&name),
            Some("coalesced"),
            Some(1),
            Some(bytes),
            &[cold].into_iter().collect(),
        ));
        let (row_opts, row_name) = within_budget(opts, cold, "actors seed coalesced");
        let samples = repeat(&row_opts, || pair.transfer(p_blocks, std::slice::from_ref(&seed_d))).await?;
        rows.push(report::row_cpu(&row_name, Some(&name), Some("coalesced"), Some(1), Some(bytes), &samples));

        // Concurrency 8: eight requests in one step, into disjoint D blocks.
        let sets: Vec<Vec<BlockId>> = std::iter::once(seed_d.clone())
            .chain((0..CONCURRENT as u32 - 1).map(|i| (i * 64..i * 64 + 63).collect()))
            .collect();
        for set in &sets {
            zero(d_cache, set);
        }
        let first = pair.transfer(p_blocks, &sets).await?;
        for set in &sets {
            verify(p_cache, p_blocks, d_cache, set, "actors c=8")?;
        }
        let (row_opts, row_name) = within_budget(opts, first, "actors seed coalesced");
        let samples = repeat(&row_opts, || pair.transfer(p_blocks, &sets)).await?;
        rows.push(report::row_cpu(
            &row_name,
            Some(&name),
            Some("coalesced"),
            Some(CONCURRENT as u32),
            Some(bytes),
            &samples,
        ));
        anyhow::Ok(())
    }
    .await;
    pair.shutdown().await;
    result
}

/// One write of `plan` into D's `d_blocks` by the engine under test, after `idle` without
/// writing; timed, wall-clock and CPU, from the call to the engine until it returns. For the rdma
/// backend D grants `d_blocks` under a new fence token first (as D's Receiver does when it sends
/// the pull), the plan carries the grant, and D closes the token after the write (cleanly: the
/// keys revoked, as when P reported the write finished); neither is in the timed part.
async fn timed_write(
    setup: &Setup<'_>,
    plan: &TransferPlan,
    d_blocks: &[BlockId],
    idle: Duration,
) -> anyhow::Result<Sample> {
    let granted = setup.fence.map(|fence| Granted::open(fence, setup.d_cache, d_blocks)).transpose()?;
    let with_grant = granted.as_ref().map(|g| g.plan(plan));
    if !idle.is_zero() {
        tokio::time::sleep(idle).await;
    }
    let watch = Stopwatch::start();
    let written = setup.engine.write(setup.d_addr, with_grant.as_ref().unwrap_or(plan)).await;
    let sample = watch.stop();
    if let Some(g) = granted {
        g.close(written.is_ok());
    }
    written?;
    Ok(sample)
}

/// The runs of a row whose first run took `first`: `opts`' warm-up and measured runs, fewer when
/// they would not fit in [`ROW_BUDGET`] (at least one measured run); and the row's name, which
/// then says how many ran.
fn within_budget(opts: &Options, first: Sample, name: &str) -> (Options, String) {
    let fit = (ROW_BUDGET.as_secs_f64() / first.wall.as_secs_f64().max(1e-6)) as usize;
    if fit >= opts.runs + opts.warmup {
        return (opts.clone(), name.to_string());
    }
    let runs = opts.runs.min(fit).max(1);
    let warmup = opts.warmup.min(fit.saturating_sub(runs));
    let name = if runs < opts.runs { format!("{name} [{runs} of {} runs]", opts.runs) } else { name.to_string() };
    (Options { runs, warmup, ..opts.clone() }, name)
}

/// `opts.warmup` unmeasured runs, then `opts.runs` measured ones.
async fn repeat<F, Fut>(opts: &Options, mut once: F) -> anyhow::Result<Samples>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Sample>>,
{
    for _ in 0..opts.warmup {
        once().await?;
    }
    let mut samples = Samples::default();
    for _ in 0..opts.runs {
        samples.push(once().await?);
    }
    Ok(samples)
}

/// Fills `blocks` of every layer with a pattern that differs per layer and block.
fn fill(cache: &Arc<KvCache>, blocks: &[BlockId]) {
    let table = cache.region_table();
    for (layer, r) in table.regions().iter().enumerate() {
        for &b in blocks {
            // SAFETY: the bench owns the cache; nothing else touches these blocks now.
            if let Ok(bytes) = unsafe { table.slice_mut(r.block_addr(b), r.block_len) } {
                for (i, chunk) in bytes.chunks_mut(8).enumerate() {
                    let word = ((layer as u64) << 48) ^ (u64::from(b) << 32) ^ (i as u64).wrapping_mul(0x9E37_79B9);
                    chunk.copy_from_slice(&word.to_le_bytes()[..chunk.len()]);
                }
            }
        }
    }
}

/// Zeroes `blocks` of every layer (so a later check proves the transfer wrote them).
fn zero(cache: &Arc<KvCache>, blocks: &[BlockId]) {
    let table = cache.region_table();
    for r in table.regions() {
        for &b in blocks {
            // SAFETY: as in `fill`; no transfer is in flight between runs.
            if let Ok(bytes) = unsafe { table.slice_mut(r.block_addr(b), r.block_len) } {
                bytes.fill(0);
            }
        }
    }
}

fn verify(p: &KvCache, p_blocks: &[BlockId], d: &KvCache, d_blocks: &[BlockId], what: &str) -> anyhow::Result<()> {
    let (sent, got) = (p.blocks_checksum(p_blocks)?, d.blocks_checksum(d_blocks)?);
    if sent != got {
        bail!(
            "{what}: D's blocks {}..={} hold checksum {got:#x}, P's blocks {sent:#x}: the bytes differ",
            d_blocks[0],
            d_blocks[d_blocks.len() - 1]
        );
    }
    Ok(())
}

/// pdflow/Mooncake ratios of medians (below 1: pdflow is faster), and pdflow's uncoalesced/coalesced.
fn ratio_rows(ours: &[Row], theirs: &[Row]) -> Vec<Row> {
    let median = |rows: &[Row], name: &str| {
        rows.iter().find(|r| r.name.starts_with(name) && r.median_ms.is_some()).and_then(|r| r.median_ms)
    };
    let mut out = Vec::new();
    let backends: Vec<String> = ours
        .iter()
        .filter(|r| r.name.starts_with("actors seed coalesced"))
        .filter_map(|r| r.backend.clone())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    for backend in backends {
        let mine: Vec<Row> = ours
            .iter()
            .filter(|r| r.backend.as_deref() == Some(&backend) && r.concurrency == Some(1))
            .cloned()
            .collect();
        let pairs = [
            ("actors seed coalesced", "mooncake seed coalesced", "coalesced"),
            ("engine seed coalesced", "mooncake seed coalesced", "coalesced"),
            ("engine seed uncoalesced", "mooncake seed uncoalesced (queue", "uncoalesced"),
            ("engine 32 KiB write", "mooncake 32 KiB write", "single"),
        ];
        for (a, b, plan) in pairs {
            if let (Some(x), Some(y)) = (median(&mine, a), median(theirs, b)) {
                out.push(Row {
                    name: format!("ratio {a} / mooncake = {:.2}x", x / y),
                    backend: Some(backend.clone()),
                    plan: Some(plan.into()),
                    ..Row::default()
                });
            }
        }
        if let (Some(u), Some(c)) = (median(&mine, "engine seed uncoalesced"), median(&mine, "engine seed coalesced")) {
            out.push(Row {
                name: format!("ratio uncoalesced / coalesced = {:.2}x", u / c),
                backend: Some(backend.clone()),
                ..Row::default()
            });
        }
    }
    out
}

#[cfg(test)]
mod tests;
