//! Each node's actors run under its root supervisor: an actor killed while the node is idle is
//! restarted with the same mailbox (the refs the engine holds stay valid) — a restarted
//! SenderListener binds its old side-channel address, so its re-registration with bootstrap is
//! identical — and the next request is served correctly.
//! (Kills in the middle of a request are the fault-injection suite's subject.)

use std::time::Duration;

use kameo::actor::ActorRef;
use pdflow_messages::receiver::GetFinishedRecving;
use pdflow_messages::scheduler_connector::BuildConnectorMeta;
use pdflow_messages::sender_listener::SideChannelAddr;
use pdflow_tests::{completion, prompt, reference_tokens, token_ids, Cluster, ClusterSpec, SMALL};

async fn served(cluster: &Cluster, seed: u64) {
    let body = completion(&prompt(130, seed), 6);
    let (status, response) = cluster.post("/v1/completions", &body).await.expect("request");
    assert_eq!(status, 200, "{response}");
    assert_eq!(token_ids(&response), reference_tokens(SMALL, &body).await);
}

/// Kills the actor, then waits (bounded) until an `ask` is answered again — by the incarnation the
/// supervisor started, since a killed actor answers nothing. The probe must be harmless when idle.
async fn kill_and_wait_restart<A, M>(name: &str, actor: &ActorRef<A>, probe: impl Fn() -> M)
where
    A: kameo::Actor + kameo::message::Message<M>,
    M: Send + 'static,
{
    let before = actor.id();
    actor.kill();
    let answered = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if actor.ask(probe()).await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(answered.is_ok(), "{name} did not answer within 10 s of being killed: not restarted");
    assert_eq!(actor.id(), before, "the restarted {name} keeps its ref");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_actors_are_restarted_and_the_node_keeps_serving() {
    let _capture = pdflow_tests::capture();
    let mut spec = ClusterSpec::one_p_one_d();
    spec.deadlines = pdflow_node::config::Deadlines::from_abort_timeout(Duration::from_secs(3));
    let cluster = Cluster::start(spec).await.expect("cluster starts");
    served(&cluster, 1).await;
    let p = &cluster.prefill[0];
    let d = &cluster.decode[0];

    kill_and_wait_restart(
        "P's SenderListener",
        p.first_worker().and_then(|w| w.sender_listener.as_ref()).expect("P has a listener"),
        || SideChannelAddr,
    )
    .await;
    // D still addresses the previous incarnation; this request's pull may race ahead of P's
    // scheduler naming the transfer to the new one: it waits for it (the lineage of the
    // listener's incarnations says its ready is still to come) and is served.
    served(&cluster, 2).await;
    kill_and_wait_restart("P's SchedulerConnector", &p.connector, BuildConnectorMeta::default).await;
    served(&cluster, 3).await;
    kill_and_wait_restart(
        "D's Receiver",
        d.first_worker().and_then(|w| w.receiver.as_ref()).expect("D has a receiver"),
        || GetFinishedRecving,
    )
    .await;
    served(&cluster, 4).await;
    kill_and_wait_restart("D's SchedulerConnector", &d.connector, BuildConnectorMeta::default).await;
    served(&cluster, 5).await;

    cluster.assert_blocks_at_baseline().await;
    cluster.shutdown().await;
}

/// The proxy's HTTP server outlives its actor: clients arriving while the Proxy actor is killed and
/// restarted are served — never refused or cut (the actor owned the socket once), nor answered
/// 503 while the restarted actor re-discovers its pools (flows wait for it). Both found by
/// `pdflow chaos --load`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_proxy_actor_refuses_no_client() {
    let cluster = Cluster::start(ClusterSpec::one_p_one_d()).await.expect("cluster starts");
    served(&cluster, 1).await;
    let clients: Vec<_> = (0..24u64)
        .map(|i| {
            // A fresh connection each: a pooled one would hide a closed listening socket.
            let client = reqwest::Client::builder().no_proxy().pool_max_idle_per_host(0).build().expect("client");
            let url = format!("{}/v1/completions", cluster.proxy.url());
            let body = completion(&prompt(40, 100 + i), 2);
            tokio::spawn(async move {
                let resp = client
                    .post(&url)
                    .json(&body)
                    .timeout(Duration::from_secs(30))
                    .send()
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<u16, String>(resp.status().as_u16())
            })
        })
        .collect();
    cluster.proxy.proxy.kill();
    let mut statuses = Vec::new();
    for client in clients {
        let answer = client.await.expect("client task");
        let status =
            answer.unwrap_or_else(|e| panic!("a client got no HTTP answer while the proxy actor restarted: {e}"));
        assert_eq!(status, 200, "a client of the restart window was not served");
        statuses.push(status);
    }
    // Restarted with the same ref: the next request is served.
    let answered = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let (status, _) = cluster.post("/v1/completions", &completion(&prompt(130, 7), 6)).await.expect("request");
            if status == 200 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(answered.is_ok(), "the proxy did not serve again within 10 s: {statuses:?}");
    served(&cluster, 8).await;
    cluster.assert_blocks_at_baseline().await;
    cluster.shutdown().await;
}
