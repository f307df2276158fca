//! Reading and writing container images for lamina.
//!
//! Sources: OCI image layouts (`oci:DIR[:TAG]`), `docker save` archives
//! (`docker-archive:FILE[:REF]`) and registries (`docker://HOST/REPO[:TAG]`).
//! Sinks: OCI image layouts (atomic) and registries.
//!
//! Every blob is verified: manifests and configs fully before they are
//! parsed, layers while they stream (compressed digest and size, then the
//! uncompressed diff_id), with mismatches surfacing as `io::Error`s of kind
//! `InvalidData` that carry an [`OciError`].

#![forbid(unsafe_code)]

pub mod archive;
pub mod compression;
pub mod cosign;
pub mod digest;
pub mod error;
pub mod hosts;
pub mod layout;
pub mod reference;
pub mod registry;
pub mod sink;
pub mod source;
pub mod types;

pub use compression::{Compression, LayerReader};
pub use digest::{sha256, Digest, DigestReader, DigestWriter, Sha256, VerifyingReader};
pub use error::OciError;
pub use hosts::{HostsConfig, HostsError};
pub use reference::{ImageRef, RegistryRef, RegistryReference};
pub use registry::{
    credentials_identity, fallback_tag, load_trust_store, FetchedManifest, Listed, RegistryClient,
};
pub use sink::{open_sink, ImageSink};
pub use source::{open_source, platforms, ImageSource, SourceImage, SourceLayer, SourceOptions};
pub use types::{media_types, Descriptor, ImageIndex, Manifest, Platform};

/// `WWW-Authenticate` challenge parsing, exposed only for the fuzz targets in
/// `fuzz/`: the scheme and the parameters (keys lower-cased), or `None`.
#[doc(hidden)]
pub fn fuzz_parse_challenge(
    header: &str,
) -> Option<(String, std::collections::HashMap<String, String>)> {
    registry::auth::parse_challenge(header).map(|c| (c.scheme, c.params))
}
