//! The fault module's global state is shared: one test drives it all, in order.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tracing_subscriber::layer::SubscriberExt;

use super::*;
use pdflow_telemetry::{step_span, steps};

fn target(kind: ActorKind, role: Role, transfer_ids: &[&str], kills: &Arc<AtomicUsize>) {
    let kills = kills.clone();
    register(Registration {
        target: Target::Actor(kind),
        role: Some(role),
        transfer_ids: transfer_ids.iter().map(|t| t.to_string()).collect(),
        alive: Box::new(|| true),
        kill: Arc::new(move || {
            kills.fetch_add(1, Ordering::SeqCst);
        }),
    });
}

#[test]
fn plan_edges_fire_kills_and_message_faults_once_and_only_when_armed() {
    registry::clear();
    let (w1, w2, d_conn, p_conn) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    // Not enabled: registrations are ignored.
    target(ActorKind::SendWorker, Role::P, &["x1"], &w1);
    enable();
    target(ActorKind::SendWorker, Role::P, &["x1"], &w1);
    target(ActorKind::SendWorker, Role::P, &["x2"], &w2);
    target(ActorKind::SchedulerConnector, Role::D, &[], &d_conn);
    target(ActorKind::SchedulerConnector, Role::P, &[], &p_conn);
    let subscriber = tracing_subscriber::registry().with(FaultLayer);
    tracing::subscriber::with_default(subscriber, || {
        // No plan: nothing fires, no message fault.
        drop(step_span!(steps::P_TRANSFER_WRITE, request_id = "r1", transfer_id = "x1"));
        assert_eq!(message_fault(21, "r1"), None);
        assert_eq!(data_cut("r1"), None);
        assert_eq!(w1.load(Ordering::SeqCst), 0);

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
        let injector = arm(plan);
        // Step 29 begins for x1: only x1's worker dies, and only once.
        drop(step_span!(steps::P_TRANSFER_WRITE, request_id = "r1", transfer_id = "x1"));
        drop(step_span!(steps::P_TRANSFER_WRITE, request_id = "r1", transfer_id = "x1"));
        assert_eq!((w1.load(Ordering::SeqCst), w2.load(Ordering::SeqCst)), (1, 0));
        // Step 17 fires at its end, on D's connector only.
        let span = step_span!(steps::D_SCHEDULE_REMOTE, request_id = "r1");
        assert_eq!(d_conn.load(Ordering::SeqCst), 0, "not at the beginning");
        drop(span);
        assert_eq!((d_conn.load(Ordering::SeqCst), p_conn.load(Ordering::SeqCst)), (1, 0));
        // Message faults: by request id, and `times`.
        assert_eq!(message_fault(21, "cmpl-r1"), None);
        assert_eq!(message_fault(21, "cmpl-r2-0"), Some(MessageFault::Drop));
        assert_eq!(message_fault(21, "cmpl-r2-0"), None);
        assert_eq!(message_fault(30, "a"), Some(MessageFault::Corrupt));
        assert_eq!(message_fault(30, "b"), Some(MessageFault::Corrupt));
        assert_eq!(message_fault(30, "c"), None);
        // Data cuts: claimed by the writer, not by the layer; the smallest K wins, each `times` once.
        drop(step_span!(steps::P_TRANSFER_WRITE, request_id = "r3", transfer_id = "x3"));
        assert_eq!(data_cut("r1"), None, "another request");
        assert_eq!(data_cut("cmpl-r3"), Some(100));
        assert_eq!(data_cut("cmpl-r3"), Some(100));
        assert_eq!(data_cut("cmpl-r3"), None, "every fault used up");
        // A per-request kill for a transfer no worker serves kills no other request's worker.
        drop(step_span!(steps::P_MARK_SENT, request_id = "r9", transfer_id = "x9"));
        assert_eq!((w1.load(Ordering::SeqCst), w2.load(Ordering::SeqCst)), (1, 0));
        let fired = injector.fired();
        assert_eq!(
            fired.iter().map(|f| (f.index, f.step)).collect::<Vec<_>>(),
            vec![(0, 29), (1, 17), (2, 21), (3, 30), (3, 30), (4, 29), (5, 29), (5, 29), (6, 31)]
        );
        assert_eq!(fired[0].killed, 1);
        assert_eq!(fired[8].killed, 0);
        disarm();
        drop(step_span!(steps::D_SCHEDULE_REMOTE, request_id = "r1"));
        assert_eq!(d_conn.load(Ordering::SeqCst), 1);
    });
    let mut frame = vec![b'P', b'D'];
    corrupt_frame(&mut frame);
    assert_ne!(frame[0], b'P');
    registry::clear();
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
