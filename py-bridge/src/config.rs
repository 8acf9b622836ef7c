//! The connector's configuration: `kv_connector_extra_config` keys (passed in as JSON) over the
//! environment variables vLLM's Mooncake users already set, with the same meaning
//! (`VLLM_MOONCAKE_BOOTSTRAP_PORT`, `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`). An unknown key or a bad
//! value is an error at start-up that names the key, never a silent default.

use std::time::Duration;

use pdflow_auth::ClusterSecret;
use pdflow_node::config::{Deadlines, VllmEnv};
use pdflow_transfer::same_host::SameHostMode;
use pdflow_transfer::tcp::TcpConfig;
use pdflow_transfer::GpuPath;
use serde::Deserialize;

use crate::error::BridgeError;

/// `kv_connector_extra_config`, as the user writes it. Every key is optional.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExtraConfig {
    /// Address this engine's sockets bind to and advertise (side channel, data server, bootstrap).
    /// Default: `$VLLM_HOST_IP`, else 127.0.0.1.
    pub host: Option<String>,
    /// Port of the bootstrap server P's TP0 launches (default `$VLLM_MOONCAKE_BOOTSTRAP_PORT`, 8998).
    pub bootstrap_port: Option<u16>,
    /// Register with this bootstrap (`http://host:port`) instead of launching one (P only).
    pub bootstrap_url: Option<String>,
    /// `auto` (same-host `process_vm_writev` when D shares the host and the kernel allows it,
    /// else tcp) or `tcp`.
    pub transport: Option<String>,
    /// TCP connections one transfer is spread over.
    pub tcp_streams: Option<usize>,
    /// Shared token D's data server demands of P (both sides must set the same one).
    pub auth_token: Option<String>,
    /// A file holding the cluster secret (current key, optionally the previous one on a second
    /// line); without it, `PDFLOW_CLUSTER_SECRET_FILE` or `PDFLOW_CLUSTER_SECRET` are read.
    pub cluster_secret_file: Option<String>,
    /// TLS on every data connection (needs the cluster secret; set the same on P and D).
    pub tls: Option<bool>,
    /// Seconds (default `$VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`, 30): how long P waits for a
    /// request's prefill once D pulled, and keeps sent-ready blocks for a pull that never comes.
    pub abort_request_timeout_s: Option<f64>,
    /// Seconds D waits for one pull to be answered (default: abort timeout + 5).
    pub pull_timeout_s: Option<f64>,
    /// Seconds D waits for one bootstrap look-up (default 5).
    pub bootstrap_timeout_s: Option<f64>,
    /// Seconds for one whole KV write, P side (default 30).
    pub write_timeout_s: Option<f64>,
    /// Record KV checksums on both sides of every transfer (costs a pass over the bytes).
    pub verify_checksums: Option<bool>,
    /// P: write each prefill's KV to D layer by layer (`save_kv_layer`) while later layers compute.
    pub layerwise: Option<bool>,
    /// With KV on a GPU: `auto` (CUDA IPC on one host, staged tcp across hosts) or `staged`
    /// (staged tcp always).
    pub gpu_path: Option<String>,
}

/// The resolved configuration of one connector.
#[derive(Debug, Clone)]
pub struct BridgeConfig {
    pub host: String,
    pub bootstrap_port: u16,
    pub bootstrap_url: Option<String>,
    pub deadlines: Deadlines,
    pub tcp: TcpConfig,
    pub verify_checksums: bool,
    pub layerwise: bool,
}

fn seconds(key: &str, value: Option<f64>) -> Result<Option<Duration>, BridgeError> {
    match value {
        None => Ok(None),
        Some(v) if v.is_finite() && v > 0.0 && v < 1e9 => Ok(Some(Duration::from_secs_f64(v))),
        Some(v) => Err(BridgeError::Config(format!(
            "kv_connector_extra_config[{key:?}] = {v}: expected a positive number of seconds"
        ))),
    }
}

impl BridgeConfig {
    /// The bootstrap P's workers register with: `bootstrap_url`, else the one P's TP0 launches.
    pub fn bootstrap_addr(&self) -> String {
        self.bootstrap_url.clone().unwrap_or_else(|| format!("http://{}:{}", self.host, self.bootstrap_port))
    }

    /// From the extra config's JSON text and an environment lookup.
    pub fn from_json(extra_json: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, BridgeError> {
        let extra: ExtraConfig = if extra_json.trim().is_empty() {
            ExtraConfig::default()
        } else {
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(extra_json)).map_err(|e| {
                // The key of a bad value (none for an unknown key or bad JSON: serde names those).
                let key = match e.path().to_string() {
                    path if path == "." => String::new(),
                    path => format!("[\"{path}\"]"),
                };
                BridgeError::Config(format!(
                    "kv_connector_extra_config{key}: {}; known keys: host, bootstrap_port, bootstrap_url, transport, tcp_streams, auth_token, cluster_secret_file, tls, abort_request_timeout_s, pull_timeout_s, bootstrap_timeout_s, write_timeout_s, verify_checksums, layerwise, gpu_path",
                    e.inner()
                ))
            })?
        };
        let vllm_env = VllmEnv::from_lookup(env).map_err(|errors| {
            BridgeError::Config(errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))
        })?;
        let abort = seconds("abort_request_timeout_s", extra.abort_request_timeout_s)?
            .unwrap_or(vllm_env.abort_request_timeout);
        let mut deadlines = Deadlines::from_abort_timeout(abort);
        if let Some(d) = seconds("pull_timeout_s", extra.pull_timeout_s)? {
            deadlines.pull_timeout = d;
        }
        if let Some(d) = seconds("bootstrap_timeout_s", extra.bootstrap_timeout_s)? {
            deadlines.bootstrap_timeout = d;
        }
        let tcp = tcp_config(&extra, env)?;
        if extra.bootstrap_port == Some(0) {
            return Err(BridgeError::Config(
                "kv_connector_extra_config[\"bootstrap_port\"] = 0: expected a TCP port (1-65535)".into(),
            ));
        }
        if let Some(url) = &extra.bootstrap_url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(BridgeError::Config(format!(
                    "kv_connector_extra_config[\"bootstrap_url\"] = {url:?}: expected http://host:port"
                )));
            }
        }
        let host = extra
            .host
            .clone()
            .or_else(|| env("VLLM_HOST_IP").filter(|h| !h.trim().is_empty()))
            .unwrap_or_else(|| "127.0.0.1".into());
        if host.parse::<std::net::IpAddr>().is_err() {
            return Err(BridgeError::Config(format!(
                "host {host:?} (kv_connector_extra_config[\"host\"] or VLLM_HOST_IP): expected an IP address"
            )));
        }
        Ok(Self {
            host,
            bootstrap_port: extra.bootstrap_port.unwrap_or(vllm_env.bootstrap_port),
            bootstrap_url: extra.bootstrap_url,
            deadlines,
            tcp,
            verify_checksums: extra.verify_checksums.unwrap_or(false),
            layerwise: extra.layerwise.unwrap_or(false),
        })
    }
}

/// The data plane's settings from `kv_connector_extra_config`.
fn tcp_config(extra: &ExtraConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<TcpConfig, BridgeError> {
    let secret = match &extra.cluster_secret_file {
        Some(path) => Some(ClusterSecret::from_file(path)),
        None => ClusterSecret::from_lookup(env).transpose(),
    };
    let secret = secret
        .transpose()
        .map_err(|e| BridgeError::Config(format!("kv_connector_extra_config[\"cluster_secret_file\"]: {e}")))?;
    let mut tcp = TcpConfig { auth_token: extra.auth_token.clone(), secret, ..TcpConfig::default() };
    tcp.set_tls(extra.tls.unwrap_or(false))
        .map_err(|e| BridgeError::Config(format!("kv_connector_extra_config[\"tls\"]: {e}")))?;
    if let Some(d) = seconds("write_timeout_s", extra.write_timeout_s)? {
        tcp.write_timeout = d;
    }
    if let Some(n) = extra.tcp_streams {
        if n == 0 || n > 64 {
            return Err(BridgeError::Config(format!(
                "kv_connector_extra_config[\"tcp_streams\"] = {n}: expected 1..=64"
            )));
        }
        tcp.streams_per_peer = n;
    }
    tcp.same_host = match extra.transport.as_deref() {
        None | Some("auto") => SameHostMode::Auto,
        Some("tcp") => SameHostMode::Off,
        Some(other) => {
            return Err(BridgeError::Config(format!(
                "kv_connector_extra_config[\"transport\"] = {other:?}: expected \"auto\" or \"tcp\""
            )))
        }
    };
    tcp.gpu_path = match extra.gpu_path.as_deref() {
        None | Some("auto") => GpuPath::Auto,
        Some("staged") => GpuPath::Staged,
        Some(other) => {
            return Err(BridgeError::Config(format!(
                "kv_connector_extra_config[\"gpu_path\"] = {other:?}: expected \"auto\" or \"staged\""
            )));
        }
    };
    Ok(tcp)
}
