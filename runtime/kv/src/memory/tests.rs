//! Unit tests of the KV cache memory: shapes, regions, bounds checks.

use super::*;

#[test]
fn qwen3_8b_figures_match_the_seed() {
    let s = KvShape::QWEN3_8B;
    assert_eq!(s.bytes_per_token(), 147_456);
    assert_eq!(s.block_len(), 64 * 1024);
    assert_eq!(s.bytes_per_block(), 2_359_296);
    assert_eq!(s.blocks_for(1000), 63);
    assert_eq!(63 * s.bytes_per_block(), 148_635_648);
}

#[test]
fn region_checks_refuse_ranges_outside_or_across_regions() {
    let shape = KvShape { num_layers: 2, num_kv_heads: 1, head_dim: 4, dtype_bytes: 2, block_size: 2 };
    let cache = KvCache::new(shape, 4);
    let table = cache.region_table();
    let r0 = table.regions()[0];
    assert_eq!(table.check(r0.base_addr, r0.len), Ok(0));
    assert!(table.check(r0.base_addr + 1, r0.len).is_err());
    assert!(table.check(u64::MAX - 1, 4).is_err());
    assert!(table.check(0, 1).is_err());
}

#[test]
fn external_regions_are_checked_and_used_in_place() {
    let shape = KvShape { num_layers: 2, num_kv_heads: 1, head_dim: 4, dtype_bytes: 2, block_size: 2 };
    let mut a = vec![0u8; 3 * shape.block_len()];
    let mut b = vec![0u8; 3 * shape.block_len()];
    let regions = [(a.as_mut_ptr(), a.len()), (b.as_mut_ptr(), b.len())];
    // SAFETY: both vectors outlive the cache (dropped after it below).
    let cache = unsafe { KvCache::from_external(shape, 3, &regions, Box::new(())) }.expect("valid regions");
    assert_eq!(cache.regions()[0].base_addr, a.as_ptr() as u64);
    let data: Vec<u8> = (0..shape.slot_len() as u8).collect();
    cache.write_slot(1, 2, 0, 1, &data).expect("in range");
    drop(cache);
    let off = 2 * shape.block_len() + shape.slot_offset(0, 1);
    assert_eq!(&b[off..off + data.len()], &data[..], "the write landed in the caller's memory");
    let short = [(a.as_mut_ptr(), a.len()), (b.as_mut_ptr(), b.len() - 1)];
    // SAFETY: as above; refused before use.
    let err = unsafe { KvCache::from_external(shape, 3, &short, Box::new(())) }.expect_err("short region");
    assert!(matches!(err, ExternalRegionError::Length { index: 1, .. }), "{err}");
    let overlap = [(a.as_mut_ptr(), a.len()), (a.as_mut_ptr(), a.len())];
    // SAFETY: as above; refused before use.
    assert!(matches!(
        unsafe { KvCache::from_external(shape, 3, &overlap, Box::new(())) },
        Err(ExternalRegionError::Overlap { .. })
    ));
}

#[test]
fn slots_round_trip() {
    let shape = KvShape { num_layers: 2, num_kv_heads: 2, head_dim: 4, dtype_bytes: 2, block_size: 2 };
    let cache = KvCache::new(shape, 3);
    let data: Vec<u8> = (0..shape.slot_len() as u8).collect();
    cache.write_slot(1, 2, 1, 1, &data).expect("in range");
    let mut out = vec![0; shape.slot_len()];
    cache.read_slot(1, 2, 1, 1, &mut out).expect("in range");
    assert_eq!(out, data);
    assert!(cache.write_slot(0, 3, 0, 0, &data).is_err());
}
