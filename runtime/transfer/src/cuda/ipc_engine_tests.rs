//! Tests of [`CudaIpcEngine`]. The error mapping is CPU-only and runs everywhere; the two-process
//! write through the `TransferEngine` trait needs a GPU and NVRTC and skips, saying why, otherwise.
//! Its D is this test binary run again as `ipc_tests::d_role_child` (the IPC tests' D process).

use std::process::Command;
use std::time::Duration;

use pdflow_messages::layout::RegionDesc;

use super::ipc::{CudaIpcWriter, IpcError};
use super::ipc_engine::*;
use crate::cuda::ipc_peer::DPeerProcess;
use crate::cuda::{
    checksum_words, device_count, nvrtc_available, plan_checksum, CudaBatchCopy, CudaContext, DeviceBuffer,
    CHECKSUM_BASIS,
};
use crate::{TransferEngine, TransferError};
use pdflow_kv::memory::RegionError;
use pdflow_kv::planner::{build_plan, Descriptor};

const PEER: &str = "10.0.0.2:7000";

#[test]
fn ipc_failures_map_onto_the_transfer_errors_of_the_other_backends() {
    let region = RegionError::OutOfRegion { addr: 0x10, len: 0x20 };
    assert!(
        matches!(to_transfer_error(PEER, IpcError::SourceOutOfRegion { index: 3, source: region.clone() }), TransferError::LocalRegion(r) if r == region)
    );
    match to_transfer_error(PEER, IpcError::DestinationOutOfRegion { index: 4, source: region }) {
        TransferError::Refused { peer, reason } => {
            assert_eq!(peer, PEER);
            assert!(reason.contains("descriptor 4"), "{reason}");
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    let deadline = Duration::from_millis(7);
    assert!(
        matches!(to_transfer_error(PEER, IpcError::Timeout { deadline }), TransferError::Timeout { deadline: d, .. } if d == deadline)
    );
    match to_transfer_error(PEER, IpcError::SameProcess { pid: 9 }) {
        TransferError::Io { peer, source } => {
            assert!(peer == PEER && source.to_string().starts_with("cuda-ipc: "), "{source}")
        }
        other => panic!("expected Io, got {other:?}"),
    }
    match unregistered(PEER) {
        TransferError::SameHostUnavailable { peer, reason } => {
            assert!(peer == PEER && reason.contains("register_peer"), "{reason}")
        }
        other => panic!("expected SameHostUnavailable, got {other:?}"),
    }
}

fn gpus() -> Option<usize> {
    match device_count() {
        Err(e) => pdflow_testkit::skipped("cuda ipc engine test", &e),
        Ok(_) if !nvrtc_available() => {
            pdflow_testkit::skipped("cuda ipc engine test", &crate::cuda::CudaError::NoNvrtc)
        }
        Ok(n) => return Some(n),
    }
    None
}

#[test]
fn the_engine_writes_into_another_process_through_the_trait() {
    let Some(n) = gpus() else { return };
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args([super::ipc_tests::d_role_child_test().as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env("PDFLOW_IPC_D_DEVICE", if n >= 2 { "1" } else { "0" });
    let (mut d, export) = DPeerProcess::spawn(cmd, Duration::from_secs(60)).expect("D starts and exports");

    let ctx = CudaContext::new(0).expect("GPU 0");
    let d_regions = export.regions.clone();
    let bytes: u64 = d_regions.iter().map(|r| r.len).sum();
    let p_mem = DeviceBuffer::new(&ctx, bytes as usize).expect("alloc");
    // P's regions: D's layout, laid out in P's allocation.
    let mut offset = 0;
    let p_regions: Vec<RegionDesc> = d_regions
        .iter()
        .map(|r| {
            offset += r.len;
            RegionDesc { base_addr: p_mem.ptr + offset - r.len, ..*r }
        })
        .collect();
    let engine =
        CudaIpcEngine::new(CudaIpcWriter::new(CudaBatchCopy::new(&ctx).expect("kernel compiles"), p_regions.clone()));
    engine.writer().copier().fill_pattern(&p_mem, 0xabcd).expect("fill");

    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
    let plan = build_plan(&p_regions, &[1, 2, 3, 10, 17], &d_regions, &[20, 21, 22, 5, 0], true).expect("plan");
    // Before registration the engine refuses, naming the missing step.
    assert!(matches!(rt.block_on(engine.write(PEER, &plan)), Err(TransferError::SameHostUnavailable { .. })));

    engine.register_peer(PEER, &export).expect("P opens D's handles");
    assert!(engine.has_peer(PEER));
    assert_eq!((engine.name(), engine.backend_for(PEER)), ("cuda-ipc", "cuda-ipc"));
    let stats = rt.block_on(engine.write(PEER, &plan)).expect("write");
    assert_eq!((stats.bytes, stats.descriptors), (plan.total_bytes(), plan.descriptors.len()));
    let expected = plan_checksum(&ctx, &plan, true).expect("source checksum");
    let (got, ok) = d.verify(&plan, expected).expect("D verifies");
    assert!(ok, "D's checksum {got:016x} != P's {expected:016x}");

    // A plan with one descriptor past D's last region is refused whole: nothing lands.
    d.zero().expect("zero");
    let mut bad = plan.clone();
    let last = d_regions[d_regions.len() - 1];
    bad.descriptors.push(Descriptor { src: p_mem.ptr, dst: last.base_addr + last.len - 8, len: 4096 });
    assert!(matches!(rt.block_on(engine.write(PEER, &bad)), Err(TransferError::Refused { .. })));
    let zeros = plan.descriptors.iter().fold(CHECKSUM_BASIS, |h, d| checksum_words(h, &vec![0u8; d.len as usize]));
    let (_, untouched) = d.verify(&plan, zeros).expect("D verifies");
    assert!(untouched, "a refused plan wrote bytes");

    assert!(engine.forget_peer(PEER));
    assert!(matches!(rt.block_on(engine.write(PEER, &plan)), Err(TransferError::SameHostUnavailable { .. })));
    drop(engine);
    d.quit().expect("D exits cleanly");
}
