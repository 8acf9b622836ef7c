//! KV events as a router receives them: a real ZeroMQ SUB socket on the engine's PUB endpoint
//! decodes (msgpack, with `rmp`) `BlockStored` with the prompt's chained hashes and tokens, and
//! `BlockRemoved` when an allocation evicts them; a DEALER on the replay endpoint gets the kept
//! batches from a sequence number on, then the end marker.

use std::time::Duration;

use bytes::Bytes;
use rmp::decode::RmpRead;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::block_hash::BlockHash;
use super::kv_events::publisher::END_SEQ;
use super::kv_events::KvEventsConfig;
use super::tests::{prompt, request, run, start, DEADLINE};
use super::tests_prefix::caching_config;
use super::*;

/// A msgpack value, as far as KV events use them.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Nil,
    Int(u64),
    Float(f64),
    Str(String),
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
}

fn read_value(rd: &mut &[u8]) -> Value {
    use rmp::Marker as M;
    let marker = rmp::decode::read_marker(rd).expect("a msgpack marker");
    let len = |rd: &mut &[u8], bytes: usize| -> usize {
        match bytes {
            1 => rd.read_data_u8().expect("u8").into(),
            2 => rd.read_data_u16().expect("u16").into(),
            _ => rd.read_data_u32().expect("u32") as usize,
        }
    };
    match marker {
        M::Null => Value::Nil,
        M::FixPos(n) => Value::Int(n.into()),
        M::U8 => Value::Int(rd.read_data_u8().expect("u8").into()),
        M::U16 => Value::Int(rd.read_data_u16().expect("u16").into()),
        M::U32 => Value::Int(rd.read_data_u32().expect("u32").into()),
        M::U64 => Value::Int(rd.read_data_u64().expect("u64")),
        M::F64 => Value::Float(rd.read_data_f64().expect("f64")),
        M::FixStr(n) => read_str(rd, n.into()),
        M::Str8 => {
            let n = len(rd, 1);
            read_str(rd, n)
        }
        M::FixArray(n) => read_array(rd, n.into()),
        M::Array16 => {
            let n = len(rd, 2);
            read_array(rd, n)
        }
        M::Array32 => {
            let n = len(rd, 4);
            read_array(rd, n)
        }
        M::FixMap(n) => read_map(rd, n.into()),
        M::Map16 => {
            let n = len(rd, 2);
            read_map(rd, n)
        }
        other => panic!("unexpected msgpack marker {other:?}"),
    }
}

fn read_str(rd: &mut &[u8], n: usize) -> Value {
    let (s, rest) = rd.split_at(n);
    *rd = rest;
    Value::Str(String::from_utf8(s.to_vec()).expect("utf-8"))
}

fn read_array(rd: &mut &[u8], n: usize) -> Value {
    Value::Array((0..n).map(|_| read_value(rd)).collect())
}

fn read_map(rd: &mut &[u8], n: usize) -> Value {
    Value::Map((0..n).map(|_| (read_value(rd), read_value(rd))).collect())
}

/// An event as a subscriber sees it.
#[derive(Debug, Clone, PartialEq)]
enum Event {
    Stored { hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, block_size: u64 },
    Removed { hashes: Vec<u64> },
}

fn ints(v: &Value) -> Vec<u64> {
    match v {
        Value::Array(items) => items.iter().map(|i| if let Value::Int(n) = i { *n } else { panic!("{i:?}") }).collect(),
        other => panic!("not an array: {other:?}"),
    }
}

/// `[ts, [event…], dp_rank]`, each event a map with its `type` first (vLLM 0.33's form).
fn decode_batch(payload: &[u8]) -> (Vec<Event>, Value) {
    let mut rd = payload;
    let Value::Array(batch) = read_value(&mut rd) else { panic!("a batch is an array") };
    assert!(rd.is_empty(), "one value per payload");
    assert!(matches!(batch[0], Value::Float(ts) if ts > 1.6e9), "ts: {:?}", batch[0]);
    let Value::Array(events) = &batch[1] else { panic!("events: {:?}", batch[1]) };
    let events = events
        .iter()
        .map(|e| {
            let Value::Map(fields) = e else { panic!("an event is a map: {e:?}") };
            let get = |k: &str| fields.iter().find(|(key, _)| key == &Value::Str(k.into())).map(|(_, v)| v.clone());
            assert_eq!(fields[0].0, Value::Str("type".into()), "the tag comes first");
            assert_eq!(get("medium"), Some(Value::Str("GPU".into())));
            match get("type") {
                Some(Value::Str(t)) if t == "BlockStored" => Event::Stored {
                    hashes: ints(&get("block_hashes").expect("block_hashes")),
                    parent: match get("parent_block_hash") {
                        Some(Value::Int(h)) => Some(h),
                        _ => None,
                    },
                    tokens: ints(&get("token_ids").expect("token_ids")).into_iter().map(|t| t as u32).collect(),
                    block_size: match get("block_size") {
                        Some(Value::Int(n)) => n,
                        other => panic!("block_size {other:?}"),
                    },
                },
                Some(Value::Str(t)) if t == "BlockRemoved" => {
                    Event::Removed { hashes: ints(&get("block_hashes").expect("block_hashes")) }
                }
                other => panic!("unexpected event type {other:?}"),
            }
        })
        .collect();
    (events, batch[2].clone())
}

/// `tcp://0.0.0.0:PORT` → `tcp://127.0.0.1:PORT`.
fn local(endpoint: &str) -> String {
    let port = endpoint.rsplit(':').next().expect("a port");
    format!("tcp://127.0.0.1:{port}")
}

fn seq_of(frame: &Bytes) -> u64 {
    u64::from_be_bytes(frame.as_ref().try_into().expect("8 bytes"))
}

/// Received messages, (seq, payload), until `done` says enough (bounded wait).
async fn receive_until(sub: &mut SubSocket, got: &mut Vec<(u64, Bytes)>, done: impl Fn(&[Event]) -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let events: Vec<Event> = got.iter().flat_map(|(_, p)| decode_batch(p).0).collect();
        if done(&events) {
            return;
        }
        let Ok(msg) = tokio::time::timeout_at(deadline, sub.recv()).await else {
            panic!("the events never came; received {events:?}");
        };
        let msg = msg.expect("a message");
        let frames = msg.into_vec();
        assert_eq!(frames.len(), 3, "topic, seq, payload");
        assert!(frames[0].is_empty(), "the default topic is empty");
        got.push((seq_of(&frames[1]), frames[2].clone()));
    }
}

#[tokio::test]
async fn a_subscriber_decodes_stored_and_removed_blocks_and_replay_returns_them() {
    let config = EngineConfig {
        kv_events: Some(KvEventsConfig::zmq("tcp://*:0", Some("tcp://*:0".into()))),
        ..caching_config(16)
    };
    let engine = start(config, None);
    let endpoints = engine.kv_events_endpoints().await.expect("bound").expect("events on");
    let mut sub = SubSocket::new();
    sub.subscribe("").await.expect("subscribe");
    sub.connect(&local(&endpoints.endpoint)).await.expect("connect");
    // The subscription reaches the publisher asynchronously: one-block prompts until one
    // of their batches arrives.
    let mut got: Vec<(u64, Bytes)> = Vec::new();
    for i in 0.. {
        run(&engine, request(&format!("warm-{i}"), vec![900 + i, 1, 2, 3], 1)).await;
        if let Ok(Ok(msg)) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
            let frames = msg.into_vec();
            got.push((seq_of(&frames[1]), frames[2].clone()));
            break;
        }
        assert!(i < 100, "no KV event reached the subscriber");
    }
    let after_warm_up = got.len();

    // A 13-token prompt caches its 3 full blocks, in one event whose hashes chain from NONE_HASH.
    let a = prompt(13);
    run(&engine, request("a", a.clone(), 1)).await;
    let want: Vec<u64> = BlockHash::extend_chain(&[], &a, 4).iter().map(BlockHash::external).collect();
    let stored_a = Event::Stored { hashes: want.clone(), parent: None, tokens: a[..12].to_vec(), block_size: 4 };
    receive_until(&mut sub, &mut got, |events| events.contains(&stored_a)).await;
    let seq_a = got.last().expect("a's batch").0;

    // A prompt needing every block evicts every cached one, a's included, each in its own event.
    let big: Vec<u32> = (100..163).collect();
    run(&engine, request("big", big, 1)).await;
    receive_until(&mut sub, &mut got, |events| {
        want.iter().all(|h| events.contains(&Event::Removed { hashes: vec![*h] }))
    })
    .await;
    let seqs: Vec<u64> = got.iter().map(|(s, _)| *s).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "sequence numbers count up by one: {seqs:?}");
    assert!(got[after_warm_up..].iter().all(|(_, p)| decode_batch(p).1 == Value::Int(0)), "dp rank 0");

    // Replay from a's batch on: every kept batch, byte for byte, then the end marker.
    let mut dealer = DealerSocket::new();
    dealer.connect(&local(endpoints.replay_endpoint.as_deref().expect("a replay endpoint"))).await.expect("connect");
    let ask = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&seq_a.to_be_bytes())]).expect("frames");
    dealer.send(ask).await.expect("replay request");
    let mut replayed = Vec::new();
    loop {
        let msg = tokio::time::timeout(DEADLINE, dealer.recv()).await.expect("replay in time").expect("a reply");
        let frames = msg.into_vec();
        assert_eq!(frames.len(), 4, "delimiter, topic, seq, payload");
        if frames[2].as_ref() == END_SEQ {
            assert!(frames[1].is_empty() && frames[3].is_empty());
            break;
        }
        replayed.push((seq_of(&frames[2]), frames[3].clone()));
    }
    let published: Vec<(u64, Bytes)> = got.into_iter().filter(|(s, _)| *s >= seq_a).collect();
    assert!(replayed.len() >= published.len());
    assert_eq!(&replayed[..published.len()], published.as_slice());
    engine.shutdown().await;
}
