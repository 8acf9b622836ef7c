//! `--compare-mooncake`: runs `tests/peers/mooncake_tcp.py` (Mooncake's TransferEngine over
//! protocol "tcp", two processes) and reads its rows back. Any failure — python missing, the
//! package not installable, Mooncake refusing to run — becomes a row whose name says why; the
//! bench goes on.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, Context as _};

use crate::bench::report::Row;

/// The whole Mooncake run (install included) must end within this.
const MOONCAKE_DEADLINE: Duration = Duration::from_secs(540);

/// The script, next to this crate's sources (or under the current directory).
fn script() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/peers/mooncake_tcp.py");
    if built.exists() {
        built
    } else {
        PathBuf::from("tests/peers/mooncake_tcp.py")
    }
}

/// Mooncake's rows, or one row naming why there are none.
pub async fn rows(runs: usize, warmup: usize) -> Vec<Row> {
    match run(runs, warmup).await {
        Ok(rows) => rows,
        Err(e) => vec![Row {
            name: format!("mooncake unavailable: {e:#}"),
            backend: Some("mooncake-tcp".into()),
            ..Row::default()
        }],
    }
}

#[derive(serde::Deserialize)]
struct Output {
    rows: Vec<ScriptRow>,
}

#[derive(serde::Deserialize)]
struct ScriptRow {
    name: String,
    backend: Option<String>,
    plan: Option<String>,
    concurrency: Option<u32>,
    bytes: Option<u64>,
    median_ms: Option<f64>,
    min_ms: Option<f64>,
    max_ms: Option<f64>,
    gbps: Option<f64>,
    note: Option<String>,
}

async fn run(runs: usize, warmup: usize) -> anyhow::Result<Vec<Row>> {
    let script = script();
    let out = std::env::temp_dir().join(format!("pdflow-mooncake-{}.json", std::process::id()));
    let mut cmd = tokio::process::Command::new("python3");
    cmd.arg(&script)
        .args([
            "--runs",
            &runs.to_string(),
            "--warmup",
            &warmup.to_string(),
            "--small-runs",
            &(runs * 10).max(100).to_string(),
        ])
        .arg("--json")
        .arg(&out)
        .env("GLOG_minloglevel", "2")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let child = cmd.spawn().with_context(|| format!("cannot start python3 {}", script.display()))?;
    let done = tokio::time::timeout(MOONCAKE_DEADLINE, child.wait_with_output())
        .await
        .map_err(|_| anyhow!("{} did not finish within {MOONCAKE_DEADLINE:?}", script.display()))??;
    let text = std::fs::read_to_string(&out).map_err(|e| {
        let stderr = String::from_utf8_lossy(&done.stderr);
        let tail: String = stderr.chars().rev().take(300).collect::<Vec<_>>().into_iter().rev().collect();
        anyhow!("{} wrote no rows ({e}; exit {}): {tail}", script.display(), done.status)
    })?;
    let _ = std::fs::remove_file(&out);
    let parsed: Output = serde_json::from_str(&text).context("the mooncake script's JSON is not in the bench shape")?;
    Ok(parsed
        .rows
        .into_iter()
        .map(|r| Row {
            name: match r.note {
                Some(note) => format!("{} — {note}", r.name),
                None => r.name,
            },
            backend: r.backend,
            plan: r.plan,
            concurrency: r.concurrency,
            bytes: r.bytes,
            median_ms: r.median_ms,
            min_ms: r.min_ms,
            max_ms: r.max_ms,
            gbps: r.gbps,
            ..Row::default()
        })
        .collect())
}
