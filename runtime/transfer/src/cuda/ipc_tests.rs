//! Tests of the IPC path. The address translation, region checks and the export's wire form are
//! CPU-only and run everywhere (CI included); the two-process round trip needs a GPU and NVRTC and
//! skips with the reason printed otherwise. Its D is this test binary run again with the
//! `d_role_child` test selected and `PDFLOW_IPC_D_DEVICE` set.

use std::io::Write as _;
use std::process::Command;
use std::time::Duration;

use pdflow_messages::layout::RegionDesc;

use super::ipc::*;
use super::ipc_peer::*;
use super::*;
use pdflow_kv::memory::RegionError;
use pdflow_kv::planner::{build_plan, Descriptor, TransferPlan};

const D_DEVICE_ENV: &str = "PDFLOW_IPC_D_DEVICE";

fn fake_export() -> ExportedKv {
    // Allocation A (D's 0x10_0000, 64 KiB) holds regions 0 and 1; allocation B (0x90_0000) region 2.
    let region = |base: u64| RegionDesc { base_addr: base, len: 0x4000, block_len: 0x1000 };
    ExportedKv {
        pid: 1,
        device: 1,
        allocations: vec![
            ExportedAllocation { handle: IpcMemHandle(vec![7; IPC_HANDLE_LEN]), base_addr: 0x10_0000, len: 0x1_0000 },
            ExportedAllocation { handle: IpcMemHandle(vec![9; IPC_HANDLE_LEN]), base_addr: 0x90_0000, len: 0x8000 },
        ],
        regions: vec![region(0x10_0000), region(0x10_4000), region(0x90_2000)],
    }
}

#[test]
fn destinations_translate_into_the_mapping_of_their_allocation() {
    let map = PeerAddressMap::new(&fake_export(), &[0x7000_0000, 0x5000_0000]).expect("valid export");
    assert_eq!(map.translate(0x10_0000, 0x1000), Ok(0x7000_0000));
    assert_eq!(map.translate(0x10_5000, 0x3000), Ok(0x7000_5000), "region 1, same allocation");
    assert_eq!(map.translate(0x90_3000, 0x1000), Ok(0x5000_3000), "region 2, allocation B");
}

#[test]
fn out_of_region_destinations_and_sources_are_refused_before_launch() {
    let map = PeerAddressMap::new(&fake_export(), &[0x7000_0000, 0x5000_0000]).expect("valid export");
    // Inside allocation A but across two regions, past the last region, below every region, overflow.
    for (addr, len) in [(0x10_3000, 0x2000), (0x90_6000, 0x1000), (0x90_0000, 0x1000), (u64::MAX - 8, 0x1000)] {
        assert_eq!(map.translate(addr, len), Err(RegionError::OutOfRegion { addr, len }), "{addr:#x}+{len:#x}");
    }
    let local = [RegionDesc { base_addr: 0x2000_0000, len: 0x8000, block_len: 0x1000 }];
    let good = Descriptor { src: 0x2000_0000, dst: 0x10_0000, len: 0x1000 };
    let plan = TransferPlan {
        descriptors: vec![good, Descriptor { dst: 0x90_6000, ..good }],
        fence: 0,
        write_by: None,
        grant: None,
    };
    match map.translate_plan(&local, &plan) {
        Err(IpcError::DestinationOutOfRegion { index: 1, .. }) => {}
        other => panic!("expected descriptor 1's destination refused, got {other:?}"),
    }
    let plan = TransferPlan {
        descriptors: vec![good, good, Descriptor { src: 0x2000_7800, ..good }],
        fence: 0,
        write_by: None,
        grant: None,
    };
    match map.translate_plan(&local, &plan) {
        Err(IpcError::SourceOutOfRegion { index: 2, .. }) => {}
        other => panic!("expected descriptor 2's source refused, got {other:?}"),
    }
    let ok = map
        .translate_plan(&local, &TransferPlan { descriptors: vec![good], fence: 0, write_by: None, grant: None })
        .expect("in regions");
    assert_eq!(ok.descriptors, vec![Descriptor { src: 0x2000_0000, dst: 0x7000_0000, len: 0x1000 }]);
}

#[test]
fn inconsistent_exports_are_refused() {
    let mut bad = fake_export();
    bad.allocations[1].handle = IpcMemHandle(vec![0; 63]);
    assert!(matches!(bad.validate(), Err(IpcError::BadHandle { index: 1, len: 63 })));
    let mut bad = fake_export();
    bad.regions[2].len = 0x8000; // runs past allocation B
    assert!(matches!(bad.validate(), Err(IpcError::RegionNotExported { region: 2, .. })));
    assert!(matches!(
        PeerAddressMap::new(&fake_export(), &[1]),
        Err(IpcError::MappingCountMismatch { handles: 2, mapped: 1 })
    ));
}

#[test]
fn the_export_and_the_peer_protocol_survive_json() {
    let export = fake_export();
    let json = serde_json::to_string(&PeerReply::Exported(export.clone())).expect("serialises");
    match serde_json::from_str(&json).expect("parses") {
        PeerReply::Exported(back) => assert_eq!(back, export),
        other => panic!("got {other:?}"),
    }
    let cmd = PeerCommand::Verify { dst: vec![Descriptor { src: 1, dst: 2, len: 3 }], expected: 42 };
    let back: PeerCommand = serde_json::from_str(&serde_json::to_string(&cmd).expect("serialises")).expect("parses");
    assert!(matches!(back, PeerCommand::Verify { expected: 42, ref dst } if dst.len() == 1));
}

#[test]
fn protocol_lines_are_found_behind_other_output() {
    assert_eq!(protocol_payload("PDFLOW_IPC \"Zeroed\""), Some("\"Zeroed\""));
    assert_eq!(protocol_payload("test x::d_role_child ... PDFLOW_IPC {\"a\":1}"), Some("{\"a\":1}"));
    assert_eq!(protocol_payload("running 1 test"), None);
}

/// The number of GPUs, or `None` after printing why the test skips.
fn gpus() -> Option<usize> {
    match device_count() {
        Err(e) => pdflow_testkit::skipped("cuda ipc test", &e),
        Ok(_) if !nvrtc_available() => pdflow_testkit::skipped("cuda ipc test", &CudaError::NoNvrtc),
        Ok(n) => return Some(n),
    }
    None
}

const LAYOUT: PeerLayout = PeerLayout { regions: 4, blocks: 32, block_len: 4096 };

/// D's role when this binary is started by `ipc_round_trip_in_two_processes`; a no-op otherwise.
#[test]
fn d_role_child() {
    let Ok(device) = std::env::var(D_DEVICE_ENV) else { return };
    let device: usize = device.parse().expect("device ordinal");
    let result = serve_d(device, LAYOUT, std::io::stdin().lock(), std::io::stdout().lock());
    std::io::stdout().flush().expect("flush");
    result.expect("D serves until Quit");
}

#[test]
fn an_export_cannot_be_opened_by_its_own_process() {
    let Some(_) = gpus() else { return };
    let ctx = CudaContext::new(0).expect("GPU 0");
    let mem = DeviceBuffer::new(&ctx, LAYOUT.bytes() as usize).expect("alloc");
    let export = ExportedKv::export(&ctx, &LAYOUT.regions_at(mem.ptr)).expect("export");
    assert_eq!(export.allocations.len(), 1, "one allocation behind the four regions");
    assert_eq!(export.allocations[0].base_addr, mem.ptr);
    assert!(matches!(ImportedKv::open(&ctx, &export), Err(IpcError::SameProcess { .. })));
}

/// The name the test harness knows `d_role_child` by (its module path without the crate's name),
/// for running this binary again as D.
pub(super) fn d_role_child_test() -> String {
    let module = module_path!().split_once("::").map_or(module_path!(), |(_, rest)| rest);
    format!("{module}::d_role_child")
}

#[test]
fn d_role_child_is_named_as_the_harness_names_it() {
    assert_eq!(d_role_child_test(), "cuda::ipc_tests::d_role_child");
}

#[test]
fn ipc_round_trip_in_two_processes() {
    let Some(n) = gpus() else { return };
    let d_device = if n >= 2 { 1 } else { 0 };
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args([d_role_child_test().as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(D_DEVICE_ENV, d_device.to_string());
    let (mut d, export) = DPeerProcess::spawn(cmd, Duration::from_secs(60)).expect("D starts and exports");
    assert_ne!(export.pid, std::process::id());

    let ctx = CudaContext::new(0).expect("GPU 0");
    let p_mem = DeviceBuffer::new(&ctx, LAYOUT.bytes() as usize).expect("alloc");
    let p_regions = LAYOUT.regions_at(p_mem.ptr);
    let writer = CudaIpcWriter::new(CudaBatchCopy::new(&ctx).expect("kernel compiles"), p_regions.clone());
    writer.copier().fill_pattern(&p_mem, 0xfeed).expect("fill");
    let peer = ImportedKv::open(&ctx, &export).expect("P opens D's handles");

    // Scattered ids on both sides, one run of two contiguous blocks.
    let plan = build_plan(&p_regions, &[3, 4, 5, 9, 20], &export.regions, &[30, 1, 2, 7, 8], true).expect("plan");
    let stats = writer.write(&peer, &plan).expect("write");
    assert_eq!((stats.bytes, stats.descriptors), (plan.total_bytes(), plan.descriptors.len()));
    let expected = plan_checksum(&ctx, &plan, true).expect("source checksum");
    let (got, ok) = d.verify(&plan, expected).expect("D verifies");
    assert!(ok, "D's checksum {got:016x} != P's {expected:016x}");

    // A plan with one out-of-region descriptor is refused whole: nothing lands, not even its good part.
    d.zero().expect("zero");
    let mut bad = plan.clone();
    bad.descriptors.push(Descriptor {
        src: p_mem.ptr,
        dst: export.regions[3].base_addr + export.regions[3].len - 8,
        len: 4096,
    });
    assert!(matches!(writer.write(&peer, &bad), Err(IpcError::DestinationOutOfRegion { .. })));
    let zeros = (0..plan.descriptors.len())
        .fold(CHECKSUM_BASIS, |h, i| checksum_words(h, &vec![0u8; plan.descriptors[i].len as usize]));
    let (_, untouched) = d.verify(&plan, zeros).expect("D verifies");
    assert!(untouched, "a refused plan wrote bytes");

    drop(peer);
    d.quit().expect("D exits cleanly");
}
