//! criterion micro-benchmarks of the side-channel codec (seed step 21): `frame::encode` and
//! `frame::decode` of a `PullRequest` naming the seed's 63 D block ids, with and without D's full
//! layout (the first pull to a P carries it, later ones only its `layout_id`).
//!
//! Run: `cargo bench -p pdflow-kv --bench codec`.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use pdflow_kv::memory::KvShape;
use pdflow_messages::frame;
use pdflow_messages::sender_listener::{PullReq, PullRequest, SideChannelRequest};

fn pull(with_layout: bool) -> SideChannelRequest {
    let s = KvShape::QWEN3_8B;
    let block_len = s.block_len() as u64;
    let regions = (0..s.num_layers as u64)
        .map(|i| pdflow_messages::layout::RegionDesc {
            base_addr: (1 << 40) + (i << 30),
            len: 1024 * block_len,
            block_len,
        })
        .collect();
    SideChannelRequest::Pull(PullRequest {
        pull_id: 0x1234_5678_0000_0001,
        engine_id: "d-engine-0".into(),
        data_addr: "127.0.0.1:45678".into(),
        tp_size: 1,
        tp_rank: 0,
        pp_size: 1,
        layout_id: 0x5eed,
        layout: with_layout.then_some(pdflow_messages::layout::KvLayout { layout_id: 0x5eed, regions }),
        reqs: vec![PullReq {
            d_req_id: "cmpl-d-ce531e714c002ea4-0".into(),
            transfer_id: "xfer-ce531e714c002ea4".into(),
            block_ids: (512..=574).collect(),
            traceparent: None,
            fence: 0x5eed_0001,
            remote: Vec::new(),
        }],
        traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
        p_generation: 0,
        deadline_ms: 0,
        pp_rank: 0,
        p_world: (1, 1),
        rdma: None,
    })
}

fn codec(c: &mut Criterion) {
    for (name, with_layout) in [("pull (63 block ids)", false), ("pull (63 block ids + 36-region layout)", true)] {
        let msg = pull(with_layout);
        let bytes = frame::encode(&msg).expect("encodes");
        c.bench_function(&format!("frame::encode {name}"), |b| b.iter(|| frame::encode(black_box(&msg))));
        c.bench_function(&format!("frame::decode {name}"), |b| {
            b.iter(|| frame::decode::<SideChannelRequest>(black_box(&bytes), "side-channel request"))
        });
    }
}

criterion_group!(benches, codec);
criterion_main!(benches);
