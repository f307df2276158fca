use base64::Engine as _;
use p256::ecdsa::signature::Signer as _;
use p256::ecdsa::SigningKey;
use p256::pkcs8::{EncodePublicKey as _, LineEnding};

use super::*;

fn signing_key(seed: u8) -> SigningKey {
    SigningKey::from_bytes(&[seed; 32].into()).unwrap()
}

fn trusted(seed: u8) -> TrustedKey {
    let pem = signing_key(seed)
        .verifying_key()
        .to_public_key_pem(LineEnding::LF)
        .unwrap();
    TrustedKey::from_pem(&format!("key{seed}.pub"), &pem).unwrap()
}

fn payload(digest: &Digest) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "critical": {
            "identity": {"docker-reference": "127.0.0.1:5000/app"},
            "image": {"docker-manifest-digest": digest.to_string()},
            "type": "cosign container image signature",
        },
        "optional": null,
    }))
    .unwrap()
}

fn sign(seed: u8, bytes: &[u8]) -> String {
    let sig: DerSignature = signing_key(seed).sign(bytes);
    base64::engine::general_purpose::STANDARD.encode(sig.as_bytes())
}

#[test]
fn a_signature_by_a_trusted_key_of_the_digest_is_taken() {
    let d = Digest::of_bytes(b"index");
    let p = payload(&d);
    let keys = [trusted(2), trusted(1)];
    assert_eq!(
        verify(&p, &sign(1, &p), &d, &keys).unwrap().name,
        "key1.pub"
    );
}

#[test]
fn anything_else_is_refused() {
    let d = Digest::of_bytes(b"index");
    let other = Digest::of_bytes(b"other");
    let p = payload(&d);
    let keys = [trusted(1)];
    // Another key.
    assert_eq!(verify(&p, &sign(3, &p), &d, &keys), Err(CosignError::NoKey));
    // A payload changed after signing.
    let mut changed = p.clone();
    changed[10] ^= 1;
    assert_eq!(
        verify(&changed, &sign(1, &p), &d, &keys),
        Err(CosignError::NoKey)
    );
    // A true signature of another manifest.
    let q = payload(&other);
    assert!(matches!(
        verify(&q, &sign(1, &q), &d, &keys),
        Err(CosignError::Payload(_))
    ));
    // Signed bytes that are no cosign payload.
    let junk = b"{\"critical\":{}}".to_vec();
    assert!(matches!(
        verify(&junk, &sign(1, &junk), &d, &keys),
        Err(CosignError::Payload(_))
    ));
    // Not base64, too long, not DER.
    for bad in [
        "%%%".to_string(),
        "A".repeat(4096),
        base64::engine::general_purpose::STANDARD.encode([0u8; 8]),
    ] {
        assert_eq!(verify(&p, &bad, &d, &keys), Err(CosignError::Malformed));
    }
}

#[test]
fn keys_are_p256_public_keys_in_pem() {
    assert!(TrustedKey::from_pem("x", "not a key").is_err());
    let private = "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg\n-----END PRIVATE KEY-----\n";
    assert!(TrustedKey::from_pem("x", private).is_err());
    assert_eq!(
        signature_tag(&Digest::of_bytes(b"")),
        format!("sha256-{}.sig", Digest::of_bytes(b"").hex())
    );
}
