//! Cosign signatures (sigstore's `cosign sign --key`): the one place their
//! wire format is read. A signature of manifest `D` is an OCI manifest whose
//! layers are "simple signing" payloads, JSON that names `D`, each with the
//! base64 ECDSA signature of its bytes in an annotation. cosign stores that
//! manifest under the tag `sha256-<hex of D>.sig`, or as a referrer of `D`
//! (`--registry-referrers-mode=oci-1-1`); both are looked at.
//!
//! What is checked, in order: the signature verifies against one of the
//! node's keys over the payload's exact bytes (the blob, checked against
//! its digest as it is read); only then is the payload parsed, and it must
//! be a cosign container image signature naming `D`. Keys are ECDSA P-256
//! public keys in PEM, what `cosign generate-key-pair` writes. Nothing is
//! asked of a transparency log or a certificate authority: the check is
//! offline, against keys the node's operator chose.

use p256::ecdsa::signature::Verifier as _;
use p256::ecdsa::{DerSignature, VerifyingKey};
use p256::pkcs8::DecodePublicKey as _;
use serde::Deserialize;

use crate::digest::Digest;

/// The artifact type of a cosign signature stored as a referrer.
pub const SIGNATURE_ARTIFACT_TYPE: &str = "application/vnd.dev.cosign.artifact.sig.v1+json";
/// The media type of a signature's payload layer.
pub const SIMPLE_SIGNING: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
/// The layer annotation holding the base64 signature of the payload.
pub const SIGNATURE_ANNOTATION: &str = "dev.cosignproject.cosign/signature";
/// The payload's `critical.type`.
const PAYLOAD_TYPE: &str = "cosign container image signature";
/// Largest payload read (cosign's are a few hundred bytes).
pub const MAX_PAYLOAD: u64 = 64 << 10;
/// Largest base64 signature taken (a DER P-256 signature is at most 72
/// bytes, 96 in base64).
const MAX_SIGNATURE_B64: usize = 256;

/// The tag cosign stores `digest`'s signatures under by default.
pub fn signature_tag(digest: &Digest) -> String {
    format!("{}-{}.sig", digest.algorithm(), digest.hex())
}

/// A public key the node trusts to sign.
#[derive(Clone)]
pub struct TrustedKey {
    /// Where it came from (a file name), for the log.
    pub name: String,
    key: VerifyingKey,
}

impl std::fmt::Debug for TrustedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrustedKey")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl PartialEq for TrustedKey {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl TrustedKey {
    /// An ECDSA P-256 public key in PEM (`-----BEGIN PUBLIC KEY-----`).
    pub fn from_pem(name: &str, pem: &str) -> Result<TrustedKey, String> {
        let key = VerifyingKey::from_public_key_pem(pem.trim()).map_err(|e| {
            format!("{name}: not an ECDSA P-256 public key in PEM (cosign.pub): {e}")
        })?;
        Ok(TrustedKey {
            name: name.to_string(),
            key,
        })
    }
}

/// Why a signature was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CosignError {
    /// The annotation is not a base64 DER signature.
    #[error("the signature is not base64 of a DER ECDSA signature")]
    Malformed,
    /// No trusted key made it.
    #[error("no trusted key made this signature")]
    NoKey,
    /// Signed, but not a cosign image signature of this digest.
    #[error("a signed payload that {0}")]
    Payload(String),
}

#[derive(Deserialize)]
struct Payload {
    critical: Critical,
}

#[derive(Deserialize)]
struct Critical {
    #[serde(rename = "type")]
    kind: String,
    image: Image,
}

#[derive(Deserialize)]
struct Image {
    #[serde(rename = "docker-manifest-digest")]
    manifest_digest: String,
}

/// The key among `keys` whose signature `signature` (base64, as in the
/// annotation) is of `payload`, provided the payload is a cosign image
/// signature of `digest`.
pub fn verify<'k>(
    payload: &[u8],
    signature: &str,
    digest: &Digest,
    keys: &'k [TrustedKey],
) -> Result<&'k TrustedKey, CosignError> {
    let signature = decode_signature(signature)?;
    let key = keys
        .iter()
        .find(|k| k.key.verify(payload, &signature).is_ok())
        .ok_or(CosignError::NoKey)?;
    check_payload(payload, digest)?;
    Ok(key)
}

fn decode_signature(b64: &str) -> Result<DerSignature, CosignError> {
    use base64::Engine as _;
    let b64 = b64.trim();
    if b64.len() > MAX_SIGNATURE_B64 {
        return Err(CosignError::Malformed);
    }
    let der = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|_| CosignError::Malformed)?;
    DerSignature::from_bytes(&der).map_err(|_| CosignError::Malformed)
}

/// A signed payload must say what it signs: a cosign image signature of
/// `digest` (a signature of another manifest, or of something else, by
/// the same key vouches for nothing here).
pub fn check_payload(payload: &[u8], digest: &Digest) -> Result<(), CosignError> {
    let parsed: Payload = serde_json::from_slice(payload)
        .map_err(|e| CosignError::Payload(format!("is not a cosign payload: {e}")))?;
    if parsed.critical.kind != PAYLOAD_TYPE {
        return Err(CosignError::Payload(format!(
            "is of type {:?}",
            parsed.critical.kind
        )));
    }
    if parsed.critical.image.manifest_digest != digest.to_string() {
        return Err(CosignError::Payload(format!(
            "signs {}, not {digest}",
            parsed.critical.image.manifest_digest
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
