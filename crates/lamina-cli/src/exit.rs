//! Mapping errors to exit codes, and printing them.
//!
//! `#[error(transparent)]` wrappers hand on their inner error's *source*,
//! not the inner error itself, so walking `Error::source` alone would skip
//! exactly the errors that decide the code. [`inner`] unwraps them by type.

use std::error::Error;
use std::io;

use lamina_image::artifact::ArtifactError;
use lamina_image::build::BuildError;
use lamina_image::convert::ConvertError;
use lamina_mount::{CacheError, MountError};
use lamina_oci::OciError;
use lamina_tree::ApplyError;

/// Exit code for a failed command (see the crate docs for the table).
pub fn code_for(err: &anyhow::Error) -> u8 {
    for cause in err.chain() {
        if let Some(code) = classify_deep(cause) {
            return code;
        }
    }
    1
}

/// Classifies `cause` or, failing that, what it wraps.
fn classify_deep(cause: &(dyn Error + 'static)) -> Option<u8> {
    let mut current = Some(cause);
    let mut depth = 0;
    while let Some(c) = current {
        if let Some(code) = classify(c) {
            return Some(code);
        }
        depth += 1;
        if depth > 16 {
            return None;
        }
        current = inner(c);
    }
    None
}

/// The error a wrapper carries, for wrapper types and `io::Error`.
fn inner<'a>(cause: &'a (dyn Error + 'static)) -> Option<&'a (dyn Error + 'static)> {
    if let Some(e) = cause.downcast_ref::<ConvertError>() {
        return match e {
            ConvertError::Oci(e) => Some(e),
            ConvertError::Build(e) => Some(e),
            ConvertError::Io(e) => Some(e),
            ConvertError::Config(_) | ConvertError::Lookup(_) | ConvertError::BootSet(_) => None,
        };
    }
    if let Some(e) = cause.downcast_ref::<BuildError>() {
        return match e {
            BuildError::Layer(e) => Some(e),
            BuildError::Format(e) => Some(e),
            BuildError::Io(e) => Some(e),
            BuildError::Options(_) | BuildError::TooLarge(_) => None,
        };
    }
    if let Some(e) = cause.downcast_ref::<MountError>() {
        return match e {
            MountError::Oci(e) => Some(e),
            MountError::Artifact(e) => Some(e),
            MountError::Cache(e) => Some(e),
            _ => None,
        };
    }
    if let Some(ArtifactError::Oci(e)) = cause.downcast_ref::<ArtifactError>() {
        return Some(e);
    }
    if let Some(e) = cause.downcast_ref::<ApplyError>() {
        return match e {
            ApplyError::Read { source, .. } | ApplyError::Content { source, .. } => Some(source),
            ApplyError::Entry { .. } => None,
        };
    }
    if let Some(e) = cause.downcast_ref::<CacheError>() {
        return match e {
            CacheError::Read { source, .. } | CacheError::Io { source, .. } => Some(source),
            CacheError::BadChunk { .. } => None,
        };
    }
    if let Some(e) = cause.downcast_ref::<io::Error>() {
        return e.get_ref().map(|r| r as &(dyn Error + 'static));
    }
    cause.source()
}

fn classify(cause: &(dyn Error + 'static)) -> Option<u8> {
    if cause.downcast_ref::<crate::config::ConfigError>().is_some() {
        return Some(2);
    }
    if let Some(oci) = cause.downcast_ref::<OciError>() {
        return Some(match oci {
            OciError::InvalidReference { .. } | OciError::Hosts(_) => 2,
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
            OciError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound => 4,
            OciError::Http { .. }
            | OciError::HttpStatus { .. }
            | OciError::Auth { .. }
            | OciError::Tls { .. }
            | OciError::Registry { .. } => 5,
            _ => return None,
        });
    }
    if let Some(ApplyError::Entry { .. }) = cause.downcast_ref::<ApplyError>() {
        return Some(3);
    }
    if cause
        .downcast_ref::<lamina_format::erofs::FormatError>()
        .is_some()
    {
        return Some(3);
    }
    if let Some(e) = cause.downcast_ref::<ArtifactError>() {
        if !matches!(e, ArtifactError::Oci(_)) {
            return Some(3);
        }
    }
    if let Some(CacheError::BadChunk { .. }) = cause.downcast_ref::<CacheError>() {
        return Some(3);
    }
    match cause.downcast_ref::<MountError>() {
        Some(MountError::Syscall { .. }) => return Some(6),
        Some(MountError::UntrustedIndex(_)) => return Some(3),
        _ => {}
    }
    None
}

/// docker's code for a `run` that failed in lamina itself.
pub const RUN_FAILED: u8 = 125;

/// Exit code for a failed `lamina run`: 125, or 126/127 when runc could not
/// execute or find the command.
pub fn run_code_for(err: &anyhow::Error) -> u8 {
    err.chain()
        .find_map(|c| c.downcast_ref::<lamina_run::RunError>())
        .map_or(RUN_FAILED, lamina_run::RunError::exit_code)
}

/// Whether the command line is `lamina [GLOBAL FLAGS] run ...`, for usage
/// errors, which clap reports before any command exists.
pub fn is_run_invocation() -> bool {
    std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .is_some_and(|a| a == "run")
}

/// Whether the failure was only stdout closing early (`lamina ... | head`).
pub fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|c| {
        c.downcast_ref::<io::Error>()
            .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
    })
}

/// The error and its causes on one line, leaving out a cause whose text the
/// previous message already ends with (wrappers often repeat their source).
pub fn render(err: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in err.chain() {
        let msg = cause.to_string();
        if out.ends_with(&msg) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&msg);
    }
    out
}
