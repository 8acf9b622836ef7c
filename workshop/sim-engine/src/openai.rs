//! The JSON of vLLM's OpenAI-compatible API, as far as pdflow's clients use it: completion and
//! chat requests, responses, stream chunks and errors (seed steps 11, 16, 24, 42).

use pdflow_messages::kv_transfer_params::KvTransferParams;
use serde::{Deserialize, Serialize};

/// A prompt: text, or token ids.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// The fields both completion endpoints take besides their prompt and length.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    /// Ignored: the simulated model is greedy.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// `null` is `false`, as in vLLM.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Choices per request: only 1 is served (the simulated engine samples one sequence).
    #[serde(default)]
    pub n: Option<u32>,
    /// `null` is none, as in vLLM.
    #[serde(default)]
    pub stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub kv_transfer_params: Option<serde_json::Value>,
    /// Accepted and ignored (usage is always reported on the last chunk).
    #[serde(default)]
    pub stream_options: Option<serde_json::Value>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Prompt,
    #[serde(default)]
    pub max_tokens: Option<usize>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// One chat message; `content` is a string or a list of `{"type":"text","text":..}` parts.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    #[serde(default)]
    pub role: Option<String>,
    #[serde(default)]
    pub content: Option<serde_json::Value>,
}

impl ChatMessage {
    pub fn text(&self) -> String {
        match &self.content {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(parts)) => {
                parts.iter().filter_map(|p| p.get("text").and_then(|t| t.as_str())).collect::<Vec<_>>().join(" ")
            }
            _ => String::new(),
        }
    }
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// A completion choice (full response or stream chunk).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Option<serde_json::Value>,
    pub finish_reason: Option<String>,
    pub stop_reason: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

/// A completion response, or one stream chunk (then `usage` is absent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub usage: Option<Usage>,
    #[serde(default)]
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// The assistant's message (full response) or delta (stream chunk).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatContent {
    pub role: String,
    pub content: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub message: Option<ChatContent>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub delta: Option<ChatContent>,
    pub token_ids: Vec<u32>,
    pub logprobs: Option<serde_json::Value>,
    pub finish_reason: Option<String>,
    pub stop_reason: Option<serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub usage: Option<Usage>,
    #[serde(default)]
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// vLLM's error body: `{"error": {"message", "type", "code"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorInfo,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorInfo {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub code: u16,
}

/// Seconds since the epoch, for `created`.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
