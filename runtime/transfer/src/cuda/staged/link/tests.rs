//! CPU-only: staged connections over real sockets on 127.0.0.1, with a relay in the middle that
//! records every byte P sends. With TLS a sealed request and its payload arrive whole and none of
//! the payload crosses in clear (without TLS it does: the capture is not vacuous); a stranger's
//! certificate is refused by both ends; TLS on one end only fails, the
//! plain end saying so.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use pdflow_auth::{ClusterSecret, TlsIdentity};
use pdflow_kv::planner::Descriptor;

use super::{HandshakeError, StagedLink};
use crate::cuda::staged::wire::{self, Reply, WireError};

const KEY: &str = "the-cluster-secret-0001";
const BOUND: Duration = Duration::from_secs(20);
/// Four TLS records' worth.
const PAYLOAD: usize = 64 * 1024;

fn secret(text: &str) -> ClusterSecret {
    ClusterSecret::from_text(text).expect("valid secret")
}

fn identity(text: &str) -> TlsIdentity {
    TlsIdentity::from_secret(&secret(text)).expect("identity")
}

/// Bytes that repeat nowhere within the payload (xorshift).
fn payload() -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..PAYLOAD)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn bounded(tcp: &TcpStream) {
    tcp.set_read_timeout(Some(BOUND)).expect("read timeout");
    tcp.set_write_timeout(Some(BOUND)).expect("write timeout");
}

/// A relay to `to` for one connection: copies both ways, and returns what P sent.
fn relay(to: SocketAddr) -> (SocketAddr, JoinHandle<Vec<u8>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("relay listens");
    let addr = listener.local_addr().expect("relay address");
    let handle = std::thread::spawn(move || {
        let (from_p, _) = listener.accept().expect("P connects");
        let to_d = TcpStream::connect(to).expect("relay reaches D");
        bounded(&from_p);
        bounded(&to_d);
        let (mut p_read, mut d_write) = (from_p.try_clone().expect("clone"), to_d.try_clone().expect("clone"));
        let (mut d_read, mut p_write) = (to_d, from_p);
        let back = std::thread::spawn(move || {
            let _ = std::io::copy(&mut d_read, &mut p_write);
            let _ = p_write.shutdown(std::net::Shutdown::Write);
        });
        let mut seen = Vec::new();
        let mut buf = [0u8; 16 * 1024];
        while let Ok(n @ 1..) = p_read.read(&mut buf) {
            seen.extend_from_slice(&buf[..n]);
            if d_write.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = d_write.shutdown(std::net::Shutdown::Write);
        let _ = back.join();
        seen
    });
    (addr, handle)
}

/// D's end of one request: accepts (sealed), takes the payload, answers DONE.
fn serve_one(listener: TcpListener, tls: Option<TlsIdentity>) -> JoinHandle<(wire::Offer, Vec<u8>)> {
    std::thread::spawn(move || {
        let (tcp, _) = listener.accept().expect("P connects");
        bounded(&tcp);
        let mut link = match &tls {
            Some(id) => StagedLink::accept_tls(tcp, id).expect("D's handshake"),
            None => StagedLink::Plain(tcp),
        };
        let offer = wire::read_request(&mut link).expect("reads").expect("a request");
        let nonce = pdflow_auth::sealed::STAGED
            .open_request(&secret(KEY), &offer.sealed_bytes(), &offer.seal, &pdflow_auth::ReplayGuard::new(BOUND))
            .expect("P's seal");
        wire::write_reply(&mut link, &wire::accept_sealed(&secret(KEY), &nonce)).expect("accepts");
        assert!(wire::read_go(&mut link).expect("go or abort"), "P sends GO");
        let mut got = vec![0u8; PAYLOAD];
        link.read_exact(&mut got).expect("the payload");
        wire::write_reply(&mut link, &Reply::Done).expect("done");
        (offer, got)
    })
}

/// One sealed request and its payload from P to D through a recording relay: what D received,
/// and what crossed the wire.
fn exchange(tls: bool) -> ((wire::Offer, Vec<u8>), Vec<u8>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("D listens");
    let d = serve_one(listener.try_clone().expect("clone"), tls.then(|| identity(KEY)));
    let (via, recorded) = relay(listener.local_addr().expect("D's address"));
    let tcp = TcpStream::connect(via).expect("P connects");
    bounded(&tcp);
    let mut link =
        if tls { StagedLink::connect_tls(tcp, &identity(KEY)).expect("P's handshake") } else { StagedLink::Plain(tcp) };
    assert_eq!(link.is_tls(), tls);
    let part = [Descriptor { src: 0, dst: 0x7000_0000, len: PAYLOAD as u64 }];
    let request = wire::encode_request(b"", 42, &part, Some(&secret(KEY))).expect("encodes");
    link.write_all(&request.bytes).expect("request");
    let Reply::AcceptedSealed(seal) = wire::read_reply(&mut link).expect("reply") else {
        panic!("a sealed acceptance")
    };
    wire::open_acceptance(&secret(KEY), &seal, &request.nonce.expect("sealed")).expect("D proved the secret");
    link.write_all(&[wire::GO]).expect("go");
    link.write_all(&payload()).expect("payload");
    link.flush().expect("flush");
    assert_eq!(wire::read_reply(&mut link).expect("reply"), Reply::Done);
    drop(link);
    let received = d.join().expect("D's thread");
    (received, recorded.join().expect("relay"))
}

/// How many of the payload's 32-byte runs (one per 256 bytes) appear in `capture`.
fn runs_seen(capture: &[u8]) -> usize {
    let payload = payload();
    payload.chunks(256).filter(|c| capture.windows(32).any(|w| w == &c[..32])).count()
}

#[test]
fn with_tls_a_sealed_request_and_its_payload_land_whole_and_none_of_the_payload_crosses_in_clear() {
    let ((offer, got), capture) = exchange(true);
    assert_eq!((offer.fence, offer.ranges.clone()), (42, vec![(0x7000_0000, PAYLOAD as u64)]));
    assert!(got == payload(), "D received P's payload unaltered");
    assert!(capture.len() > PAYLOAD, "the whole exchange was recorded: {} bytes", capture.len());
    assert_eq!(runs_seen(&capture), 0, "a run of the payload crossed in clear");
    assert!(!capture.windows(4).any(|w| w == wire::MAGIC), "the request's header crossed in clear");

    let ((_, got), capture) = exchange(false);
    assert!(got == payload());
    assert_eq!(runs_seen(&capture), PAYLOAD / 256, "without TLS the capture shows every run");
}

/// Both ends' handshakes, P holding `p_key` and D `d_key`.
fn handshakes(p_key: &str, d_key: &str) -> (Result<StagedLink, HandshakeError>, Result<StagedLink, HandshakeError>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("D listens");
    let addr = listener.local_addr().expect("address");
    let d_identity = identity(d_key);
    let d = std::thread::spawn(move || {
        let (tcp, _) = listener.accept().expect("P connects");
        bounded(&tcp);
        let mut link = StagedLink::accept_tls(tcp, &d_identity)?;
        // A finished handshake: wait for P's first bytes (or its close) so that P's refusal of D,
        // which may come after D's side finished, reaches D.
        let _ = link.read(&mut [0u8; 1]);
        Ok(link)
    });
    let tcp = TcpStream::connect(addr).expect("P connects");
    bounded(&tcp);
    let p = StagedLink::connect_tls(tcp, &identity(p_key));
    let p_end = p.map(|mut link| {
        let _ = link.write_all(b"x").and_then(|()| link.flush());
        link
    });
    (p_end, d.join().expect("D's thread"))
}

#[test]
fn a_stranger_is_refused_by_either_end() {
    let (p, d) = handshakes("not-the-cluster-secret", KEY);
    let p_err = p.err().expect("P refuses D's certificate");
    assert!(p_err.is_refusal(), "P: {p_err}");
    let d_err = d.err().expect("D hears P's refusal");
    assert!(d_err.is_refusal(), "D: {d_err}");
    let (p, d) = handshakes(KEY, KEY);
    assert!(p.is_ok() && d.is_ok(), "the same secret shakes hands");
}

#[test]
fn tls_on_one_end_only_fails_and_the_plain_end_says_so() {
    // A plain P at a TLS D: D's handshake fails on P's request bytes, not as a refusal.
    let listener = TcpListener::bind("127.0.0.1:0").expect("D listens");
    let addr = listener.local_addr().expect("address");
    let d = std::thread::spawn(move || {
        let (tcp, _) = listener.accept().expect("P connects");
        bounded(&tcp);
        StagedLink::accept_tls(tcp, &identity(KEY)).map(|_| ())
    });
    let mut tcp = TcpStream::connect(addr).expect("P connects");
    let part = [Descriptor { src: 0, dst: 0, len: 16 }];
    tcp.write_all(&wire::encode_request(b"", 0, &part, None).expect("encodes").bytes).expect("request");
    let d_err = d.join().expect("D's thread").expect_err("D expects TLS");
    assert!(!d_err.is_refusal(), "{d_err}");

    // A TLS P at a plain D: D reads a TLS record where a request should be, and says what it is.
    let listener = TcpListener::bind("127.0.0.1:0").expect("D listens");
    let addr = listener.local_addr().expect("address");
    let d = std::thread::spawn(move || {
        let (mut tcp, _) = listener.accept().expect("P connects");
        bounded(&tcp);
        wire::read_request(&mut tcp).map(|_| ())
    });
    let tcp = TcpStream::connect(addr).expect("P connects");
    bounded(&tcp);
    let p = std::thread::spawn(move || StagedLink::connect_tls(tcp, &identity(KEY)).map(|_| ()));
    let d_err = d.join().expect("D's thread").expect_err("not a request");
    assert!(matches!(d_err, WireError::BadMagic(_)), "{d_err}");
    assert!(d_err.to_string().contains("set `tls` on both ends"), "{d_err}");
    assert!(p.join().expect("P's thread").is_err(), "P's handshake cannot finish with a plain D");
}

#[test]
fn decrypted_bytes_not_yet_read_count_as_a_request_begun() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("D listens");
    let addr = listener.local_addr().expect("address");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let d_seen = seen.clone();
    let d = std::thread::spawn(move || {
        let (tcp, _) = listener.accept().expect("P connects");
        bounded(&tcp);
        let mut link = StagedLink::accept_tls(tcp, &identity(KEY)).expect("D's handshake");
        let mut first = [0u8; 4];
        link.read_exact(&mut first).expect("4 bytes");
        let mut seen = d_seen.lock().unwrap_or_else(PoisonError::into_inner);
        seen.push(link.has_plaintext());
        let mut rest = [0u8; 6];
        link.read_exact(&mut rest).expect("6 bytes");
        seen.push(link.has_plaintext());
    });
    let tcp = TcpStream::connect(addr).expect("P connects");
    bounded(&tcp);
    let mut link = StagedLink::connect_tls(tcp, &identity(KEY)).expect("P's handshake");
    link.write_all(b"0123456789").and_then(|()| link.flush()).expect("one record");
    d.join().expect("D's thread");
    assert_eq!(*seen.lock().unwrap_or_else(PoisonError::into_inner), vec![true, false]);
    let other = TcpListener::bind("127.0.0.1:0").expect("listens");
    let plain = TcpStream::connect(other.local_addr().expect("address")).expect("connects");
    assert!(!StagedLink::Plain(plain).has_plaintext(), "a plain link buffers nothing");
}
