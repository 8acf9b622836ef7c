//! The command line as a user types it: flags parsed, bad values refused naming the flag.

use super::*;

#[test]
fn proxy_accepts_vllm_arguments() {
    let cli = Cli::try_parse_from([
        "pdflow",
        "proxy",
        "--port",
        "0",
        "--prefill",
        "http://127.0.0.1:8010",
        "8998",
        "--prefill",
        "http://127.0.0.1:8011",
        "--decode",
        "http://127.0.0.1:8020",
        "--decode",
        "http://127.0.0.1:8021",
    ])
    .expect("parses");
    let Command::Proxy(p) = cli.command else { panic!("not proxy") };
    let args = p.to_args().expect("valid");
    assert_eq!(args.prefill.len(), 2);
    assert_eq!(args.prefill[0].bootstrap_port, 8998);
    assert_eq!(args.prefill[1].bootstrap_port, DEFAULT_BOOTSTRAP_PORT);
    assert_eq!(args.decode.len(), 2);
}

#[test]
fn bad_flags_are_all_reported() {
    let cli = Cli::try_parse_from(["pdflow", "proxy", "--prefill", "127.0.0.1:8010", "99999", "--decode", "ftp://x"])
        .expect("parses");
    let Command::Proxy(p) = cli.command else { panic!("not proxy") };
    assert_eq!(p.to_args().expect_err("invalid").len(), 3);
    assert!(parse_shape("36,8,128,16").is_ok());
    assert!(parse_shape("36,8,x,16").is_err());
    assert!(parse_shape("36,8,128").is_err());
}

#[cfg(feature = "fault-injection")]
#[test]
fn chaos_load_flags_parse_and_need_load() {
    let cli = Cli::try_parse_from([
        "pdflow",
        "chaos",
        "--load",
        "--requests",
        "240",
        "--concurrency",
        "16",
        "--fault-rate",
        "0.05",
        "--seed",
        "9",
        "--policy",
        "fail",
    ])
    .expect("parses");
    let Command::Chaos(c) = cli.command else { panic!("not chaos") };
    let o = c.to_load_options().expect("valid");
    assert_eq!(
        (o.requests, o.concurrency, o.fault_rate, o.seed, o.policy),
        (240, 16, 0.05, 9, LoadFailurePolicy::Fail)
    );
    assert!(Cli::try_parse_from(["pdflow", "chaos", "--requests", "10"]).is_err(), "--requests needs --load");
    let cli =
        Cli::try_parse_from(["pdflow", "chaos", "--load", "--fault-rate", "2", "--concurrency", "0"]).expect("parses");
    let Command::Chaos(c) = cli.command else { panic!("not chaos") };
    assert_eq!(c.to_load_options().expect_err("invalid").len(), 2);
    let cli = Cli::try_parse_from(["pdflow", "chaos", "--quick"]).expect("the matrix is unchanged");
    let Command::Chaos(c) = cli.command else { panic!("not chaos") };
    assert!(!c.load && c.quick);
}

#[cfg(feature = "fault-injection")]
#[test]
fn chaos_soak_takes_durations_and_the_matrix_takes_starve() {
    let cli = Cli::try_parse_from([
        "pdflow",
        "chaos",
        "soak",
        "--duration",
        "30m",
        "--sample-every",
        "10s",
        "--starve",
        "2",
        "--json",
        "/tmp/s.json",
    ])
    .expect("parses");
    let Command::Chaos(c) = cli.command else { panic!("not chaos") };
    let Some(crate::cli::ChaosCmd::Soak(s)) = &c.sub else { panic!("not soak") };
    let o = s.to_options().expect("valid");
    assert_eq!((o.duration, o.sample_every, o.starve), (Duration::from_secs(1800), Duration::from_secs(10), 2));
    assert_eq!(o.warmup(), Duration::from_secs(300), "a sixth of the duration, at most 5 minutes");
    assert_eq!(s.json.as_deref(), Some(std::path::Path::new("/tmp/s.json")));
    for bad in [&["--duration", "1d"][..], &["--duration", "0s"], &["--duration", "30s", "--sample-every", "10s"]] {
        let cli = Cli::try_parse_from(["pdflow", "chaos", "soak"].iter().chain(bad)).expect("parses");
        let Command::Chaos(c) = cli.command else { panic!("not chaos") };
        let Some(crate::cli::ChaosCmd::Soak(s)) = &c.sub else { panic!("not soak") };
        assert!(s.to_options().is_err(), "{bad:?} must be refused");
    }
    let cli = Cli::try_parse_from(["pdflow", "chaos", "--no-netns", "--starve", "2"]).expect("parses");
    let Command::Chaos(c) = cli.command else { panic!("not chaos") };
    assert_eq!((c.starve, c.sub.is_none()), (2, true));
}

#[cfg(feature = "fault-injection")]
#[test]
fn chaos_network_cells_are_in_the_full_run_only_alone_or_left_out() {
    use pdflow_tools::chaos::NetworkCells;
    let network = |args: &[&str]| {
        let cli = Cli::try_parse_from(["pdflow", "chaos"].iter().chain(args)).expect("parses");
        let Command::Chaos(c) = cli.command else { panic!("not chaos") };
        c.to_options().network
    };
    assert_eq!(network(&[]), NetworkCells::WhereAvailable);
    assert_eq!(network(&["--netns"]), NetworkCells::Only);
    assert_eq!(network(&["--netns", "--only", "link:p-d"]), NetworkCells::Only);
    assert_eq!(network(&["--no-netns"]), NetworkCells::Off);
    assert_eq!(network(&["--quick"]), NetworkCells::Off);
    for bad in [&["--netns", "--quick"][..], &["--netns", "--no-netns"], &["--netns", "--load"]] {
        assert!(Cli::try_parse_from(["pdflow", "chaos"].iter().chain(bad)).is_err(), "{bad:?} must be refused");
    }
}

#[test]
fn serve_deadline_flags_map_onto_deadlines_and_bad_values_name_the_flag() {
    let env = VllmEnv::from_lookup(&|_| None).expect("defaults");
    let parse = |extra: &[&str]| {
        let mut argv = vec!["pdflow", "serve", "--role", "consumer", "--abort-request-timeout", "10"];
        argv.extend_from_slice(extra);
        let Command::Serve(s) = Cli::try_parse_from(argv).expect("parses").command else { panic!("not serve") };
        s.to_config(&env)
    };
    let cfg =
        parse(&["--pull-timeout", "2.5", "--bootstrap-timeout", "0.5", "--ready-timeout", "3", "--send-expiry", "4"])
            .expect("valid");
    assert_eq!(
        cfg.deadlines,
        Deadlines {
            ready_timeout: Duration::from_secs(3),
            send_expiry: Duration::from_secs(4),
            pull_timeout: Duration::from_millis(2500),
            bootstrap_timeout: Duration::from_millis(500),
        }
    );
    assert_eq!(
        parse(&[]).expect("valid").deadlines,
        Deadlines::from_abort_timeout(Duration::from_secs(10)),
        "unset flags keep the derived defaults"
    );
    let errors =
        parse(&["--pull-timeout", "0", "--send-expiry", "-1", "--ready-timeout", "NaN", "--bootstrap-timeout", "1e9"])
            .expect_err("invalid");
    assert_eq!(errors.len(), 4, "{errors:?}");
    for (e, flag) in errors.iter().zip(["--ready-timeout", "--send-expiry", "--pull-timeout", "--bootstrap-timeout"]) {
        assert!(e.starts_with(flag), "{e} names {flag}");
    }
}

#[test]
fn trace_flags_and_render_parse() {
    let cli = Cli::try_parse_from([
        "pdflow",
        "serve",
        "--role",
        "producer",
        "--otlp-endpoint",
        "http://127.0.0.1:4317",
        "--otlp-protocol",
        "grpc",
        "--trace-file",
        "t.json",
    ])
    .expect("parses");
    let Command::Serve(s) = cli.command else { panic!("not serve") };
    let settings = s.trace.settings();
    assert_eq!(settings.otlp_endpoint.as_deref(), Some("http://127.0.0.1:4317"));
    assert_eq!(settings.otlp_protocol.as_deref(), Some("grpc"));
    assert_eq!(settings.trace_file, Some(PathBuf::from("t.json")));
    let cli = Cli::try_parse_from(["pdflow", "trace", "render", "t.json", "--out", "timeline.html"]).expect("parses");
    let Command::Trace(TraceCmd::Render(r)) = cli.command else { panic!("not trace render") };
    assert_eq!((r.trace, r.out), (PathBuf::from("t.json"), PathBuf::from("timeline.html")));
    assert!(Cli::try_parse_from(["pdflow", "trace", "render", "t.json"]).is_err(), "--out is required");
}

/// Protected mode's opt-out is a flag of `serve`, `proxy` and `bootstrap`; without a secret or
/// `--insecure`, a `--host` no peer could reach (not loopback, not 0.0.0.0) is refused before
/// anything binds, saying what to do. (Assumes PDFLOW_INSECURE and the secret's variables unset,
/// as the test command runs.)
#[test]
fn insecure_is_a_flag_and_a_host_off_loopback_needs_it_or_a_secret() {
    let env = VllmEnv::from_lookup(&|_| None).expect("defaults");
    let serve = |extra: &[&str]| {
        let mut argv = vec!["pdflow", "serve", "--role", "consumer"];
        argv.extend_from_slice(extra);
        let Command::Serve(s) = Cli::try_parse_from(argv).expect("parses").command else { panic!("not serve") };
        s.to_config(&env)
    };
    let errors = serve(&["--host", "192.0.2.7"]).expect_err("unreachable in protected mode");
    assert!(errors.iter().any(|e| e.starts_with("--host 192.0.2.7") && e.contains("--insecure")), "{errors:?}");
    let cfg = serve(&["--host", "192.0.2.7", "--insecure"]).expect("opted out");
    assert!(cfg.tcp.insecure);
    assert_eq!(cfg.tcp.peers(), pdflow_auth::PeerFilter::AnyPeer);
    let cfg = serve(&["--host", "0.0.0.0"]).expect("loopback peers on every interface");
    assert_eq!(cfg.tcp.peers(), pdflow_auth::PeerFilter::LoopbackOnly);

    let proxy = |extra: &[&str]| {
        let mut argv =
            vec!["pdflow", "proxy", "--prefill", "http://127.0.0.1:8010", "--decode", "http://127.0.0.1:8020"];
        argv.extend_from_slice(extra);
        let Command::Proxy(p) = Cli::try_parse_from(argv).expect("parses").command else { panic!("not proxy") };
        p
    };
    assert!(proxy(&["--host", "192.0.2.7"]).to_args().is_err());
    let opted = proxy(&["--host", "192.0.2.7", "--insecure"]);
    assert!(opted.to_args().is_ok() && opted.insecure());
    let Command::Bootstrap(b) = Cli::try_parse_from(["pdflow", "bootstrap", "--insecure"]).expect("parses").command
    else {
        panic!("not bootstrap")
    };
    assert!(b.secret.insecure);
}

/// `pdflow proxy` with one P and one D, plus `extra`: its configuration, or what is wrong.
fn proxy_args(extra: &[&str]) -> Result<pdflow_actors::proxy::ProxyArgs, Vec<String>> {
    let mut argv = vec!["pdflow", "proxy", "--prefill", "http://127.0.0.1:8010", "--decode", "http://127.0.0.1:8020"];
    argv.extend_from_slice(extra);
    let Command::Proxy(p) = Cli::try_parse_from(argv).expect("parses").command else { panic!("not proxy") };
    p.to_args()
}

/// D alone: at the measured default share with a D pool that knows what it holds, never with
/// one that does not, `off` or a share given; a bad share or one without such a pool is refused.
#[test]
fn d_alone_defaults_to_the_measured_share_where_d_knows_what_it_holds() {
    let proxy = proxy_args;
    let share = |extra: &[&str]| proxy(extra).expect("valid").local_prefill.d_holds_permille;
    assert_eq!(share(&[]), None, "round robin D: D alone never");
    assert_eq!(share(&["--decode-policy", "cache_aware"]), Some(930));
    assert_eq!(share(&["--decode-policy", "cache_aware", "--local-prefill-when-d-holds", "off"]), None);
    assert_eq!(share(&["--decode-policy", "cache_aware", "--local-prefill-when-d-holds", "0.75"]), Some(750));
    for bad in [
        &["--local-prefill-when-d-holds", "0.5"][..],
        &["--decode-policy", "cache_aware", "--local-prefill-when-d-holds", "2"],
    ] {
        let errors = proxy(bad).expect_err("refused");
        assert!(errors.iter().any(|e| e.contains("--local-prefill-when-d-holds")), "{errors:?}");
    }
}

/// `--unhealthy-after` defaults to the poller's 3 and refuses 0; `pdflow admin` parses its calls.
#[test]
fn unhealthy_after_and_admin_calls_parse() {
    let proxy = proxy_args;
    assert_eq!(proxy(&[]).expect("valid").unhealthy_after, pdflow_actors::proxy::UNHEALTHY_AFTER);
    assert_eq!(proxy(&["--unhealthy-after", "1"]).expect("valid").unhealthy_after, 1);
    let errors = proxy(&["--unhealthy-after", "0"]).expect_err("refused");
    assert!(errors.iter().any(|e| e.starts_with("--unhealthy-after 0")), "{errors:?}");

    let admin = |argv: &[&str]| match Cli::try_parse_from(argv).map(|c| c.command) {
        Ok(Command::Admin(a)) => Some(a.action),
        _ => None,
    };
    assert!(matches!(admin(&["pdflow", "admin", "list"]), Some(AdminAction::List)));
    assert!(matches!(
        admin(&["pdflow", "admin", "add", "prefill", "http://h:1", "8998"]),
        Some(AdminAction::Add { pool: PoolArg::Prefill, bootstrap_port: Some(8998), .. })
    ));
    assert!(matches!(
        admin(&["pdflow", "admin", "remove", "http://h:1", "--force"]),
        Some(AdminAction::Remove { force: true, .. })
    ));
    assert!(admin(&["pdflow", "admin", "add", "router", "http://h:1"]).is_none());
}

/// `--discover` stands in for `--prefill` and `--decode` (without either, one is needed); `pdflow
/// serve --advertise-to` takes a bootstrap's http:// URL; `pdflow admin` parses undrain and an
/// added engine's KV-event endpoints.
#[test]
fn discovery_flags_parse_and_a_proxy_needs_engines_or_a_bootstrap() {
    let parse = |argv: &[&str]| match Cli::try_parse_from(argv).expect("parses").command {
        Command::Proxy(p) => p.to_args(),
        _ => panic!("not proxy"),
    };
    let args =
        parse(&["pdflow", "proxy", "--discover", "http://127.0.0.1:8998/", "--discover", "http://10.0.0.1:8998"])
            .expect("discovery alone is enough");
    assert_eq!(args.discover, ["http://127.0.0.1:8998", "http://10.0.0.1:8998"]);
    assert!(args.prefill.is_empty() && args.decode.is_empty());
    let errors = parse(&["pdflow", "proxy", "--decode", "http://127.0.0.1:8020"]).expect_err("no P, no bootstrap");
    assert!(errors.iter().any(|e| e.contains("--discover BOOTSTRAP_URL")), "{errors:?}");
    let errors = parse(&["pdflow", "proxy", "--discover", "10.0.0.1:8998"]).expect_err("not a URL");
    assert!(errors.iter().any(|e| e.starts_with("--discover 10.0.0.1:8998")), "{errors:?}");

    let env = VllmEnv::from_lookup(&|_| None).expect("defaults");
    let serve = |extra: &[&str]| {
        let mut argv = vec!["pdflow", "serve", "--role", "consumer"];
        argv.extend_from_slice(extra);
        let Command::Serve(s) = Cli::try_parse_from(argv).expect("parses").command else { panic!("not serve") };
        s.to_config(&env).map(|_| s.advertise_to.clone())
    };
    assert_eq!(serve(&["--advertise-to", "http://127.0.0.1:8998"]).expect("valid"), ["http://127.0.0.1:8998"]);
    let errors = serve(&["--advertise-to", "127.0.0.1:8998"]).expect_err("not a URL");
    assert!(errors[0].starts_with("--advertise-to 127.0.0.1:8998"), "{errors:?}");

    let admin = |argv: &[&str]| match Cli::try_parse_from(argv).map(|c| c.command) {
        Ok(Command::Admin(a)) => Some(a.action),
        _ => None,
    };
    assert!(matches!(admin(&["pdflow", "admin", "undrain", "http://h:1"]), Some(AdminAction::Undrain { .. })));
    let added =
        admin(&["pdflow", "admin", "add", "decode", "http://h:1", "--kv-events", "tcp://h:5557,replay=tcp://h:5558"]);
    assert!(matches!(added, Some(AdminAction::Add { ref kv_events, .. }) if kv_events.len() == 1), "{added:?}");
}
