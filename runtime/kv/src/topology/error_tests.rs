//! The invalid inputs: each refused with a typed error that says what to change.

use pdflow_messages::layout::RegionDesc;

use super::*;
use crate::planner::Descriptor;

fn uniform(tp: usize, pp: usize, layers: usize, h: usize) -> Topology {
    Topology::uniform(tp, pp, layers, h).expect("valid topology")
}

#[test]
fn invalid_topologies_say_what_to_change() {
    let err = Topology::uniform(3, 1, 4, 8).expect_err("3 does not divide 8");
    assert_eq!(err, TopologyError::HeadsNotDivisible { tp: 3, num_kv_heads: 8 });
    assert!(err.to_string().contains("choose a tp that divides 8"), "{err}");
    let err = Topology::uniform(6, 1, 4, 4).expect_err("6 is not a multiple of 4");
    assert_eq!(err, TopologyError::TpNotMultipleOfHeads { tp: 6, num_kv_heads: 4 });
    assert!(err.to_string().contains("multiple of 4"), "{err}");
    assert_eq!(Topology::uniform(0, 1, 4, 4), Err(TopologyError::Zero { what: "tp" }));
    assert_eq!(Topology::uniform(1, 0, 4, 4), Err(TopologyError::Zero { what: "pp" }));
    assert_eq!(Topology::uniform(1, 1, 0, 4), Err(TopologyError::Zero { what: "num_layers" }));
    assert_eq!(Topology::uniform(1, 1, 4, 0), Err(TopologyError::Zero { what: "num_kv_heads" }));
    let err = Topology::uniform(1, 5, 4, 1).expect_err("more stages than layers");
    assert!(err.to_string().contains("use pp <= 4"), "{err}");
    assert_eq!(
        Topology::with_partition(1, &[2, 2], 5, 1),
        Err(TopologyError::PartitionSum { partition: vec![2, 2], sum: 4, num_layers: 5 })
    );
    assert_eq!(Topology::with_stages(1, &[2, 0], 1), Err(TopologyError::EmptyStage { stage: 1 }));
    assert_eq!(tp_heads(4, 4, 8), Err(TopologyError::NoSuchTpRank { tp_rank: 4, tp: 4 }));
}

#[test]
fn invalid_explicit_ranks_are_refused() {
    let rank = |layers, heads| RankLayout { layers, heads };
    assert_eq!(Topology::new(4, 2, vec![]), Err(TopologyError::NoRanks));
    assert_eq!(
        Topology::new(4, 2, vec![rank(0..5, 0..2)]),
        Err(TopologyError::BadLayers { rank: 0, start: 0, end: 5, num_layers: 4 })
    );
    assert_eq!(
        Topology::new(4, 2, vec![rank(0..4, 0..2), rank(1..1, 0..2)]),
        Err(TopologyError::BadLayers { rank: 1, start: 1, end: 1, num_layers: 4 })
    );
    assert_eq!(
        Topology::new(4, 2, vec![rank(0..4, 1..3)]),
        Err(TopologyError::BadHeads { rank: 0, start: 1, end: 3, num_kv_heads: 2 })
    );
    assert_eq!(
        Topology::new(4, 2, vec![rank(0..4, 0..1), rank(0..2, 1..2)]),
        Err(TopologyError::Uncovered { layer: 2, head: 1 })
    );
    // Overlapping replicas are fine.
    assert!(Topology::new(4, 2, vec![rank(0..4, 0..2), rank(0..2, 1..2)]).is_ok());
}

#[test]
fn unplannable_requests_are_refused() {
    let h = HeadLayout { num_kv_heads: 2, slot_len: 4, block_size: 2 };
    let t = uniform(1, 1, 2, 2);
    assert_eq!(
        plan_ranks(&t, &uniform(1, 1, 3, 2), &h, &[1], &[1]),
        Err(RankPlanError::LayerCountMismatch { p: 2, d: 3 })
    );
    assert_eq!(
        plan_ranks(&uniform(1, 1, 2, 1), &t, &h, &[1], &[1]),
        Err(RankPlanError::HeadCountMismatch { side: Side::P, topology: 1, layout: 2 })
    );
    let empty = HeadLayout { slot_len: 0, ..h };
    assert_eq!(plan_ranks(&t, &t, &empty, &[1], &[1]), Err(RankPlanError::EmptyHeadLayout { what: "slot_len" }));
    let err = plan_ranks(&t, &t, &h, &[1, 2], &[1]).expect_err("unaligned");
    assert!(err.to_string().contains("align_tail"), "{err}");
    assert_eq!(plan_ranks(&t, &t, &h, &[1, 2], &[3, 3]), Err(RankPlanError::DuplicateDestination { block: 3 }));
    let huge = HeadLayout { slot_len: 1 << 42, block_size: 1 << 20, ..h };
    assert!(matches!(plan_ranks(&t, &t, &huge, &[1], &[1]), Err(RankPlanError::TooLarge { side: Side::P, .. })));
    assert_eq!(plan_ranks(&t, &t, &h, &[], &[]), Ok(RankPlan::default()));
    assert_eq!(align_tail(&[1, 2, 3], &[8, 9]), Ok(&[2, 3][..]));
    assert_eq!(align_tail(&[1], &[8, 9]), Err(RankPlanError::PTooShort { p: 1, d: 2 }));
}

#[test]
fn addresses_are_checked_against_the_ranks_regions() {
    let h = HeadLayout { num_kv_heads: 2, slot_len: 4, block_size: 2 };
    let (p, d) = (uniform(2, 1, 2, 2), uniform(1, 1, 2, 2));
    let plan = plan_ranks(&p, &d, &h, &[3], &[5]).expect("valid");
    let pair = plan.pair(1, 0).expect("P1 sends head 1");
    let regions = |base: u64, blocks: u64, block_len: u64, n: u64| -> Vec<RegionDesc> {
        (0..n).map(|i| RegionDesc { base_addr: base + (i << 20), len: blocks * block_len, block_len }).collect()
    };
    let ok = pair.to_transfer_plan(&regions(1 << 30, 4, 8, 2), &regions(1 << 31, 6, 16, 2)).expect("fits");
    assert_eq!(ok.descriptors[0], Descriptor { src: (1 << 30) + 3 * 8, dst: (1 << 31) + 5 * 16 + 8, len: 8 });
    assert_eq!(ok.descriptors[1].src, (1 << 30) + (1 << 20) + 3 * 8);
    assert_eq!(
        pair.to_transfer_plan(&regions(1 << 30, 4, 8, 1), &regions(1 << 31, 6, 16, 2)),
        Err(AddressError::MissingRegion { side: Side::P, rank: 1, region: 1, count: 1 })
    );
    assert_eq!(
        pair.to_transfer_plan(&regions(1 << 30, 4, 8, 2), &regions(1 << 31, 6, 8, 2)),
        Err(AddressError::BlockLenMismatch { side: Side::D, rank: 0, region: 0, registered: 8, expected: 16 })
    );
    assert!(matches!(
        pair.to_transfer_plan(&regions(1 << 30, 3, 8, 2), &regions(1 << 31, 6, 16, 2)),
        Err(AddressError::OutOfRegion { side: Side::P, offset: 24, len: 8, region_len: 24, .. })
    ));
}
