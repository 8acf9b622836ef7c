//! Separate `pdflow` processes for tests: each command is started with port 0, and its
//! `{"event":"ready", …}` line on stdout tells where it listens. Processes are killed on drop.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The `pdflow` binary: `$PDFLOW_BIN`, else next to the test executable's `deps/` folder.
pub fn pdflow_bin() -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var("PDFLOW_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().context("locating the test executable")?;
    let dir = exe.parent().and_then(|d| d.parent()).context("test executable has no target dir")?;
    let bin = dir.join("pdflow");
    if !bin.exists() {
        bail!(
            "{} does not exist: build it first with `cargo build --bin pdflow` (the README's test command does)",
            bin.display()
        );
    }
    Ok(bin)
}

/// Runs `pdflow demo ARGS… --json FILE` as a user does; asserts it succeeded and returns its
/// report and what it printed.
pub async fn run_demo(args: &[&str]) -> (Value, String) {
    let dir = std::env::temp_dir().join(format!("pdflow-demo-{}-{}", std::process::id(), crate::uuid_like()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let json = dir.join("out.json");
    let output = Command::new(pdflow_bin().expect("pdflow binary"))
        .arg("demo")
        .args(args)
        .arg("--json")
        .arg(&json)
        .output()
        .await
        .expect("demo runs");
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(output.status.success(), "demo failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    let report = serde_json::from_slice(&std::fs::read(&json).expect("report written")).expect("report is JSON");
    let _ = std::fs::remove_dir_all(&dir);
    (report, stdout)
}

/// A running `pdflow` process.
pub struct Proc {
    pub child: Child,
    pub ready: Value,
    pub name: String,
}

impl Proc {
    /// Starts `pdflow ARGS…` and waits (bounded) for its ready line.
    pub async fn spawn(name: &str, args: &[&str], envs: &[(&str, &str)]) -> anyhow::Result<Self> {
        Self::spawn_with_open_files(name, args, envs, None).await
    }

    /// [`Proc::spawn`], the process's open-file limit (`ulimit -n`) set to `open_files` when given.
    pub async fn spawn_with_open_files(
        name: &str,
        args: &[&str],
        envs: &[(&str, &str)],
        open_files: Option<u64>,
    ) -> anyhow::Result<Self> {
        let mut cmd = Command::new(pdflow_bin()?);
        cmd.args(args).stdout(Stdio::piped()).stdin(Stdio::null()).kill_on_drop(true);
        if let Some(limit) = open_files {
            // SAFETY: between fork and exec the closure only calls setrlimit, which is
            // async-signal-safe, on a struct on its own stack.
            unsafe {
                cmd.pre_exec(move || {
                    let rlimit = libc::rlimit { rlim_cur: limit as libc::rlim_t, rlim_max: limit as libc::rlim_t };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &rlimit) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                });
            }
        }
        if std::env::var_os("PDFLOW_TEST_LOG").is_none() {
            cmd.stderr(Stdio::null());
        }
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().with_context(|| format!("spawning pdflow {args:?}"))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .with_context(|| format!("{name}: no ready line within 30 s"))?
            .with_context(|| format!("{name}: reading stdout"))?
            .with_context(|| format!("{name}: exited before it was ready"))?;
        let ready: Value =
            serde_json::from_str(&line).with_context(|| format!("{name}: ready line is not JSON: {line}"))?;
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self { child, ready, name: name.to_string() })
    }

    /// Why `pdflow ARGS…` does not start (its standard error, or the missing ready line), or
    /// `None` when it does (it is then stopped): for a test to skip, saying why, where a feature
    /// or a library it needs is missing.
    pub async fn why_not_ready(args: &[&str]) -> anyhow::Result<Option<String>> {
        let mut child = Command::new(pdflow_bin()?)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("spawning pdflow {args:?}"))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let first = tokio::time::timeout(Duration::from_secs(30), BufReader::new(stdout).lines().next_line()).await;
        if let Ok(Ok(Some(_))) = first {
            let _ = child.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
            return Ok(None);
        }
        let _ = child.start_kill();
        let out = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
            .await
            .context("pdflow did not exit after it was killed")??;
        Ok(Some(String::from_utf8_lossy(&out.stderr).trim().to_string()))
    }

    /// `pdflow proxy` with vLLM's arguments in front of one P (and its bootstrap port) and one D.
    pub async fn proxy(prefill: &Proc, bootstrap_port: &str, decode: &Proc) -> anyhow::Result<Self> {
        let args = ["proxy", "--port", "0", "--prefill", &prefill.url(), bootstrap_port, "--decode", &decode.url()];
        Self::spawn("proxy", &args, &[]).await
    }

    /// `http://` + the address it announced.
    pub fn url(&self) -> String {
        format!("http://{}", self.ready["addr"].as_str().unwrap_or_default())
    }

    /// Waits (at most 10 s) until the engine's `GET /pdflow/blocks` shows every block free;
    /// panics naming the engine and `context` otherwise.
    pub async fn assert_blocks_at_baseline(&self, client: &reqwest::Client, context: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let stats: Value = client
                .get(format!("{}/pdflow/blocks", self.url()))
                .send()
                .await
                .expect("block stats")
                .json()
                .await
                .expect("block stats are JSON");
            if stats["free"] == stats["total"] {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{context}: {} did not return to baseline: {stats}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the process (SIGKILL) and waits (bounded) for it to exit.
    pub async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
    }
}

/// The pids of the `pdflow rank-worker` processes `engine` started (its ranks' processes).
pub fn rank_processes_of(engine: &Proc) -> Vec<u32> {
    let Some(parent) = engine.child.id() else { return Vec::new() };
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // `pid (comm) state ppid …`: the fields after the last ')'.
            let ppid = stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            ppid == Some(parent) && cmdline.split(|b| *b == 0).any(|arg| arg == b"rank-worker")
        })
        .collect()
}

/// A cluster of separate processes: each P (`pdflow serve --role producer`, launching its own
/// bootstrap as P's TP0 does), each D (`pdflow serve --role consumer`) and the proxy
/// (`pdflow proxy` with vLLM's arguments).
pub struct ProcCluster {
    pub endpoints: crate::Endpoints,
    procs: Vec<Proc>,
    /// The secret files the processes read (removed with the cluster).
    _secrets: SecretFiles,
}

/// The engines' cluster secrets as files (`--cluster-secret-file`), one per distinct secret, in a
/// directory of the cluster's own that is removed with it.
struct SecretFiles {
    dir: PathBuf,
}

impl SecretFiles {
    fn new() -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("pdflow-secrets-{}-{}", std::process::id(), crate::uuid_like()));
        std::fs::create_dir_all(&dir)?;
        Ok(Self { dir })
    }

    /// The file holding `o`'s secret, written on first use; `None` without a secret.
    fn file_for(&self, o: &crate::EngineOpts) -> Option<String> {
        let text = o.secret.as_deref()?;
        let digest =
            text.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3));
        let path = self.dir.join(format!("secret-{digest:016x}"));
        if let Err(e) = std::fs::write(&path, text) {
            panic!("cannot write the test cluster's secret file {}: {e}", path.display());
        }
        Some(path.to_string_lossy().into_owned())
    }
}

impl Drop for SecretFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl ProcCluster {
    pub async fn start(spec: crate::ClusterSpec) -> anyhow::Result<Self> {
        let shape = format!(
            "{},{},{},{}",
            spec.shape.num_layers, spec.shape.num_kv_heads, spec.shape.head_dim, spec.shape.block_size
        );
        let abort = spec.deadlines.ready_timeout.as_secs().max(1).to_string();
        let secrets = SecretFiles::new()?;
        let engine_args = |role: &str, o: &crate::EngineOpts| -> Vec<String> {
            let policy = match o.policy {
                pdflow_sim_engine::LoadFailurePolicy::Recompute => "recompute",
                pdflow_sim_engine::LoadFailurePolicy::Fail => "fail",
            };
            let mut a: Vec<String> = ["serve", "--role", role, "--kv-shape", &shape, "--abort-request-timeout", &abort]
                .iter()
                .map(|s| s.to_string())
                .collect();
            a.extend([
                "--num-blocks".into(),
                o.num_blocks.to_string(),
                "--max-num-batched-tokens".into(),
                o.max_num_batched_tokens.to_string(),
            ]);
            a.extend([
                "--max-model-len".into(),
                o.max_model_len.to_string(),
                "--kv-load-failure-policy".into(),
                policy.into(),
            ]);
            if spec.verify_checksums {
                a.push("--verify-checksums".into());
            }
            if let Some(file) = secrets.file_for(o) {
                a.extend(["--cluster-secret-file".into(), file]);
            }
            if o.tls {
                a.extend(["--tls".into(), "on".into()]);
            }
            if o.tcp_only {
                a.extend(["--transport".into(), "tcp".into()]);
            }
            if o.layerwise {
                a.extend(["--layerwise".into(), "on".into()]);
            }
            a.extend(o.extra_args.iter().cloned());
            a
        };
        let mut procs = Vec::new();
        let mut prefill = Vec::new();
        for (i, o) in spec.prefill.iter().enumerate() {
            let mut args = engine_args("producer", o);
            args.extend(["--bootstrap-port".into(), "0".into()]);
            let p =
                Proc::spawn(&format!("producer{i}"), &args.iter().map(String::as_str).collect::<Vec<_>>(), &[]).await?;
            prefill.push(crate::EngineEndpoint {
                url: p.url(),
                engine_id: p.ready["engine_id"].as_str().unwrap_or_default().to_string(),
                bootstrap_url: p.ready["bootstrap_addr"].as_str().map(|a| format!("http://{a}")),
                data_addr: None,
            });
            procs.push(p);
        }
        let mut decode = Vec::new();
        for (i, o) in spec.decode.iter().enumerate() {
            let args = engine_args("consumer", o);
            let d =
                Proc::spawn(&format!("consumer{i}"), &args.iter().map(String::as_str).collect::<Vec<_>>(), &[]).await?;
            decode.push(crate::EngineEndpoint {
                url: d.url(),
                engine_id: d.ready["engine_id"].as_str().unwrap_or_default().to_string(),
                bootstrap_url: None,
                data_addr: d.ready["data_addr"].as_str().map(str::to_string),
            });
            procs.push(d);
        }
        let mut proxy_args: Vec<String> =
            vec!["proxy".into(), "--port".into(), "0".into(), "--health-interval-ms".into(), "25".into()];
        for p in &prefill {
            let port =
                p.bootstrap_url.as_deref().and_then(|u| u.rsplit(':').next()).context("P announced no bootstrap")?;
            proxy_args.extend(["--prefill".into(), p.url.clone(), port.to_string()]);
        }
        for d in &decode {
            proxy_args.extend(["--decode".into(), d.url.clone()]);
        }
        // The proxy's look-ups are signed with P's secret (a deployment gives all one).
        if let Some(file) = spec.prefill.first().and_then(|o| secrets.file_for(o)) {
            proxy_args.extend(["--cluster-secret-file".into(), file]);
        }
        let proxy = Proc::spawn("proxy", &proxy_args.iter().map(String::as_str).collect::<Vec<_>>(), &[]).await?;
        let endpoints = crate::Endpoints { client: crate::http_client(), proxy: proxy.url(), prefill, decode };
        procs.push(proxy);
        crate::wait_healthy(&endpoints.client, &endpoints.proxy, Duration::from_secs(20)).await?;
        Ok(Self { endpoints, procs, _secrets: secrets })
    }

    pub async fn shutdown(self) {
        for p in self.procs.into_iter().rev() {
            p.stop().await;
        }
    }
}
