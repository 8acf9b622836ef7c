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
        bail!("{} does not exist: build it first with `cargo build --bin pdflow` (the README's test command does)", bin.display());
    }
    Ok(bin)
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
        let mut cmd = Command::new(pdflow_bin()?);
        cmd.args(args).stdout(Stdio::piped()).stdin(Stdio::null()).kill_on_drop(true);
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
        let ready: Value = serde_json::from_str(&line).with_context(|| format!("{name}: ready line is not JSON: {line}"))?;
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self { child, ready, name: name.to_string() })
    }

    /// `http://` + the address it announced.
    pub fn url(&self) -> String {
        format!("http://{}", self.ready["addr"].as_str().unwrap_or_default())
    }

    /// Sends SIGTERM-equivalent (kill) and waits for exit.
    pub async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
    }
}
