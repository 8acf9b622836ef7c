//! `pdflow bench router` as a user runs it, small: a shared-prefix workload through pdflow's
//! proxy under round robin and under `cache_aware` (and D alone for prompts D holds), in front of
//! 2P2D simulated engines. Every request is answered; under `cache_aware` P computes no more
//! than the prompt tokens an ideal router would leave (the tokens not shared with an earlier
//! prompt), within 10%, and fewer than under round robin; D alone moves less KV. Times are
//! printed, never asserted.

use serde_json::Value;
use tokio::process::Command;

use pdflow_tests::processes::pdflow_bin;

/// Runs `pdflow bench router ARGS… --json FILE`; returns its rows and what it printed.
pub async fn bench_router(args: &[&str], envs: &[(&str, &str)]) -> (Vec<Value>, String) {
    let dir =
        std::env::temp_dir().join(format!("pdflow-bench-router-{}-{}", std::process::id(), pdflow_tests::uuid_like()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let json = dir.join("rows.json");
    let output = Command::new(pdflow_bin().expect("pdflow binary"))
        .args(["bench", "router"])
        .args(args)
        .arg("--json")
        .arg(&json)
        .envs(envs.iter().copied())
        .output()
        .await
        .expect("the bench runs");
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(output.status.success(), "bench failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    let report: Value = serde_json::from_slice(&std::fs::read(&json).expect("rows written")).expect("rows are JSON");
    let _ = std::fs::remove_dir_all(&dir);
    (report["rows"].as_array().cloned().unwrap_or_default(), stdout)
}

/// The row of `front`.
pub fn row<'a>(rows: &'a [Value], front: &str, stdout: &str) -> &'a Value {
    rows.iter().find(|r| r["front"] == front).unwrap_or_else(|| panic!("no row for {front}:\n{stdout}"))
}

/// A small shared-prefix run's arguments.
pub const SMALL: [&str; 12] = [
    "--workload",
    "shared",
    "--sessions",
    "6",
    "--few-shot",
    "24",
    "--concurrency",
    "4",
    "--num-blocks",
    "4096",
    "--seed",
    "3",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_routing_computes_what_an_ideal_router_would_and_less_than_round_robin() {
    let fronts = "pdflow:round_robin,pdflow:cache_aware,pdflow:cache_aware+d-alone";
    let mut args = vec!["--fronts", fronts, "--no-install"];
    args.extend(SMALL);
    let (rows, stdout) = bench_router(&args, &[]).await;
    println!("{stdout}");
    let n = |r: &Value, k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} of {r}"));
    for r in &rows {
        assert_eq!(n(r, "failed"), 0, "every request is answered: {r}");
        assert!(n(r, "requests") > 24, "sessions' later turns were sent too: {r}");
    }
    let rr = row(&rows, "pdflow round_robin", &stdout);
    let cache = row(&rows, "pdflow cache_aware", &stdout);
    let alone = row(&rows, "pdflow cache_aware + D alone ≥93%", &stdout);
    let ideal = n(cache, "ideal_computed_tokens");
    assert!(ideal < n(cache, "prompt_tokens") / 2, "the workload shares most of its prompts: {cache}");
    let computed = n(cache, "p_computed_tokens") + n(cache, "d_computed_tokens");
    assert!(computed * 10 <= ideal * 11, "cache_aware computes within 10% of the ideal: {computed} against {ideal}");
    assert!(computed < n(rr, "p_computed_tokens"), "round robin computes more: {rr}\n{cache}");
    assert!(n(alone, "d_computed_tokens") > 0, "D served some prompts it held alone: {alone}");
    assert!(
        n(alone, "kv_moved_tokens") < n(cache, "kv_moved_tokens"),
        "D alone moves less KV from P to D: {alone}\n{cache}"
    );
}
