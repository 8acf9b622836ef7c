//! Placeholder: the PyO3 bridge (`pdflow.vllm.PdflowConnector`) arrives with the bridge issue.
