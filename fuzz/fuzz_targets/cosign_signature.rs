//! cosign signature checks (`lamina_oci::cosign`): a payload and a base64
//! signature from the input never panic the check, and never pass it: the
//! key below has no signature in any corpus, so only a forged ECDSA
//! signature could.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lamina_oci::cosign::{check_payload, verify, TrustedKey};
use lamina_oci::Digest;

/// A P-256 public key made for this target (its private key was thrown
/// away), PEM.
const KEY: &str = "-----BEGIN PUBLIC KEY-----
MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEHEWGoModimqwlv+4n4GKgPLIO1jT
UfKyoV8oxmQLzH8KE193jiCKV2XODtl00r3iEXFYplZJsGmEapQ6FkWaLA==
-----END PUBLIC KEY-----";

fuzz_target!(|data: &[u8]| {
    // The first up to 128 bytes (to the first newline) are the signature.
    let cut = data.iter().take(128).position(|&b| b == b'\n').unwrap_or(0);
    let (signature, payload) = data.split_at(cut);
    let signature = String::from_utf8_lossy(signature);
    let digest = Digest::of_bytes(b"index");
    let _ = check_payload(payload, &digest);
    let keys = [TrustedKey::from_pem("fuzz.pub", KEY).expect("the key parses")];
    assert!(verify(payload, &signature, &digest, &keys).is_err());
    let _ = TrustedKey::from_pem("input", &String::from_utf8_lossy(data));
});
