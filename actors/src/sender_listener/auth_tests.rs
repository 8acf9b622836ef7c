//! P's side channel under the cluster secret, against a D played by a DEALER: a pull sealed by a
//! holder of the secret is served and its answer sealed to it; the same frames again (a replay),
//! a forged seal, a pull altered after sealing and an unsealed pull are refused with a clear
//! error, and none of them writes a byte of D's blocks. With TLS on the side channel, a holder of
//! the secret is served through it; a stranger's handshake is refused (and counted) and a D
//! without TLS is never answered.

use std::time::Duration;

use bytes::Bytes;
use pdflow_auth::{sealed, ClusterSecret, TlsIdentity};
use pdflow_messages::frame;
use pdflow_messages::sender_listener::{PullResponse, PullStatus};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::tests::{harness_with_auth, harness_with_options, Harness, WAIT};
use crate::side_channel_auth::{ListenerAuth, PullAuth};
use pdflow_messages::sender_listener::SideChannelAddr;

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
    let rendered = pdflow_observability::metrics::global().render();
    assert!(rendered.contains("pdflow_auth_refusals_total{socket=\"side_channel\",cause=\"replayed\"}"), "{rendered}");
}

fn side_channel_refusals(cause: &str) -> f64 {
    let series = format!("pdflow_auth_refusals_total{{socket=\"side_channel\",cause=\"{cause}\"}} ");
    let text = pdflow_observability::metrics::global().render();
    text.lines().find_map(|l| l.strip_prefix(series.as_str())).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}

#[tokio::test]
async fn with_tls_a_holder_is_served_and_a_stranger_or_a_plain_dealer_never_reaches_the_listener() {
    let key = secret();
    let tls = TlsIdentity::from_secret(&key).expect("identity");
    let auth = ListenerAuth::new(Some(key.clone())).with_tls(Some(tls.clone()));
    let d_auth = PullAuth { secret: Some(key.clone()), tls: Some(tls) };
    let mut h = harness_with_options(Duration::from_secs(30), auth, d_auth.socket_options(WAIT)).await;
    h.record(&[("cmpl-p1", "xfer-1", vec![3, 4])], &[]).await;

    // A holder of the secret, through TLS: served as without it.
    let body = frame::encode(&h.pull(12, &[("cmpl-d1", "xfer-1", vec![20, 21])], true)).expect("encodes");
    let (seal, nonce) = sealed::seal_request(&key, &body);
    send_frames(&mut h, vec![body, seal]).await;
    let frames = recv_frames(&mut h).await;
    sealed::open_reply(&key, &frames[0], &frames[1], &nonce).expect("sealed to this pull");
    h.assert_copied(&[3, 4], &[20, 21]);

    let addr = h.listener.ask(SideChannelAddr).await.expect("address");
    // A stranger's TLS: its handshake is refused and counted, it never connects.
    let before = side_channel_refusals("bad_proof");
    let stranger_key = ClusterSecret::from_text("a-stranger-secret-0002").expect("valid");
    let stranger =
        PullAuth { tls: Some(TlsIdentity::from_secret(&stranger_key).expect("identity")), secret: Some(stranger_key) };
    let mut dealer = DealerSocket::with_options(stranger.socket_options(Duration::from_secs(2)));
    let connected = tokio::time::timeout(Duration::from_secs(5), dealer.connect(&addr)).await;
    assert!(!matches!(connected, Ok(Ok(()))), "a stranger connected through TLS");
    let deadline = tokio::time::Instant::now() + WAIT;
    while side_channel_refusals("bad_proof") <= before {
        assert!(tokio::time::Instant::now() < deadline, "the stranger's handshake was not counted as a refusal");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A D without TLS is told why it cannot connect, naming the setting to change, and P counts it.
    let plaintext_before = side_channel_refusals("plaintext_on_tls");
    let plain_d = PullAuth { secret: Some(key.clone()), tls: None };
    let mut dealer = DealerSocket::with_options(plain_d.socket_options(Duration::from_secs(2)));
    match tokio::time::timeout(Duration::from_secs(5), dealer.connect(&addr)).await {
        Ok(Err(e)) => {
            let why = crate::pull_task::connect_failure(&e, &addr, &plain_d);
            assert!(why.contains("or TLS is on at P and off here") && why.contains("--tls on"), "{why}");
        }
        Ok(Ok(())) => panic!("a D without TLS connected to a TLS side channel"),
        Err(_) => panic!("a D without TLS was not refused within its connect timeout"),
    }
    let deadline = tokio::time::Instant::now() + WAIT;
    while side_channel_refusals("plaintext_on_tls") <= plaintext_before {
        assert!(tokio::time::Instant::now() < deadline, "P did not count the plain-text D");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A D without TLS: whatever it sends is never answered and writes nothing.
    let mut plain = DealerSocket::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), plain.connect(&addr)).await;
    let body = frame::encode(&h.pull(13, &[("cmpl-d2", "xfer-1", vec![24, 25])], true)).expect("encodes");
    let (seal, _) = sealed::seal_request(&key, &body);
    let mut message = ZmqMessage::from(Bytes::from(body));
    message.push_back(Bytes::from(seal));
    let _ = tokio::time::timeout(Duration::from_secs(1), plain.send(message)).await;
    let answer = tokio::time::timeout(Duration::from_millis(500), plain.recv()).await;
    assert!(!matches!(answer, Ok(Ok(_))), "a D without TLS got an answer");
    assert!(untouched(&h, &[24, 25]), "a pull over a plain connection wrote D's blocks");
}
