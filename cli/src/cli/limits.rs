//! `--limit KEY=VALUE` (repeatable; also `PDFLOW_LIMITS`, comma-separated) on `pdflow serve`,
//! `proxy` and `bootstrap`: what a peer may make the process's sockets hold, over the defaults
//! ([`pdflow_auth::limits`] lists the keys; docs/security.md the defaults).

use clap::Args;
use pdflow_auth::LimitSettings;

#[derive(Debug, Args)]
pub struct LimitArgs {
    /// A limit on what a peer may make this process's sockets hold, over its default (repeat for
    /// several): http.header_timeout, http.body_timeout, http.idle_timeout (seconds),
    /// http.max_connections, http.max_connections_per_peer, side_channel.max_message_bytes,
    /// side_channel.max_message_frames, side_channel.max_unfinished_bytes,
    /// side_channel.unbudgeted_bytes_per_connection (bytes: 64KiB, 16MiB),
    /// side_channel.max_connections, side_channel.max_connections_per_peer,
    /// side_channel.handshake_timeout, side_channel.idle_timeout. E.g.
    /// `--limit http.header_timeout=5 --limit side_channel.max_unfinished_bytes=32MiB`.
    #[arg(long = "limit", value_name = "KEY=VALUE", env = "PDFLOW_LIMITS", value_delimiter = ',')]
    pub limits: Vec<String>,
}

impl LimitArgs {
    /// The settings, or every refused item (each naming its key and what it takes).
    pub fn settings(&self) -> Result<LimitSettings, Vec<String>> {
        LimitSettings::parse(self.limits.iter().map(String::as_str))
            .map_err(|errors| errors.iter().map(|e| format!("--limit: {e}")).collect())
    }

    /// Makes the settings the process's, before any socket binds; logs those set.
    pub fn install(&self) -> anyhow::Result<()> {
        let settings = self.settings().map_err(|e| anyhow::anyhow!("invalid limits:\n  {}", e.join("\n  ")))?;
        if !settings.is_empty() {
            tracing::info!(limits = ?self.limits, "limits set for this process's sockets");
        }
        anyhow::ensure!(
            pdflow_auth::limits::install(settings),
            "limits were already set for this process: {:?}",
            pdflow_auth::limits::process()
        );
        Ok(())
    }
}
