//! Network cuts between nodes in their own network namespaces, with separate `pdflow`
//! processes: the proxy in the root namespace, P (and the bootstrap it launches) in `p`, D in
//! `d`, three veth links — proxy↔P, proxy↔D and a dedicated P↔D link. Each test runs one of the
//! network cells of `pdflow chaos` ([`pdflow_tools::chaos::net`], where each cell's contract is
//! written) against the built `pdflow` binary and asserts its row: a terminal state within the
//! bound its deadlines give, an outcome the cell allows, tokens equal to the single-engine
//! reference, no block leaked on P or D after the restore, the next request served, and the cut
//! really hit the request.
//!
//! Cells run one at a time (their time bounds would not mean much on two shared cores) and skip,
//! saying why, where namespaces are unavailable (not root, no `ip netns`).

use pdflow_kv::memory::KvShape;
use pdflow_tests::processes::pdflow_bin;
use pdflow_tools::chaos::net::{self, NetCell, NetEnv};
use pdflow_tools::chaos::{render_row, Reference};

/// One cell at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs `cell` (or skips, printing why) and asserts that its row passed.
async fn check(cell: NetCell) {
    if let Err(reason) = net::available() {
        pdflow_testkit::skipped(&cell.name(), &reason);
        return;
    }
    let _serial = SERIAL.lock().await;
    let bin = pdflow_bin().expect("the pdflow binary");
    let reference = Reference::start(KvShape::QWEN3_8B, None).await.expect("reference engine");
    let client = reqwest::Client::builder().no_proxy().build().expect("client");
    let r = net::run_net_cell(cell, &NetEnv { bin: &bin, client: &client, reference_url: &reference.url }).await;
    reference.shutdown().await;
    eprintln!("{}", render_row(&r));
    assert!(r.passed, "{}: {}", cell.name(), r.detail);
    assert!(r.hit, "{}: the cut did not hit the request", cell.name());
    assert!(cell.allowed().contains(&r.outcome), "{}: outcome {:?}", cell.name(), r.outcome);
    assert_eq!((r.leaked_blocks_p, r.leaked_blocks_d), (0, 0), "{}: leaked blocks", cell.name());
    assert!(r.correct && r.next_ok, "{}: tokens correct {}, next request served {}", cell.name(), r.correct, r.next_ok);
}

/// P↔D cut before D's request: D's bootstrap look-up is black-holed, D recomputes (policy
/// recompute) and returns the reference tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pd_cut_before_the_pull_recomputes_on_d() {
    check(NetCell::CutPdBeforeRequest).await;
}

/// P↔D cut mid-transfer with policy fail: a clean HTTP error within the pull deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn b_pd_cut_mid_transfer_fails_cleanly_with_policy_fail() {
    check(NetCell::CutPdMidWriteFail).await;
}

/// P↔D cut mid-transfer with policy recompute: the reference tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn b_pd_cut_mid_transfer_recomputes_with_policy_recompute() {
    check(NetCell::CutPdMidWriteRecompute).await;
}

/// After a mid-transfer cut, requests back to back while P's stalled write resumes: every one
/// returns the reference tokens (D's write fence refuses the late write).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn e_requests_right_after_restore_are_not_corrupted_by_the_late_write() {
    check(NetCell::LateWriteAfterRestore).await;
}

/// Once D has freed a cut transfer's blocks, no more of its KV reaches D (write-after-free).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn f_no_kv_reaches_d_after_d_freed_the_blocks() {
    check(NetCell::NoKvAfterDFreed).await;
}

/// proxy↔P cut while P prefills: completed over the intact P↔D link, or a clean error within the
/// proxy's upstream deadline; P frees what it held once restored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn c_proxy_p_cut_while_prefilling_ends_within_the_proxy_deadline() {
    check(NetCell::CutProxyPWhilePrefilling).await;
}

/// proxy↔P cut before the request: a clean error within the proxy's upstream deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn c2_proxy_p_cut_before_the_request_is_a_clean_error() {
    check(NetCell::CutProxyPBeforeRequest).await;
}

/// The harness itself: without a cut the seed request's KV really crosses the P↔D link (not the
/// same-host path).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn harness_without_a_cut_the_kv_crosses_the_pd_link() {
    check(NetCell::NoCut).await;
}

/// `pdflow chaos`'s selection: a full run whose filter matches only a network cell runs that
/// cell (as root) and no matrix cell, in one report; where namespaces cannot be used the report
/// says why instead, and asking for the network cells alone is an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_run_reports_the_network_cells_or_why_they_did_not_run() {
    use pdflow_sim_engine::LoadFailurePolicy;
    use pdflow_tools::chaos::{self, ChaosOptions, NetworkCells};
    let _serial = SERIAL.lock().await;
    let layers = chaos::install_layers();
    let bin = pdflow_bin().expect("the pdflow binary");
    let opts = |network| ChaosOptions {
        quick: false,
        policy: LoadFailurePolicy::Recompute,
        filter: Some("no_cut".into()),
        network,
        hybrid: None,
    };
    let mut sections = Vec::new();
    let report = chaos::run_selected(&opts(NetworkCells::WhereAvailable), &layers, &bin, |p| {
        if let chaos::Progress::Section(title) = p {
            sections.push(title);
        }
    })
    .await;
    let report = report.expect("the run");
    assert!(sections[0].contains("matrix"), "{sections:?}");
    match net::available() {
        Ok(()) => {
            assert_eq!(report.cells.len(), 1, "{:?}", report.cells);
            assert_eq!(report.cells[0].actor, "link:p-d");
            assert!(report.cells[0].passed, "{}", report.cells[0].detail);
            assert_eq!((report.passed, report.failed, report.network_skipped.as_deref()), (1, 0, None));
        }
        Err(why) => {
            assert!(report.cells.is_empty());
            assert_eq!(report.network_skipped, Some(why));
            let alone = chaos::run_selected(&opts(NetworkCells::Only), &layers, &bin, |_| {}).await;
            assert!(alone.is_err_and(|e| e.to_string().contains("cannot run here")), "asked for alone, they must fail");
        }
    }
}

/// Every network cell has its own name, and the filter of `pdflow chaos --only` selects by it.
#[test]
fn network_cells_are_named_and_filtered_like_the_matrix() {
    let names: std::collections::BTreeSet<String> = NetCell::ALL.iter().map(|c| c.name()).collect();
    assert_eq!(names.len(), NetCell::ALL.len(), "cell names must be unique: {names:?}");
    assert_eq!(net::cells(None).len(), NetCell::ALL.len());
    assert_eq!(
        net::cells(Some("link:proxy-p")),
        vec![NetCell::CutProxyPWhilePrefilling, NetCell::CutProxyPBeforeRequest]
    );
    assert!(net::cells(Some("no such cell")).is_empty());
}
