//! The wire between an engine and the processes of its ranks (`pdflow serve --rank-processes`):
//! the engine's scheduler side calls each rank's worker role (vLLM's `KVConnectorBase_V1` worker
//! hooks, seed steps 14, 19, 27, 32, 35) over a Unix socket, one [`frame`](crate::frame) per
//! length-prefixed message. The engine opens with a [`RankHello`]; the rank answers
//! [`RankMessage::Ready`] once its worker actors run, then a [`RankMessage::Reply`] per
//! [`RankRequest`] (by id) and a [`RankMessage::KvEvent`] whenever a transfer settles.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::scheduler_connector::{ConnectorMetadata, ConnectorOutput, LayerSave};
use crate::RequestId;

/// What a rank process needs to start its worker: the engine's own `pdflow serve` arguments
/// (the rank builds the same configuration from them), which rank it is, where its KV cache lives
/// and where P's bootstrap is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankHello {
    /// `pdflow serve …` as the engine was started, without the program name.
    pub serve_argv: Vec<String>,
    /// The engine's id and data-parallel rank (a data-parallel group numbers its engines).
    pub engine_id: String,
    pub dp_rank: u32,
    /// The rank, in vLLM's order (`pp_rank * tp + tp_rank`).
    pub rank: u32,
    /// The shared-memory file holding this rank's KV cache, which the engine's forward writes.
    pub kv_path: String,
    /// P: where this rank registers (rank 0 launches or finds the bootstrap as its engine decided,
    /// the other ranks register where rank 0 did).
    pub bootstrap: RankBootstrap,
    /// P: the side-channel port to bind (0: any).
    pub side_channel_port: u16,
}

/// Where a P rank finds its bootstrap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RankBootstrap {
    /// Launch it on this port (0: any), and register there.
    Launch { port: u16 },
    /// Register with the bootstrap at this URL.
    External { url: String },
    /// Register nowhere (D, or an engine without a bootstrap).
    None,
}

/// A rank's worker runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankReady {
    pub pid: u32,
    /// P: the bootstrap it registered with.
    pub bootstrap_url: Option<String>,
    /// P: the bootstrap it launched (rank 0 only), `host:port`.
    pub launched_bootstrap: Option<String>,
    /// D: its data server, `host:port`.
    pub data_addr: Option<String>,
    /// P: its side channel's port.
    pub side_channel_port: u16,
}

/// One call of the engine on a rank's worker role.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RankCall {
    /// Step 14/19/27: the step's metadata.
    StartLoadKv(ConnectorMetadata),
    /// Steps 32/35: what finished since the last call.
    GetFinished,
    /// Layer-wise: `layer` (the rank's local index) of the forward is done for `reqs`. Not answered.
    SaveKvLayer { layer: u32, reqs: BTreeMap<RequestId, LayerSave> },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankRequest {
    pub id: u64,
    pub call: RankCall,
}

/// Why a rank's worker could not answer a call (the engine's `ConnectorError`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RankCallError {
    /// The rank's actor behind `hook` is gone or did not answer.
    Unavailable { hook: String, target: String, reason: String },
    /// The rank was asked for the half its `kv_role` does not run.
    RolesDisagree { role: String, asked: String, count: usize },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RankAnswer {
    Done,
    Finished(ConnectorOutput),
}

/// What a rank process sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RankMessage {
    Ready(RankReady),
    /// The rank could not start: why, for the engine's error.
    Failed(String),
    Reply {
        id: u64,
        answer: Result<RankAnswer, RankCallError>,
    },
    /// A transfer settled: the engine should poll `GetFinished`.
    KvEvent,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame;

    #[test]
    fn messages_round_trip_through_frames() {
        let hello = RankHello {
            serve_argv: vec!["serve".into(), "--tp".into(), "2".into()],
            engine_id: "p".into(),
            dp_rank: 0,
            rank: 1,
            kv_path: "/dev/shm/x".into(),
            bootstrap: RankBootstrap::External { url: "http://127.0.0.1:8998".into() },
            side_channel_port: 0,
        };
        let bytes = frame::encode(&hello).expect("encodes");
        assert_eq!(frame::decode::<RankHello>(&bytes, "RankHello").expect("decodes"), hello);
        let msg = RankMessage::Reply {
            id: 7,
            answer: Err(RankCallError::RolesDisagree {
                role: "kv_consumer".into(),
                asked: "send the KV of".into(),
                count: 2,
            }),
        };
        let bytes = frame::encode(&msg).expect("encodes");
        assert_eq!(frame::decode::<RankMessage>(&bytes, "RankMessage").expect("decodes"), msg);
    }
}
