use thiserror::Error;

/// Represents an error when encoding/decoding raw byte buffers and frames
#[non_exhaustive]
#[derive(Error, Debug)]
pub enum CodecError {
    #[error("{0}")]
    Command(&'static str),
    #[error("{0}")]
    Greeting(&'static str),
    #[error("{0}")]
    Mechanism(&'static str),
    #[error("{0}")]
    Decode(&'static str),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Other(&'static str),
    /// pdflow patch: the peer hit one of the socket's limits (`SocketOptions::limits`).
    #[error("peer refused: {0}")]
    Limit(crate::LimitKind),
}

pub(crate) type CodecResult<T> = Result<T, CodecError>;
