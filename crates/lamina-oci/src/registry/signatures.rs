//! Finding a manifest's cosign signatures in a registry and checking them
//! against the node's keys ([`crate::cosign`] says what a signature is).

use std::io::Read as _;

use super::RegistryClient;
use crate::cosign::{self, TrustedKey, MAX_PAYLOAD, SIGNATURE_ANNOTATION, SIMPLE_SIGNING};
use crate::digest::Digest;
use crate::error::OciError;
use crate::reference::RegistryReference;
use crate::types::Manifest;

/// Most signature manifests looked at per signed manifest, and payloads
/// per signature manifest: a repository may hold many, and each costs
/// requests.
const MAX_SIGNATURE_MANIFESTS: usize = 16;
const MAX_PAYLOADS: usize = 16;

impl RegistryClient {
    /// The key among `keys` that signed `digest` in `repo`, if one did:
    /// cosign signatures listed as referrers of `digest` (newest first)
    /// and under cosign's `sha256-<hex>.sig` tag. A signature that does not
    /// verify is skipped (and logged); a registry that cannot be asked is
    /// an error.
    pub fn cosign_signer(
        &self,
        repo: &str,
        digest: &Digest,
        keys: &[TrustedKey],
    ) -> Result<Option<TrustedKey>, OciError> {
        if keys.is_empty() {
            return Ok(None);
        }
        let (listed, _) = self.find_referrers(repo, digest, cosign::SIGNATURE_ARTIFACT_TYPE)?;
        let mut manifests: Vec<RegistryReference> = listed
            .iter()
            .rev()
            .map(|d| RegistryReference::Digest(d.digest.clone()))
            .collect();
        manifests.push(RegistryReference::Tag(cosign::signature_tag(digest)));
        for reference in manifests.iter().take(MAX_SIGNATURE_MANIFESTS) {
            let manifest = match self.get_manifest(repo, reference) {
                Ok(m) => m,
                Err(OciError::NotFound { .. }) => continue,
                Err(e) => return Err(e),
            };
            let Ok(parsed) = serde_json::from_slice::<Manifest>(&manifest.bytes) else {
                tracing::debug!(%reference, "not a signature manifest: skipped");
                continue;
            };
            if let Some(key) = self.signed_by(repo, &parsed, digest, keys) {
                return Ok(Some(key));
            }
        }
        Ok(None)
    }

    /// The key that made one of `signatures`' payload signatures of
    /// `digest`. A payload that cannot be read (missing, corrupt, longer
    /// than it said) is skipped like one that does not verify: anyone who
    /// may push a referrer could list such a signature, and it must not
    /// keep a good signature beside it from being found.
    fn signed_by(
        &self,
        repo: &str,
        signatures: &Manifest,
        digest: &Digest,
        keys: &[TrustedKey],
    ) -> Option<TrustedKey> {
        let payloads = signatures
            .layers
            .iter()
            .filter(|l| l.media_type == SIMPLE_SIGNING && l.size <= MAX_PAYLOAD)
            .take(MAX_PAYLOADS);
        for layer in payloads {
            let Some(signature) = layer.annotations.get(SIGNATURE_ANNOTATION) else {
                continue;
            };
            let payload = match self.signature_payload(repo, &layer.digest) {
                Ok(payload) => payload,
                Err(e) => {
                    tracing::debug!(payload = %layer.digest, "signature of {digest} unread: {e}");
                    continue;
                }
            };
            match cosign::verify(&payload, signature, digest, keys) {
                Ok(key) => return Some(key.clone()),
                Err(e) => {
                    tracing::debug!(payload = %layer.digest, "signature of {digest} not taken: {e}")
                }
            }
        }
        None
    }

    /// A payload blob, read whole (so checked against its digest) and at
    /// most [`MAX_PAYLOAD`] bytes long.
    fn signature_payload(&self, repo: &str, blob: &Digest) -> Result<Vec<u8>, OciError> {
        let mut payload = Vec::new();
        let mut reader = self.get_blob(repo, blob)?.take(MAX_PAYLOAD + 1);
        reader
            .read_to_end(&mut payload)
            .map_err(|e| OciError::io("reading a signature payload", blob.to_string(), e))?;
        if payload.len() as u64 > MAX_PAYLOAD {
            // Longer than it said: never read to its digest check.
            return Err(OciError::Unsupported(format!(
                "signature payload {blob} is over {MAX_PAYLOAD} bytes"
            )));
        }
        Ok(payload)
    }
}
