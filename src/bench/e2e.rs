//! `pdflow bench e2e` (to be written).

/// Options of `pdflow bench e2e`.
#[derive(Debug, Clone, clap::Args)]
pub struct Options {
    /// Write the rows as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// Runs the benchmark; prints the table; writes the JSON.
pub async fn run(opts: Options) -> anyhow::Result<()> {
    let _ = opts;
    anyhow::bail!("pdflow bench e2e is not implemented yet")
}
