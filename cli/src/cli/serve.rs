//! `pdflow serve`: the simulated engine with pdflow's connector, its flags, and the engine's
//! configuration they make (every bad value reported before anything binds).

use super::*;

#[derive(Debug, Args)]
pub struct ServeCmd {
    #[arg(long, value_enum)]
    pub role: RoleArg,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// HTTP port (0 for any).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Engine id (default: a random uuid).
    #[arg(long)]
    pub engine_id: Option<String>,
    #[arg(long, default_value = "Qwen/Qwen3-8B")]
    pub served_model_name: String,
    /// KV shape: `qwen3-8b`, a hybrid preset (`gpt-oss-like`, `qwen3.5-like`) or
    /// `LAYERS,KV_HEADS,HEAD_DIM,BLOCK_SIZE`.
    #[arg(long, default_value = "qwen3-8b", value_parser = parse_shape)]
    pub kv_shape: ModelShape,
    #[arg(long, default_value_t = 256)]
    pub num_blocks: usize,
    /// Tokens per step; below the prompt length this is chunked prefill.
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Prefix caching as vLLM's (`--enable-prefix-caching`): a prompt's cached full blocks are
    /// reused, freed blocks stay cached until evicted. Off by default here; dense models only.
    #[arg(long)]
    pub enable_prefix_caching: bool,
    /// Publish KV events on a ZeroMQ PUB socket here (e.g. `tcp://*:5557`; a wildcard binds, any
    /// other host is connected to), in vLLM's wire format. Needs --enable-prefix-caching.
    #[arg(long, value_name = "ENDPOINT", conflicts_with = "kv_events_config")]
    pub kv_events_endpoint: Option<String>,
    /// vLLM's `--kv-events-config` JSON (`enable_kv_cache_events`, `publisher`, `endpoint`,
    /// `replay_endpoint`, `buffer_steps`, `hwm`, `max_queue_size`, `topic`).
    #[arg(long, value_name = "JSON")]
    pub kv_events_config: Option<String>,
    /// Make each step take as long as a GPU would: `h200` (Qwen3-8B on one H200, see
    /// docs/simulated-engine.md) or `PREFILL_US_PER_TOKEN,DECODE_US_PER_STEP`. The engine sleeps
    /// the difference, so that many engines share few cores. Off by default.
    #[arg(long, value_name = "MODEL", value_parser = parse_forward_timing)]
    pub forward_timing: Option<pdflow_sim_engine::ForwardTiming>,
    #[arg(long, default_value_t = 4096)]
    pub max_model_len: usize,
    /// Producer: register with this bootstrap instead of launching one (e.g. `http://127.0.0.1:8998`).
    #[arg(long, conflicts_with = "bootstrap_port")]
    pub bootstrap_url: Option<String>,
    /// Producer: launch the bootstrap on this port (default VLLM_MOONCAKE_BOOTSTRAP_PORT, else 8998).
    #[arg(long)]
    pub bootstrap_port: Option<u16>,
    /// Advertise this engine (its role, HTTP URL and KV-event endpoints) at this bootstrap, for
    /// `pdflow proxy --discover` (repeat for several). A producer advertises at its own bootstrap
    /// as well.
    #[arg(long, value_name = "BOOTSTRAP_URL")]
    pub advertise_to: Vec<String>,
    /// Seconds P waits for a pulled request's prefill, and keeps sent-ready blocks
    /// (default VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, else 30).
    #[arg(long)]
    pub abort_request_timeout: Option<u64>,
    /// Producer: seconds a pull waits for its request's prefill to be ready — seed step 22
    /// (`p_pull_wait_ready`: regions prepared, waiting for ready) — before P answers D with an
    /// error (default: the abort-request timeout).
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub ready_timeout: Option<f64>,
    /// Producer: seconds sent-ready blocks wait for D's pull — from seed step 27
    /// (`p_record_send_ready`: block ids and expiry recorded) — before P frees them anyway
    /// (default: the abort-request timeout).
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub send_expiry: Option<f64>,
    /// Consumer: seconds one side-channel exchange may take — seed step 21 (`d_send_pull_meta`)
    /// until P's FINISH, step 30 (`p_reply_finish`) — before D fails the load (default: the
    /// abort-request timeout + 5).
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub pull_timeout: Option<f64>,
    /// Consumer: seconds one bootstrap look-up may take — seed step 20 (`d_bootstrap_query`:
    /// GET /query for P's worker addresses) (default 5).
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub bootstrap_timeout: Option<f64>,
    /// Consumer: what to do when the KV cannot be loaded.
    #[arg(long, value_enum, default_value = "recompute")]
    pub kv_load_failure_policy: PolicyArg,
    /// Parallel TCP streams per peer for KV writes.
    #[arg(long, default_value_t = 4)]
    pub streams_per_peer: usize,
    /// Shared token that P must present to D's data server.
    #[arg(long, env = "PDFLOW_TRANSFER_TOKEN")]
    pub transfer_token: Option<String>,
    #[command(flatten)]
    pub secret: SecretArgs,
    /// TLS on every data connection (`on` needs the cluster secret: the certificates are made
    /// from it, and both ends prove it in the handshake). Set the same on P and D; the same-host
    /// path, which never leaves the host, is not affected.
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub tls: OnOff,
    /// `auto`: P writes one-sided (RDMA) when D offers it on a NIC, a D on the same host straight
    /// into its memory (`process_vm_writev`) when the kernel allows it, over tcp otherwise; `tcp`:
    /// always over tcp; `rdma`: only one-sided RDMA writes, on the software `tcp` provider where
    /// no NIC's opens (a build with `--features rdma`). As vLLM's `kv_connector_extra_config`
    /// `transport`; set the same on P and D.
    #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
    pub transport: TransportArg,
    /// The libfabric provider for RDMA (`verbs`, `efa`, `tcp`; `tcp;ofi_rxm` for `efa`'s
    /// datagram endpoints in software): default a NIC's when one opens. Naming one with
    /// `--transport auto` offers RDMA on it.
    #[arg(long, value_name = "PROVIDER")]
    pub rdma_provider: Option<String>,
    /// Record KV checksums on both sides of every transfer (costs a pass over the bytes).
    #[arg(long)]
    pub verify_checksums: bool,
    /// Producer: write each prefill's KV to D layer by layer while later layers compute (D's pull
    /// must have arrived; layers done before it are written when it does). Consumers ignore it.
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub layerwise: OnOff,
    /// Run the simulated model's forward pinned to CPU N, apart from the connector's threads and
    /// the network stack, as a GPU runs it (the rest of the process stays where it was started:
    /// e.g. `taskset -c 1 pdflow serve … --forward-cpu 0`).
    #[arg(long, value_name = "N")]
    pub forward_cpu: Option<usize>,
    /// Keep this engine's KV on CUDA device N (a build with `--features cuda`): P then writes a D
    /// with GPU KV in another process on this host through CUDA IPC, one kernel launch per plan.
    #[arg(long, value_name = "N")]
    pub kv_device: Option<usize>,
    /// Producer with `--kv-device`: the path to a D with GPU KV (`auto`: CUDA IPC on this host,
    /// staged tcp across hosts; `staged`: staged tcp always).
    #[arg(long, value_enum, default_value = "auto")]
    pub gpu_path: GpuPathArg,
    /// Shard the engine's KV over this many tensor-parallel workers (KV heads split, replicated
    /// when there are more workers than heads), as vLLM's `--tensor-parallel-size`: each worker
    /// has its own KV cache and side channel (P) or data server (D); P and D may differ.
    #[arg(long, visible_alias = "tp", default_value_t = 1)]
    pub tensor_parallel_size: u32,
    /// Split the engine's layers over this many pipeline stages, as vLLM's
    /// `--pipeline-parallel-size` (its default split).
    #[arg(long, visible_alias = "pp", default_value_t = 1)]
    pub pipeline_parallel_size: u32,
    /// Run this many engines (data-parallel ranks, each its own scheduler, KV cache and workers)
    /// behind one API, as vLLM's `--data-parallel-size`: engine ids `{engine_id}_dp{rank}`; a
    /// request goes to the rank its `X-data-parallel-rank` header names, else the least busy.
    #[arg(long, visible_alias = "dp", default_value_t = 1)]
    pub data_parallel_size: u32,
    /// With tensor or pipeline parallelism: run each rank's worker (P's side channel, D's data
    /// server, and their transfers) in a process of its own, as vLLM runs one worker process per
    /// rank. Each rank's KV cache is shared memory that the engine's simulated forward writes; a
    /// rank's process that dies stops the engine.
    #[arg(long)]
    pub rank_processes: bool,
    #[command(flatten)]
    pub limits: super::LimitArgs,
    #[command(flatten)]
    pub trace: TraceArgs,
}

impl ServeCmd {
    /// The engine node's config, from flags and vLLM's environment variables; every error at once.
    pub fn to_config(&self, env: &VllmEnv) -> Result<EngineNodeConfig, Vec<String>> {
        let mut errors = self.count_errors();
        let flags = self.deadline_flags(&mut errors);
        if self.role == RoleArg::Consumer && (self.bootstrap_url.is_some() || self.bootstrap_port.is_some()) {
            errors.push("--bootstrap-url/--bootstrap-port are for producers: a consumer finds P's bootstrap in each request's kv_transfer_params (to be discovered by a proxy, give --advertise-to BOOTSTRAP_URL)".to_string());
        }
        for url in self.advertise_to.iter().filter(|u| !u.starts_with("http://")) {
            errors.push(format!("--advertise-to {url}: expected a bootstrap's http:// URL"));
        }
        let host = self.host.parse::<std::net::IpAddr>().ok();
        let (secret, insecure) = self.secret.load_for(host, &mut errors);
        let mut tcp = TcpConfig {
            streams_per_peer: self.streams_per_peer,
            auth_token: self.transfer_token.clone(),
            secret,
            insecure,
            gpu_path: self.gpu_path.into(),
            same_host: match self.transport {
                TransportArg::Auto => pdflow_transfer::same_host::SameHostMode::Auto,
                TransportArg::Tcp | TransportArg::Rdma => pdflow_transfer::same_host::SameHostMode::Off,
            },
            rdma: match self.transport {
                TransportArg::Auto => pdflow_transfer::tcp::RdmaMode::Auto,
                TransportArg::Tcp => pdflow_transfer::tcp::RdmaMode::Off,
                TransportArg::Rdma => pdflow_transfer::tcp::RdmaMode::Required,
            },
            rdma_provider: self.rdma_provider.clone(),
            ..TcpConfig::default()
        };
        if let Err(e) = tcp.set_tls(self.tls == OnOff::On) {
            errors.push(format!("--tls on: {e}"));
        }
        let engine = self.engine_config().map_err(|e| errors.push(e)).ok();
        if let Some(Err(e)) = engine.as_ref().map(EngineConfig::check) {
            errors.push(e.to_string());
        }
        let Some(engine) = engine.filter(|_| errors.is_empty()) else {
            return Err(errors);
        };
        let role = match self.role {
            RoleArg::Producer => KvRole::Producer,
            RoleArg::Consumer => KvRole::Consumer,
        };
        Ok(EngineNodeConfig {
            role,
            host: self.host.clone(),
            port: self.port,
            engine,
            bootstrap: self.bootstrap(role, env),
            deadlines: self.deadlines(env, flags),
            tcp,
            verify_checksums: self.verify_checksums,
            layerwise: self.layerwise == OnOff::On && role.produces(),
            kv_device: self.kv_device,
            faults: pdflow_actors::fault_seam::no_faults(),
            parallel: Parallel { tp: self.tensor_parallel_size, pp: self.pipeline_parallel_size },
            dp_rank: 0,
            // The program and its arguments are the process's: `main` fills them in.
            rank_processes: None,
        })
    }

    /// The flags that count something and must not be 0.
    fn count_errors(&self) -> Vec<String> {
        let mut errors = Vec::new();
        if self.num_blocks == 0 {
            errors.push("--num-blocks must be at least 1".to_string());
        }
        if self.max_num_batched_tokens == 0 {
            errors.push("--max-num-batched-tokens must be at least 1".to_string());
        }
        if self.streams_per_peer == 0 {
            errors.push("--streams-per-peer must be at least 1".to_string());
        }
        if self.tensor_parallel_size == 0 || self.pipeline_parallel_size == 0 || self.data_parallel_size == 0 {
            errors.push(
                "--tensor-parallel-size, --pipeline-parallel-size and --data-parallel-size must be at least 1"
                    .to_string(),
            );
        }
        if self.rank_processes && self.tensor_parallel_size * self.pipeline_parallel_size == 1 {
            errors.push(
                "--rank-processes runs each rank of a sharded engine in its own process: it needs --tensor-parallel-size or --pipeline-parallel-size above 1"
                    .to_string(),
            );
        }
        if self.abort_request_timeout == Some(0) {
            errors.push("--abort-request-timeout 0 would fail every transfer; use at least 1".to_string());
        }
        if let Some(cpu) = self.forward_cpu {
            if let Err(e) = pdflow_sim_engine::affinity::check_cpu(cpu) {
                errors.push(format!(
                    "--forward-cpu {cpu}: cannot run a thread there ({e}); give one of the CPUs this process may use (`nproc`, `taskset -p $$`)"
                ));
            }
        }
        errors
    }

    /// The deadline flags given, each checked ([`deadline_seconds`]).
    fn deadline_flags(&self, errors: &mut Vec<String>) -> DeadlineFlags {
        DeadlineFlags {
            ready_timeout: deadline_seconds("--ready-timeout", self.ready_timeout, errors),
            send_expiry: deadline_seconds("--send-expiry", self.send_expiry, errors),
            pull_timeout: deadline_seconds("--pull-timeout", self.pull_timeout, errors),
            bootstrap_timeout: deadline_seconds("--bootstrap-timeout", self.bootstrap_timeout, errors),
        }
    }

    /// The deadlines: each flag given, else the default derived from the abort-request timeout
    /// (the flag, else `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`).
    fn deadlines(&self, env: &VllmEnv, flags: DeadlineFlags) -> Deadlines {
        let abort = self.abort_request_timeout.map(Duration::from_secs).unwrap_or(env.abort_request_timeout);
        let defaults = Deadlines::from_abort_timeout(abort);
        Deadlines {
            ready_timeout: flags.ready_timeout.unwrap_or(defaults.ready_timeout),
            send_expiry: flags.send_expiry.unwrap_or(defaults.send_expiry),
            pull_timeout: flags.pull_timeout.unwrap_or(defaults.pull_timeout),
            bootstrap_timeout: flags.bootstrap_timeout.unwrap_or(defaults.bootstrap_timeout),
        }
    }

    /// Where a producer's bootstrap runs: an external one, or launched on the flag's port (else
    /// `VLLM_MOONCAKE_BOOTSTRAP_PORT`); a consumer has none.
    fn bootstrap(&self, role: KvRole, env: &VllmEnv) -> BootstrapPlacement {
        match (role, &self.bootstrap_url) {
            (KvRole::Consumer, _) => BootstrapPlacement::None,
            (_, Some(url)) => BootstrapPlacement::External { url: url.trim_end_matches('/').to_string() },
            (_, None) => BootstrapPlacement::Launch { port: self.bootstrap_port.unwrap_or(env.bootstrap_port) },
        }
    }

    /// The simulated engine's config.
    fn engine_config(&self) -> Result<EngineConfig, String> {
        let kv_events = match (&self.kv_events_endpoint, &self.kv_events_config) {
            (Some(endpoint), _) => Some(pdflow_sim_engine::kv_events::KvEventsConfig::zmq(endpoint.clone(), None)),
            (None, Some(json)) => {
                Some(pdflow_sim_engine::kv_events::KvEventsConfig::from_json(json).map_err(|e| e.to_string())?)
            }
            (None, None) => None,
        };
        Ok(EngineConfig {
            engine_id: self.engine_id.clone().unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
            served_model_name: self.served_model_name.clone(),
            shape: self.kv_shape.kv,
            hybrid: self.kv_shape.hybrid.clone(),
            num_blocks: self.num_blocks,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            kv_load_failure_policy: match self.kv_load_failure_policy {
                PolicyArg::Recompute => LoadFailurePolicy::Recompute,
                PolicyArg::Fail => LoadFailurePolicy::Fail,
            },
            forward_cpu: self.forward_cpu,
            enable_prefix_caching: self.enable_prefix_caching,
            kv_events,
            forward_timing: self.forward_timing,
            ..EngineConfig::default()
        })
    }
}

/// A deadline flag's seconds: above 0 and at most [`MAX_DEADLINE_S`]; an invalid value is
/// reported in `errors`.
fn deadline_seconds(flag: &str, value: Option<f64>, errors: &mut Vec<String>) -> Option<Duration> {
    let v = value?;
    // A day bounds every deadline of the transfer path (and keeps Duration from overflowing).
    if v.is_finite() && v > 0.0 && v <= MAX_DEADLINE_S {
        Some(Duration::from_secs_f64(v))
    } else {
        errors
            .push(format!("{flag} {v}: expected a number of seconds above 0 and at most {MAX_DEADLINE_S} (e.g. 2.5)"));
        None
    }
}

/// `--forward-timing`: `h200`, or `PREFILL_US_PER_TOKEN,DECODE_US_PER_STEP` (microseconds).
fn parse_forward_timing(s: &str) -> Result<pdflow_sim_engine::ForwardTiming, String> {
    if s == "h200" {
        return Ok(pdflow_sim_engine::ForwardTiming::H200_QWEN3_8B);
    }
    let us = |v: &str| {
        v.trim()
            .parse::<f64>()
            .ok()
            .filter(|x| x.is_finite() && *x >= 0.0 && *x <= 60e6)
            .map(|x| Duration::from_secs_f64(x / 1e6))
    };
    match s.split_once(',').map(|(p, d)| (us(p), us(d))) {
        Some((Some(prefill_per_token), Some(decode_per_step))) => {
            Ok(pdflow_sim_engine::ForwardTiming { prefill_per_token, decode_per_step })
        }
        _ => Err(format!("`{s}`: expected `h200` or PREFILL_US_PER_TOKEN,DECODE_US_PER_STEP (e.g. 30,5000)")),
    }
}
