//! A D process for measuring and testing the IPC path: D allocates its KV regions on its
//! GPU, exports them ([`ExportedKv`]) and, on request, zeroes them or verifies the bytes P wrote
//! (a checksum over the destination blocks, compared with P's). It talks over its stdin/stdout,
//! one JSON message per line behind [`LINE_PREFIX`] (so other output, e.g. libtest's, is skipped).
//! [`DPeerProcess`] is P's end: it spawns the process and waits for each reply under a deadline.
//!
//! Stands in for D's side of seed steps 21 (D publishes its layout) and 31 (D checks the bytes
//! landed) when the engine's KV lives on a GPU; it is no part of the serving path.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use pdflow_messages::layout::RegionDesc;
use serde::{Deserialize, Serialize};

use super::ipc::{region_of, ExportedKv, IpcError};
use super::{plan_checksum, CudaContext, CudaError, DeviceBuffer};
use pdflow_kv::planner::{Descriptor, TransferPlan};

/// Marks protocol lines on the peer's stdout.
pub const LINE_PREFIX: &str = "PDFLOW_IPC ";

/// D's KV layout: `regions` regions of `blocks` blocks of `block_len` bytes, back to back in one
/// allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerLayout {
    pub regions: u64,
    pub blocks: u64,
    pub block_len: u64,
}

impl PeerLayout {
    pub fn bytes(&self) -> u64 {
        self.regions * self.blocks * self.block_len
    }

    /// The regions laid out from `base`.
    pub fn regions_at(&self, base: u64) -> Vec<RegionDesc> {
        (0..self.regions)
            .map(|i| RegionDesc {
                base_addr: base + i * self.blocks * self.block_len,
                len: self.blocks * self.block_len,
                block_len: self.block_len,
            })
            .collect()
    }
}

/// P → D.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum PeerCommand {
    /// Set every byte of D's regions to 0 (before a write that is verified).
    Zero,
    /// Checksum the destination side of `dst` (D's addresses) and compare with `expected`.
    Verify {
        dst: Vec<Descriptor>,
        expected: u64,
    },
    Quit,
}

/// D → P.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum PeerReply {
    Exported(ExportedKv),
    Zeroed,
    Verified { checksum: u64, ok: bool },
    Failed(String),
}

/// Why talking to the D process failed.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error(transparent)]
    Ipc(#[from] IpcError),
    #[error("cannot start or talk to the D process: {0}")]
    Io(#[from] std::io::Error),
    #[error("the D process sent an unreadable message: {0}")]
    Protocol(String),
    #[error("the D process did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the D process exited (or closed its stdout) before answering")]
    Gone,
    #[error("the D process failed: {0}")]
    Failed(String),
}

/// The message on `line`, if it carries one. The prefix may come mid-line: libtest prints a
/// test's name without a newline before the test's own output.
pub fn protocol_payload(line: &str) -> Option<&str> {
    line.split_once(LINE_PREFIX).map(|(_, json)| json)
}

fn send_line<T: Serialize>(out: &mut impl Write, msg: &T) -> Result<(), PeerError> {
    let json = serde_json::to_string(msg).map_err(|e| PeerError::Protocol(e.to_string()))?;
    writeln!(out, "{LINE_PREFIX}{json}")?;
    out.flush()?;
    Ok(())
}

/// Runs D: allocates `layout` on GPU `device`, exports it, then serves commands from `input` until
/// `Quit` or end of input. Replies go to `output`.
pub fn serve_d(
    device: usize,
    layout: PeerLayout,
    input: impl BufRead,
    mut output: impl Write,
) -> Result<(), PeerError> {
    let ctx = CudaContext::new(device).map_err(|e| IpcError::Cuda(CudaError::from(e)))?;
    let mem = DeviceBuffer::new(&ctx, layout.bytes() as usize).map_err(IpcError::from)?;
    mem.fill(0).map_err(IpcError::from)?;
    let regions = layout.regions_at(mem.ptr);
    send_line(&mut output, &PeerReply::Exported(ExportedKv::export(&ctx, &regions)?))?;
    for line in input.lines() {
        let line = line?;
        let Some(json) = protocol_payload(&line) else { continue };
        let cmd: PeerCommand = serde_json::from_str(json).map_err(|e| PeerError::Protocol(e.to_string()))?;
        let reply = match cmd {
            PeerCommand::Quit => return Ok(()),
            PeerCommand::Zero => match mem.fill(0) {
                Ok(()) => PeerReply::Zeroed,
                Err(e) => PeerReply::Failed(e.to_string()),
            },
            PeerCommand::Verify { dst, expected } => match verify(&ctx, &regions, dst, expected) {
                Ok((checksum, ok)) => PeerReply::Verified { checksum, ok },
                Err(e) => PeerReply::Failed(e.to_string()),
            },
        };
        send_line(&mut output, &reply)?;
    }
    Ok(())
}

/// The checksum of the destination blocks, after checking that they are D's.
fn verify(
    ctx: &Arc<CudaContext>,
    regions: &[RegionDesc],
    dst: Vec<Descriptor>,
    expected: u64,
) -> Result<(u64, bool), IpcError> {
    for (index, d) in dst.iter().enumerate() {
        region_of(regions, d.dst, d.len).map_err(|source| IpcError::DestinationOutOfRegion { index, source })?;
    }
    let checksum =
        plan_checksum(ctx, &TransferPlan { descriptors: dst, fence: 0, write_by: None, grant: None }, false)?;
    Ok((checksum, checksum == expected))
}

/// P's end of a D process.
pub struct DPeerProcess {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    pub deadline: Duration,
}

impl DPeerProcess {
    /// Spawns `cmd` (stdin and stdout piped; stderr inherited) and waits for its export.
    pub fn spawn(mut cmd: Command, deadline: Duration) -> Result<(Self, ExportedKv), PeerError> {
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            return Err(PeerError::Gone);
        };
        let (tx, lines) = mpsc::channel();
        // Reads the child's stdout so that every wait on it can have a deadline.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(json) = protocol_payload(&line) {
                    if tx.send(json.to_string()).is_err() {
                        break;
                    }
                } else {
                    println!("[D] {line}");
                }
            }
        });
        let mut peer = Self { child, stdin, lines, deadline };
        match peer.recv()? {
            PeerReply::Exported(export) => Ok((peer, export)),
            other => Err(PeerError::Protocol(format!("expected the export first, got {other:?}"))),
        }
    }

    fn recv(&mut self) -> Result<PeerReply, PeerError> {
        let json = self.lines.recv_timeout(self.deadline).map_err(|e| match e {
            mpsc::RecvTimeoutError::Timeout => PeerError::Timeout(self.deadline),
            mpsc::RecvTimeoutError::Disconnected => PeerError::Gone,
        })?;
        match serde_json::from_str(&json).map_err(|e| PeerError::Protocol(e.to_string()))? {
            PeerReply::Failed(reason) => Err(PeerError::Failed(reason)),
            reply => Ok(reply),
        }
    }

    fn ask(&mut self, cmd: &PeerCommand) -> Result<PeerReply, PeerError> {
        send_line(&mut self.stdin, cmd)?;
        self.recv()
    }

    /// Zeroes D's regions.
    pub fn zero(&mut self) -> Result<(), PeerError> {
        match self.ask(&PeerCommand::Zero)? {
            PeerReply::Zeroed => Ok(()),
            other => Err(PeerError::Protocol(format!("expected Zeroed, got {other:?}"))),
        }
    }

    /// D's checksum of the destination side of `plan` (D's addresses), and whether it is `expected`.
    pub fn verify(&mut self, plan: &TransferPlan, expected: u64) -> Result<(u64, bool), PeerError> {
        match self.ask(&PeerCommand::Verify { dst: plan.descriptors.clone(), expected })? {
            PeerReply::Verified { checksum, ok } => Ok((checksum, ok)),
            other => Err(PeerError::Protocol(format!("expected Verified, got {other:?}"))),
        }
    }

    /// Asks D to exit and waits for it (killed after the deadline).
    pub fn quit(mut self) -> Result<(), PeerError> {
        let _ = send_line(&mut self.stdin, &PeerCommand::Quit);
        let start = Instant::now();
        while start.elapsed() < self.deadline {
            if let Some(status) = self.child.try_wait()? {
                return if status.success() {
                    Ok(())
                } else {
                    Err(PeerError::Failed(format!("D exited with {status}")))
                };
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Err(PeerError::Timeout(self.deadline))
    }
}

impl Drop for DPeerProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
