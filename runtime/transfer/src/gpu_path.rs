//! Which path P's engine for GPU KV takes to a D whose KV is on a GPU too (`pdflow serve
//! --gpu-path`). Built with or without the `cuda` feature, so that the option parses everywhere.

/// How P reaches D's GPU KV (seed step 29 with KV in GPU memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuPath {
    /// The most direct path there is: cuda-peer for a D in this process, cuda-ipc for a D on
    /// this host, cuda-staged (tcp through pinned host buffers) for a D on another host or one
    /// whose CUDA IPC handles cannot be opened here (e.g. containers without a shared IPC
    /// namespace).
    #[default]
    Auto,
    /// Always cuda-staged, even on one host (what a D on another host gets; to measure that path).
    Staged,
}

impl GpuPath {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Staged => "staged",
        }
    }
}
