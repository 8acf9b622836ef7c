//! The connector's configuration: `kv_connector_extra_config` keys (passed in as JSON) over the
//! environment variables vLLM's Mooncake users already set, with the same meaning
//! (`VLLM_MOONCAKE_BOOTSTRAP_PORT`, `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`). An unknown key or a bad
//! value is an error at start-up that names the key, never a silent default.

use std::time::Duration;

use pdflow_actors::scheduler_connector::KvRole;
use pdflow_auth::{ClusterSecret, LimitSettings, SecretError};
use pdflow_node::config::{Deadlines, VllmEnv};
use pdflow_node::registration::PlacementError;
use pdflow_observability::export::ExportError;
use pdflow_transfer::same_host::SameHostMode;
use pdflow_transfer::tcp::{RdmaMode, TcpConfig, TlsSetupError};
use pdflow_transfer::GpuPath;
use serde::Deserialize;

/// The keys `kv_connector_extra_config` takes.
pub const KNOWN_KEYS: &str = "host, bootstrap_port, bootstrap_url, side_channel_port, data_port, transport, rdma_provider, tcp_streams, auth_token, cluster_secret_file, insecure, tls, abort_request_timeout_s, pull_timeout_s, bootstrap_timeout_s, write_timeout_s, verify_checksums, layerwise, gpu_path, limits, advertise_url, advertise_to";

/// A setting of this connector that cannot be used: which one, what it was, what is allowed.
/// Python sees each as `pdflow.ConfigError`.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A pinned base port (`side_channel_port`, `data_port`) too high for this worker's index.
    #[error(transparent)]
    PortRange(pdflow_node::RegistrationError),
    /// `kv_connector_extra_config` is not JSON, has an unknown key, or a value of the wrong type
    /// (`key`: the key of a bad value, as `["key"]`; none for an unknown key or bad JSON, which
    /// `source` names).
    #[error("kv_connector_extra_config{}: {source}; known keys: {KNOWN_KEYS}", .key.as_deref().unwrap_or(""))]
    ExtraConfig { key: Option<String>, source: serde_json::Error },
    /// A key's value outside what it allows (`value` as written).
    #[error("kv_connector_extra_config[{key:?}] = {value}: expected {expected}")]
    Invalid { key: &'static str, value: String, expected: &'static str },
    /// The address sockets bind to, from the extra config or `VLLM_HOST_IP`.
    #[error("host {host:?} (kv_connector_extra_config[\"host\"] or VLLM_HOST_IP): expected an IP address")]
    Host { host: String },
    /// vLLM's `VLLM_MOONCAKE_*` variables (every bad one).
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Environment(Vec<pdflow_node::config::ConfigError>),
    /// The cluster secret's file (or `PDFLOW_CLUSTER_SECRET*`) cannot be used.
    #[error("kv_connector_extra_config[\"cluster_secret_file\"]: {0}")]
    ClusterSecret(#[source] SecretError),
    /// `PDFLOW_INSECURE` is neither on nor off.
    #[error(transparent)]
    Insecure(#[from] pdflow_auth::InsecureEnvError),
    /// Without a cluster secret (and without `insecure`), `host` is an address no peer could use:
    /// pdflow would serve loopback peers only.
    #[error("host (kv_connector_extra_config[\"host\"] or VLLM_HOST_IP): {0}; or set \"insecure\": true in kv_connector_extra_config")]
    Protected(#[source] pdflow_auth::ProtectedBindError),
    /// `tls` asked for what cannot be set up (no cluster secret).
    #[error("kv_connector_extra_config[\"tls\"]: {0}")]
    Tls(#[source] TlsSetupError),
    /// A KV-cache group the bridge does not know (from vLLM's `kv_cache_config`).
    #[error("KV-cache group of kind {kind:?} (sliding window {window}): expected \"full\", \"sliding_window\" with a window, or \"state\"; this vLLM has a group pdflow does not know yet")]
    KvGroup { kind: String, window: u32 },
    /// vLLM's `kv_role`.
    #[error("kv_role {value:?}: expected \"kv_producer\" (P), \"kv_consumer\" (D) or \"kv_both\"")]
    Role { value: String },
    /// A worker's ranks as vLLM reports them: a rank outside its group, a stage's layers that are
    /// not one range.
    #[error(transparent)]
    Placement(#[from] PlacementError),
    /// OpenTelemetry's variables or `PDFLOW_TRACE_FILE` (every bad one).
    #[error("trace export: {}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    TraceSettings(Vec<ExportError>),
    /// The trace exporter they ask for could not start.
    #[error("trace export: {0}")]
    TraceExport(#[source] ExportError),
    /// The trace file's writer thread could not start.
    #[error("trace export: could not start the trace file's writer: {0}")]
    TraceFileWriter(#[source] std::io::Error),
    /// `limits` names a limit that does not exist, or a value it cannot take (every one).
    #[error("kv_connector_extra_config[\"limits\"]: {}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Limits(Vec<pdflow_auth::LimitError>),
    /// `advertise_url` / `advertise_to` cannot be used for this engine's role (`key`: the one at
    /// fault).
    #[error("kv_connector_extra_config[{key:?}]: {reason}")]
    Advertise { key: &'static str, reason: &'static str },
    /// `PDFLOW_LOG` is not a log filter.
    #[error("{var}={text:?} is not a log filter: {source}")]
    LogFilter { var: &'static str, text: String, source: tracing_subscriber::filter::ParseError },
}

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
    /// P: the side channel's base port (default: any); each worker of a host listens on this
    /// plus its index on the host (`dp_local · tp · pp + pp_rank · tp + tp_rank`).
    pub side_channel_port: Option<u16>,
    /// D: the data server's base port (default: any), per worker as `side_channel_port`.
    pub data_port: Option<u16>,
    /// `auto` (one-sided RDMA when D offers it on a NIC, same-host `process_vm_writev` when D
    /// shares the host and the kernel allows it, else tcp), `tcp`, or `rdma` (one-sided RDMA
    /// writes only, on the software `tcp` provider where no NIC's opens; a wheel built with the
    /// `rdma` feature).
    pub transport: Option<String>,
    /// The libfabric provider for RDMA (`verbs`, `efa`, `tcp`; `tcp;ofi_rxm` for `efa`'s datagram
    /// endpoints in software); default a NIC's when one opens.
    pub rdma_provider: Option<String>,
    /// TCP connections one transfer is spread over.
    pub tcp_streams: Option<usize>,
    /// Shared token D's data server demands of P (both sides must set the same one).
    pub auth_token: Option<String>,
    /// A file holding the cluster secret (current key, optionally the previous one on a second
    /// line); without it, `PDFLOW_CLUSTER_SECRET_FILE` or `PDFLOW_CLUSTER_SECRET` are read.
    pub cluster_secret_file: Option<String>,
    /// Without a cluster secret, serve peers that are not on loopback anyway (unauthenticated);
    /// also `PDFLOW_INSECURE=1`. Without either, pdflow's sockets serve loopback peers only.
    pub insecure: Option<bool>,
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
    /// What a peer may make this worker's sockets hold, over the defaults:
    /// `{"side_channel.max_unfinished_bytes": "32MiB", "http.header_timeout": 5}` (the keys of
    /// `pdflow serve --limit`, [`pdflow_auth::limits::KEYS`]).
    pub limits: Option<std::collections::BTreeMap<String, serde_json::Value>>,
    /// This engine's HTTP API as clients (the proxy) reach it, `http://HOST:PORT`: with it the
    /// engine advertises itself for `pdflow proxy --discover` (vLLM's API server port is not the
    /// connector's to know). P advertises at its own bootstrap; either role at `advertise_to`.
    pub advertise_url: Option<String>,
    /// Bootstraps (`http://host:port`) to advertise at besides P's own (D: where it is found).
    pub advertise_to: Option<Vec<String>>,
}

/// The resolved configuration of one connector.
#[derive(Debug, Clone)]
pub struct BridgeConfig {
    pub host: String,
    pub bootstrap_port: u16,
    pub bootstrap_url: Option<String>,
    /// Pinned base ports (0: any).
    pub side_channel_port: u16,
    pub data_port: u16,
    pub deadlines: Deadlines,
    pub tcp: TcpConfig,
    pub verify_checksums: bool,
    pub layerwise: bool,
    /// The process's limits on what peers may make its sockets hold (installed when the worker
    /// starts: [`pdflow_auth::limits::install`]).
    pub limits: LimitSettings,
    /// Where and as what this engine advertises itself (none: it does not).
    pub advertise: Option<Advertise>,
}

/// `advertise_url` and `advertise_to`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advertise {
    /// The engine's HTTP API, `http://HOST:PORT` (no trailing `/`).
    pub url: String,
    /// Its HOST (an IPv6 address in brackets), put in place of a wildcard in the KV-event
    /// endpoints advertised.
    pub host: String,
    /// The bootstraps to advertise at besides P's own, without a trailing `/`, each once.
    pub to: Vec<String>,
}

impl Advertise {
    /// Refuses what `role` cannot advertise: kv_both (an engine is advertised as P or as D), and a
    /// D with nowhere to advertise (it has no bootstrap of its own).
    pub fn check_role(&self, role: KvRole) -> Result<(), ConfigError> {
        match role {
            KvRole::Both => Err(ConfigError::Advertise {
                key: "advertise_url",
                reason: "a kv_both engine cannot be advertised (discovery puts an engine in the prefill or the \
                         decode pool): leave advertise_url out, or run it as kv_producer or kv_consumer",
            }),
            KvRole::Consumer if self.to.is_empty() => Err(ConfigError::Advertise {
                key: "advertise_to",
                reason: "a kv_consumer (D) has no bootstrap of its own: give the bootstraps it advertises at \
                         (advertise_to, e.g. a P's http://HOST:BOOTSTRAP_PORT)",
            }),
            _ => Ok(()),
        }
    }
}

/// `advertise_url` as `(url, host)`: `http://HOST:PORT`, HOST a name, an IPv4 address or an
/// IPv6 address in brackets (not a wildcard), PORT 1-65535, nothing after it but an optional `/`.
fn engine_url(url: &str) -> Option<(String, String)> {
    let rest = url.strip_prefix("http://")?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let (host, port) = rest.rsplit_once(':')?;
    let host_ok = if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        inner.parse::<std::net::Ipv6Addr>().is_ok_and(|ip| !ip.is_unspecified())
    } else {
        // A name or an IPv4 address; never the wildcard an API server binds to, which no client
        // reaches.
        !host.is_empty()
            && host.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
            && host.parse::<std::net::Ipv4Addr>().map_or(true, |ip| !ip.is_unspecified())
    };
    let port_ok = port.parse::<u16>().is_ok_and(|p| p != 0) && port.bytes().all(|b| b.is_ascii_digit());
    (host_ok && port_ok).then(|| (format!("http://{rest}"), host.to_owned()))
}

/// `advertise_url` and `advertise_to` checked together (neither: `None`).
fn advertise(url: Option<&str>, to: Option<&[String]>) -> Result<Option<Advertise>, ConfigError> {
    let to = to.unwrap_or_default();
    let Some(url) = url else {
        if to.is_empty() {
            return Ok(None);
        }
        return Err(ConfigError::Advertise {
            key: "advertise_to",
            reason: "needs advertise_url too: the engine's HTTP URL as clients reach it (http://HOST:PORT of \
                     its vllm serve)",
        });
    };
    let Some((url, host)) = engine_url(url) else {
        return Err(ConfigError::Invalid {
            key: "advertise_url",
            value: format!("{url:?}"),
            expected: "this engine's HTTP URL as clients reach it, http://HOST:PORT (vllm serve's --port; HOST not a \
                       wildcard such as 0.0.0.0)",
        });
    };
    let mut bootstraps: Vec<String> = Vec::new();
    for b in to {
        if !(b.starts_with("http://") || b.starts_with("https://")) || b.chars().any(char::is_whitespace) {
            return Err(ConfigError::Invalid {
                key: "advertise_to",
                value: format!("{b:?}"),
                expected: "a list of bootstrap URLs, each http://host:port",
            });
        }
        let b = b.trim_end_matches('/').to_owned();
        if !bootstraps.contains(&b) {
            bootstraps.push(b);
        }
    }
    Ok(Some(Advertise { url, host, to: bootstraps }))
}

/// `limits`, each value a number or a string (`"32MiB"`); every refused one in the error.
fn limit_settings(
    limits: Option<&std::collections::BTreeMap<String, serde_json::Value>>,
) -> Result<LimitSettings, ConfigError> {
    let items = limits.into_iter().flatten().map(|(key, value)| match value {
        serde_json::Value::String(text) => format!("{key}={text}"),
        other => format!("{key}={other}"),
    });
    let items = items.collect::<Vec<_>>();
    LimitSettings::parse(items.iter().map(String::as_str)).map_err(ConfigError::Limits)
}

fn seconds(key: &'static str, value: Option<f64>) -> Result<Option<Duration>, ConfigError> {
    match value {
        None => Ok(None),
        Some(v) if v.is_finite() && v > 0.0 && v < 1e9 => Ok(Some(Duration::from_secs_f64(v))),
        Some(v) => Err(ConfigError::Invalid { key, value: v.to_string(), expected: "a positive number of seconds" }),
    }
}

impl BridgeConfig {
    /// The bootstrap P's workers register with: `bootstrap_url`, else the one P's TP0 launches.
    pub fn bootstrap_addr(&self) -> String {
        self.bootstrap_url.clone().unwrap_or_else(|| format!("http://{}:{}", self.host, self.bootstrap_port))
    }

    /// Refuses a setting `role` cannot use (see [`Advertise::check_role`]).
    pub fn check_role(&self, role: KvRole) -> Result<(), ConfigError> {
        self.advertise.as_ref().map_or(Ok(()), |a| a.check_role(role))
    }

    /// From the extra config's JSON text and an environment lookup.
    pub fn from_json(extra_json: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let extra: ExtraConfig = if extra_json.trim().is_empty() {
            ExtraConfig::default()
        } else {
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(extra_json)).map_err(|e| {
                // The key of a bad value (none for an unknown key or bad JSON: serde names those).
                let key = match e.path().to_string() {
                    path if path == "." => None,
                    path => Some(format!("[\"{path}\"]")),
                };
                ConfigError::ExtraConfig { key, source: e.into_inner() }
            })?
        };
        let vllm_env = VllmEnv::from_lookup(env).map_err(ConfigError::Environment)?;
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
            return Err(ConfigError::Invalid {
                key: "bootstrap_port",
                value: "0".into(),
                expected: "a TCP port (1-65535)",
            });
        }
        if let Some(url) = &extra.bootstrap_url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(ConfigError::Invalid {
                    key: "bootstrap_url",
                    value: format!("{url:?}"),
                    expected: "http://host:port",
                });
            }
        }
        let host = extra
            .host
            .clone()
            .or_else(|| env("VLLM_HOST_IP").filter(|h| !h.trim().is_empty()))
            .unwrap_or_else(|| "127.0.0.1".into());
        let Ok(ip) = host.parse::<std::net::IpAddr>() else { return Err(ConfigError::Host { host }) };
        tcp.peers().check_bind(ip).map_err(ConfigError::Protected)?;
        Ok(Self {
            host,
            bootstrap_port: extra.bootstrap_port.unwrap_or(vllm_env.bootstrap_port),
            bootstrap_url: extra.bootstrap_url,
            side_channel_port: extra.side_channel_port.unwrap_or(0),
            data_port: extra.data_port.unwrap_or(0),
            deadlines,
            tcp,
            verify_checksums: extra.verify_checksums.unwrap_or(false),
            layerwise: extra.layerwise.unwrap_or(false),
            limits: limit_settings(extra.limits.as_ref())?,
            advertise: advertise(extra.advertise_url.as_deref(), extra.advertise_to.as_deref())?,
        })
    }
}

/// The data plane's settings from `kv_connector_extra_config`.
fn tcp_config(extra: &ExtraConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<TcpConfig, ConfigError> {
    let secret = match &extra.cluster_secret_file {
        Some(path) => Some(ClusterSecret::from_file(path)),
        None => ClusterSecret::from_lookup(env).transpose(),
    };
    let secret = secret.transpose().map_err(ConfigError::ClusterSecret)?;
    let insecure = match extra.insecure {
        Some(on) => on,
        None => pdflow_auth::insecure_from_lookup(env)?,
    };
    let mut tcp = TcpConfig { auth_token: extra.auth_token.clone(), secret, insecure, ..TcpConfig::default() };
    tcp.set_tls(extra.tls.unwrap_or(false)).map_err(ConfigError::Tls)?;
    if let Some(d) = seconds("write_timeout_s", extra.write_timeout_s)? {
        tcp.write_timeout = d;
    }
    if let Some(n) = extra.tcp_streams {
        if n == 0 || n > 64 {
            return Err(ConfigError::Invalid { key: "tcp_streams", value: n.to_string(), expected: "1..=64" });
        }
        tcp.streams_per_peer = n;
    }
    (tcp.same_host, tcp.rdma) = match extra.transport.as_deref() {
        None | Some("auto") => (SameHostMode::Auto, RdmaMode::Auto),
        Some("tcp") => (SameHostMode::Off, RdmaMode::Off),
        Some("rdma") => (SameHostMode::Off, RdmaMode::Required),
        Some(other) => {
            return Err(ConfigError::Invalid {
                key: "transport",
                value: format!("{other:?}"),
                expected: "\"auto\", \"tcp\" or \"rdma\"",
            })
        }
    };
    tcp.rdma_provider = extra.rdma_provider.clone();
    tcp.gpu_path = match extra.gpu_path.as_deref() {
        None | Some("auto") => GpuPath::Auto,
        Some("staged") => GpuPath::Staged,
        Some(other) => {
            return Err(ConfigError::Invalid {
                key: "gpu_path",
                value: format!("{other:?}"),
                expected: "\"auto\" or \"staged\"",
            });
        }
    };
    Ok(tcp)
}
