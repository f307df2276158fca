//! Mapping errors to exit codes by walking the error chain.

use std::error::Error;
use std::io;

use lamina_oci::OciError;

/// Exit code for a failed command (see the crate docs for the table).
pub fn code_for(err: &anyhow::Error) -> u8 {
    for cause in err.chain() {
        if let Some(code) = classify(cause) {
            return code;
        }
        if let Some(io) = cause.downcast_ref::<io::Error>() {
            if let Some(code) = io.get_ref().and_then(|inner| classify(inner)) {
                return code;
            }
        }
    }
    1
}

fn classify(cause: &(dyn Error + 'static)) -> Option<u8> {
    if let Some(oci) = cause.downcast_ref::<OciError>() {
        return Some(match oci {
            OciError::InvalidReference { .. } => 2,
            OciError::DigestMismatch { .. }
            | OciError::SizeMismatch { .. }
            | OciError::DiffIdMismatch { .. }
            | OciError::Decompress { .. }
            | OciError::InvalidDigest { .. }
            | OciError::Json { .. }
            | OciError::Config { .. }
            | OciError::Archive { .. }
            | OciError::UnsupportedMediaType { .. }
            | OciError::TooLarge { .. } => 3,
            OciError::NotFound { .. }
            | OciError::BlobNotFound { .. }
            | OciError::NoMatchingPlatform { .. }
            | OciError::Ambiguous { .. } => 4,
            OciError::Http { .. }
            | OciError::HttpStatus { .. }
            | OciError::Auth { .. }
            | OciError::Registry { .. } => 5,
            _ => return None,
        });
    }
    if cause
        .downcast_ref::<lamina_tree::ApplyError>()
        .is_some_and(|e| {
            // A read error may be a digest check underneath: let the chain decide.
            !matches!(e, lamina_tree::ApplyError::Read { .. })
        })
    {
        return Some(3);
    }
    if cause
        .downcast_ref::<lamina_format::erofs::FormatError>()
        .is_some()
        || cause
            .downcast_ref::<lamina_image::artifact::ArtifactError>()
            .is_some_and(|e| !matches!(e, lamina_image::artifact::ArtifactError::Oci(_)))
    {
        return Some(3);
    }
    if let Some(e) = cause.downcast_ref::<lamina_mount::CacheError>() {
        if matches!(e, lamina_mount::CacheError::BadChunk { .. }) {
            return Some(3);
        }
    }
    if let Some(lamina_mount::MountError::Syscall { .. }) = cause.downcast_ref() {
        return Some(6);
    }
    None
}

/// Whether the failure was only stdout closing early (`lamina ... | head`).
pub fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|c| {
        c.downcast_ref::<io::Error>()
            .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
    })
}
