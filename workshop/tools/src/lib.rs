//! pdflow-tools — what `pdflow` runs besides serving, never linked into vLLM.
//!
//! # Layout
//! - [`timeline`] — the seed's 43-step timeline rebuilt from captured spans.
//! - [`demo`] — `pdflow demo`: the seed scenario end to end, verified.
//! - [`bench`] — `pdflow bench …`: transfer, end-to-end and proxy benchmarks.
//! - `chaos` — `pdflow chaos`: the fault matrix on the simulated engines (feature
//!   `fault-injection`).
//! - [`render`] — `pdflow trace render`: one request's timeline as self-contained HTML/SVG.
//! - [`netns`] — network namespaces for the chaos matrix's network cuts (root only).

pub mod bench;
#[cfg(feature = "fault-injection")]
pub mod chaos;
pub mod demo;
pub mod netns;
pub mod render;
pub mod timeline;
