//! `lamina convert`: source image in, lamina image out, atomically.

use std::io::{self, Read};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use lamina_format::boot::BootPages;
use lamina_oci::{
    media_types, open_sink, open_source, Descriptor, Digest, ImageRef, ImageSink, ImageSource,
    Manifest, SourceImage, SourceOptions,
};

use crate::artifact::*;
use crate::boot::{
    boot_chunks, build_boot_pages, parse_trace, read_chunks, trace_reads, TraceEntry,
};
use crate::build::{BuildError, BuildOptions, BuildStats, BuiltImage, ImageBuilder};
use crate::static_boot::{static_reads, ExecEnv};

/// Conversion settings.
#[derive(Debug, Clone, Default)]
pub struct ConvertOptions {
    /// Chunking and compression.
    pub build: BuildOptions,
    /// Registry credentials, platform, temp dir.
    pub source: SourceOptions,
    /// Where blobs are staged while building (default: the system temp dir).
    pub work_dir: Option<PathBuf>,
    /// A trace from `lamina mount --record-trace`: its chunks become the boot set.
    pub prefetch_trace: Option<PathBuf>,
    /// Programs whose start-up pages become the boot set when there is no
    /// trace ([`crate::static_boot`]).
    pub boot_execs: Vec<String>,
    /// Bytes of metadata per zstd frame (default [`METADATA_FRAME_SIZE`]):
    /// the unit a lazy FUSE mount decompresses on demand. Tests make small
    /// images span several frames with it.
    pub metadata_frame_size: Option<usize>,
}

/// Progress reports for a terminal.
#[derive(Debug, Clone, Copy)]
pub enum Progress {
    /// Starting layer `index` of `total`, whose compressed size is `size`.
    Layer {
        /// 0-based.
        index: usize,
        /// Layer count.
        total: usize,
        /// Compressed size.
        size: u64,
    },
    /// Uncompressed tar bytes read so far in the current layer.
    Bytes(u64),
    /// Writing blobs and manifest to the destination.
    Writing,
}

/// Why a conversion failed. Nothing is left tagged at the destination.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// Opening or reading the source, or writing the destination.
    #[error(transparent)]
    Oci(#[from] lamina_oci::OciError),
    /// Building the image.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The source config is unusable.
    #[error("source image config: {0}")]
    Config(String),
    /// Local I/O.
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    /// Building the lookup table over the metadata image.
    #[error("lookup table: {0}")]
    Lookup(#[from] lamina_format::lookup::BuildError),
    /// A boot set from the image (`--boot-exec`) could not be made.
    #[error(transparent)]
    BootSet(#[from] crate::static_boot::StaticBootError),
}

/// What a conversion produced.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ConvertReport {
    /// Digest of the lamina manifest.
    pub manifest_digest: String,
    /// Digest of the source manifest.
    pub source_manifest_digest: String,
    /// EROFS metadata image size, uncompressed.
    pub metadata_bytes: u64,
    /// Its compressed size in the registry.
    pub metadata_compressed_bytes: u64,
    /// Chunk index size, uncompressed.
    pub index_bytes: u64,
    /// Lookup table size, uncompressed.
    pub lookup_bytes: u64,
    /// Data blobs: digest, compressed size, cache size.
    pub blobs: Vec<BlobReport>,
    /// Compressed size of the source layers.
    pub source_layer_bytes: u64,
    /// Boot pages, when converted with a trace that has page ranges.
    pub boot_pages: Option<BootReport>,
    /// Counts.
    pub stats: BuildStats,
    /// Bytes the final tree references in blobs / bytes stored in blobs
    /// (below 1 when layers stored data that later layers deleted).
    pub dedup_ratio: f64,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// Boot pages in the report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BootReport {
    /// Runs of pages.
    pub extents: u64,
    /// Uncompressed size (pages and their table).
    pub bytes: u64,
    /// Size in the registry.
    pub compressed_bytes: u64,
    /// Layers they are split into (see `lamina_format::boot`).
    pub segments: u64,
}

/// Boot pages as an artifact layer (`MEDIA_TYPE_BOOT`).
#[derive(Debug, Clone)]
pub struct BootPagesLayer {
    /// Its descriptor (content annotations and the frames annotation).
    pub descriptor: Descriptor,
    /// Its bytes.
    pub compressed: Vec<u8>,
    /// What goes in the report.
    pub report: BootReport,
}

/// Why boot pages could not be made a layer.
#[derive(Debug, thiserror::Error)]
pub enum BootLayerError {
    /// More than a mount takes.
    #[error("{0}")]
    TooLarge(String),
    /// Compressing.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// `boot` as one layer: each segment one zstd frame, in read order (a
/// mount fetches the frames as ranges, several at once, and applies each
/// as soon as it is verified). Fetched at every cold mount and written
/// once: worth zstd's strongest level. `None` when there are no pages.
/// `from_image`: the pages were known from the image, not recorded
/// ([`ANNOTATION_BOOT_SOURCE`]).
pub fn boot_pages_layer(
    boot: &lamina_format::boot::BootPages,
    from_image: bool,
) -> Result<Option<BootPagesLayer>, BootLayerError> {
    if boot.extents.is_empty() {
        return Ok(None);
    }
    let segments: Vec<Vec<u8>> = boot.segments().iter().map(|s| s.to_bytes()).collect();
    // All segments with their headers, as a mount bounds them.
    let total: u64 = segments.iter().map(|raw| raw.len() as u64).sum();
    if total > MAX_BOOT_PAGES_SIZE {
        return Err(BootLayerError::TooLarge(format!(
            "the trace's boot pages are {total} bytes, more than {MAX_BOOT_PAGES_SIZE}"
        )));
    }
    let frames: Vec<Vec<u8>> = segments
        .iter()
        .map(|raw| zstd::bulk::compress(raw, 19))
        .collect::<Result<_, _>>()?;
    let sizes: Vec<(&[u8], u64)> = frames
        .iter()
        .zip(&segments)
        .map(|(z, raw)| (z.as_slice(), raw.len() as u64))
        .collect();
    let mut annotations = content_annotations(&segments.concat());
    annotations.insert(
        ANNOTATION_BOOT_FRAMES.to_string(),
        boot_frames_annotation(&sizes),
    );
    if from_image {
        annotations.insert(
            ANNOTATION_BOOT_SOURCE.to_string(),
            BOOT_SOURCE_IMAGE.to_string(),
        );
    }
    let compressed = frames.concat();
    let descriptor = Descriptor {
        media_type: MEDIA_TYPE_BOOT.to_string(),
        digest: Digest::of_bytes(&compressed),
        size: compressed.len() as u64,
        annotations,
        platform: None,
        artifact_type: None,
    };
    let report = BootReport {
        extents: boot.extents.len() as u64,
        bytes: total,
        compressed_bytes: compressed.len() as u64,
        segments: segments.len() as u64,
    };
    Ok(Some(BootPagesLayer {
        descriptor,
        compressed,
        report,
    }))
}

/// One data blob in the report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BlobReport {
    /// Blob digest.
    pub digest: String,
    /// Compressed size.
    pub size: u64,
    /// Uncompressed, block-addressed size.
    pub cache_size: u64,
}

/// Converts `src` into a lamina image stored at `dst`.
pub fn convert(
    src: &ImageRef,
    dst: &ImageRef,
    opts: &ConvertOptions,
    progress: &dyn Fn(Progress),
) -> Result<ConvertReport, ConvertError> {
    let started = Instant::now();
    let mut sink = open_sink(dst, &opts.source)?;
    let source = open_source(src, &opts.source)?;
    let image = source.image();

    // Blobs are built where the sink can take them over by a rename
    // (an OCI layout's staging directory), unless told otherwise.
    let work_parent = opts
        .work_dir
        .clone()
        .or_else(|| sink.scratch_dir().map(PathBuf::from));
    let work = match &work_parent {
        Some(dir) => tempfile::Builder::new()
            .prefix("lamina-convert-")
            .tempdir_in(dir)?,
        None => tempfile::Builder::new()
            .prefix("lamina-convert-")
            .tempdir()?,
    };
    let (built, boot) = build_image(&*source, opts, work.path(), progress)?;
    let tables = compress_tables(&built, opts)?;
    let lookup_bytes = tables.lookup_raw.len() as u64;

    let (mut layers, blob_reports) = adopt_blobs(&mut *sink, &built)?;
    let boot_report = put_small_layers(
        &mut *sink,
        &built,
        &tables,
        &boot,
        !opts.boot_execs.is_empty(),
        &mut layers,
    )?;
    let config_desc = put_config(&mut *sink, image, &layers)?;
    let manifest = lamina_manifest(config_desc, layers, &built, image, opts);
    let manifest_bytes =
        serde_json::to_vec(&manifest).map_err(|e| ConvertError::Config(e.to_string()))?;
    let manifest_digest = sink.commit(&manifest_bytes, media_types::OCI_MANIFEST)?;

    let stats = built.stats;
    Ok(ConvertReport {
        manifest_digest: manifest_digest.to_string(),
        source_manifest_digest: image.manifest_digest.to_string(),
        metadata_bytes: built.metadata.len() as u64,
        metadata_compressed_bytes: tables.metadata_z.bytes.len() as u64,
        index_bytes: tables.index_raw.len() as u64,
        lookup_bytes,
        blobs: blob_reports,
        source_layer_bytes: image
            .layers
            .iter()
            .map(|l| l.descriptor.size)
            .fold(0, u64::saturating_add),
        boot_pages: boot_report,
        dedup_ratio: if stats.stored_bytes == 0 {
            1.0
        } else {
            stats.referenced_bytes as f64 / stats.stored_bytes as f64
        },
        stats,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Builds the image from the source's layers in `work`, with the boot set
/// of the trace given in `opts`; returns it with its boot pages.
fn build_image(
    source: &dyn ImageSource,
    opts: &ConvertOptions,
    work: &std::path::Path,
    progress: &dyn Fn(Progress),
) -> Result<(BuiltImage, BootPages), ConvertError> {
    let image = source.image();
    let mut builder = ImageBuilder::new(&opts.build, work)?;
    let total = image.layers.len();
    for (i, layer) in image.layers.iter().enumerate() {
        progress(Progress::Layer {
            index: i,
            total,
            size: layer.descriptor.size,
        });
        let reader = source.open_layer(i)?;
        with_readahead(reader, progress, |tar| builder.add_layer(tar))?;
    }
    let trace = match &opts.prefetch_trace {
        Some(path) => read_trace(path)?,
        None => Vec::new(),
    };
    let mut built = builder.finish(&boot_chunks(&trace))?;
    progress(Progress::Writing);
    let reads = if opts.boot_execs.is_empty() {
        trace_reads(&built, &trace)
    } else {
        let env = ExecEnv::from_config(&image.config);
        let reads = static_reads(&built, &opts.boot_execs, &env)?;
        built.set_boot_set(&read_chunks(&reads));
        reads
    };
    let boot = build_boot_pages(&built, &reads)?;
    Ok((built, boot))
}

/// The metadata, chunk index and lookup table, raw and compressed.
struct Tables {
    metadata_z: CompressedFrames,
    index_raw: Vec<u8>,
    index_z: Vec<u8>,
    lookup_raw: Vec<u8>,
    lookup_z: Vec<u8>,
}

/// Compresses the metadata, and builds and compresses the chunk index and
/// the lookup table beside it.
fn compress_tables(built: &BuiltImage, opts: &ConvertOptions) -> Result<Tables, ConvertError> {
    // The metadata's compression (the slowest step left: 85 MB for a
    // million files) runs beside the lookup table's build and compression.
    let frame = opts.metadata_frame_size.unwrap_or(METADATA_FRAME_SIZE);
    let (metadata_z, tables) = std::thread::scope(|scope| {
        let metadata = scope.spawn(|| compress_frames(&built.metadata, frame, 12));
        let tables = (|| -> Result<_, ConvertError> {
            let index_raw = match built.paged {
                true => built.index.to_paged_bytes(),
                false => built.index.to_bytes(),
            };
            let index_z = zstd::bulk::compress(&index_raw, 12)?;
            let lookup_raw = lamina_format::lookup::build_from_image(&built.metadata)?;
            // Hashes and nids barely compress: a fast level keeps convert quick.
            let lookup_z = zstd::bulk::compress(&lookup_raw, 3)?;
            Ok((index_raw, index_z, lookup_raw, lookup_z))
        })();
        let metadata = metadata
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("metadata compression panicked")));
        (metadata, tables)
    });
    let metadata_z = metadata_z?;
    let (index_raw, index_z, lookup_raw, lookup_z) = tables?;
    Ok(Tables {
        metadata_z,
        index_raw,
        index_z,
        lookup_raw,
        lookup_z,
    })
}

/// Hands the built data blobs to `sink`; returns their descriptors (the
/// first layers) and their reports.
fn adopt_blobs(
    sink: &mut dyn ImageSink,
    built: &BuiltImage,
) -> Result<(Vec<Descriptor>, Vec<BlobReport>), ConvertError> {
    let mut layers = Vec::new();
    let mut blob_reports = Vec::new();
    for blob in &built.blobs {
        let desc = Descriptor {
            media_type: MEDIA_TYPE_BLOB.to_string(),
            digest: Digest::from_sha256(blob.digest),
            size: blob.size,
            annotations: [(
                ANNOTATION_UNCOMPRESSED_SIZE.to_string(),
                blob.cache_size.to_string(),
            )]
            .into(),
            platform: None,
            artifact_type: None,
        };
        // The builder hashed the blob as it wrote it.
        sink.adopt_blob(&desc, &blob.path)?;
        blob_reports.push(BlobReport {
            digest: desc.digest.to_string(),
            size: blob.size,
            cache_size: blob.cache_size,
        });
        layers.push(desc);
    }
    Ok((layers, blob_reports))
}

/// Writes the index, metadata and lookup layers, then the boot pages
/// layer if any, to `sink`, adding them to `layers`; returns the boot
/// pages' report.
fn put_small_layers(
    sink: &mut dyn ImageSink,
    built: &BuiltImage,
    tables: &Tables,
    boot: &BootPages,
    from_image: bool,
    layers: &mut Vec<Descriptor>,
) -> Result<Option<BootReport>, ConvertError> {
    let small_layers: [(&[u8], &[u8], &str); 3] = [
        (&tables.index_raw, &tables.index_z, MEDIA_TYPE_INDEX),
        (
            &built.metadata,
            &tables.metadata_z.bytes,
            MEDIA_TYPE_METADATA,
        ),
        (&tables.lookup_raw, &tables.lookup_z, MEDIA_TYPE_LOOKUP),
    ];
    let boot_layer = boot_pages_layer(boot, from_image).map_err(|e| match e {
        BootLayerError::TooLarge(why) => ConvertError::Config(why),
        BootLayerError::Io(e) => e.into(),
    })?;
    let boot_report = boot_layer.as_ref().map(|b| b.report.clone());
    for (raw, compressed, media_type) in small_layers {
        let mut annotations = content_annotations(raw);
        if media_type == MEDIA_TYPE_METADATA {
            tables.metadata_z.annotate(&mut annotations);
        }
        let desc = Descriptor {
            media_type: media_type.to_string(),
            digest: Digest::of_bytes(compressed),
            size: compressed.len() as u64,
            annotations,
            platform: None,
            artifact_type: None,
        };
        sink.put_blob_bytes(&desc, compressed)?;
        layers.push(desc);
    }
    if let Some(boot) = &boot_layer {
        sink.put_blob_bytes(&boot.descriptor, &boot.compressed)?;
        layers.push(boot.descriptor.clone());
    }
    Ok(boot_report)
}

/// Writes the image config to `sink`: the source's, with `layers` as its
/// rootfs and no history; returns its descriptor.
fn put_config(
    sink: &mut dyn ImageSink,
    image: &SourceImage,
    layers: &[Descriptor],
) -> Result<Descriptor, ConvertError> {
    // The runtime config stays the source's; only the layer list changes.
    let mut config = image.config.clone();
    let obj = config
        .as_object_mut()
        .ok_or_else(|| ConvertError::Config("not a JSON object".into()))?;
    obj.remove("history");
    obj.insert(
        "rootfs".into(),
        serde_json::json!({
            "type": "layers",
            "diff_ids": layers.iter().map(|l| l.digest.to_string()).collect::<Vec<_>>(),
        }),
    );
    let config_bytes =
        serde_json::to_vec(&config).map_err(|e| ConvertError::Config(e.to_string()))?;
    let config_desc = Descriptor {
        media_type: media_types::OCI_CONFIG.to_string(),
        digest: Digest::of_bytes(&config_bytes),
        size: config_bytes.len() as u64,
        annotations: Default::default(),
        platform: None,
        artifact_type: None,
    };
    sink.put_blob_bytes(&config_desc, &config_bytes)?;
    Ok(config_desc)
}

/// The lamina manifest: `config_desc` and `layers`, annotated with the
/// format, the source, the build options and the build's figures.
fn lamina_manifest(
    config_desc: Descriptor,
    layers: Vec<Descriptor>,
    built: &BuiltImage,
    image: &SourceImage,
    opts: &ConvertOptions,
) -> Manifest {
    Manifest {
        schema_version: 2,
        media_type: Some(media_types::OCI_MANIFEST.to_string()),
        config: config_desc,
        layers,
        annotations: [
            (
                ANNOTATION_FORMAT.to_string(),
                match built.paged {
                    true => format_version(),
                    false => FORMAT_VERSION_LOOKUP,
                }
                .to_string(),
            ),
            (
                ANNOTATION_SOURCE.to_string(),
                image.manifest_digest.to_string(),
            ),
            (
                ANNOTATION_CHUNK_SIZE.to_string(),
                (1u64 << opts.build.chunk_bits).to_string(),
            ),
            (
                ANNOTATION_PACK_LIMIT.to_string(),
                opts.build.pack_limit.to_string(),
            ),
            (
                ANNOTATION_STATS_ENTRIES.to_string(),
                built.stats.entries.to_string(),
            ),
            (
                ANNOTATION_STATS_FILES.to_string(),
                built.stats.files.to_string(),
            ),
            (
                ANNOTATION_STATS_FILE_BYTES.to_string(),
                built.stats.file_bytes.to_string(),
            ),
            (
                ANNOTATION_STATS_REFERENCED_BYTES.to_string(),
                built.stats.referenced_bytes.to_string(),
            ),
            (
                ANNOTATION_STATS_XATTR_INODES.to_string(),
                built.stats.xattr_inodes.to_string(),
            ),
        ]
        .into(),
        artifact_type: None,
        subject: None,
    }
}

/// Reads a trace file (see [`crate::boot`]).
pub fn read_trace(path: &std::path::Path) -> Result<Vec<TraceEntry>, ConvertError> {
    let text = std::fs::read_to_string(path)?;
    parse_trace(path, &text).map_err(|e| ConvertError::Config(e.to_string()))
}

/// A layer compressed as independent zstd frames.
pub(crate) struct CompressedFrames {
    /// The frames back to back: the layer.
    pub bytes: Vec<u8>,
    /// Its [`ANNOTATION_METADATA_FRAMES`] value: each frame's compressed
    /// and content size and content digest; none for more than
    /// [`MAX_LAZY_FRAMES`] frames (a mount fetches such a layer whole).
    pub annotation: Option<String>,
}

impl CompressedFrames {
    /// Adds the frames list, if any, to the layer's `annotations`.
    pub(crate) fn annotate(&self, annotations: &mut std::collections::BTreeMap<String, String>) {
        if let Some(frames) = &self.annotation {
            annotations.insert(ANNOTATION_METADATA_FRAMES.to_string(), frames.clone());
        }
    }
}

/// `bytes` compressed at `level` as independent zstd frames: the first of
/// [`METADATA_FIRST_FRAME_SIZE`] bytes (what a lazy FUSE mount waits for),
/// then `frame` bytes each (the metadata layer's form: a mount decompresses
/// the frames in parallel, or fetches them as they are needed), on up to 8
/// threads. Each frame depends only on its own bytes, so the output is the
/// same on any machine and the image stays reproducible.
pub(crate) fn compress_frames(
    bytes: &[u8],
    frame: usize,
    level: i32,
) -> io::Result<CompressedFrames> {
    compress_frames_on(bytes, frame, level, frame_threads())
}

fn compress_frames_on(
    bytes: &[u8],
    frame: usize,
    level: i32,
    threads: usize,
) -> io::Result<CompressedFrames> {
    let (first, rest) = bytes.split_at(bytes.len().min(METADATA_FIRST_FRAME_SIZE.min(frame)));
    // One empty frame for no bytes: a stream has at least one.
    let mut frames: Vec<&[u8]> = vec![first];
    frames.extend(rest.chunks(frame.max(1)));
    let next = AtomicUsize::new(0);
    type Done = (usize, Vec<u8>, Digest);
    let mut compressed = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads.clamp(1, frames.len()))
            .map(|_| {
                scope.spawn(|| -> io::Result<Vec<Done>> {
                    let mut done = Vec::new();
                    let mut compressor = zstd::bulk::Compressor::new(level)?;
                    // The size in each header lets a reader place the frame.
                    compressor.include_contentsize(true)?;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(frame) = frames.get(i) else {
                            return Ok(done);
                        };
                        done.push((i, compressor.compress(frame)?, Digest::of_bytes(frame)));
                    }
                })
            })
            .collect();
        let mut all = Vec::with_capacity(frames.len());
        for worker in workers {
            all.extend(
                worker
                    .join()
                    .map_err(|_| io::Error::other("compression panicked"))??,
            );
        }
        io::Result::Ok(all)
    })?;
    compressed.sort_unstable_by_key(|(i, _, _)| *i);
    let listed: Vec<(u64, u64, &Digest)> = compressed
        .iter()
        .map(|(i, z, digest)| (z.len() as u64, frames[*i].len() as u64, digest))
        .collect();
    let annotation = (listed.len() <= MAX_LAZY_FRAMES).then(|| frames_annotation(&listed));
    let bytes = compressed.iter().flat_map(|(_, z, _)| z).copied().collect();
    Ok(CompressedFrames { bytes, annotation })
}

/// Runs `reader` (decompression and digest checks) on a second thread, so
/// that it overlaps with chunking and compression on this one.
fn with_readahead<T>(
    mut reader: Box<dyn Read + Send + '_>,
    progress: &dyn Fn(Progress),
    consume: impl FnOnce(&mut dyn Read) -> T,
) -> T {
    const BUF: usize = 1 << 20;
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::sync_channel::<io::Result<Vec<u8>>>(8);
        scope.spawn(move || loop {
            let mut buf = vec![0u8; BUF];
            let (filled, result) = read_full(&mut reader, &mut buf);
            buf.truncate(filled);
            let done = filled < BUF;
            let sent = match result {
                Ok(()) if filled == 0 => break,
                Ok(()) => tx.send(Ok(buf)),
                Err(e) => {
                    let _ = tx.send(Ok(buf));
                    let _ = tx.send(Err(e));
                    break;
                }
            };
            if sent.is_err() || done {
                break;
            }
        });
        let mut chan = ChannelReader {
            rx,
            buf: Vec::new(),
            pos: 0,
            total: 0,
            progress,
        };
        let out = consume(&mut chan);
        drop(chan);
        out
    })
}

struct ChannelReader<'p> {
    rx: mpsc::Receiver<io::Result<Vec<u8>>>,
    buf: Vec<u8>,
    pos: usize,
    total: u64,
    progress: &'p dyn Fn(Progress),
}

impl Read for ChannelReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.buf.len() {
            match self.rx.recv() {
                Ok(Ok(buf)) => {
                    self.total += buf.len() as u64;
                    (self.progress)(Progress::Bytes(self.total));
                    self.buf = buf;
                    self.pos = 0;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => return Ok(0), // producer finished
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The metadata's compression gives the same bytes on any machine (one
    /// thread or several), as a frame of [`METADATA_FIRST_FRAME_SIZE`] bytes
    /// then one per [`METADATA_FRAME_SIZE`] bytes, each naming its size; together they decompress to the input as one
    /// zstd stream.
    #[test]
    fn frames_compress_alike_on_any_number_of_threads() {
        let len = 2 * METADATA_FRAME_SIZE + 12_345;
        let bytes: Vec<u8> = (0..len as u32)
            .map(|i| ((i / 7).wrapping_mul(2_654_435_761) >> 29) as u8)
            .collect();
        let one = compress_frames_on(&bytes, METADATA_FRAME_SIZE, 3, 1).unwrap();
        for threads in [2, 3] {
            let many = compress_frames_on(&bytes, METADATA_FRAME_SIZE, 3, threads).unwrap();
            assert!(
                many.bytes == one.bytes,
                "{threads} threads compressed otherwise"
            );
            assert_eq!(many.annotation, one.annotation);
        }
        let listed: Vec<(u64, u64, String)> =
            serde_json::from_str(one.annotation.as_deref().unwrap()).unwrap();
        let mut at = 0;
        for (len, size, digest) in &listed {
            let z = &one.bytes[at..at + *len as usize];
            let content = zstd::decode_all(z).unwrap();
            assert_eq!(content.len() as u64, *size);
            assert_eq!(Digest::of_bytes(&content).to_string(), *digest);
            at += *len as usize;
        }
        assert_eq!(at, one.bytes.len());
        let one = one.bytes;
        assert!(zstd::decode_all(&one[..]).unwrap() == bytes);
        let mut sizes = Vec::new();
        let mut rest = &one[..];
        while !rest.is_empty() {
            let n = zstd::zstd_safe::find_frame_compressed_size(rest).unwrap();
            sizes.push(zstd::zstd_safe::get_frame_content_size(&rest[..n]).unwrap());
            rest = &rest[n..];
        }
        let (first, frame) = (METADATA_FIRST_FRAME_SIZE, METADATA_FRAME_SIZE);
        let last = len - first - frame;
        let want = [first, frame, last].map(|n| Some(n as u64));
        assert_eq!(sizes, want);
        // More frames than a mount takes one by one: no list, fetched whole.
        let many = compress_frames_on(&[7; MAX_LAZY_FRAMES + 1], 1, 3, 2).unwrap();
        assert_eq!(many.annotation, None);
        let most = compress_frames_on(&[7; MAX_LAZY_FRAMES], 1, 3, 2).unwrap();
        assert!(most.annotation.is_some());
        let empty = compress_frames_on(&[], METADATA_FRAME_SIZE, 3, 2)
            .unwrap()
            .bytes;
        assert!(zstd::decode_all(&empty[..]).unwrap().is_empty());
    }
}
