//! TLS for the data channel (seed step 29 across hosts), keyed by the cluster secret: no
//! certificate authority, no files to hand out.
//!
//! Every key of the secret yields an Ed25519 key pair (its seed is derived one-way from the key,
//! [`Context::TlsKey`]) and one self-signed certificate made from it deterministically (fixed
//! names, serial and dates; Ed25519 signs deterministically), so every holder of the secret makes
//! byte-for-byte the same certificate and nobody else can. Both ends present the certificate of
//! the current key and accept only a certificate of a key they hold: the handshake is mutual
//! authentication by the secret, and a relay in the middle holds neither private key. The
//! secret itself never crosses the wire; the certificates carry public keys only.
//!
//! TLS 1.3 only, rustls with the `ring` provider (AES-128-GCM first where the CPU has AES
//! instructions, ChaCha20-Poly1305 first otherwise); no session tickets, no resumption (a data
//! connection lives for many transfers, and an idle one must not see bytes nobody asked for).

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, ServerConfig, SignatureScheme};

use crate::proof::Context;
use crate::secret::{ClusterSecret, KeyId};

/// rustls' error type, for callers that look inside an I/O error for it.
pub use rustls::Error as RustlsError;

/// The name P asks for and every certificate carries (the verifier compares whole certificates;
/// the name only has to be the same everywhere).
pub const SERVER_NAME: &str = "pdflow.cluster";

/// The PKCS #8 (v1) header of an Ed25519 private key, before its 32-byte seed (RFC 8410).
const ED25519_PKCS8_PREFIX: [u8; 16] =
    [0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];

/// Why the TLS identity could not be made (a library refusing our own fixed inputs).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot make the data channel's TLS certificate from the cluster secret: {0}")]
    Certificate(#[from] rcgen::Error),
    #[error("cannot set up TLS for the data channel: {0}")]
    Config(#[from] rustls::Error),
}

/// Both ends' TLS configuration for one cluster secret. Cheap to clone.
#[derive(Clone)]
pub struct TlsIdentity {
    key_ids: Vec<KeyId>,
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsIdentity").field("key_ids", &self.key_ids).finish_non_exhaustive()
    }
}

/// Two identities are equal when they come from the same keys.
impl PartialEq for TlsIdentity {
    fn eq(&self, other: &Self) -> bool {
        self.key_ids == other.key_ids
    }
}

impl Eq for TlsIdentity {}

impl TlsIdentity {
    /// The identity of every holder of `secret`: presents the current key's certificate,
    /// accepts the certificate of any key held.
    pub fn from_secret(secret: &ClusterSecret) -> Result<Self, TlsError> {
        let mut certs = Vec::new();
        let mut signing = None;
        for (id, seed) in secret.derive_each(Context::TlsKey) {
            let (cert, key) = certificate(&seed)?;
            signing.get_or_insert((cert.clone(), key));
            certs.push((id, cert));
        }
        let Some((cert, key)) = signing else {
            return Err(TlsError::Config(rustls::Error::General("the cluster secret holds no key".into())));
        };
        let provider = Arc::new(provider());
        let accepted = Arc::new(SecretCertificates {
            certs: certs.iter().map(|(_, c)| c.clone()).collect(),
            algorithms: provider.signature_verification_algorithms,
        });

        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(accepted.clone())
            .with_single_cert(vec![cert.clone()], PrivateKeyDer::Pkcs8(key.clone_key()))?;
        server.send_tls13_tickets = 0;

        let mut client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(accepted)
            .with_client_auth_cert(vec![cert], PrivateKeyDer::Pkcs8(key))?;
        client.resumption = rustls::client::Resumption::disabled();

        Ok(Self {
            key_ids: certs.iter().map(|(id, _)| *id).collect(),
            client: Arc::new(client),
            server: Arc::new(server),
        })
    }

    /// P's side (the connecting end).
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.client.clone()
    }

    /// D's side (the data server).
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.server.clone()
    }

    /// The server name P connects under.
    pub fn server_name() -> ServerName<'static> {
        ServerName::try_from(SERVER_NAME).unwrap_or_else(|_| unreachable!("a valid DNS name"))
    }
}

/// ring's provider with the fastest suite for this CPU first: AES-128-GCM where the CPU has AES
/// and carry-less multiply instructions (the AES-256 default costs ~40% more rounds for no
/// security this link needs), ChaCha20-Poly1305 where it has not.
fn provider() -> rustls::crypto::CryptoProvider {
    use rustls::crypto::ring::cipher_suite::{
        TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256,
    };
    let aes_in_hardware = {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("aes") && std::arch::is_x86_feature_detected!("pclmulqdq")
        }
        #[cfg(target_arch = "aarch64")]
        {
            std::arch::is_aarch64_feature_detected!("aes") && std::arch::is_aarch64_feature_detected!("pmull")
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            false
        }
    };
    let cipher_suites = if aes_in_hardware {
        vec![TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256]
    } else {
        vec![TLS13_CHACHA20_POLY1305_SHA256, TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384]
    };
    rustls::crypto::CryptoProvider { cipher_suites, ..rustls::crypto::ring::default_provider() }
}

/// The certificate of the key pair grown from `seed`, and its private key.
fn certificate(seed: &[u8; 32]) -> Result<(CertificateDer<'static>, PrivatePkcs8KeyDer<'static>), TlsError> {
    let mut pkcs8 = ED25519_PKCS8_PREFIX.to_vec();
    pkcs8.extend_from_slice(seed);
    let der = PrivatePkcs8KeyDer::from(pkcs8);
    let key_pair = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&der, &rcgen::PKCS_ED25519)?;
    let mut params = rcgen::CertificateParams::new(vec![SERVER_NAME.to_string()])?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(rcgen::DnType::CommonName, "pdflow cluster member");
    params.serial_number = Some(rcgen::SerialNumber::from(vec![1u8]));
    params.not_before = rcgen::date_time_ymd(2024, 1, 1);
    params.not_after = rcgen::date_time_ymd(4000, 1, 1);
    let cert = params.self_signed(&key_pair)?;
    Ok((cert.der().clone(), der))
}

/// Accepts exactly the certificates of the secret's keys (on both ends).
#[derive(Debug)]
struct SecretCertificates {
    certs: Vec<CertificateDer<'static>>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl SecretCertificates {
    fn check(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
    ) -> Result<(), rustls::Error> {
        if intermediates.is_empty() && self.certs.iter().any(|c| c.as_ref() == end_entity.as_ref()) {
            Ok(())
        } else {
            // The peer's key is not one of the secret's: a different secret, or not a member.
            Err(rustls::Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure))
        }
    }
}

/// The handshake-signature checks both verifier traits ask for, the same on either end: by the
/// provider's algorithms, against the certificate already accepted by `check`.
macro_rules! handshake_signatures {
    () => {
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls12_signature(message, cert, dss, &self.algorithms)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls13_signature(message, cert, dss, &self.algorithms)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.algorithms.supported_schemes()
        }
    };
}

impl ServerCertVerifier for SecretCertificates {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity, intermediates).map(|()| ServerCertVerified::assertion())
    }

    handshake_signatures!();
}

impl ClientCertVerifier for SecretCertificates {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.check(end_entity, intermediates).map(|()| ClientCertVerified::assertion())
    }

    handshake_signatures!();
}

/// Whether a TLS server's handshake failed because the peer did not speak TLS at all (the first
/// bytes are no TLS record: a peer whose `tls` is off).
pub fn is_plaintext(e: &rustls::Error) -> bool {
    matches!(e, rustls::Error::InvalidMessage(_))
}

/// Whether a handshake failed because the peer's certificate is not the secret's (or it sent
/// none): an authentication refusal, not a network fault.
pub fn is_refusal(e: &rustls::Error) -> bool {
    matches!(
        e,
        rustls::Error::InvalidCertificate(_)
            | rustls::Error::NoCertificatesPresented
            | rustls::Error::AlertReceived(
                rustls::AlertDescription::BadCertificate
                    | rustls::AlertDescription::AccessDenied
                    | rustls::AlertDescription::CertificateRequired
                    | rustls::AlertDescription::DecryptError
                    | rustls::AlertDescription::HandshakeFailure
            )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(current: &str, previous: Option<&str>) -> ClusterSecret {
        ClusterSecret::new(current.as_bytes(), previous.map(str::as_bytes)).expect("long enough")
    }

    #[test]
    fn every_holder_of_a_key_makes_the_same_certificate_and_nobody_else_does() {
        let a = secret("correct horse battery staple", None).derive_each(Context::TlsKey);
        let b = secret("correct horse battery staple", None).derive_each(Context::TlsKey);
        let c = secret("another secret, not the same", None).derive_each(Context::TlsKey);
        let cert = |seed: &[u8; 32]| certificate(seed).expect("certificate").0;
        assert_eq!(cert(&a[0].1), cert(&b[0].1));
        assert_ne!(cert(&a[0].1), cert(&c[0].1));
        // The certificate carries nothing of the key itself.
        let der = cert(&a[0].1);
        let key = b"correct horse battery staple";
        assert!(!der.as_ref().windows(key.len()).any(|w| w == key));
    }

    #[test]
    fn a_rotating_side_accepts_both_keys_certificates() {
        let rotating = SecretCertificates {
            certs: secret("the new key of this cluster", Some("the old key of this cluster"))
                .derive_each(Context::TlsKey)
                .iter()
                .map(|(_, s)| certificate(s).expect("certificate").0)
                .collect(),
            algorithms: rustls::crypto::ring::default_provider().signature_verification_algorithms,
        };
        let old = secret("the old key of this cluster", None).derive_each(Context::TlsKey);
        let stranger = secret("a stranger's key, not ours", None).derive_each(Context::TlsKey);
        assert!(rotating.check(&certificate(&old[0].1).expect("certificate").0, &[]).is_ok());
        assert!(rotating.check(&certificate(&stranger[0].1).expect("certificate").0, &[]).is_err());
    }

    /// Each side's verdict of an in-memory handshake, and the suite they agreed on.
    type Verdicts = (Result<(), rustls::Error>, Result<(), rustls::Error>, Option<rustls::SupportedCipherSuite>);

    /// Runs a handshake between P (`client`) and D (`server`) in memory.
    fn handshake(p: &TlsIdentity, d: &TlsIdentity) -> Verdicts {
        let mut client = rustls::ClientConnection::new(p.client_config(), TlsIdentity::server_name()).expect("client");
        let mut server = rustls::ServerConnection::new(d.server_config()).expect("server");
        let (mut c_res, mut s_res) = (Ok(()), Ok(()));
        for _ in 0..10 {
            let mut buf = Vec::new();
            while client.wants_write() {
                client.write_tls(&mut buf).expect("in memory");
            }
            if !buf.is_empty() && s_res.is_ok() {
                server.read_tls(&mut &buf[..]).expect("in memory");
                s_res = server.process_new_packets().map(|_| ());
            }
            let mut buf = Vec::new();
            while server.wants_write() {
                server.write_tls(&mut buf).expect("in memory");
            }
            if !buf.is_empty() && c_res.is_ok() {
                client.read_tls(&mut &buf[..]).expect("in memory");
                c_res = client.process_new_packets().map(|_| ());
            }
            if !client.is_handshaking() && !server.is_handshaking() {
                break;
            }
        }
        if c_res.is_ok() && client.is_handshaking() {
            c_res = Err(rustls::Error::General("handshake did not finish".into()));
        }
        if s_res.is_ok() && server.is_handshaking() {
            s_res = Err(rustls::Error::General("handshake did not finish".into()));
        }
        let suite = client.negotiated_cipher_suite();
        (c_res, s_res, suite)
    }

    #[test]
    fn holders_of_the_secret_shake_hands_on_the_fastest_suite_and_a_stranger_is_refused_on_either_end() {
        let ours = TlsIdentity::from_secret(&secret("the cluster's shared secret", None)).expect("identity");
        let again = TlsIdentity::from_secret(&secret("the cluster's shared secret", None)).expect("identity");
        let theirs = TlsIdentity::from_secret(&secret("somebody else's secret!!", None)).expect("identity");
        let (p, d, suite) = handshake(&ours, &again);
        assert!(p.is_ok() && d.is_ok(), "same secret: {p:?} {d:?}");
        // The fastest suite for this CPU: the first of `provider()`'s.
        let first = provider().cipher_suites[0].suite();
        assert_eq!(suite.map(|s| s.suite()), Some(first), "negotiated {suite:?}");
        // A stranger as D: P refuses its certificate.
        let (p, _, _) = handshake(&ours, &theirs);
        assert!(p.as_ref().is_err_and(is_refusal), "P facing a stranger: {p:?}");
        // A stranger as P: D refuses (or P, seeing D's certificate first, gives up).
        let (p, d, _) = handshake(&theirs, &ours);
        assert!(p.is_err() || d.is_err(), "D facing a stranger: {p:?} {d:?}");
        assert!(d.as_ref().err().or(p.as_ref().err()).is_some_and(is_refusal), "{p:?} {d:?}");
    }
}
