//! pdflow-testkit — test support shared by the crates.
//!
//! Tests that cannot run on this machine (no GPU, no root, no network namespace, no browser) say
//! so instead of passing silently: [`skipped`] prints why, and with `PDFLOW_SKIP_LOG` naming a file
//! appends one line per skipped test there (`test thread \t what \t why`), which the test command
//! counts as skipped, not passed. Called once per skipped test, before it returns.
//! [`non_loopback_ip`] (and [`non_loopback_ip_or_skip`]) finds an address of this machine other than loopback, for tests of what a
//! socket serves to other hosts.

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

/// An address of this machine that is not loopback — the source address of its route to another
/// network, found by connecting a UDP socket (no packet is sent) — for tests of what a socket
/// serves to other hosts: such a test binds its server on the unspecified address and connects
/// from this one, no root needed. `Err` says why there is none (no route off the host); the test
/// then reports itself [`skipped`].
pub fn non_loopback_ip() -> Result<std::net::IpAddr, String> {
    let mut tried = Vec::new();
    for (bind, target) in [("0.0.0.0:0", "10.255.255.1:9"), ("[::]:0", "[2001:db8::1]:9")] {
        let found = std::net::UdpSocket::bind(bind)
            .and_then(|socket| socket.connect(target).and_then(|()| socket.local_addr()))
            .map(|local| local.ip());
        match found {
            Ok(ip) if !ip.is_loopback() && !ip.is_unspecified() => return Ok(ip),
            Ok(ip) => tried.push(format!("the route to {target} leaves from {ip}")),
            Err(e) => tried.push(format!("no route to {target} ({e})")),
        }
    }
    Err(format!("this machine has no non-loopback address: {}", tried.join("; ")))
}

/// [`non_loopback_ip`], or `None` once `test` is reported [`skipped`] for want of one.
pub fn non_loopback_ip_or_skip(test: &str) -> Option<std::net::IpAddr> {
    match non_loopback_ip() {
        Ok(ip) => Some(ip),
        Err(why) => {
            skipped(test, &why);
            None
        }
    }
}
