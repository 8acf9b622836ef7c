//! pdflow-testkit — test support shared by the crates.
//!
//! Tests that cannot run on this machine (no GPU, no root, no network namespace, no browser) say
//! so instead of passing silently: [`skipped`] prints why, and with `PDFLOW_SKIP_LOG` naming a file
//! appends one line per skipped test there (`test thread \t what \t why`), which the test command
//! counts as skipped, not passed. Called once per skipped test, before it returns.

use std::fmt::Display;
use std::io::Write;

/// Reports the calling test as skipped: `what` did not run, because `why`.
pub fn skipped(what: &str, why: &dyn Display) {
    eprintln!("SKIPPED {what}: {why}");
    let Some(path) = std::env::var_os("PDFLOW_SKIP_LOG") else { return };
    // libtest names each test's thread after the test (but runs on `main` with one test thread).
    let test = std::thread::current().name().filter(|n| *n != "main").unwrap_or(what).to_owned();
    let line = format!("{test}\t{what}\t{why}").replace(['\n', '\r'], " ");
    let written =
        std::fs::OpenOptions::new().create(true).append(true).open(&path).and_then(|mut f| writeln!(f, "{line}"));
    if let Err(e) = written {
        eprintln!("could not record the skip in {}: {e}", path.to_string_lossy());
    }
}
