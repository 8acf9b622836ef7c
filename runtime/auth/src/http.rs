//! Authenticated HTTP calls — the bootstrap's (steps 4, 7 and 20) and the proxy's admin API: the caller's `X-Pdflow-Auth` header carries
//! its nonce, its send time and its proof over the method, the path (with its query) and the
//! body; the bootstrap checks the proof, then freshness and replay. Its answer carries
//! `X-Pdflow-Auth-Reply`: the bootstrap's proof over the answer's body and the caller's nonce, so
//! a caller takes worker addresses only from a bootstrap that holds the secret, and only the
//! answer to its own call.
//!
//! Header form: `v1.<nonce, 32 hex>.<send time, ms>.<proof, 80 hex>`.

use crate::error::Refusal;
use crate::proof::{hex_decode, hex_encode, nonce, Context, Nonce, Proof};
use crate::replay::{now_ms, ReplayGuard};
use crate::secret::ClusterSecret;

/// The caller's header.
pub const AUTH_HEADER: &str = "x-pdflow-auth";
/// The bootstrap's answer header.
pub const REPLY_HEADER: &str = "x-pdflow-auth-reply";

/// Which call a proof is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// `POST /register` (step 4).
    Register,
    /// `GET /query` (steps 7 and 20).
    Query,
    /// A call to the proxy's admin API (`/admin/engines…`, any method).
    Admin,
}

impl Call {
    fn request(self) -> Context {
        match self {
            Call::Register => Context::Register,
            Call::Query => Context::Query,
            Call::Admin => Context::Admin,
        }
    }

    fn reply(self) -> Context {
        match self {
            Call::Register => Context::RegisterReply,
            Call::Query => Context::QueryReply,
            Call::Admin => Context::AdminReply,
        }
    }
}

/// The caller signs a call: the `X-Pdflow-Auth` value, and the nonce the answer must carry.
pub fn sign_call(secret: &ClusterSecret, call: Call, method: &str, path: &str, body: &[u8]) -> (String, Nonce) {
    let n = nonce();
    let sent = now_ms();
    let proof = secret.sign(call.request(), &[method.as_bytes(), path.as_bytes(), body, &n, &sent.to_le_bytes()]);
    (format!("v1.{}.{sent}.{}", hex_encode(&n), proof.to_hex()), n)
}

/// The bootstrap opens a call's header (`None`: the call carried none). Returns the nonce its
/// answer is bound to.
pub fn open_call(
    secret: &ClusterSecret,
    call: Call,
    method: &str,
    path: &str,
    body: &[u8],
    header: Option<&str>,
    guard: &ReplayGuard,
) -> Result<Nonce, Refusal> {
    let header = header.ok_or(Refusal::Missing)?;
    let mut fields = header.split('.');
    let (Some("v1"), Some(n), Some(sent), Some(proof), None) =
        (fields.next(), fields.next(), fields.next(), fields.next(), fields.next())
    else {
        return Err(Refusal::Malformed);
    };
    let n: Nonce = hex_decode(n)?.try_into().map_err(|_| Refusal::Malformed)?;
    let sent: u64 = sent.parse().map_err(|_| Refusal::Malformed)?;
    let proof = Proof::from_hex(proof)?;
    secret.verify(call.request(), &[method.as_bytes(), path.as_bytes(), body, &n, &sent.to_le_bytes()], &proof)?;
    guard.check(&n, sent, now_ms())?;
    Ok(n)
}

/// The bootstrap seals its answer `body` to the call that carried `call_nonce`.
pub fn seal_answer(secret: &ClusterSecret, call: Call, body: &[u8], call_nonce: &Nonce) -> String {
    secret.sign(call.reply(), &[body, call_nonce]).to_hex()
}

/// The caller opens the bootstrap's answer to its call (`None`: the answer carried no proof).
pub fn open_answer(
    secret: &ClusterSecret,
    call: Call,
    body: &[u8],
    header: Option<&str>,
    call_nonce: &Nonce,
) -> Result<(), Refusal> {
    let proof = Proof::from_hex(header.ok_or(Refusal::Missing)?)?;
    secret.verify(call.reply(), &[body, call_nonce], &proof)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn secret(text: &str) -> ClusterSecret {
        ClusterSecret::from_text(text).expect("a valid secret")
    }

    fn guard() -> ReplayGuard {
        ReplayGuard::new(Duration::from_secs(30))
    }

    const EMPTY_TABLE: &[u8] = b"{}";
    const BODY: &[u8] = br#"{"engine_id":"6c1f","dp_rank":0,"tp_rank":0,"pp_rank":0,"addr":"tcp://10.0.0.1:41235"}"#;

    #[test]
    fn a_signed_call_opens_once_and_its_answer_opens_for_it_alone() {
        let s = secret("a cluster secret of enough bytes");
        let g = guard();
        let (header, n) = sign_call(&s, Call::Register, "POST", "/register", BODY);
        assert!(!header.contains("cluster secret"), "the secret never travels");
        let opened = open_call(&s, Call::Register, "POST", "/register", BODY, Some(&header), &g).expect("opens");
        assert_eq!(opened, n);
        assert_eq!(
            open_call(&s, Call::Register, "POST", "/register", BODY, Some(&header), &g),
            Err(Refusal::Replayed),
            "the same header twice is a replay"
        );
        let answer = seal_answer(&s, Call::Register, b"{\"status\":\"ok\"}", &n);
        open_answer(&s, Call::Register, b"{\"status\":\"ok\"}", Some(&answer), &n).expect("its own answer");
        let (_, other) = sign_call(&s, Call::Register, "POST", "/register", BODY);
        assert_eq!(
            open_answer(&s, Call::Register, b"{\"status\":\"ok\"}", Some(&answer), &other),
            Err(Refusal::BadProof),
            "an answer to another call is refused"
        );
        assert_eq!(
            open_answer(&s, Call::Query, b"{\"status\":\"ok\"}", Some(&answer), &n),
            Err(Refusal::BadProof),
            "a register answer does not pass as a query answer"
        );
    }

    #[test]
    fn altered_calls_wrong_secrets_and_missing_headers_are_refused() {
        let s = secret("a cluster secret of enough bytes");
        let (header, _) = sign_call(&s, Call::Register, "POST", "/register", BODY);
        let altered = String::from_utf8_lossy(BODY).replace("41235", "6666");
        let cases: [(&str, &str, &[u8], Call); 4] = [
            ("POST", "/register", altered.as_bytes(), Call::Register),
            ("GET", "/register", BODY, Call::Register),
            ("POST", "/register?x=1", BODY, Call::Register),
            ("POST", "/register", BODY, Call::Query),
        ];
        for (method, path, body, call) in cases {
            assert_eq!(
                open_call(&s, call, method, path, body, Some(&header), &guard()),
                Err(Refusal::BadProof),
                "{method} {path} {call:?}"
            );
        }
        let stranger = secret("another secret, not the cluster's");
        assert_eq!(
            open_call(&stranger, Call::Register, "POST", "/register", BODY, Some(&header), &guard()),
            Err(Refusal::UnknownKey)
        );
        assert_eq!(open_call(&s, Call::Register, "POST", "/register", BODY, None, &guard()), Err(Refusal::Missing));
        assert_eq!(open_answer(&s, Call::Query, b"{}", None, &[0; 16]), Err(Refusal::Missing));
    }

    #[test]
    fn a_rotated_secret_accepts_calls_signed_with_the_previous_key() {
        let old = secret("the previous cluster secret key");
        let rotated = secret("the current cluster secret key\nthe previous cluster secret key");
        let (header, n) = sign_call(&old, Call::Query, "GET", "/query", b"");
        open_call(&rotated, Call::Query, "GET", "/query", b"", Some(&header), &guard()).expect("old key accepted");
        let answer = seal_answer(&rotated, Call::Query, b"{}", &n);
        assert_eq!(
            open_answer(&old, Call::Query, b"{}", Some(&answer), &n),
            Err(Refusal::UnknownKey),
            "the rotated side signs with its new key, which a peer not yet rotated does not hold"
        );
    }

    proptest::proptest! {
        #[test]
        fn any_header_text_is_refused_without_panicking(text in ".{0,200}") {
            let s = secret("a cluster secret of enough bytes");
            let call = open_call(&s, Call::Query, "GET", "/query", b"", Some(&text), &guard());
            let answer = open_answer(&s, Call::Query, EMPTY_TABLE, Some(&text), &[0; 16]);
            proptest::prop_assert!(call.is_err() && answer.is_err());
        }

        #[test]
        fn one_changed_character_of_a_real_header_is_refused(pos in 0usize..160, c in "[0-9a-z.]") {
            let s = secret("a cluster secret of enough bytes");
            let (header, _) = sign_call(&s, Call::Query, "GET", "/query", b"");
            let mut chars: Vec<char> = header.chars().collect();
            let pos = pos % chars.len();
            let c = c.chars().next().unwrap_or('x');
            proptest::prop_assume!(chars[pos] != c);
            chars[pos] = c;
            let forged: String = chars.into_iter().collect();
            proptest::prop_assert!(open_call(&s, Call::Query, "GET", "/query", b"", Some(&forged), &guard()).is_err());
        }
    }
}
