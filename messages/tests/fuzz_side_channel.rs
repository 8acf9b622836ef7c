//! Fuzz targets (bad input) for the side channel's frame decoder, seed steps 21 and 30:
//! `frame::decode` of every message D and P exchange ([`SideChannelRequest`], [`PullResponse`]).
//!
//! Properties, each over a bounded number of proptest cases:
//! - any message value round-trips through `frame::encode` / `frame::decode`;
//! - arbitrary bytes (with and without a valid 5-byte header) never panic and give a typed
//!   [`FrameError`];
//! - structured mutations of valid frames (truncation, bit flips, length prefixes set huge, wrong
//!   magic, wrong version, trailing bytes) never panic, and the mutations that must fail do, with
//!   the right error;
//! - no decode asks the allocator for more than a small multiple of the frame's own length, however
//!   large a length prefix claims to be (a counting global allocator, per thread, checks it).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use pdflow_messages::frame::{self, FrameError, MAGIC, MAX_FRAME_LEN, VERSION};
use pdflow_messages::kv_groups::{BlockSpan, GroupBlocks};
use pdflow_messages::layout::{KvLayout, RegionDesc};
use pdflow_messages::sender_listener::{
    AbortPull, BlockDigests, PullErr, PullErrorCause, PullReq, PullRequest, PullResponse, PullStatus,
    SideChannelRequest,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError};

// ---- allocation probe ------------------------------------------------------------------------

/// Records, on the current thread while armed, the largest single allocation requested.
struct PeakAlloc;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = ARMED.try_with(|armed| {
        if armed.get() {
            let _ = PEAK.try_with(|p| p.set(p.get().max(size)));
        }
    });
}

// SAFETY: forwards every call to the system allocator unchanged; only records sizes.
unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: PeakAlloc = PeakAlloc;

/// Runs `f` and returns its result with the largest single allocation it asked for.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    PEAK.with(|p| p.set(0));
    ARMED.with(|a| a.set(true));
    let out = f();
    ARMED.with(|a| a.set(false));
    (out, PEAK.with(Cell::get))
}

/// The most one decode may allocate at once for a frame of `len` bytes: postcard preallocates a
/// sequence only when its claimed length fits in the bytes left, so allocations stay proportional
/// to the input (the largest element, `PullReq`, is under 128 bytes).
fn alloc_bound(len: usize) -> usize {
    4096 + 128 * len
}

// ---- strategies ------------------------------------------------------------------------------

fn cfg(cases: u32) -> Config {
    Config { cases, failure_persistence: None, ..Config::default() }
}

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(any::<char>(), 0..12).prop_map(String::from_iter)
}

fn layout() -> impl Strategy<Value = KvLayout> {
    let region = (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(base_addr, len, block_len)| RegionDesc {
        base_addr,
        len,
        block_len,
    });
    (any::<u64>(), prop::collection::vec(region, 0..6)).prop_map(|(layout_id, regions)| KvLayout { layout_id, regions })
}

fn pull_req() -> impl Strategy<Value = PullReq> {
    let span = (prop::option::of(any::<u32>()), prop::collection::vec(any::<u32>(), 0..40))
        .prop_map(|(first, ids)| BlockSpan { first, ids });
    (text(), text(), prop::collection::vec(span, 0..4), prop::option::of(text())).prop_map(
        |(d_req_id, transfer_id, spans, traceparent)| PullReq {
            d_req_id: d_req_id.into(),
            transfer_id: transfer_id.into(),
            block_ids: GroupBlocks(spans),
            traceparent,
            fence: 3,
            remote: Vec::new(),
        },
    )
}

fn pull_request() -> impl Strategy<Value = PullRequest> {
    (
        (any::<u64>(), text(), text(), any::<u32>(), any::<u32>(), any::<u32>(), any::<u64>()),
        (
            prop::option::of(layout()),
            prop::collection::vec(pull_req(), 0..5),
            prop::option::of(text()),
            any::<u64>(),
            any::<u64>(),
            (any::<u32>(), any::<u32>(), any::<u32>()),
        ),
    )
        .prop_map(
            |(
                (pull_id, engine_id, data_addr, tp_size, tp_rank, pp_size, layout_id),
                (layout, reqs, traceparent, p_generation, deadline_ms, (pp_rank, p_tp, p_pp)),
            )| {
                PullRequest {
                    pull_id,
                    engine_id,
                    data_addr,
                    tp_size,
                    tp_rank,
                    pp_size,
                    layout_id,
                    layout,
                    reqs,
                    traceparent,
                    p_generation,
                    deadline_ms,
                    pp_rank,
                    p_world: (p_tp, p_pp),
                    rdma: None,
                }
            },
        )
}

fn side_channel_request() -> impl Strategy<Value = SideChannelRequest> {
    prop_oneof![
        pull_request().prop_map(SideChannelRequest::Pull),
        (any::<u64>(), prop::collection::vec(text(), 0..8)).prop_map(|(pull_id, transfer_ids)| {
            SideChannelRequest::Abort(AbortPull {
                pull_id,
                transfer_ids: transfer_ids.into_iter().map(Into::into).collect(),
            })
        }),
    ]
}

fn pull_response() -> impl Strategy<Value = PullResponse> {
    let status = prop_oneof![Just(PullStatus::Continue), Just(PullStatus::Finish), Just(PullStatus::Error)];
    let cause = prop_oneof![
        Just(PullErrorCause::Aborted),
        Just(PullErrorCause::ReadyTimeout),
        Just(PullErrorCause::LayoutMismatch),
        Just(PullErrorCause::TransferFailed),
        Just(PullErrorCause::UnknownLayout),
        Just(PullErrorCause::CancelledByPeer),
        Just(PullErrorCause::Expired),
        Just(PullErrorCause::StaleGeneration),
    ];
    let err = (text(), cause, text()).prop_map(|(d_req_id, cause, detail)| PullErr {
        d_req_id: d_req_id.into(),
        cause,
        detail,
    });
    let digests = (text(), prop::collection::vec(any::<u64>(), 0..8))
        .prop_map(|(d_req_id, digests)| BlockDigests { d_req_id: d_req_id.into(), digests });
    (
        any::<u64>(),
        status,
        prop::collection::vec(text(), 0..6),
        prop::collection::vec(digests, 0..3),
        prop::collection::vec(err, 0..4),
        prop::option::of(any::<u64>()),
        prop::option::of(text()),
        any::<u64>(),
    )
        .prop_map(|(pull_id, status, ok_reqs, digests, err_reqs, layout_id, error, p_generation)| PullResponse {
            pull_id,
            status,
            ok_reqs: ok_reqs.into_iter().map(Into::into).collect(),
            digests,
            err_reqs,
            layout_id,
            error,
            p_generation,
        })
}

/// A valid frame of either message type, with its index in [`decode_both`]'s answer.
fn valid_frame() -> impl Strategy<Value = (Vec<u8>, usize)> {
    prop_oneof![
        side_channel_request().prop_map(|m| (frame::encode(&m).expect("a side-channel request encodes"), 0)),
        pull_response().prop_map(|m| (frame::encode(&m).expect("a pull response encodes"), 1)),
    ]
}

/// Varints claiming huge lengths: u32::MAX, u64::MAX, 2^63 and an over-long (11-byte) varint.
const HUGE_VARINTS: [&[u8]; 4] = [
    &[0xff, 0xff, 0xff, 0xff, 0x0f],
    &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01],
    &[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01],
    &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f],
];

/// A structured mutation of a valid frame; indices are taken modulo the frame's length.
#[derive(Debug, Clone)]
enum Mutation {
    Truncate(usize),
    FlipBit(usize, u8),
    SetByte(usize, u8),
    /// Inserts a huge varint into the body (where a length prefix may be).
    InsertHuge(usize, usize),
    /// Overwrites body bytes with a huge varint.
    OverwriteHuge(usize, usize),
    WrongMagic(usize, u8),
    WrongVersion(u8),
    Trailing(Vec<u8>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Mutation::SetByte(i, v)),
        (any::<usize>(), 0..HUGE_VARINTS.len()).prop_map(|(i, h)| Mutation::InsertHuge(i, h)),
        (any::<usize>(), 0..HUGE_VARINTS.len()).prop_map(|(i, h)| Mutation::OverwriteHuge(i, h)),
        (0usize..4, any::<u8>()).prop_map(|(i, v)| Mutation::WrongMagic(i, v)),
        any::<u8>().prop_filter("not this build's version", |v| *v != VERSION).prop_map(Mutation::WrongVersion),
        prop::collection::vec(any::<u8>(), 1..16).prop_map(Mutation::Trailing),
    ]
}

/// Which error a mutated frame must give.
type Expected = fn(&FrameError) -> bool;

/// Applies `m` to `frame`; returns the mutated bytes and the error the decode must give, if any.
fn apply(frame: &[u8], m: &Mutation) -> (Vec<u8>, Option<Expected>) {
    let mut out = frame.to_vec();
    let body = |i: usize| 5 + i % (frame.len() - 4); // a position in 5..=len
    match m {
        Mutation::Truncate(i) => {
            out.truncate(i % frame.len());
            let short = out.len() < 5;
            return (
                out,
                Some(if short {
                    |e| matches!(e, FrameError::TooShort { .. })
                } else {
                    |e| matches!(e, FrameError::Body { .. })
                }),
            );
        }
        Mutation::FlipBit(i, b) => out[i % frame.len()] ^= 1 << b,
        Mutation::SetByte(i, v) => out[i % frame.len()] = *v,
        Mutation::InsertHuge(i, h) => {
            let at = body(*i);
            out.splice(at..at, HUGE_VARINTS[*h].iter().copied());
        }
        Mutation::OverwriteHuge(i, h) => {
            let at = body(*i);
            let huge = HUGE_VARINTS[*h];
            out.truncate(at);
            out.extend_from_slice(huge);
            if let Some(rest) = frame.get(at + huge.len()..) {
                out.extend_from_slice(rest);
            }
        }
        Mutation::WrongMagic(i, v) => {
            out[*i] = *v;
            if out[..4] != MAGIC {
                return (out, Some(|e| matches!(e, FrameError::BadMagic { .. })));
            }
        }
        Mutation::WrongVersion(v) => {
            out[4] = *v;
            return (
                out,
                Some(|e| matches!(e, FrameError::UnsupportedVersion { found, expected: VERSION } if *found != VERSION)),
            );
        }
        Mutation::Trailing(extra) => {
            out.extend_from_slice(extra);
            return (out, Some(|e| matches!(e, FrameError::Body { reason, .. } if reason.contains("trailing"))));
        }
    }
    (out, None)
}

/// Decodes `bytes` as both message types under the allocation probe; a decoded value must encode
/// again to a frame that decodes to the same value.
fn decode_both(bytes: &[u8]) -> Result<[Result<(), FrameError>; 2], TestCaseError> {
    let (req, peak_req) = peak_of(|| frame::decode::<SideChannelRequest>(bytes, "side-channel request"));
    let (resp, peak_resp) = peak_of(|| frame::decode::<PullResponse>(bytes, "pull response"));
    for (what, peak) in [("side-channel request", peak_req), ("pull response", peak_resp)] {
        prop_assert!(
            peak <= alloc_bound(bytes.len()),
            "decoding {} bytes as a {what} allocated {peak} bytes at once (bound {})",
            bytes.len(),
            alloc_bound(bytes.len())
        );
    }
    if let Ok(value) = &req {
        let again = frame::encode(value).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let back = frame::decode::<SideChannelRequest>(&again, "side-channel request");
        prop_assert_eq!(back.as_ref(), Ok(value));
    }
    if let Ok(value) = &resp {
        let again = frame::encode(value).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let back = frame::decode::<PullResponse>(&again, "pull response");
        prop_assert_eq!(back.as_ref(), Ok(value));
    }
    for err in [req.as_ref().err(), resp.as_ref().err()].into_iter().flatten() {
        prop_assert!(!err.to_string().is_empty());
        if let FrameError::Body { what, .. } = err {
            prop_assert!(err.to_string().contains(what), "the error names the message type: {err}");
        }
    }
    Ok([req.map(drop), resp.map(drop)])
}

// ---- properties ------------------------------------------------------------------------------

proptest! {
    #![proptest_config(cfg(512))]

    #[test]
    fn side_channel_requests_round_trip(msg in side_channel_request()) {
        let bytes = frame::encode(&msg).expect("encodes");
        prop_assert_eq!(&bytes[..4], &MAGIC[..]);
        prop_assert_eq!(bytes[4], VERSION);
        let (back, peak) = peak_of(|| frame::decode::<SideChannelRequest>(&bytes, "side-channel request"));
        prop_assert_eq!(back, Ok(msg));
        prop_assert!(peak <= alloc_bound(bytes.len()));
    }

    #[test]
    fn pull_responses_round_trip(msg in pull_response()) {
        let bytes = frame::encode(&msg).expect("encodes");
        prop_assert_eq!(frame::decode::<PullResponse>(&bytes, "pull response"), Ok(msg));
    }

    #[test]
    fn arbitrary_bytes_are_typed_errors(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let results = decode_both(&bytes)?;
        if bytes.len() < 5 {
            prop_assert!(results.iter().all(|r| matches!(r, Err(FrameError::TooShort { .. }))), "{results:?}");
        } else if bytes[..4] != MAGIC {
            prop_assert!(results.iter().all(|r| matches!(r, Err(FrameError::BadMagic { .. }))), "{results:?}");
        }
    }

    #[test]
    fn arbitrary_bodies_behind_a_valid_header_are_typed_errors(body in prop::collection::vec(any::<u8>(), 0..256)) {
        let mut bytes = MAGIC.to_vec();
        bytes.push(VERSION);
        bytes.extend_from_slice(&body);
        let _ = decode_both(&bytes)?;
    }

    #[test]
    fn mutated_valid_frames_never_panic_and_fail_as_they_must((frame, kind) in valid_frame(), m in mutation()) {
        let (bytes, must_fail) = apply(&frame, &m);
        let results = decode_both(&bytes)?;
        if let Some(expected) = must_fail {
            // Decoded as its own type, the mutated frame must fail, and with the right error (as
            // the other type it may happen to be valid: postcard is not self-describing).
            match &results[kind] {
                Err(e) => prop_assert!(expected(e), "{m:?} gave {e}"),
                Ok(()) => prop_assert!(false, "{m:?} must make the decode fail"),
            }
        }
    }
}

// ---- plain regression and limit tests --------------------------------------------------------

#[test]
fn a_huge_string_length_prefix_is_a_body_error_without_allocating_it() {
    // Pull, pull_id 1, engine_id claiming u64::MAX bytes.
    let mut bytes = MAGIC.to_vec();
    bytes.extend_from_slice(&[VERSION, 0, 1]);
    bytes.extend_from_slice(HUGE_VARINTS[1]);
    bytes.extend_from_slice(b"d");
    let (r, peak) = peak_of(|| frame::decode::<SideChannelRequest>(&bytes, "side-channel request"));
    assert!(matches!(&r, Err(FrameError::Body { what: "side-channel request", .. })), "{r:?}");
    assert!(peak <= alloc_bound(bytes.len()), "allocated {peak}");
}

#[test]
fn a_huge_sequence_length_prefix_is_a_body_error_without_allocating_it() {
    // Abort, pull_id 7, transfer_ids claiming u32::MAX entries, then one short entry.
    let mut bytes = MAGIC.to_vec();
    bytes.extend_from_slice(&[VERSION, 1, 7]);
    bytes.extend_from_slice(HUGE_VARINTS[0]);
    bytes.extend_from_slice(&[1, b'x']);
    let (r, peak) = peak_of(|| frame::decode::<SideChannelRequest>(&bytes, "side-channel request"));
    assert!(matches!(&r, Err(FrameError::Body { .. })), "{r:?}");
    assert!(peak <= alloc_bound(bytes.len()), "allocated {peak}");
    // The same for P's answer: ok_reqs claiming u32::MAX request ids.
    let mut bytes = MAGIC.to_vec();
    bytes.extend_from_slice(&[VERSION, 3, 1]);
    bytes.extend_from_slice(HUGE_VARINTS[0]);
    let (r, peak) = peak_of(|| frame::decode::<PullResponse>(&bytes, "pull response"));
    assert!(matches!(&r, Err(FrameError::Body { what: "pull response", .. })), "{r:?}");
    assert!(peak <= alloc_bound(bytes.len()), "allocated {peak}");
}

#[test]
fn an_oversize_frame_is_refused_before_decoding() {
    let mut bytes = vec![0u8; MAX_FRAME_LEN + 1];
    bytes[..4].copy_from_slice(&MAGIC);
    bytes[4] = VERSION;
    let (r, peak) = peak_of(|| frame::decode::<SideChannelRequest>(&bytes, "side-channel request"));
    assert_eq!(r, Err(FrameError::Oversize { len: MAX_FRAME_LEN + 1, max: MAX_FRAME_LEN }));
    assert!(peak < 4096, "refused without decoding, allocated {peak}");
}

#[test]
fn an_unknown_enum_variant_is_a_body_error() {
    let mut bytes = MAGIC.to_vec();
    bytes.extend_from_slice(&[VERSION, 2, 0]); // SideChannelRequest has two variants
    assert!(matches!(
        frame::decode::<SideChannelRequest>(&bytes, "side-channel request"),
        Err(FrameError::Body { .. })
    ));
    let ok = frame::encode(&PullResponse::error(3, "x")).expect("encodes");
    let mut bad_status = ok.clone();
    bad_status[6] = 9; // status: three variants
    assert!(matches!(frame::decode::<PullResponse>(&bad_status, "pull response"), Err(FrameError::Body { .. })));
}

#[test]
fn invalid_utf8_in_a_string_is_a_body_error() {
    let abort = SideChannelRequest::Abort(AbortPull { pull_id: 1, transfer_ids: vec!["ab".into()] });
    let mut bytes = frame::encode(&abort).expect("encodes");
    let last = bytes.len() - 1;
    bytes[last] = 0xff;
    assert!(matches!(
        frame::decode::<SideChannelRequest>(&bytes, "side-channel request"),
        Err(FrameError::Body { .. })
    ));
}
