use std::time::Duration;

use super::*;

fn secret(text: &str) -> ClusterSecret {
    ClusterSecret::from_text(text).expect("valid secret")
}

#[test]
fn a_proof_passes_only_for_its_context_parts_and_key() {
    let s = secret("0123456789abcdef-current");
    let p = s.sign(Context::Pull, &[b"xfer-1", b"engine-d"]);
    assert_eq!(s.verify(Context::Pull, &[b"xfer-1", b"engine-d"], &p), Ok(()));
    assert_eq!(s.verify(Context::PullReply, &[b"xfer-1", b"engine-d"], &p), Err(Refusal::BadProof), "another use");
    assert_eq!(s.verify(Context::Pull, &[b"xfer-2", b"engine-d"], &p), Err(Refusal::BadProof), "another transfer");
    // Length prefixes: moving a byte between parts changes the proof.
    assert_eq!(s.verify(Context::Pull, &[b"xfer-1e", b"ngine-d"], &p), Err(Refusal::BadProof));
    let other = secret("another-secret-of-enough-length");
    assert_eq!(other.verify(Context::Pull, &[b"xfer-1", b"engine-d"], &p), Err(Refusal::UnknownKey));
    let mut forged = p;
    forged.mac[0] ^= 1;
    assert_eq!(s.verify(Context::Pull, &[b"xfer-1", b"engine-d"], &forged), Err(Refusal::BadProof));
    assert_eq!(Proof::from_hex(&p.to_hex()), Ok(p));
    assert_eq!(Proof::from_bytes(&p.to_bytes()[..39]), Err(Refusal::Malformed));
    assert_eq!(Proof::from_hex("zz"), Err(Refusal::Malformed));
}

#[test]
fn during_a_rotation_both_keys_verify_and_the_new_one_signs() {
    let old = secret("the-old-secret-0001");
    let rotating = secret("the-new-secret-0002\nthe-old-secret-0001");
    let new = secret("the-new-secret-0002");
    let from_old = old.sign(Context::Register, &[b"body"]);
    let from_rotating = rotating.sign(Context::Register, &[b"body"]);
    assert_eq!(rotating.verify(Context::Register, &[b"body"], &from_old), Ok(()), "old peers still pass");
    assert_eq!(new.verify(Context::Register, &[b"body"], &from_rotating), Ok(()), "the new key signs");
    assert_eq!(old.verify(Context::Register, &[b"body"], &from_rotating), Err(Refusal::UnknownKey));
}

#[test]
fn secrets_load_from_the_environment_or_a_file_and_bad_ones_say_what_to_change() {
    let none = |_: &str| None;
    assert!(ClusterSecret::from_lookup(&none).expect("no secret is fine").is_none());
    let value = |k: &str| (k == ENV_SECRET).then(|| "  0123456789abcdefXYZ \n".to_string());
    let s = ClusterSecret::from_lookup(&value).expect("valid").expect("set");
    assert_eq!(s.key_id(), secret("0123456789abcdefXYZ").key_id(), "trimmed");
    let dir = std::env::temp_dir().join(format!("pdflow-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("secret");
    std::fs::write(&file, "# rotated on 2026-12-02\nnew-key-0123456789\n\nold-key-0123456789\n").expect("write");
    let path = file.to_string_lossy().to_string();
    let from_file = |k: &str| (k == ENV_SECRET_FILE).then(|| path.clone());
    let s = ClusterSecret::from_lookup(&from_file).expect("valid").expect("set");
    assert_eq!(s.key_id(), secret("new-key-0123456789").key_id());
    let both = |_: &str| Some("0123456789abcdefXYZ".to_string());
    assert!(matches!(ClusterSecret::from_lookup(&both), Err(SecretError::Ambiguous(..))));
    let short = ClusterSecret::from_text("short").expect_err("too short");
    assert!(short.to_string().contains("at least 16"), "{short}");
    assert!(matches!(
        ClusterSecret::from_text("a-key-of-16-bytes!\nb-key-of-16-bytes!\nc-key-of-16-bytes!"),
        Err(SecretError::KeyCount { found: 3 })
    ));
    let missing = ClusterSecret::from_file("/nonexistent/secret").expect_err("no file");
    assert!(missing.to_string().contains("/nonexistent/secret"), "{missing}");
    assert!(!format!("{s:?}").contains("new-key"), "Debug never shows a key");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_replay_guard_takes_a_nonce_once_and_only_within_its_window() {
    let guard = ReplayGuard::new(Duration::from_secs(30));
    let (n1, n2) = (nonce(), nonce());
    assert_ne!(n1, n2, "nonces are random");
    let now = 1_000_000;
    assert_eq!(guard.check(&n1, now - 1_000, now), Ok(()));
    assert_eq!(guard.check(&n1, now - 1_000, now), Err(Refusal::Replayed));
    assert_eq!(guard.check(&n2, now - 31_000, now), Err(Refusal::Stale));
    assert_eq!(guard.check(&n2, now + 31_000, now), Err(Refusal::Stale), "from the future too");
    assert_eq!(guard.check(&n2, now, now), Ok(()));
}

#[test]
fn a_sealed_pull_opens_once_and_only_unaltered_and_its_answer_only_for_it() {
    let s = secret("the-cluster-secret-0001");
    let guard = ReplayGuard::new(Duration::from_secs(30));
    let (seal, n) = sealed::seal_request(&s, b"pull xfer-1");
    assert_eq!(sealed::open_request(&s, b"pull xfer-1", &seal, &guard), Ok(n));
    assert_eq!(sealed::open_request(&s, b"pull xfer-1", &seal, &guard), Err(Refusal::Replayed));
    let (seal, _) = sealed::seal_request(&s, b"pull xfer-1");
    assert_eq!(sealed::open_request(&s, b"pull xfer-2", &seal, &guard), Err(Refusal::BadProof), "altered");
    assert_eq!(sealed::open_request(&s, b"pull xfer-1", &seal[..10], &guard), Err(Refusal::Malformed));
    let stranger = secret("not-the-cluster-secret");
    let (forged, _) = sealed::seal_request(&stranger, b"pull xfer-1");
    assert_eq!(sealed::open_request(&s, b"pull xfer-1", &forged, &guard), Err(Refusal::UnknownKey));
    let reply = sealed::seal_reply(&s, b"ok", &n);
    assert_eq!(sealed::open_reply(&s, b"ok", &reply, &n), Ok(()));
    assert_eq!(sealed::open_reply(&s, b"ok", &reply, &nonce()), Err(Refusal::BadProof), "another pull's answer");
}

#[test]
fn a_seal_made_for_one_exchange_is_refused_by_the_other() {
    let s = secret("the-cluster-secret-0001");
    let guard = ReplayGuard::new(Duration::from_secs(30));
    let (pull_seal, _) = sealed::PULL.seal_request(&s, b"offer");
    assert_eq!(sealed::STAGED.open_request(&s, b"offer", &pull_seal, &guard), Err(Refusal::BadProof));
    let (staged_seal, n) = sealed::STAGED.seal_request(&s, b"offer");
    assert_eq!(sealed::PULL.open_request(&s, b"offer", &staged_seal, &guard), Err(Refusal::BadProof));
    assert_eq!(sealed::STAGED.open_request(&s, b"offer", &staged_seal, &guard), Ok(n));
    let accept = sealed::STAGED.seal_reply(&s, b"accepted", &n);
    assert_eq!(sealed::PULL.open_reply(&s, b"accepted", &accept, &n), Err(Refusal::BadProof));
    assert_eq!(sealed::STAGED.open_reply(&s, b"accepted", &accept, &n), Ok(()));
}
