//! The crate's error type.

use std::io;
use std::path::PathBuf;

use crate::digest::Digest;

/// Everything that can go wrong while reading or writing images.
///
/// Messages name the object that failed (blob digest, file path, URL) and
/// what was wrong with it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OciError {
    /// A string is not a valid `sha256:<64 lowercase hex>` digest.
    #[error("invalid digest {value:?}: {reason}")]
    InvalidDigest {
        /// The rejected input.
        value: String,
        /// Why it was rejected.
        reason: &'static str,
    },

    /// An image reference (`oci:`, `docker-archive:`, `docker://`) could not be parsed.
    #[error("invalid image reference {input:?}: {reason}")]
    InvalidReference {
        /// The rejected input.
        input: String,
        /// Why it was rejected.
        reason: String,
    },

    /// Blob content does not hash to the expected digest.
    #[error("blob {expected}: digest mismatch, got {actual}")]
    DigestMismatch {
        /// The digest the blob was expected to have.
        expected: Digest,
        /// The digest of the bytes actually read.
        actual: Digest,
    },

    /// Blob content does not have the expected length.
    #[error("blob {digest}: size mismatch, expected {expected} bytes, got {actual}")]
    SizeMismatch {
        /// The blob's digest.
        digest: Digest,
        /// Size from the descriptor.
        expected: u64,
        /// Bytes actually seen (a lower bound when the blob is too long).
        actual: u64,
    },

    /// Uncompressed layer content does not hash to the config's diff_id.
    #[error("layer {blob}: uncompressed content has digest {actual}, config rootfs.diff_ids says {expected}")]
    DiffIdMismatch {
        /// Digest of the (compressed) layer blob.
        blob: Digest,
        /// The diff_id from the image config.
        expected: Digest,
        /// The digest of the decompressed bytes.
        actual: Digest,
    },

    /// The compressed layer stream is corrupt or truncated.
    #[error("layer {blob}: {compression} decompression failed: {source}")]
    Decompress {
        /// Digest of the layer blob.
        blob: Digest,
        /// Compression name (gzip, zstd).
        compression: &'static str,
        /// The decoder's error.
        source: io::Error,
    },

    /// A filesystem operation failed.
    #[error("{path}: {action}: {source}")]
    Io {
        /// What was being done ("read", "create directory", ...).
        action: &'static str,
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },

    /// A JSON document could not be parsed or produced.
    #[error("{what}: invalid JSON: {source}")]
    Json {
        /// Which document ("index.json of /x", "manifest sha256:..").
        what: String,
        /// The parser's error.
        source: serde_json::Error,
    },

    /// An OCI image layout directory is malformed or inconsistent.
    #[error("OCI layout {dir}: {message}")]
    Layout {
        /// The layout directory.
        dir: PathBuf,
        /// What is wrong with it.
        message: String,
    },

    /// A `docker save` archive is malformed or inconsistent.
    #[error("docker archive {path}: {message}")]
    Archive {
        /// The archive file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },

    /// A tag or image was not found; `available` lists what exists.
    #[error("{location}: {wanted} not found{}", available_suffix(available))]
    NotFound {
        /// Where we looked (directory, archive, registry repository).
        location: String,
        /// What was asked for.
        wanted: String,
        /// What exists instead.
        available: Vec<String>,
    },

    /// The image has several manifests and no tag was given to choose one.
    #[error("{location}: holds {} images, name one with a tag (available: {})", available.len(), list_or_none(available))]
    Ambiguous {
        /// The layout directory or archive.
        location: String,
        /// The candidate tags.
        available: Vec<String>,
    },

    /// An image index has no entry for the wanted platform.
    #[error(
        "image index {index}: no manifest for platform {wanted} (available: {})",
        list_or_none(available)
    )]
    NoMatchingPlatform {
        /// Digest of the index.
        index: Digest,
        /// `os/arch` that was wanted.
        wanted: String,
        /// Platforms the index offers.
        available: Vec<String>,
    },

    /// A media type this crate cannot handle.
    #[error("{what}: unsupported media type {media_type:?}")]
    UnsupportedMediaType {
        /// The object carrying the media type.
        what: String,
        /// The media type.
        media_type: String,
    },

    /// The image config is unusable (missing rootfs.diff_ids, count mismatch...).
    #[error("image config {config}: {message}")]
    Config {
        /// Digest of the config blob.
        config: Digest,
        /// What is wrong.
        message: String,
    },

    /// A layer index outside `0..count`.
    #[error("layer index {index} out of range: image has {count} layers")]
    LayerIndex {
        /// The requested index.
        index: usize,
        /// Number of layers.
        count: usize,
    },

    /// A blob requested from a source that does not know it.
    #[error("{location}: blob {digest} not found")]
    BlobNotFound {
        /// The source.
        location: String,
        /// The requested blob.
        digest: Digest,
    },

    /// A blob too large to hold in memory (manifests, configs).
    #[error("{what}: {size} bytes exceeds the in-memory limit of {limit} bytes")]
    TooLarge {
        /// The object.
        what: String,
        /// Its (claimed) size.
        size: u64,
        /// The limit.
        limit: u64,
    },

    /// An image sink refused a commit (missing blobs, bad manifest...).
    #[error("{location}: {message}")]
    Sink {
        /// The destination.
        location: String,
        /// What is wrong.
        message: String,
    },

    /// A verifying stream was read again after it had reported an error.
    #[error("{object}: read after the stream already failed")]
    StreamFailed {
        /// The blob or layer.
        object: String,
    },

    /// The operation is not supported for this kind of reference.
    #[error("{0}")]
    Unsupported(String),

    /// An HTTP request could not be completed (connection, TLS, timeout).
    #[error("{method} {url}: {source}")]
    Http {
        /// HTTP method.
        method: String,
        /// Request URL.
        url: String,
        /// The client error.
        source: reqwest::Error,
    },

    /// The server's TLS certificate was not trusted (unknown CA, wrong
    /// name, expired).
    #[error(
        "{url}: TLS certificate not trusted: {detail} (a registry with a private CA needs \
         its CA certificate: --ca-file PATH)"
    )]
    Tls {
        /// Request URL.
        url: String,
        /// The TLS library's complaint.
        detail: String,
    },

    /// A registry answered with an unexpected HTTP status.
    #[error("{method} {url}: HTTP {status}{}", body_suffix(body))]
    HttpStatus {
        /// HTTP method.
        method: String,
        /// Request URL.
        url: String,
        /// The status code.
        status: u16,
        /// The start of the response body (registry error JSON, usually).
        body: String,
    },

    /// Authentication with a registry failed.
    #[error("registry {host}: authentication failed: {message}")]
    Auth {
        /// Registry host.
        host: String,
        /// What went wrong.
        message: String,
    },

    /// The registry host configuration (`hosts.toml`) is unusable.
    #[error("registry host configuration: {0}")]
    Hosts(#[from] crate::hosts::HostsError),

    /// A registry answered with something that violates the protocol.
    #[error("registry {host}: {message}")]
    Registry {
        /// Registry host.
        host: String,
        /// What went wrong.
        message: String,
    },
}

impl OciError {
    /// The [`OciError`] carried inside an `io::Error` returned by a layer or
    /// blob stream, if there is one.
    pub fn from_io(err: &io::Error) -> Option<&OciError> {
        err.get_ref().and_then(|e| e.downcast_ref::<OciError>())
    }

    /// Wrap into an `io::Error` of kind `InvalidData`.
    pub fn into_io(self) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, self)
    }

    pub(crate) fn io(action: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        OciError::Io {
            action,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn json(what: impl Into<String>, source: serde_json::Error) -> Self {
        OciError::Json {
            what: what.into(),
            source,
        }
    }
}

fn list_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_string()
    } else {
        items.join(", ")
    }
}

fn body_suffix(body: &str) -> String {
    let trimmed = body.trim();
    if trimmed.is_empty() {
        String::new()
    } else {
        format!(": {trimmed}")
    }
}

/// ` (available: a, b)` when something is known to exist, else nothing.
fn available_suffix(available: &[String]) -> String {
    if available.is_empty() {
        String::new()
    } else {
        format!(" (available: {})", available.join(", "))
    }
}
