//! OCI 1.1 referrers: manifests that name another in their `subject` (a
//! lamina tar index names the image it indexes).
//!
//! A registry with the referrers API lists them itself
//! (`GET /v2/<name>/referrers/<digest>`, an image index). One without it
//! (Debian's docker-registry 2.8 answers 404) gets the spec's tag schema:
//! an image index under the tag `sha256-<hex of the subject digest>`,
//! which whoever pushes a referrer reads, extends and writes back. Two
//! pushers at once may lose one entry (the spec's known race; the lost
//! index is still in the registry, and pushing it again lists it).

use reqwest::header::ACCEPT;
use reqwest::{Method, StatusCode};

use super::{effective_repository, expect_status, pull_scope, read_limited, RegistryClient};
use crate::digest::Digest;
use crate::error::OciError;
use crate::reference::RegistryReference;
use crate::source::MAX_MANIFEST_SIZE;
use crate::types::{media_types, Descriptor, ImageIndex, Manifest};

/// How a referrer was made findable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listed {
    /// The registry's referrers API lists it.
    ByApi,
    /// Under the tag-schema fallback tag.
    ByTag,
}

/// The tag-schema fallback tag of `subject`: `sha256-<hex>`.
pub fn fallback_tag(subject: &Digest) -> String {
    format!("{}-{}", subject.algorithm(), subject.hex())
}

impl RegistryClient {
    /// The registry's referrers list of `subject` in `repo`, or `None` when
    /// it has no referrers API (404: use the fallback tag).
    pub fn referrers_api(
        &self,
        repo: &str,
        subject: &Digest,
    ) -> Result<Option<ImageIndex>, OciError> {
        let repo = effective_repository(&self.host, repo);
        // Read from the hosts that may resolve tags, as a tag is.
        let (list, _) = self.on_hosts(super::Op::Resolve, |ep, retries| {
            let url = ep.url(&format!("{repo}/referrers/{subject}"))?;
            let resp = ep.send(
                false,
                retries,
                Method::GET,
                &url,
                &pull_scope(&repo),
                &|r| Ok(r.header(ACCEPT, media_types::OCI_INDEX)),
            )?;
            if resp.status() == StatusCode::NOT_FOUND {
                return Ok(None);
            }
            let resp = expect_status(resp, "GET", &url, &[StatusCode::OK])?;
            let bytes = read_limited(resp, MAX_MANIFEST_SIZE, &url, ep.budget)?;
            serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| OciError::json(format!("referrers list {url}"), e))
        })?;
        Ok(list)
    }

    /// The referrers of `subject` in `repo` whose artifact type is
    /// `artifact_type`: from the referrers API, else the fallback tag's
    /// index (none when there is no such tag).
    pub fn find_referrers(
        &self,
        repo: &str,
        subject: &Digest,
        artifact_type: &str,
    ) -> Result<(Vec<Descriptor>, Listed), OciError> {
        let (list, how) = match self.referrers_api(repo, subject)? {
            Some(list) => (list, Listed::ByApi),
            None => (self.fallback_list(repo, subject)?, Listed::ByTag),
        };
        let found = list
            .manifests
            .into_iter()
            .filter(|d| d.artifact_type.as_deref() == Some(artifact_type))
            .collect();
        Ok((found, how))
    }

    /// Pushes `manifest` (which must name a `subject`) by its digest and
    /// makes it findable: by the registry's referrers API when it has one,
    /// else by adding it to the fallback tag's index.
    pub fn push_referrer(&self, repo: &str, manifest: &[u8]) -> Result<(Digest, Listed), OciError> {
        let parsed: Manifest = serde_json::from_slice(manifest)
            .map_err(|e| OciError::json("referrer manifest".to_string(), e))?;
        let subject = parsed
            .subject
            .as_ref()
            .ok_or_else(|| OciError::Unsupported("a referrer without a subject".into()))?;
        let digest = Digest::of_bytes(manifest);
        let by_digest = RegistryReference::Digest(digest.clone());
        self.put_manifest(repo, &by_digest, manifest, media_types::OCI_MANIFEST)?;
        if self.referrers_api(repo, &subject.digest)?.is_some() {
            return Ok((digest, Listed::ByApi));
        }
        let mut list = self.fallback_list(repo, &subject.digest)?;
        list.manifests.retain(|d| d.digest != digest);
        list.manifests.push(Descriptor {
            artifact_type: parsed.artifact_type.clone(),
            annotations: parsed.annotations.clone(),
            ..Descriptor::new(
                media_types::OCI_MANIFEST,
                digest.clone(),
                manifest.len() as u64,
            )
        });
        let bytes = serde_json::to_vec(&list)
            .map_err(|e| OciError::json("referrers list".to_string(), e))?;
        let tag = RegistryReference::Tag(fallback_tag(&subject.digest));
        self.put_manifest(repo, &tag, &bytes, media_types::OCI_INDEX)?;
        Ok((digest, Listed::ByTag))
    }

    /// The fallback tag's index, empty when the tag does not exist.
    fn fallback_list(&self, repo: &str, subject: &Digest) -> Result<ImageIndex, OciError> {
        let tag = RegistryReference::Tag(fallback_tag(subject));
        match self.get_manifest(repo, &tag) {
            Ok(fetched) => serde_json::from_slice(&fetched.bytes)
                .map_err(|e| OciError::json(format!("referrers tag {tag}"), e)),
            Err(OciError::NotFound { .. }) => Ok(ImageIndex::default()),
            Err(e) => Err(e),
        }
    }
}
