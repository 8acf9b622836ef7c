//! A domain's plan fires on its own targets only, through the seam's hooks and its layer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use pdflow_actors::fault_seam::{FaultSeam, Killable, Target};
use pdflow_kv::memory::{KvCache, KvShape};
use pdflow_messages::TransferId;
use pdflow_transfer::tcp::TcpConfig;
use pdflow_transfer::TransferEngine;
use tracing_subscriber::layer::SubscriberExt;

use super::*;
use pdflow_observability::{step_span, steps};

fn counting(kills: &Arc<AtomicUsize>) -> Killable {
    let kills = kills.clone();
    Killable {
        alive: Box::new(|| true),
        kill: Arc::new(move || {
            kills.fetch_add(1, Ordering::SeqCst);
        }),
    }
}

fn target(domain: &FaultDomain, kind: ActorKind, role: Role, transfer_ids: &[&str], kills: &Arc<AtomicUsize>) {
    let ids = transfer_ids.iter().map(|t| TransferId::from(*t)).collect();
    domain.register(Target::Actor(kind), Some(role), ids, counting(kills));
}

fn counters<const N: usize>() -> [Arc<AtomicUsize>; N] {
    std::array::from_fn(|_| Arc::new(AtomicUsize::new(0)))
}

fn n(c: &Arc<AtomicUsize>) -> usize {
    c.load(Ordering::SeqCst)
}

#[test]
fn plan_edges_fire_kills_and_message_faults_once_and_only_when_armed() {
    let domain = FaultDomain::new(TcpConfig::default());
    let [w1, w2, d_conn, p_conn] = counters();
    target(&domain, ActorKind::SendWorker, Role::P, &["x1"], &w1);
    target(&domain, ActorKind::SendWorker, Role::P, &["x2"], &w2);
    target(&domain, ActorKind::SchedulerConnector, Role::D, &[], &d_conn);
    target(&domain, ActorKind::SchedulerConnector, Role::P, &[], &p_conn);
    let subscriber = tracing_subscriber::registry().with(domain.layer());
    tracing::subscriber::with_default(subscriber, || {
        // No plan: nothing fires, no message fault, the frame goes out as it is.
        drop(step_span!(steps::P_TRANSFER_WRITE, request_id = "r1", transfer_id = "x1"));
        assert_eq!(domain.message_fault(21, "r1"), None);
        assert_eq!(domain.outgoing(21, "r1", vec![1, 2]), Some(vec![1, 2]));
        assert_eq!(domain.data_cut("r1"), None);
        assert_eq!(n(&w1), 0);

        let plan = FaultPlan::from_json(
            r#"{"faults": [
              {"step": 29, "fault": "kill", "actor": "send_worker"},
              {"step": 17, "when": "end", "fault": "kill", "actor": "scheduler_connector", "role": "d"},
              {"step": 21, "fault": "drop", "request_id": "r2"},
              {"step": 30, "fault": "corrupt", "times": 2},
              {"step": 29, "fault": "cut_data", "after_bytes": 4096, "request_id": "r3"},
              {"step": 29, "fault": "cut_data", "after_bytes": 100, "request_id": "r3", "times": 2},
              {"step": 31, "fault": "kill", "actor": "send_worker"}
            ]}"#,
        )
        .expect("valid plan");
        let injector = domain.arm(plan);
        // Step 29 begins for x1: only x1's worker dies, and only once.
        drop(step_span!(steps::P_TRANSFER_WRITE, request_id = "r1", transfer_id = "x1"));
        drop(step_span!(steps::P_TRANSFER_WRITE, request_id = "r1", transfer_id = "x1"));
        assert_eq!((n(&w1), n(&w2)), (1, 0));
        // Step 17 fires at its end, on D's connector only.
        let span = step_span!(steps::D_SCHEDULE_REMOTE, request_id = "r1");
        assert_eq!(n(&d_conn), 0, "not at the beginning");
        drop(span);
        assert_eq!((n(&d_conn), n(&p_conn)), (1, 0));
        // Message faults through the seam: by request id, and `times`.
        assert_eq!(domain.outgoing(21, "cmpl-r1", vec![b'P', b'D']), Some(vec![b'P', b'D']));
        assert_eq!(domain.outgoing(21, "cmpl-r2-0", vec![b'P', b'D']), None, "dropped");
        assert_eq!(domain.outgoing(21, "cmpl-r2-0", vec![b'P']), Some(vec![b'P']), "used up");
        for req in ["a", "b"] {
            let damaged = domain.outgoing(30, req, vec![b'P', b'D']).expect("sent");
            assert_ne!(damaged[0], b'P', "corrupted");
            assert_eq!(damaged[1], b'D', "only the magic's first byte");
        }
        assert_eq!(domain.message_fault(30, "c"), None);
        // Data cuts: claimed by the writer, not by the layer; the smallest K wins, each `times` once.
        drop(step_span!(steps::P_TRANSFER_WRITE, request_id = "r3", transfer_id = "x3"));
        assert_eq!(domain.data_cut("r1"), None, "another request");
        assert_eq!(domain.data_cut("cmpl-r3"), Some(100));
        assert_eq!(domain.data_cut("cmpl-r3"), Some(100));
        assert_eq!(domain.data_cut("cmpl-r3"), None, "every fault used up");
        // A per-request kill for a transfer no worker serves kills no other request's worker.
        drop(step_span!(steps::P_MARK_SENT, request_id = "r9", transfer_id = "x9"));
        assert_eq!((n(&w1), n(&w2)), (1, 0));
        let fired = injector.fired();
        assert_eq!(
            fired.iter().map(|f| (f.index, f.step)).collect::<Vec<_>>(),
            vec![(0, 29), (1, 17), (2, 21), (3, 30), (3, 30), (4, 29), (5, 29), (5, 29), (6, 31)]
        );
        assert_eq!(fired[0].killed, 1);
        assert_eq!(fired[8].killed, 0);
        domain.disarm();
        drop(step_span!(steps::D_SCHEDULE_REMOTE, request_id = "r1"));
        assert_eq!(n(&d_conn), 1);
    });
}

/// Two clusters in one process, each with its domain: a plan armed in one never reaches the other's
/// actors or nodes, even when both see the same step edges.
#[test]
fn a_plan_armed_in_one_domain_never_touches_another_domains_targets() {
    let (a, b) = (FaultDomain::new(TcpConfig::default()), FaultDomain::new(TcpConfig::default()));
    let [a_worker, b_worker, a_node, b_node] = counters();
    target(&a, ActorKind::SendWorker, Role::P, &[], &a_worker);
    target(&b, ActorKind::SendWorker, Role::P, &[], &b_worker);
    a.register_node(NodeKind::P, counting(&a_node));
    b.register_node(NodeKind::P, counting(&b_node));
    let subscriber = tracing_subscriber::registry().with(a.layer()).with(b.layer());
    tracing::subscriber::with_default(subscriber, || {
        a.arm(
            FaultPlan::from_json(
                r#"{"faults": [
                  {"step": 29, "fault": "kill", "actor": "send_worker"},
                  {"step": 27, "when": "end", "fault": "kill_node", "node": "p"},
                  {"step": 30, "fault": "drop"}
                ]}"#,
            )
            .expect("valid plan"),
        );
        drop(step_span!(steps::P_TRANSFER_WRITE, request_id = "r1", transfer_id = "x1"));
        drop(step_span!(steps::P_RECORD_SEND_READY, request_id = "r1", transfer_id = "x1"));
        assert_eq!((n(&a_worker), n(&a_node)), (1, 1));
        assert_eq!((n(&b_worker), n(&b_node)), (0, 0), "b armed nothing");
        assert_eq!(b.outgoing(30, "r1", vec![1]), Some(vec![1]), "b's frames go out");
        assert_eq!(a.outgoing(30, "r1", vec![1]), None, "a's are dropped");
    });
}

/// The production seam and an unarmed domain hand step 29 the node's own engine; a request given
/// `cut_data` gets an engine of its own.
#[test]
fn step_29_gets_the_nodes_engine_unless_its_request_is_cut() {
    let shape = KvShape { num_layers: 1, num_kv_heads: 1, head_dim: 8, dtype_bytes: 2, block_size: 4 };
    let cache = KvCache::new(shape, 4);
    let engine: Arc<dyn TransferEngine> =
        Arc::new(pdflow_transfer::tcp::TcpTransferEngine::new(cache.region_table(), TcpConfig::default()));
    let nothing = pdflow_actors::fault_seam::no_faults();
    assert!(Arc::ptr_eq(&nothing.data_engine("r1", &cache.region_table(), &engine), &engine));
    assert_eq!(nothing.outgoing(30, "r1", vec![7]), Some(vec![7]));
    let domain = FaultDomain::new(TcpConfig::default());
    assert!(Arc::ptr_eq(&domain.data_engine("r1", &cache.region_table(), &engine), &engine), "not armed");
    domain.arm(
        FaultPlan::from_json(
            r#"{"faults": [{"step": 29, "fault": "cut_data", "after_bytes": 10, "request_id": "r2"}]}"#,
        )
        .expect("valid plan"),
    );
    assert!(Arc::ptr_eq(&domain.data_engine("r1", &cache.region_table(), &engine), &engine), "another request");
    assert!(!Arc::ptr_eq(&domain.data_engine("r2", &cache.region_table(), &engine), &engine), "the cut request");
}

#[test]
fn cut_data_is_valid_only_at_the_beginning_of_step_29() {
    let ok = FaultPlan::from_json(
        r#"{"faults": [{"step": 29, "fault": "cut_data", "after_bytes": 0, "request_id": "cmpl-7"}]}"#,
    )
    .expect("valid");
    assert_eq!(ok.faults[0].action, FaultAction::CutData { after_bytes: 0 });
    assert_eq!(ok.faults[0].request_id.as_deref(), Some("cmpl-7"));
    let text = r#"{"faults": [
      {"step": 30, "fault": "cut_data", "after_bytes": 1},
      {"step": 29, "when": "end", "fault": "cut_data", "after_bytes": 1}
    ]}"#;
    let errors = FaultPlan::from_json(text).expect_err("invalid");
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors[0].to_string().contains("[29]"), "{}", errors[0]);
    assert!(errors[1].to_string().contains("begin"), "{}", errors[1]);
    assert!(
        FaultPlan::from_json(r#"{"faults": [{"step": 29, "fault": "cut_data"}]}"#).is_err(),
        "after_bytes is required"
    );
}
