//! `lamina index`: a tar index of an unmodified image, stored as an OCI
//! artifact that refers to the image (`subject`), so mounts of the image's
//! own reference find it. The image itself is not touched.
//!
//! The artifact: an OCI manifest of `artifactType` [`ARTIFACT_TYPE_TAR_INDEX`],
//! the empty config, and up to four layers: the span table
//! ([`MEDIA_TYPE_TAR_INDEX`], zstd), the EROFS metadata of 512-byte blocks
//! and its lookup table (as a lamina image has them), and the windows of
//! the gzip spans ([`MEDIA_TYPE_TAR_WINDOWS`], fetched by range; absent
//! when no span needs one). See docs/index.md.

use std::time::Instant;

use lamina_oci::{
    media_types, open_sink, open_source, Descriptor, Digest, ImageRef, Listed, Manifest,
    RegistryClient, SourceOptions,
};

use crate::artifact::*;
use crate::boot::parse_trace;
use crate::convert::{boot_pages_layer, compress_frames, BootReport};
use crate::static_boot::{static_unit_reads, ExecEnv};
use crate::tar_index::{
    boot_pages, build, trace_span_reads, BuiltTarIndex, SpanUnits, TarIndexError,
};

/// Manifest annotation: compressed bytes between random-access points.
pub const ANNOTATION_SPAN_SIZE: &str = "dev.lamina.span-size";
/// The format of a tar index artifact (`dev.lamina.format`).
pub const FORMAT_TAR_INDEX: &str = "tar-index-2";

/// The empty config of an artifact: `{}`.
const EMPTY_CONFIG: &[u8] = b"{}";

/// Settings of `lamina index`.
#[derive(Debug, Clone, Default)]
pub struct IndexOptions {
    /// Registry access, platform.
    pub source: SourceOptions,
    /// Compressed bytes between random-access points.
    pub span_size: u64,
    /// A trace recorded through a mount of this image's index (`lamina
    /// mount --record-trace`): its spans become the boot set and the pages
    /// it read the boot pages.
    pub prefetch_trace: Option<std::path::PathBuf>,
    /// Boot set without a recorded start: the programs whose start-up
    /// reads are known from the image (`crate::static_boot`). Not with
    /// `prefetch_trace`.
    pub boot_execs: Vec<String>,
    /// Without a destination: also bind the index to the image, in an
    /// image index pushed under the source's tag (see [`crate::artifact::bind`]),
    /// so that the image's digest covers it. Off (`--no-bind`), the index
    /// is a referrer only, and a mount uses it only when the node's policy
    /// pins or trusts it otherwise.
    pub bind: bool,
    /// Bytes of metadata per zstd frame (default [`METADATA_FRAME_SIZE`]),
    /// as `lamina convert` has it.
    pub metadata_frame_size: Option<usize>,
}

/// What `lamina index` made.
#[derive(Debug, Clone, serde::Serialize)]
pub struct IndexReport {
    /// The platform indexed, of a multi-platform image (`os/arch`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    /// Digest of the artifact manifest.
    pub manifest_digest: String,
    /// Digest of the image it indexes.
    pub subject: String,
    /// Where it went, and how a mount finds it.
    pub stored: String,
    /// The image index that binds it to the image: `REF@DIGEST`, what to
    /// pin or sign (absent with `--no-bind` or a destination).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bound_in: Option<String>,
    /// Compressed size of the image's layers.
    pub image_layer_bytes: u64,
    /// Size of the artifact's layers (what a mount fetches first).
    pub artifact_bytes: u64,
    /// Spans, and of them gzip checkpoints with a window.
    pub spans: u64,
    /// Of which carry a 32 KiB window.
    pub windows: u64,
    /// Bytes of the windows layer (fetched by range, only the windows of
    /// the spans a mount reads).
    pub window_bytes: u64,
    /// Boot pages, when indexed with a trace that has page ranges.
    pub boot_pages: Option<BootReport>,
    /// Spans in the boot set (fetched whole once a start is over).
    pub boot_set: u64,
    /// Regular files and other inodes.
    pub inodes: u64,
    /// Uncompressed tar bytes.
    pub tar_bytes: u64,
    /// Wall time.
    pub seconds: f64,
}

/// Why `lamina index` failed. Nothing is tagged at the destination then.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// Reading the image or writing the artifact.
    #[error(transparent)]
    Oci(#[from] lamina_oci::OciError),
    /// Building the index.
    #[error(transparent)]
    Build(#[from] TarIndexError),
    /// Compressing or local I/O.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The lookup table.
    #[error("lookup table: {0}")]
    Lookup(#[from] lamina_format::lookup::BuildError),
    /// A destination that cannot hold a referrer of the source.
    #[error("{0}")]
    Destination(String),
    /// The `--prefetch` trace, or the boot pages made from it.
    #[error("{0}")]
    Prefetch(String),
    /// The `--boot-exec` programs.
    #[error(transparent)]
    BootSet(#[from] crate::static_boot::StaticBootError),
}

/// Indexes `src` and stores the artifact: by default (no `dst`) as a
/// referrer of `src` in its own repository; else at `dst` (an OCI layout
/// or another registry tag, named with `--index` at mount). A
/// multi-platform image gets one index per platform, each a referrer of
/// that platform's manifest.
pub fn index(
    src: &ImageRef,
    dst: Option<&ImageRef>,
    opts: &IndexOptions,
    progress: &dyn Fn(usize),
) -> Result<Vec<IndexReport>, IndexError> {
    let platforms = lamina_oci::platforms(src, &opts.source)?;
    let mut made = Vec::with_capacity(platforms.len().max(1));
    if platforms.len() <= 1 {
        made.push(index_one(src, dst, opts, progress, None)?);
    } else if dst.is_some() {
        return Err(IndexError::Destination(format!(
            "{src} is a multi-platform image ({} platforms): its indexes go beside it, one \
             referrer per platform manifest; leave DST out",
            platforms.len()
        )));
    } else {
        for platform in platforms {
            let mut one = opts.clone();
            let name = format!("{}/{}", platform.0, platform.1);
            one.source.platform = platform;
            made.push(index_one(src, None, &one, progress, Some(name))?);
        }
    }
    if opts.bind && dst.is_none() {
        let bound_in = bind_to_image(src, opts, &made)?;
        for m in &mut made {
            m.report.bound_in = Some(bound_in.clone());
        }
    }
    Ok(made.into_iter().map(|m| m.report).collect())
}

/// One platform's index, and what binding it needs.
struct Made {
    report: IndexReport,
    /// The artifact manifest's descriptor.
    artifact: Descriptor,
    /// The platform manifest it indexes.
    subject: Digest,
    /// The image index's entries the platform manifest was chosen from, or
    /// (a tag that names a manifest) that manifest alone, with its platform.
    entries: Vec<Descriptor>,
}

/// Pushes the image index that binds every index in `made` to its platform
/// manifest under `src`'s tag (by digest when `src` names a digest); returns
/// `REF@DIGEST` of that image index.
fn bind_to_image(src: &ImageRef, opts: &IndexOptions, made: &[Made]) -> Result<String, IndexError> {
    let ImageRef::Registry(reg) = src else {
        return Err(IndexError::Destination(format!(
            "{src} is not in a registry: name where the index goes (oci:DIR[:TAG] or docker://…)"
        )));
    };
    let Some(first) = made.first() else {
        return Err(IndexError::Destination(format!("{src}: nothing indexed")));
    };
    let bound: Vec<_> = made
        .iter()
        .map(|m| (m.artifact.clone(), m.subject.clone()))
        .collect();
    let index = bind(&first.entries, &bound);
    let bytes = serde_json::to_vec(&index)
        .map_err(|e| IndexError::Destination(format!("image index: {e}")))?;
    let client = RegistryClient::new(&reg.host, &opts.source)?;
    let reference = match &reg.reference {
        lamina_oci::RegistryReference::Tag(_) => reg.reference.clone(),
        lamina_oci::RegistryReference::Digest(_) => {
            lamina_oci::RegistryReference::Digest(Digest::of_bytes(&bytes))
        }
    };
    let digest =
        client.put_manifest(&reg.repository, &reference, &bytes, media_types::OCI_INDEX)?;
    Ok(format!("{}/{}@{digest}", reg.host, reg.repository))
}

/// The boot pages `opts` asks for (a trace's, or the `--boot-exec`
/// programs'), as a layer; the boot set goes into `built`'s index.
fn boot_layer(
    source: &dyn lamina_oci::ImageSource,
    built: &mut BuiltTarIndex,
    opts: &IndexOptions,
) -> Result<Option<crate::convert::BootPagesLayer>, IndexError> {
    let (reads, from_image) = match &opts.prefetch_trace {
        Some(path) => {
            let text = std::fs::read_to_string(path)?;
            let trace =
                parse_trace(path, &text).map_err(|e| IndexError::Prefetch(e.to_string()))?;
            (trace_span_reads(&built.index, &trace), false)
        }
        None if !opts.boot_execs.is_empty() => {
            let env = ExecEnv::from_config(&source.image().config);
            let mut units = SpanUnits::new(source, built);
            let reads = static_unit_reads(&built.metadata, &mut units, &opts.boot_execs, &env)?;
            (reads, true)
        }
        None => return Ok(None),
    };
    let pages = boot_pages(source, &mut built.index, &reads)?;
    boot_pages_layer(&pages, from_image).map_err(|e| IndexError::Prefetch(e.to_string()))
}

/// Indexes the one manifest of `src` that `opts` selects.
fn index_one(
    src: &ImageRef,
    dst: Option<&ImageRef>,
    opts: &IndexOptions,
    progress: &dyn Fn(usize),
    platform: Option<String>,
) -> Result<Made, IndexError> {
    let started = Instant::now();
    let source = open_source(src, &opts.source)?;
    let image = source.image();
    let mut built = build(source.as_ref(), opts.span_size, progress)?;
    let boot = boot_layer(source.as_ref(), &mut built, opts)?;
    let subject = Descriptor::new(
        image.manifest_media_type(),
        image.manifest_digest.clone(),
        image.manifest_bytes.len() as u64,
    );
    let sizes = (opts.span_size, opts.metadata_frame_size);
    let (layers, manifest_bytes) = artifact(&built, boot.as_ref(), subject, sizes)?;
    let (digest, stored) = store(src, dst, opts, &layers, &manifest_bytes)?;
    let artifact = Descriptor::new(
        media_types::OCI_MANIFEST,
        digest.clone(),
        manifest_bytes.len() as u64,
    );
    let entries = match image.index_entries.is_empty() {
        true => vec![manifest_entry(image, &opts.source.platform)],
        false => image.index_entries.clone(),
    };
    let windows = built
        .index
        .layers
        .iter()
        .flat_map(|l| &l.windows)
        .flatten()
        .count();
    let report = IndexReport {
        platform,
        manifest_digest: digest.to_string(),
        subject: image.manifest_digest.to_string(),
        stored,
        bound_in: None,
        image_layer_bytes: image.layers.iter().map(|l| l.descriptor.size).sum(),
        artifact_bytes: layers.iter().map(|(d, _)| d.size).sum(),
        spans: built
            .index
            .layers
            .iter()
            .map(|l| l.blob.chunks.len() as u64)
            .sum(),
        windows: windows as u64,
        window_bytes: built.windows.len() as u64,
        boot_pages: boot.map(|b| b.report),
        boot_set: built.index.prefetch.len() as u64,
        inodes: built.files,
        tar_bytes: built.tar_bytes,
        seconds: started.elapsed().as_secs_f64(),
    };
    Ok(Made {
        report,
        artifact,
        subject: image.manifest_digest.clone(),
        entries,
    })
}

/// An image index entry for `image`'s manifest, with the platform its
/// config gives (`selected`, the one it was opened for, where it is silent).
fn manifest_entry(image: &lamina_oci::SourceImage, selected: &(String, String)) -> Descriptor {
    let field = |key: &str| image.config.get(key).and_then(|v| v.as_str());
    let mut entry = Descriptor::new(
        image.manifest_media_type(),
        image.manifest_digest.clone(),
        image.manifest_bytes.len() as u64,
    );
    entry.platform = Some(lamina_oci::Platform {
        architecture: field("architecture").unwrap_or(&selected.1).to_string(),
        os: field("os").unwrap_or(&selected.0).to_string(),
        os_version: field("os.version").map(str::to_string),
        os_features: Vec::new(),
        variant: field("variant").map(str::to_string),
    });
    entry
}

/// An artifact's layers, compressed, each with its descriptor.
pub type ArtifactLayers = Vec<(Descriptor, Vec<u8>)>;

/// The artifact of `built` (with `boot` pages) for the image manifest
/// `subject`, with its span size and metadata frame size (`None`: the
/// default): its layers, compressed, with their descriptors, and its
/// manifest's bytes.
pub fn artifact(
    built: &BuiltTarIndex,
    boot: Option<&crate::convert::BootPagesLayer>,
    subject: Descriptor,
    (span_size, frame_size): (u64, Option<usize>),
) -> Result<(ArtifactLayers, Vec<u8>), IndexError> {
    let mut layers = artifact_layers(built, frame_size.unwrap_or(METADATA_FRAME_SIZE))?;
    if let Some(boot) = boot {
        layers.push((boot.descriptor.clone(), boot.compressed.clone()));
    }
    let manifest = artifact_manifest(&layers, subject, span_size);
    let manifest_bytes = serde_json::to_vec(&manifest)
        .map_err(|e| IndexError::Destination(format!("artifact manifest: {e}")))?;
    Ok((layers, manifest_bytes))
}

/// The artifact's layers, compressed, with their descriptors.
fn artifact_layers(
    built: &BuiltTarIndex,
    frame_size: usize,
) -> Result<Vec<(Descriptor, Vec<u8>)>, IndexError> {
    let index_raw = built.index.to_bytes();
    let lookup_raw = lamina_format::lookup::build_from_image(&built.metadata)?;
    let mut metadata = compress_frames(&built.metadata, frame_size, 12)?;
    let parts = [
        (
            MEDIA_TYPE_TAR_INDEX,
            zstd::bulk::compress(&index_raw, 12)?,
            &index_raw,
        ),
        (
            MEDIA_TYPE_METADATA,
            std::mem::take(&mut metadata.bytes),
            &built.metadata,
        ),
        (
            MEDIA_TYPE_LOOKUP,
            zstd::bulk::compress(&lookup_raw, 3)?,
            &lookup_raw,
        ),
    ];
    let mut layers: Vec<_> = parts
        .into_iter()
        .map(|(media_type, compressed, raw)| {
            let mut desc = Descriptor {
                annotations: content_annotations(raw),
                ..Descriptor::of_bytes(media_type, &compressed)
            };
            if media_type == MEDIA_TYPE_METADATA {
                metadata.annotate(&mut desc.annotations);
            }
            (desc, compressed)
        })
        .collect();
    if !built.windows.is_empty() {
        let desc = Descriptor::of_bytes(MEDIA_TYPE_TAR_WINDOWS, &built.windows);
        layers.push((desc, built.windows.clone()));
    }
    Ok(layers)
}

fn artifact_manifest(
    layers: &[(Descriptor, Vec<u8>)],
    subject: Descriptor,
    span_size: u64,
) -> Manifest {
    Manifest {
        schema_version: 2,
        media_type: Some(media_types::OCI_MANIFEST.to_string()),
        config: Descriptor::of_bytes(media_types::OCI_EMPTY, EMPTY_CONFIG),
        layers: layers.iter().map(|(d, _)| d.clone()).collect(),
        annotations: [
            (ANNOTATION_FORMAT.to_string(), FORMAT_TAR_INDEX.to_string()),
            (ANNOTATION_SOURCE.to_string(), subject.digest.to_string()),
            (ANNOTATION_SPAN_SIZE.to_string(), span_size.to_string()),
        ]
        .into(),
        artifact_type: Some(ARTIFACT_TYPE_TAR_INDEX.to_string()),
        subject: Some(Box::new(subject)),
    }
}

/// Stores the artifact; returns its digest and where it went.
fn store(
    src: &ImageRef,
    dst: Option<&ImageRef>,
    opts: &IndexOptions,
    layers: &[(Descriptor, Vec<u8>)],
    manifest: &[u8],
) -> Result<(Digest, String), IndexError> {
    let config = Descriptor::of_bytes(media_types::OCI_EMPTY, EMPTY_CONFIG);
    if let Some(dst) = dst {
        let mut sink = open_sink(dst, &opts.source)?;
        sink.put_blob_bytes(&config, EMPTY_CONFIG)?;
        for (desc, bytes) in layers {
            sink.put_blob_bytes(desc, bytes)?;
        }
        let digest = sink.commit(manifest, media_types::OCI_MANIFEST)?;
        return Ok((digest, dst.to_string()));
    }
    let ImageRef::Registry(reg) = src else {
        return Err(IndexError::Destination(format!(
            "{src} is not in a registry: name where the index goes (oci:DIR[:TAG] or docker://…)"
        )));
    };
    let (digest, listed) = push_referrer(reg, &opts.source, layers, manifest)?;
    let how = match listed {
        Listed::ByApi => "listed by the registry's referrers API".to_string(),
        Listed::ByTag => {
            let subject: Manifest = serde_json::from_slice(manifest)
                .map_err(|e| IndexError::Destination(e.to_string()))?;
            let tag = subject.subject.map(|s| lamina_oci::fallback_tag(&s.digest));
            format!("listed under the referrers tag {}", tag.unwrap_or_default())
        }
    };
    Ok((
        digest,
        format!("docker://{}/{} ({how})", reg.host, reg.repository),
    ))
}

/// Pushes an artifact (its `layers` and `manifest`, which names its
/// subject) into `reg`'s repository as a referrer of that subject.
pub fn push_referrer(
    reg: &lamina_oci::RegistryRef,
    source: &SourceOptions,
    layers: &[(Descriptor, Vec<u8>)],
    manifest: &[u8],
) -> Result<(Digest, Listed), IndexError> {
    let config = Descriptor::of_bytes(media_types::OCI_EMPTY, EMPTY_CONFIG);
    let client = RegistryClient::new(&reg.host, source)?;
    let repo = &reg.repository;
    client.put_blob(
        repo,
        &config,
        lamina_oci::registry::BlobBody::Bytes(EMPTY_CONFIG),
    )?;
    for (desc, bytes) in layers {
        client.put_blob(repo, desc, lamina_oci::registry::BlobBody::Bytes(bytes))?;
    }
    Ok(client.push_referrer(repo, manifest)?)
}
