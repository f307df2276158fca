//! A tar index bound to its image: an entry of the image's own OCI image
//! index, beside the platform manifest it describes, so that the one digest
//! a user pins or signs (the image index's) covers the tar index too.
//! SOCI's index manifest v2 moved its zTOC the same way, for the same
//! reason: a referrer is chosen by whoever can push one, an entry of the
//! image index only by whoever publishes the image.
//!
//! The entry is marked as BuildKit marks its attestations: platform
//! `unknown/unknown` (docker, podman and containerd skip it when they pick a
//! platform) and `vnd.docker.reference.digest` naming the platform manifest
//! it belongs to; `vnd.docker.reference.type` says it is a lamina tar index.

use lamina_oci::{media_types, Descriptor, Digest, ImageIndex, Platform};

use super::ARTIFACT_TYPE_TAR_INDEX;

/// Annotation of an image index entry: the manifest it belongs to.
pub const ANNOTATION_REFERENCE_DIGEST: &str = "vnd.docker.reference.digest";
/// Annotation of an image index entry: what it is to that manifest.
pub const ANNOTATION_REFERENCE_TYPE: &str = "vnd.docker.reference.type";
/// [`ANNOTATION_REFERENCE_TYPE`] of a bound tar index.
pub const REFERENCE_TYPE_TAR_INDEX: &str = "dev.lamina.tar-index";

/// The image index entry that binds the tar index `artifact` (its manifest's
/// descriptor) to the platform manifest `subject`.
pub fn bound_entry(artifact: &Descriptor, subject: &Digest) -> Descriptor {
    let mut entry = Descriptor::new(
        media_types::OCI_MANIFEST,
        artifact.digest.clone(),
        artifact.size,
    );
    entry.artifact_type = Some(ARTIFACT_TYPE_TAR_INDEX.to_string());
    entry.platform = Some(Platform {
        architecture: "unknown".into(),
        os: "unknown".into(),
        os_version: None,
        os_features: Vec::new(),
        variant: None,
    });
    entry.annotations.extend([
        (ANNOTATION_REFERENCE_DIGEST.into(), subject.to_string()),
        (
            ANNOTATION_REFERENCE_TYPE.into(),
            REFERENCE_TYPE_TAR_INDEX.into(),
        ),
    ]);
    entry
}

/// Whether `entry` is a tar index bound to `manifest`.
fn binds(entry: &Descriptor, manifest: &Digest) -> bool {
    let says = |key: &str| entry.annotations.get(key).map(String::as_str);
    says(ANNOTATION_REFERENCE_TYPE) == Some(REFERENCE_TYPE_TAR_INDEX)
        && says(ANNOTATION_REFERENCE_DIGEST) == Some(manifest.as_str())
        && media_types::is_manifest(&entry.media_type)
}

/// The tar index an image index with `entries` binds to `manifest`: the
/// last one listed (binding again replaces it, so there is one).
pub fn bound_index<'a>(entries: &'a [Descriptor], manifest: &Digest) -> Option<&'a Descriptor> {
    entries.iter().rev().find(|e| binds(e, manifest))
}

/// The image index that lists `entries` (the image's platform manifests and
/// whatever else it had) with `bound` in place of the tar indexes bound
/// before to the same manifests.
pub fn bind(entries: &[Descriptor], bound: &[(Descriptor, Digest)]) -> ImageIndex {
    let mut manifests: Vec<Descriptor> = entries
        .iter()
        .filter(|e| !bound.iter().any(|(_, subject)| binds(e, subject)))
        .cloned()
        .collect();
    manifests.extend(
        bound
            .iter()
            .map(|(artifact, subject)| bound_entry(artifact, subject)),
    );
    ImageIndex {
        manifests,
        ..ImageIndex::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(name: &str) -> Descriptor {
        Descriptor::of_bytes(media_types::OCI_MANIFEST, name.as_bytes())
    }

    #[test]
    fn binding_again_replaces_the_index_of_that_manifest_only() {
        let (amd, arm) = (manifest("amd64"), manifest("arm64"));
        let (first, second, other) = (manifest("i1"), manifest("i2"), manifest("i3"));
        let once = bind(
            &[amd.clone(), arm.clone()],
            &[
                (first.clone(), amd.digest.clone()),
                (other.clone(), arm.digest.clone()),
            ],
        );
        let twice = bind(&once.manifests, &[(second.clone(), amd.digest.clone())]);
        assert_eq!(twice.manifests.len(), 4, "{:?}", twice.manifests);
        let found = bound_index(&twice.manifests, &amd.digest).map(|d| &d.digest);
        assert_eq!(found, Some(&second.digest));
        let found = bound_index(&twice.manifests, &arm.digest).map(|d| &d.digest);
        assert_eq!(found, Some(&other.digest));
        let entry = bound_index(&twice.manifests, &amd.digest).unwrap();
        let platform = entry.platform.as_ref().unwrap();
        assert_eq!(
            (platform.os.as_str(), platform.architecture.as_str()),
            ("unknown", "unknown")
        );
    }

    #[test]
    fn an_entry_must_name_the_manifest_and_say_it_is_a_tar_index() {
        let amd = manifest("amd64");
        let mut entry = bound_entry(&manifest("i1"), &amd.digest);
        assert!(bound_index(std::slice::from_ref(&entry), &manifest("x").digest).is_none());
        entry.annotations.insert(
            ANNOTATION_REFERENCE_TYPE.into(),
            "attestation-manifest".into(),
        );
        assert!(bound_index(&[entry], &amd.digest).is_none());
    }
}
