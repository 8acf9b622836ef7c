//! The forward's timing model (off by default): how long a GPU would take over a step, so that a
//! simulated engine answers when a real one would, and several of them share a few CPU cores.
//!
//! A step that computes `p` prompt tokens (prefill, any chunk of it, and the prompt token D
//! recomputes after a load) and decodes for at least one request takes
//! `p × prefill_per_token + decode_per_step`; the engine sleeps (a tokio timer, no spinning)
//! until that long after the forward started, before the step's tokens are sampled. A forward
//! that took longer on the CPU is not slowed further. The model is independent of `--kv-shape`:
//! run a small shape to keep the CPU work under the modelled time. Defaults: Qwen3-8B in bf16
//! on one H200 (docs/simulated-engine.md says where the numbers come from).

use std::time::Duration;

/// Modelled step durations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardTiming {
    /// Per prompt token computed in a step.
    pub prefill_per_token: Duration,
    /// Per step that decodes (one token for each running request, whatever their number).
    pub decode_per_step: Duration,
}

impl ForwardTiming {
    /// Qwen3-8B, bf16, one H200 (docs/simulated-engine.md derives them from NVIDIA's H200
    /// figures and the model's size): 30 µs a prompt token (about 33,000 a second), 5 ms a
    /// decode step.
    pub const H200_QWEN3_8B: Self =
        Self { prefill_per_token: Duration::from_micros(30), decode_per_step: Duration::from_millis(5) };

    /// The modelled duration of a step computing `prompt_tokens` prompt tokens and decoding for
    /// `decodes` requests.
    pub fn step(&self, prompt_tokens: usize, decodes: usize) -> Duration {
        let prefill = self.prefill_per_token.saturating_mul(u32::try_from(prompt_tokens).unwrap_or(u32::MAX));
        let decode = if decodes > 0 { self.decode_per_step } else { Duration::ZERO };
        prefill.saturating_add(decode)
    }
}

impl Default for ForwardTiming {
    fn default() -> Self {
        Self::H200_QWEN3_8B
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_costs_its_prompt_tokens_and_one_decode() {
        let t =
            ForwardTiming { prefill_per_token: Duration::from_micros(10), decode_per_step: Duration::from_millis(5) };
        assert_eq!(t.step(1000, 0), Duration::from_millis(10));
        assert_eq!(t.step(0, 32), Duration::from_millis(5));
        assert_eq!(t.step(100, 3), Duration::from_millis(6));
        assert_eq!(t.step(0, 0), Duration::ZERO);
    }
}
