//! P's side channel under the cluster secret, against a D played by a DEALER: a pull sealed by a
//! holder of the secret is served and its answer sealed to it; the same frames again (a replay),
//! a forged seal, a pull altered after sealing and an unsealed pull are refused with a clear
//! error, and none of them writes a byte of D's blocks.

use std::time::Duration;

use bytes::Bytes;
use pdflow_auth::{sealed, ClusterSecret};
use pdflow_messages::frame;
use pdflow_messages::sender_listener::{PullResponse, PullStatus};
use zeromq::{SocketRecv, SocketSend, ZmqMessage};

use super::tests::{harness_with_auth, Harness, WAIT};
use crate::side_channel_auth::ListenerAuth;

fn secret() -> ClusterSecret {
    ClusterSecret::from_text("the-cluster-secret-0001").expect("valid")
}

async fn send_frames(h: &mut Harness, frames: Vec<Vec<u8>>) {
    let mut frames = frames.into_iter().map(Bytes::from);
    let mut message = ZmqMessage::from(frames.next().expect("a body"));
    for f in frames {
        message.push_back(f);
    }
    tokio::time::timeout(WAIT, h.dealer.send(message)).await.expect("in time").expect("sent");
}

/// The answer's frames: body and seal.
async fn recv_frames(h: &mut Harness) -> Vec<Bytes> {
    tokio::time::timeout(WAIT, h.dealer.recv()).await.expect("an answer in time").expect("receives").into_vec()
}

fn untouched(h: &Harness, blocks: &[u32]) -> bool {
    blocks.iter().all(|b| h.d.block_bytes(*b).expect("block").iter().all(|&x| x == 0))
}

fn refusal(frames: &[Bytes]) -> String {
    let resp: PullResponse = frame::decode(&frames[0], "pull response").expect("decodes");
    assert_eq!(resp.status, PullStatus::Error);
    resp.error.unwrap_or_default()
}

#[tokio::test]
async fn only_a_sealed_pull_is_served_once_and_its_answer_is_sealed_to_it() {
    let key = secret();
    let mut h = harness_with_auth(Duration::from_secs(30), ListenerAuth::new(Some(key.clone()))).await;
    h.record(&[("cmpl-p1", "xfer-1", vec![3, 4])], &[]).await;
    let body = frame::encode(&h.pull(11, &[("cmpl-d1", "xfer-1", vec![20, 21])], true)).expect("encodes");

    // An unsealed pull naming the real transfer: refused, nothing written.
    send_frames(&mut h, vec![body.clone()]).await;
    let frames = recv_frames(&mut h).await;
    assert!(refusal(&frames).contains("no proof of the cluster secret"), "{:?}", refusal(&frames));
    // A seal made without the secret, and the real seal on an altered pull.
    let stranger = ClusterSecret::from_text("not-the-cluster-secret").expect("valid");
    let (forged, _) = sealed::seal_request(&stranger, &body);
    send_frames(&mut h, vec![body.clone(), forged]).await;
    assert!(refusal(&recv_frames(&mut h).await).contains("does not hold"));
    let (seal, _) = sealed::seal_request(&key, &body);
    let altered = frame::encode(&h.pull(11, &[("cmpl-d1", "xfer-1", vec![22, 23])], true)).expect("encodes");
    send_frames(&mut h, vec![altered, seal]).await;
    assert!(refusal(&recv_frames(&mut h).await).contains("does not match"));
    assert!(untouched(&h, &[20, 21, 22, 23]), "a refused pull wrote D's blocks");

    // The real, sealed pull: served, its answer sealed to its nonce.
    let (seal, nonce) = sealed::seal_request(&key, &body);
    send_frames(&mut h, vec![body.clone(), seal.clone()]).await;
    let frames = recv_frames(&mut h).await;
    assert_eq!(frames.len(), 2, "the answer and its seal");
    sealed::open_reply(&key, &frames[0], &frames[1], &nonce).expect("sealed to this pull");
    let resp: PullResponse = frame::decode(&frames[0], "pull response").expect("decodes");
    assert_eq!((resp.status, resp.ok_reqs.clone()), (PullStatus::Finish, vec!["cmpl-d1".into()]));
    h.assert_copied(&[3, 4], &[20, 21]);

    // The same frames again, captured off the wire: a replay, refused.
    send_frames(&mut h, vec![body, seal]).await;
    assert!(refusal(&recv_frames(&mut h).await).contains("seen before"));
    let rendered = pdflow_telemetry::metrics::global().render();
    assert!(rendered.contains("pdflow_auth_refusals_total{socket=\"side_channel\",cause=\"replayed\"}"), "{rendered}");
}
