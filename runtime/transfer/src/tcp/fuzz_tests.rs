//! Fuzz targets (bad input) for the data channel of seed step 29: the `tcp` backend's
//! wire parsers ([`wire`]) and D's [`TcpDataServer`] over real sockets on 127.0.0.1.
//!
//! - Every reader (hello, request/batch header, host info, ack) on arbitrary bytes and on
//!   structured mutations of valid messages (truncation, bit flips, counts and lengths set huge,
//!   wrong magic, wrong version): no panic, a typed [`WireError`], and no read into a buffer larger
//!   than [`MAX_READ_CHUNK`] however large a count claims to be (a probe reader records the
//!   largest read asked of it, which is the largest buffer the parser allocated up front).
//! - Valid messages round-trip, also back to back on one stream (no desynchronisation).
//! - The server ([`server`]): a descriptor count above the limit and a refused batch too large to drain are
//!   refused with a clear reason; descriptors outside D's regions are refused and D's memory is
//!   untouched; a wrong, missing or oversize auth token is refused; garbage never hangs a
//!   connection (once P half-closes) and never stops the server.

mod server;

use std::pin::Pin;
use std::task::{Context, Poll};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tokio::io::{AsyncRead, ReadBuf};

use super::wire::{
    self, Ack, BatchHeader, HostInfo, Request, WireError, ACK_MAGIC, BATCH_MAGIC, HELLO_MAGIC, HOST_MAGIC,
};
use pdflow_kv::planner::Descriptor;

/// The largest single read a parser may ask for, whatever a count or length on the wire claims.
const MAX_READ_CHUNK: usize = 64 * 1024;

fn cfg(cases: u32) -> Config {
    Config { cases, failure_persistence: None, ..Config::default() }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a tokio runtime")
}

// ---- a reader that records the largest read asked of it -------------------------------------

struct Probe {
    data: Vec<u8>,
    pos: usize,
    largest_read: usize,
}

impl Probe {
    fn new(data: Vec<u8>) -> Self {
        Self { data, pos: 0, largest_read: 0 }
    }
}

impl AsyncRead for Probe {
    fn poll_read(mut self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        self.largest_read = self.largest_read.max(buf.remaining());
        let n = buf.remaining().min(self.data.len() - self.pos);
        let pos = self.pos;
        buf.put_slice(&self.data[pos..pos + n]);
        self.pos += n;
        Poll::Ready(Ok(()))
    }
}

/// What each reader made of one input, and the largest read each asked for.
#[derive(Debug)]
struct Parsed {
    hello: Result<Vec<u8>, WireError>,
    request: Result<Option<Request>, WireError>,
    batch: Result<Option<BatchHeader>, WireError>,
    host: Result<HostInfo, WireError>,
    ack: Result<Ack, WireError>,
    largest_read: usize,
}

async fn parse_all(bytes: &[u8]) -> Parsed {
    let mut largest_read = 0;
    let mut p = Probe::new(bytes.to_vec());
    let hello = wire::read_hello(&mut p).await.map(|h| h.token);
    largest_read = largest_read.max(p.largest_read);
    let mut p = Probe::new(bytes.to_vec());
    let request = wire::read_request(&mut p).await;
    largest_read = largest_read.max(p.largest_read);
    let mut p = Probe::new(bytes.to_vec());
    let batch = wire::read_batch_header(&mut p).await;
    largest_read = largest_read.max(p.largest_read);
    let mut p = Probe::new(bytes.to_vec());
    let host = wire::read_host_info(&mut p).await;
    largest_read = largest_read.max(p.largest_read);
    let mut p = Probe::new(bytes.to_vec());
    let ack = wire::read_ack(&mut p).await;
    largest_read = largest_read.max(p.largest_read);
    Parsed { hello, request, batch, host, ack, largest_read }
}

fn check_parsed(bytes: &[u8], parsed: &Parsed) -> Result<(), TestCaseError> {
    prop_assert!(
        parsed.largest_read <= MAX_READ_CHUNK,
        "a {}-byte input made a parser read {} bytes at once",
        bytes.len(),
        parsed.largest_read
    );
    let errors: [Option<&WireError>; 5] = [
        parsed.hello.as_ref().err(),
        parsed.request.as_ref().err(),
        parsed.batch.as_ref().err(),
        parsed.host.as_ref().err(),
        parsed.ack.as_ref().err(),
    ];
    for e in errors.into_iter().flatten() {
        prop_assert!(!e.to_string().is_empty());
    }
    if bytes.len() >= 4 {
        let magic = &bytes[..4];
        if magic != HELLO_MAGIC && bytes.len() >= 7 {
            prop_assert!(matches!(parsed.hello, Err(WireError::BadMagic { .. })), "{:?}", parsed.hello);
        }
        if magic != BATCH_MAGIC {
            prop_assert!(matches!(parsed.batch, Err(WireError::BadMagic { .. })), "{:?}", parsed.batch);
        }
    }
    Ok(())
}

// ---- valid messages and their mutations ------------------------------------------------------

fn descriptors() -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec((any::<u64>(), any::<u64>()), 0..24)
}

fn host_info() -> impl Strategy<Value = HostInfo> {
    (
        any::<bool>(),
        any::<u32>(),
        prop::collection::vec(any::<char>(), 0..16).prop_map(String::from_iter),
        any::<u64>(),
        prop::collection::vec(any::<u8>(), 0..=wire::MAX_CANARY_LEN),
        prop::collection::vec((any::<u64>(), any::<u64>(), any::<u64>()), 0..8),
    )
        .prop_map(|(offered, pid, host_id, canary_addr, canary, regions)| HostInfo {
            offered,
            pid,
            host_id,
            canary_addr,
            canary,
            regions,
        })
}

fn batch_bytes(batch_id: u64, descriptors: &[(u64, u64)]) -> Vec<u8> {
    let descs: Vec<Descriptor> = descriptors.iter().map(|&(dst, len)| Descriptor { src: 0, dst, len }).collect();
    wire::encode_batch_header(batch_id, &descs).expect("few descriptors")
}

/// An ack as any peer may put it on the wire (a reason of any length, any status byte).
fn raw_ack(status: u8, batch_id: u64, reason: &[u8]) -> Vec<u8> {
    let mut out = ACK_MAGIC.to_vec();
    out.push(status);
    out.extend_from_slice(&batch_id.to_le_bytes());
    out.extend_from_slice(&(reason.len() as u16).to_le_bytes());
    out.extend_from_slice(reason);
    out
}

/// One valid message of each kind, as bytes.
fn valid_message() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<char>(), 0..40)
            .prop_map(|t| wire::encode_hello(Some(&String::from_iter(t))).expect("short token")),
        (any::<u64>(), descriptors()).prop_map(|(id, d)| batch_bytes(id, &d)),
        any::<u32>().prop_map(wire::encode_info_request),
        host_info().prop_map(|h| wire::encode_host_info(&h).expect("small answer")),
        (0u8..2, any::<u64>(), prop::collection::vec(any::<u8>(), 0..64)).prop_map(|(s, id, r)| raw_ack(s, id, &r)),
    ]
}

/// Counts and lengths a hostile peer may claim: at, just above and far above every limit.
fn huge_u32() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(u32::MAX),
        Just(wire::MAX_DESCRIPTORS_PER_BATCH as u32),
        Just(wire::MAX_DESCRIPTORS_PER_BATCH as u32 + 1),
        Just(wire::MAX_REGIONS as u32),
        Just(wire::MAX_REGIONS as u32 + 1),
        any::<u32>(),
    ]
}

#[derive(Debug, Clone)]
enum Mutation {
    Truncate(usize),
    FlipBit(usize, u8),
    /// Overwrites four bytes (a count, a length, a pid…) with a huge value.
    Huge(usize, u32),
    /// Overwrites two bytes (a u16 length) with a huge value.
    HugeU16(usize, u16),
    WrongMagic(usize, u8),
    WrongVersion(u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        (any::<usize>(), huge_u32()).prop_map(|(i, v)| Mutation::Huge(i, v)),
        (any::<usize>(), prop_oneof![Just(u16::MAX), Just(1025u16), any::<u16>()])
            .prop_map(|(i, v)| Mutation::HugeU16(i, v)),
        (0usize..4, any::<u8>()).prop_map(|(i, v)| Mutation::WrongMagic(i, v)),
        any::<u8>()
            .prop_filter("not this build's version", |v| *v != wire::PROTOCOL_VERSION)
            .prop_map(Mutation::WrongVersion),
    ]
}

fn apply(msg: &[u8], m: &Mutation) -> Vec<u8> {
    let mut out = msg.to_vec();
    match m {
        Mutation::Truncate(i) => out.truncate(i % msg.len()),
        Mutation::FlipBit(i, b) => out[i % msg.len()] ^= 1 << b,
        Mutation::Huge(i, v) if msg.len() >= 8 => {
            let at = 4 + i % (msg.len() - 7);
            out[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        Mutation::HugeU16(i, v) if msg.len() >= 6 => {
            let at = 4 + i % (msg.len() - 5);
            out[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
        Mutation::Huge(..) | Mutation::HugeU16(..) => {}
        Mutation::WrongMagic(i, v) => out[*i] = *v,
        Mutation::WrongVersion(v) if out[..4] == HELLO_MAGIC => out[4] = *v,
        Mutation::WrongVersion(_) => {}
    }
    out
}

// ---- the parsers -----------------------------------------------------------------------------

#[test]
fn wire_readers_on_arbitrary_bytes_give_typed_errors() {
    let rt = runtime();
    let mut runner = TestRunner::new(cfg(512));
    let inputs = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..256),
        // A valid magic, then anything: the parsers get past the first check.
        (
            prop::sample::select(vec![
                HELLO_MAGIC,
                BATCH_MAGIC,
                wire::INFO_MAGIC,
                wire::FENCE_MAGIC,
                HOST_MAGIC,
                ACK_MAGIC
            ]),
            prop::collection::vec(any::<u8>(), 0..256)
        )
            .prop_map(|(magic, rest)| [magic.to_vec(), rest].concat()),
    ];
    runner
        .run(&inputs, |bytes| {
            let parsed = rt.block_on(parse_all(&bytes));
            check_parsed(&bytes, &parsed)
        })
        .expect("every reader gives a typed answer");
}

/// Every magic the wire knows: a mutation that lands on one is a different message, not garbage.
const KNOWN_MAGICS: [[u8; 4]; 10] = [
    HELLO_MAGIC,
    BATCH_MAGIC,
    ACK_MAGIC,
    HOST_MAGIC,
    wire::INFO_MAGIC,
    wire::FENCE_MAGIC,
    wire::DEVICE_MAGIC,
    wire::DEVICE_ANSWER_MAGIC,
    wire::HOLD_MAGIC,
    wire::RELEASE_MAGIC,
];

#[test]
fn mutated_wire_messages_never_panic_and_fail_as_they_must() {
    let rt = runtime();
    let mut runner = TestRunner::new(cfg(512));
    runner
        .run(&(valid_message(), mutation()), |(msg, m)| {
            let bytes = apply(&msg, &m);
            let parsed = rt.block_on(parse_all(&bytes));
            check_parsed(&bytes, &parsed)?;
            match m {
                Mutation::WrongMagic(..) if !KNOWN_MAGICS.iter().any(|m| bytes[..4] == m[..]) => {
                    prop_assert!(matches!(parsed.request, Err(WireError::BadMagic { .. })), "{:?}", parsed.request);
                    prop_assert!(matches!(parsed.batch, Err(WireError::BadMagic { .. })), "{:?}", parsed.batch);
                }
                Mutation::WrongVersion(v) if msg[..4] == HELLO_MAGIC => {
                    prop_assert!(
                        matches!(parsed.hello, Err(WireError::UnsupportedVersion { found }) if found == v),
                        "{:?}",
                        parsed.hello
                    );
                }
                Mutation::Truncate(_) if msg[..4] == BATCH_MAGIC => {
                    prop_assert!(matches!(parsed.batch, Err(WireError::Io(_)) | Ok(None)), "{:?}", parsed.batch);
                }
                _ => {}
            }
            Ok(())
        })
        .expect("every mutation gives a typed answer");
}

#[test]
fn valid_wire_messages_round_trip_back_to_back() {
    let rt = runtime();
    let mut runner = TestRunner::new(cfg(256));
    let strategy = (
        prop::collection::vec(any::<char>(), 0..64).prop_map(String::from_iter),
        (any::<u64>(), descriptors()),
        host_info(),
        (any::<bool>(), any::<u64>(), prop::collection::vec(any::<u8>(), 0..3000)),
    );
    runner
        .run(&strategy, |(token, (batch_id, descs), info, (refused, ack_id, reason))| {
            rt.block_on(async {
                let token = if token.len() > wire::MAX_TOKEN_LEN { String::new() } else { token };
                // P's hello, a batch header, an info request; D's host answer and two acks (the first
                // with a reason of any length, as a peer may send it), all on one stream.
                let mut stream = wire::encode_hello(Some(&token)).expect("short token");
                stream.extend(batch_bytes(batch_id, &descs));
                stream.extend(wire::encode_info_request(7));
                stream.extend(wire::encode_fence(batch_id));
                stream.extend(wire::encode_host_info(&info).expect("small answer"));
                stream.extend(raw_ack(u8::from(refused), ack_id, &reason));
                stream.extend(raw_ack(0, ack_id.wrapping_add(1), b""));
                let mut r = Probe::new(stream);
                prop_assert_eq!(wire::read_hello(&mut r).await.expect("hello").token, token.as_bytes());
                let header = wire::read_batch_header(&mut r).await.expect("batch").expect("not eof");
                prop_assert_eq!(&header, &BatchHeader { batch_id, descriptors: descs.clone() });
                let info_request = wire::read_request(&mut r).await;
                prop_assert!(matches!(info_request, Ok(Some(Request::HostInfo { p_pid: 7 }))), "{:?}", info_request);
                let fence = wire::read_request(&mut r).await;
                prop_assert!(matches!(fence, Ok(Some(Request::Fence { token })) if token == batch_id), "{:?}", fence);
                prop_assert_eq!(wire::read_host_info(&mut r).await.expect("host info"), info);
                match wire::read_ack(&mut r).await.expect("first ack") {
                    Ack::Ok { batch_id } => prop_assert!(!refused && batch_id == ack_id),
                    Ack::Refused { batch_id, reason: text } => {
                        prop_assert!(refused && batch_id == ack_id);
                        // Truncated to the limit; invalid UTF-8 may widen it (U+FFFD is 3 bytes).
                        prop_assert!(text.len() <= 3 * wire::MAX_REASON_LEN, "reason of {} bytes", text.len());
                    }
                }
                let second = wire::read_ack(&mut r).await;
                prop_assert!(
                    matches!(second, Ok(Ack::Ok { batch_id }) if batch_id == ack_id.wrapping_add(1)),
                    "the stream lost sync after a {}-byte reason: {second:?}",
                    reason.len()
                );
                prop_assert!(wire::read_request(&mut r).await.expect("clean eof").is_none());
                Ok(())
            })
        })
        .expect("valid messages round-trip");
}

// ---- regression tests of the findings --------------------------------------------------------

/// Finding: a 16-byte header claiming `MAX_DESCRIPTORS_PER_BATCH` descriptors made D allocate the
/// whole 16 MiB descriptor table before reading one descriptor (per connection).
#[tokio::test]
async fn a_max_descriptor_count_with_no_descriptors_reads_in_bounded_chunks() {
    let mut header = BATCH_MAGIC.to_vec();
    header.extend_from_slice(&1u64.to_le_bytes());
    header.extend_from_slice(&(wire::MAX_DESCRIPTORS_PER_BATCH as u32).to_le_bytes());
    let mut r = Probe::new(header);
    let got = wire::read_batch_header(&mut r).await;
    assert!(matches!(&got, Err(WireError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof), "{got:?}");
    assert!(r.largest_read <= MAX_READ_CHUNK, "asked for {} bytes at once", r.largest_read);
}

/// Finding: the same for a host answer claiming `MAX_REGIONS` regions (1.5 MiB).
#[tokio::test]
async fn a_max_region_count_with_no_regions_reads_in_bounded_chunks() {
    let info = HostInfo { offered: true, pid: 1, host_id: "h".into(), canary_addr: 0, canary: vec![], regions: vec![] };
    let mut bytes = wire::encode_host_info(&info).expect("small");
    let n = bytes.len();
    bytes[n - 4..].copy_from_slice(&(wire::MAX_REGIONS as u32).to_le_bytes());
    let mut r = Probe::new(bytes);
    let got = wire::read_host_info(&mut r).await;
    assert!(matches!(&got, Err(WireError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof), "{got:?}");
    assert!(r.largest_read <= MAX_READ_CHUNK, "asked for {} bytes at once", r.largest_read);
}

/// Finding: an ack whose reason is longer than `MAX_REASON_LEN` left the rest of the reason in the
/// stream, so the next ack was read from the middle of it (P saw garbage from a valid D).
#[tokio::test]
async fn an_ack_with_an_overlong_reason_does_not_desync_the_stream() {
    let mut stream = raw_ack(1, 5, &[b'r'; 2000]);
    stream.extend(raw_ack(0, 6, b""));
    let mut r = &stream[..];
    match wire::read_ack(&mut r).await.expect("first ack") {
        Ack::Refused { batch_id: 5, reason } => assert_eq!(reason.len(), wire::MAX_REASON_LEN, "kept truncated"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(wire::read_ack(&mut r).await.expect("second ack"), Ack::Ok { batch_id: 6 });
}
