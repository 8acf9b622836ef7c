//! The cuda path's tests: they need a GPU and NVRTC, and skip with the reason printed otherwise.

use super::*;
use crate::planner::{Descriptor, TransferPlan};

/// A context on GPU 0, or `None` after printing why the test skips.
fn gpu0() -> Option<Arc<CudaContext>> {
    match device_count() {
        Err(e) => {
            pdflow_testkit::skipped("cuda test", &e);
            return None;
        }
        Ok(_) if !nvrtc_available() => {
            pdflow_testkit::skipped("cuda test", &CudaError::NoNvrtc);
            return None;
        }
        Ok(_) => {}
    }
    Some(CudaContext::new(0).expect("GPU 0 is visible"))
}

#[test]
fn batch_copy_moves_aligned_and_unaligned_descriptors() {
    let Some(ctx) = gpu0() else { return };
    let copier = CudaBatchCopy::new(&ctx).expect("kernel compiles");
    let (src, dst) =
        (DeviceBuffer::new(&ctx, 1 << 22).expect("alloc"), DeviceBuffer::new(&ctx, 1 << 22).expect("alloc"));
    copier.fill_pattern(&src, 7).expect("fill");
    dst.fill(0).expect("memset");
    let plan = TransferPlan {
        descriptors: vec![
            Descriptor { src: src.ptr, dst: dst.ptr + (1 << 21), len: 200_000 },
            Descriptor { src: src.ptr + 3, dst: dst.ptr + 5, len: 70_001 },
            Descriptor { src: src.ptr + (1 << 20), dst: dst.ptr + (3 << 20), len: 64 * 1024 * 3 },
        ],
        fence: 0,
        write_by: None,
        grant: None,
    };
    let up = copier.upload(&plan).expect("upload");
    copier.execute(&up).expect("launch");
    assert_eq!(plan_checksum(&ctx, &plan, true).expect("read"), plan_checksum(&ctx, &plan, false).expect("read"));
    let mut untouched = [1u8; 16];
    dst.read((1 << 22) - 16, &mut untouched).expect("read");
    assert_eq!(untouched, [0u8; 16], "bytes outside the plan stay untouched");
}

#[test]
fn no_gpu_is_a_typed_error_not_a_panic() {
    // On a machine without a driver this is the skip reason; with one, a device count.
    match device_count() {
        Ok(n) => assert!(n > 0),
        Err(e) => assert!(matches!(e, CudaError::NoDriver | CudaError::NoDevice | CudaError::Driver(_)), "{e}"),
    }
}

#[test]
fn a_reused_descriptor_table_carries_the_next_plan_and_grows_when_needed() {
    let Some(ctx) = gpu0() else { return };
    let copier = CudaBatchCopy::new(&ctx).expect("kernel compiles");
    let (src, dst) =
        (DeviceBuffer::new(&ctx, 1 << 22).expect("alloc"), DeviceBuffer::new(&ctx, 1 << 22).expect("alloc"));
    copier.fill_pattern(&src, 11).expect("fill");
    let plan = |n: u64, off: u64| TransferPlan {
        descriptors: (0..n)
            .map(|i| Descriptor { src: src.ptr + off + i * 4096, dst: dst.ptr + (n - 1 - i) * 4096, len: 4096 })
            .collect(),
        fence: 0,
        write_by: None,
        grant: None,
    };
    let first = copier.upload(&plan(10, 0)).expect("upload");
    let table = first.src();
    copier.execute(&first).expect("launch");
    // A smaller plan reuses the table; its bytes are its own.
    dst.fill(0).expect("memset");
    let second_plan = plan(7, 1 << 20);
    let second = copier.upload_reusing(&second_plan, Some(first)).expect("upload");
    assert_eq!(second.src(), table, "the table was reused");
    assert_eq!(second.chunks, 7);
    copier.execute(&second).expect("launch");
    assert_eq!(
        plan_checksum(&ctx, &second_plan, true).expect("read"),
        plan_checksum(&ctx, &second_plan, false).expect("read")
    );
    // A plan larger than its capacity gets a new one.
    let big_plan = plan(1000, 0);
    let big = copier.upload_reusing(&big_plan, Some(second)).expect("upload");
    assert!(big.chunks == 1000, "all chunks uploaded");
    dst.fill(0).expect("memset");
    copier.execute(&big).expect("launch");
    assert_eq!(
        plan_checksum(&ctx, &big_plan, true).expect("read"),
        plan_checksum(&ctx, &big_plan, false).expect("read")
    );
}
