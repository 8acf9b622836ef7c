//! Length-prefixed frames on the Unix socket between an engine and a rank's process: a 4-byte
//! little-endian length, then a [`pdflow_messages::frame`].

use pdflow_messages::frame::{self, MAX_FRAME_LEN};
use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::RankProcessError;

/// `msg` as the bytes [`write_frame`] sends.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, RankProcessError> {
    let body = frame::encode(msg).map_err(|e| RankProcessError::Wire(e.to_string()))?;
    let mut out = Vec::with_capacity(body.len() + 4);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Writes one encoded message.
pub async fn write_frame(w: &mut (impl AsyncWrite + Unpin), bytes: &[u8]) -> Result<(), RankProcessError> {
    w.write_all(bytes).await.map_err(|e| RankProcessError::Wire(format!("writing: {e}")))?;
    w.flush().await.map_err(|e| RankProcessError::Wire(format!("writing: {e}")))
}

/// Reads one message; `None` when the peer closed the socket between messages.
pub async fn read_frame<T: DeserializeOwned>(
    r: &mut (impl AsyncRead + Unpin),
    what: &'static str,
) -> Result<Option<T>, RankProcessError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(RankProcessError::Wire(format!("reading {what}: {e}"))),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME_LEN {
        return Err(RankProcessError::Wire(format!("{what} of {len} bytes exceeds the {MAX_FRAME_LEN}-byte limit")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.map_err(|e| RankProcessError::Wire(format!("reading {what}: {e}")))?;
    frame::decode(&body, what).map(Some).map_err(|e| RankProcessError::Wire(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdflow_messages::rank_process::RankMessage;

    #[tokio::test]
    async fn frames_cross_a_socket_and_garbage_is_an_error() {
        let (mut a, mut b) = tokio::net::UnixStream::pair().expect("pair");
        write_frame(&mut a, &encode(&RankMessage::KvEvent).expect("encodes")).await.expect("written");
        let got: Option<RankMessage> = read_frame(&mut b, "RankMessage").await.expect("reads");
        assert_eq!(got, Some(RankMessage::KvEvent));
        write_frame(&mut a, &[3, 0, 0, 0, 1, 2, 3]).await.expect("written");
        assert!(read_frame::<RankMessage>(&mut b, "RankMessage").await.is_err(), "not a pdflow frame");
        drop(a);
        assert_eq!(read_frame::<RankMessage>(&mut b, "RankMessage").await.expect("clean end"), None);
    }
}
