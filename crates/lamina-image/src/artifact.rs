//! How a lamina image sits in an OCI registry or layout: an ordinary OCI
//! image manifest whose layers are the data blobs, the chunk index and the
//! EROFS metadata image, each with a lamina media type. The media types start
//! with `application/vnd.oci.image.layer.` because containerd hands only such
//! descriptors to a snapshotter.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::sync::{mpsc, Mutex};

use lamina_format::boot::{BootExtent, BootHeader, BootTable, BOOT_PAGE};
use lamina_format::index::{BlobSummary, ChunkIndex, IndexTop, MAX_INDEX_SIZE};
use lamina_format::lookup::LookupTable;
use lamina_format::zstd_bound;
use lamina_oci::digest::Sha256;
use lamina_oci::{Descriptor, Digest, ImageSource, Manifest};

/// Media type of a data blob: concatenated chunks, each a zstd frame or raw.
pub const MEDIA_TYPE_BLOB: &str = "application/vnd.oci.image.layer.lamina.blob.v1";
/// Media type of the EROFS metadata image, zstd-compressed.
pub const MEDIA_TYPE_METADATA: &str = "application/vnd.oci.image.layer.lamina.erofs.v1+zstd";
/// Media type of the chunk index, zstd-compressed.
pub const MEDIA_TYPE_INDEX: &str = "application/vnd.oci.image.layer.lamina.index.v1+zstd";
/// Media type of the lookup table (`lamina_format::lookup`), zstd-compressed:
/// O(1) lookups for the FUSE path, bound to the metadata image's digest.
pub const MEDIA_TYPE_LOOKUP: &str = "application/vnd.oci.image.layer.lamina.lookup.v1+zstd";
/// Media type of boot pages (`lamina_format::boot`), zstd-compressed: the
/// pages a recorded start read, fetched whole at mount.
pub const MEDIA_TYPE_BOOT: &str = "application/vnd.oci.image.layer.lamina.boot.v1+zstd";

/// `artifactType` of a lamina tar index (`lamina index`, docs/index.md).
pub const ARTIFACT_TYPE_TAR_INDEX: &str = "application/vnd.lamina.tar-index.v1";
/// Media type of a tar index's span table (`lamina_format::tar_index`),
/// zstd-compressed.
pub const MEDIA_TYPE_TAR_INDEX: &str = "application/vnd.oci.image.layer.lamina.tar-index.v1+zstd";
/// Media type of a tar index's windows (`lamina_format::tar_index`): one
/// zstd frame per window, fetched by range with the spans that need them.
pub const MEDIA_TYPE_TAR_WINDOWS: &str = "application/vnd.lamina.tar-index.windows.v1";

/// Manifest annotation: lamina format version.
pub const ANNOTATION_FORMAT: &str = "dev.lamina.format";
/// Manifest annotation: digest of the source image's manifest.
pub const ANNOTATION_SOURCE: &str = "dev.lamina.source.manifest";
/// Manifest annotation: chunk size in bytes.
pub const ANNOTATION_CHUNK_SIZE: &str = "dev.lamina.chunk-size";
/// Manifest annotation: files of at most this size were packed into shared
/// chunks (informational; readers need nothing from it).
pub const ANNOTATION_PACK_LIMIT: &str = "dev.lamina.pack-limit";
/// Manifest annotation: entries in the image tree.
pub const ANNOTATION_STATS_ENTRIES: &str = "dev.lamina.stats.entries";
/// Manifest annotation: regular files (inodes) in the image tree.
pub const ANNOTATION_STATS_FILES: &str = "dev.lamina.stats.files";
/// Manifest annotation: bytes of regular file content in the image tree.
pub const ANNOTATION_STATS_FILE_BYTES: &str = "dev.lamina.stats.file-bytes";
/// Manifest annotation: bytes of the tree's files that live in blobs (holes excluded).
pub const ANNOTATION_STATS_REFERENCED_BYTES: &str = "dev.lamina.stats.referenced-bytes";
/// Manifest annotation: inodes with extended attributes in the image tree.
pub const ANNOTATION_STATS_XATTR_INODES: &str = "dev.lamina.stats.xattr-inodes";
/// Layer annotation: digest of the uncompressed content (metadata, index).
pub const ANNOTATION_UNCOMPRESSED_DIGEST: &str = "dev.lamina.uncompressed.digest";
/// Layer annotation: size of the uncompressed content; for blobs, the cache file size.
pub const ANNOTATION_UNCOMPRESSED_SIZE: &str = "dev.lamina.uncompressed.size";
/// Boot-pages layer annotation: its zstd frames, in read order, as a JSON
/// array of `[compressed size, size, "sha256:<digest of the compressed
/// frame>"]`. Each frame decompresses to a boot-pages segment of its own.
/// Without it the layer is one frame (images before frames).
pub const ANNOTATION_BOOT_FRAMES: &str = "dev.lamina.boot.frames";

/// The format version this build writes and reads.
pub const FORMAT_VERSION: &str = "1";
/// The format version of an image whose boot pages come in more than one
/// layer: builds from before boot segments then refuse it by its version
/// instead of by a layer they do not expect. This build reads both.
pub const FORMAT_VERSION_SEGMENTED: &str = "2";

/// The format version of an image with a lookup-table layer: builds from
/// before it refuse such an image by its version.
pub const FORMAT_VERSION_LOOKUP: &str = "3";

/// The format version of an image with a paged chunk index (each blob ends
/// with its chunk table; boot pages carry tables): builds from before it
/// refuse such an image by its version. This build reads all four and
/// writes this one.
pub const FORMAT_VERSION_PAGED: &str = "4";

/// The format version this build writes.
pub fn format_version() -> &'static str {
    FORMAT_VERSION_PAGED
}

/// Uncompressed bytes per zstd frame of the metadata layer. The layer is
/// a plain zstd stream made of independent frames of this many bytes (the
/// last one shorter), each naming its size in its header, so a lazy mount
/// decompresses them on every core. Images from before have one frame;
/// both read the same. The 85 MB metadata of a million files compresses to
/// 6.86 MB in frames of 4 MiB (6.92 MB with the small first frame below),
/// 7.44 MB in frames of 1 MiB and 6.80 MB in one frame: a lazy mount over a
/// network fetches it before anything else.
pub const METADATA_FRAME_SIZE: usize = 4 << 20;

/// The metadata's first frame is this small: it holds the superblock, the
/// device table and the root directory, which is all a lazy FUSE mount
/// decompresses before it returns (the daemon writes the other frames as
/// requests need them).
pub const METADATA_FIRST_FRAME_SIZE: usize = 64 << 10;

/// Threads for the metadata's frames, compressed or decompressed: one per
/// core, at most 8.
pub(crate) fn frame_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// Largest EROFS metadata image lamina writes or reads, uncompressed.
pub const MAX_METADATA_SIZE: u64 = 256 << 20;
/// Largest boot pages lamina writes or reads, uncompressed, all segments
/// together. Each segment is fetched and held whole by the mount's worker.
pub const MAX_BOOT_PAGES_SIZE: u64 = 1 << 30;
/// Largest lookup table lamina writes or reads, uncompressed (a million
/// entries take about 45 MB).
pub const MAX_LOOKUP_SIZE: u64 = 1 << 30;
/// Largest tar-index span table, uncompressed: 64 bytes per span and per
/// window (a million spans would take 128 MB).
pub const MAX_TAR_INDEX_SIZE: u64 = 256 << 20;
/// Most boot-pages layers an image may have (images before frames carried
/// each segment as a layer of its own: 9 at most).
pub const MAX_BOOT_SEGMENTS: usize = 16;
/// Most frames of boot pages, all layers together:
/// [`lamina_format::boot::BootPages::segments`] makes ~2,050 of
/// [`MAX_BOOT_PAGES_SIZE`].
pub const MAX_BOOT_FRAMES: usize = 4096;

/// Why an image is not a usable lamina image.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    /// The manifest is not a lamina manifest, or is malformed.
    #[error("not a lamina image: {0}")]
    NotLamina(String),
    /// Reading a blob failed (includes digest mismatches).
    #[error(transparent)]
    Oci(#[from] lamina_oci::OciError),
    /// A blob did not decompress, or its content digest did not match.
    #[error("{what}: {reason}")]
    Corrupt {
        /// Which blob.
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// The chunk index is malformed.
    #[error(transparent)]
    Index(#[from] lamina_format::index::IndexError),
    /// Writing a layer's bytes out failed.
    #[error("{what}: writing: {source}")]
    Write {
        /// Which layer.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
    /// A size the image states (descriptor or annotation) is beyond what
    /// lamina reads; refused before anything of that size is allocated.
    #[error("{what}: {size} bytes is more than the limit of {limit}")]
    TooLarge {
        /// Which size.
        what: &'static str,
        /// The size stated.
        size: u64,
        /// The limit.
        limit: u64,
    },
}

/// The layers of a lamina manifest, by role.
#[derive(Debug, Clone)]
pub struct LaminaLayers {
    /// EROFS metadata image.
    pub metadata: Descriptor,
    /// Chunk index.
    pub index: Descriptor,
    /// Data blobs in device order.
    pub blobs: Vec<Descriptor>,
    /// Boot pages, when the image was converted with a trace: one layer per
    /// segment, in read order (one in images converted before segments).
    pub boot: Vec<Descriptor>,
    /// The lookup table, in images converted since format 3.
    pub lookup: Option<Descriptor>,
}

/// Whether the image's tree may hold extended attributes: `false` only
/// when its manifest says no inode has any (images converted before that
/// annotation may).
pub fn may_have_xattrs(manifest: &Manifest) -> bool {
    manifest
        .annotations
        .get(ANNOTATION_STATS_XATTR_INODES)
        .is_none_or(|n| n != "0")
}

impl LaminaLayers {
    /// Sorts a manifest's layers by role; refuses anything else.
    pub fn from_manifest(manifest: &Manifest) -> Result<Self, ArtifactError> {
        match manifest.annotations.get(ANNOTATION_FORMAT) {
            Some(v)
                if [
                    FORMAT_VERSION,
                    FORMAT_VERSION_SEGMENTED,
                    FORMAT_VERSION_LOOKUP,
                    FORMAT_VERSION_PAGED,
                ]
                .contains(&v.as_str()) => {}
            Some(v) => {
                return Err(ArtifactError::NotLamina(format!(
                    "format version {v}, this build reads {FORMAT_VERSION} to {FORMAT_VERSION_PAGED}"
                )))
            }
            None => {
                return Err(ArtifactError::NotLamina(format!(
                    "manifest has no {ANNOTATION_FORMAT} annotation (convert it with `lamina convert` first)"
                )))
            }
        }
        let mut metadata = None;
        let mut index = None;
        let mut blobs = Vec::new();
        let mut boot = Vec::new();
        let mut lookup = None;
        for layer in &manifest.layers {
            match layer.media_type.as_str() {
                MEDIA_TYPE_BLOB => blobs.push(layer.clone()),
                MEDIA_TYPE_METADATA if metadata.is_none() => metadata = Some(layer.clone()),
                MEDIA_TYPE_INDEX if index.is_none() => index = Some(layer.clone()),
                MEDIA_TYPE_LOOKUP if lookup.is_none() => lookup = Some(layer.clone()),
                MEDIA_TYPE_BOOT if boot.len() < MAX_BOOT_SEGMENTS => boot.push(layer.clone()),
                MEDIA_TYPE_BOOT => {
                    return Err(ArtifactError::NotLamina(format!(
                        "more than {MAX_BOOT_SEGMENTS} boot-pages layers"
                    )))
                }
                other => {
                    return Err(ArtifactError::NotLamina(format!(
                        "unexpected layer type {other}"
                    )))
                }
            }
        }
        Ok(LaminaLayers {
            metadata: metadata
                .ok_or_else(|| ArtifactError::NotLamina("no metadata layer".into()))?,
            index: index.ok_or_else(|| ArtifactError::NotLamina("no index layer".into()))?,
            blobs,
            boot,
            lookup,
        })
    }
}

/// The most a zstd layer of `size` uncompressed bytes may take: zstd's
/// bound plus a little (lamina writes one frame; this leaves room for a
/// few more frame headers).
fn compressed_limit(size: u64) -> u64 {
    zstd_bound(size).saturating_add(64 << 10)
}

fn too_large(what: &'static str, size: u64, limit: u64) -> Result<(), ArtifactError> {
    if size > limit {
        return Err(ArtifactError::TooLarge { what, size, limit });
    }
    Ok(())
}

/// The uncompressed-size annotation of a zstd layer, if it has one.
fn annotated_size(desc: &Descriptor, what: &'static str) -> Result<Option<u64>, ArtifactError> {
    desc.annotations
        .get(ANNOTATION_UNCOMPRESSED_SIZE)
        .map(|v| {
            v.parse().map_err(|_| ArtifactError::Corrupt {
                what,
                reason: format!("bad {ANNOTATION_UNCOMPRESSED_SIZE} annotation {v:?}"),
            })
        })
        .transpose()
}

/// Reads a zstd-compressed lamina layer (index, metadata or boot pages) and
/// checks its uncompressed digest. Its sizes are checked against the
/// layer's limit first (metadata [`MAX_METADATA_SIZE`], index
/// [`MAX_INDEX_SIZE`], boot pages [`MAX_BOOT_PAGES_SIZE`], lookup table
/// [`MAX_LOOKUP_SIZE`]), and it is
/// decompressed as a stream that stops at the limit, so neither a lying
/// annotation nor a zstd bomb makes it allocate more.
pub fn read_compressed_layer(
    source: &dyn ImageSource,
    desc: &Descriptor,
    what: &'static str,
) -> Result<Vec<u8>, ArtifactError> {
    let (decoder, layer) = open_compressed_layer(source, desc, what)?;
    // Sized once (the annotation is bounded above), not grown by doubling:
    // the 85 MB metadata of a 1M-file image was copied over and over.
    let mut out = Vec::with_capacity(layer.size.unwrap_or(0) as usize);
    decoder
        .take(layer.limit.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| layer.corrupt(e.to_string()))?;
    layer.check(out.len() as u64, Digest::of_bytes(&out))?;
    Ok(out)
}

/// Bytes [`copy_compressed_layer`] decompresses at a time.
const COPY_BLOCK: usize = 1 << 20;

/// [`read_compressed_layer`] into `out` instead of memory, for a layer to
/// be kept in a file: decompressed a block at a time, each block hashed
/// and written on a second thread while the next one is decompressed (a
/// 1M-file image's 85 MB metadata took a lazy mount 0.2 s of one core,
/// hashed after it was whole). Same bounds and checks; returns the bytes
/// written. What `out` holds is verified only when this returns `Ok`.
pub fn copy_compressed_layer(
    source: &dyn ImageSource,
    desc: &Descriptor,
    what: &'static str,
    out: &mut (dyn Write + Send),
) -> Result<u64, ArtifactError> {
    let (decoder, layer) = open_compressed_layer(source, desc, what)?;
    stream_layer(decoder, &layer, out)
}

/// [`copy_compressed_layer`]'s work on an opened layer.
fn stream_layer(
    decoder: LayerDecoder<'_>,
    layer: &CompressedLayer,
    out: &mut (dyn Write + Send),
) -> Result<u64, ArtifactError> {
    let what = layer.what;
    let mut decoder = decoder.take(layer.limit.saturating_add(1));
    let (blocks, to_hash) = mpsc::sync_channel::<Vec<u8>>(2);
    let (give_back, spare) = mpsc::channel::<Vec<u8>>();
    let (len, hashed) = std::thread::scope(|scope| {
        let hasher = scope.spawn(move || -> std::io::Result<[u8; 32]> {
            let mut hash = Sha256::new();
            for block in to_hash {
                hash.update(&block);
                // In pieces, for a daemon that maps the file.
                lamina_sys::write_all_in_pieces(out, &block)?;
                let _ = give_back.send(block);
            }
            Ok(hash.finalize())
        });
        let mut len = 0u64;
        let read = loop {
            let mut block = spare.try_recv().unwrap_or_default();
            block.resize(COPY_BLOCK, 0);
            let n = match read_full(&mut decoder, &mut block) {
                (0, Ok(())) => break Ok(()),
                (n, Ok(())) => n,
                (_, Err(e)) => break Err(e),
            };
            block.truncate(n);
            len += n as u64;
            if blocks.send(block).is_err() {
                break Ok(()); // the writer failed: its error is reported
            }
        };
        drop(blocks);
        let hashed = hasher
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the hashing thread panicked")));
        (read.map(|()| len), hashed)
    });
    let len = len.map_err(|e| layer.corrupt(e.to_string()))?;
    let hashed = hashed.map_err(|e| ArtifactError::Write { what, source: e })?;
    layer.check(len, Digest::from_sha256(hashed))?;
    Ok(len)
}

/// Decompresses `desc`'s layer into `out` as [`copy_compressed_layer`]
/// does, but a layer of several zstd frames, each naming its size (the
/// metadata layer, [`METADATA_FRAME_SIZE`]), is decompressed a frame per
/// thread at a time, on every core, each frame as soon as it has arrived:
/// a lazy mount waits for this.
///
/// Checked before it returns `Ok`: the layer's own digest and size (the
/// compressed bytes must be those the manifest names), the frames (well
/// formed, each decompressing to the size it names, all together to the
/// annotated size, within the layer's limit). Not checked, for such a
/// layer: its content-digest annotation. What `out` holds is the layer's
/// content as the manifest names it, but a file filled here may only be
/// recorded (trusted by later mounts) by whoever hashes it against that
/// annotation first, as the worker does. A layer without a size
/// annotation, or whose first frame names no size or all of it (one frame:
/// images from before), is streamed with every check of
/// [`copy_compressed_layer`].
pub fn copy_compressed_layer_in_parallel(
    source: &dyn ImageSource,
    desc: &Descriptor,
    what: &'static str,
    out: &File,
) -> Result<u64, ArtifactError> {
    let layer = CompressedLayer::of(desc, what)?;
    let (first, mut frames) = match first_frame_or_stream(source, desc, &layer, out)? {
        FirstFrame::Of(first, frames) => (first, frames),
        FirstFrame::Streamed(len) => return Ok(len),
    };
    let len = decompress_frames(first, &mut frames, &layer, out)?;
    layer.check_size(len)?;
    Ok(len)
}

/// Most frames a layer may be left in for decompression on demand
/// ([`read_frames_or_copy`]); a layer in more is decompressed at once.
pub const MAX_LAZY_FRAMES: usize = 4096;

/// A zstd lamina layer fetched whole and checked against its digest, left
/// compressed as its independent frames, to be decompressed as they are
/// needed (a lazy FUSE mount's metadata).
#[derive(Debug)]
pub struct LayerFrames {
    /// The layer's bytes as fetched: the frames back to back.
    pub compressed: Vec<u8>,
    /// Its frames, in order; their sizes add up to the annotated size.
    pub frames: Vec<LayerFrame>,
}

/// One frame of [`LayerFrames`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerFrame {
    /// Where it starts in the compressed bytes.
    pub start: u64,
    /// Its compressed length.
    pub len: u64,
    /// Where its content goes.
    pub offset: u64,
    /// Its content's size, as its header names it.
    pub size: u64,
}

/// What [`read_frames_or_copy`] made of a layer.
#[derive(Debug)]
pub enum FramesOrCopy {
    /// Fetched and verified; its frames not decompressed yet.
    Frames(LayerFrames),
    /// Not in frames that name their sizes (or in over
    /// [`MAX_LAZY_FRAMES`]): decompressed into the file, with every check
    /// of [`copy_compressed_layer`]; this many bytes.
    Copied(u64),
}

/// Fetches `desc`'s layer for a mount that decompresses its frames as they
/// are needed: the layer's own digest and size are checked (the source
/// checks them as the last byte arrives), and its frames' headers (each
/// names its size, all together the annotated size, within the layer's
/// limit); the frames themselves are not decompressed, so neither their
/// contents nor the content digest are checked here. A decompressed frame
/// must be checked to be as long as its header says; a file filled from
/// them may only be recorded once hashed against the content digest. A
/// layer that cannot be split so is decompressed into `out` instead, as
/// [`copy_compressed_layer_in_parallel`] does.
pub fn read_frames_or_copy(
    source: &dyn ImageSource,
    desc: &Descriptor,
    what: &'static str,
    out: &File,
) -> Result<FramesOrCopy, ArtifactError> {
    let layer = CompressedLayer::of(desc, what)?;
    let (first, mut frames) = match first_frame_or_stream(source, desc, &layer, out)? {
        FirstFrame::Of(first, frames) => (first, frames),
        FirstFrame::Streamed(len) => return Ok(FramesOrCopy::Copied(len)),
    };
    let mut compressed = Vec::with_capacity(desc.size as usize); // bounded by `of`
    let mut spans = Vec::new();
    let mut next = Some(first);
    while let Some((f, bytes)) = next {
        if spans.len() == MAX_LAZY_FRAMES {
            compressed.extend_from_slice(&bytes);
            return frames
                .stream_into(compressed, out)
                .map(FramesOrCopy::Copied);
        }
        spans.push(LayerFrame {
            start: f.start,
            len: bytes.len() as u64,
            offset: f.offset,
            size: f.size,
        });
        compressed.extend_from_slice(&bytes);
        next = frames.next()?;
    }
    layer.check_size(frames.offset)?;
    Ok(FramesOrCopy::Frames(LayerFrames {
        compressed,
        frames: spans,
    }))
}

/// A layer's frames as read from its source.
type SourceFrames<'a> = FrameReader<'a, std::io::Take<Box<dyn Read + Send + 'a>>>;

/// What [`first_frame_or_stream`] found.
enum FirstFrame<'a> {
    /// The first of several frames that each name their size, and the
    /// reader of the others.
    Of((Frame, Vec<u8>), SourceFrames<'a>),
    /// A layer in one frame (images from before frames), without a size
    /// annotation, or whose first frame names no size: streamed into the
    /// file with every check; the bytes written.
    Streamed(u64),
}

/// Opens `desc`'s layer for its frames, or streams it into `out`.
fn first_frame_or_stream<'a>(
    source: &'a dyn ImageSource,
    desc: &Descriptor,
    layer: &'a CompressedLayer,
    out: &File,
) -> Result<FirstFrame<'a>, ArtifactError> {
    let mut frames = FrameReader::new(source, desc, layer)?;
    match frames.next()? {
        Some((f, bytes)) if f.size > 0 && layer.size.is_some_and(|total| f.size < total) => {
            Ok(FirstFrame::Of((f, bytes), frames))
        }
        first => {
            let read = first.map(|(_, bytes)| bytes).unwrap_or_default();
            frames.stream_into(read, out).map(FirstFrame::Streamed)
        }
    }
}

/// One zstd frame of a layer: where it lies in the compressed bytes and
/// in the content.
#[derive(Debug, Clone, Copy)]
struct Frame {
    start: u64,
    offset: u64,
    size: u64,
}

/// A zstd layer's frames, read one whole frame at a time.
struct FrameReader<'a, R> {
    reader: R,
    /// Bytes read and not yet split off as a frame.
    pending: Vec<u8>,
    /// Where `pending` starts in the layer.
    start: u64,
    /// Where the next frame starts in the content.
    offset: u64,
    layer: &'a CompressedLayer,
}

impl<'a> FrameReader<'a, std::io::Take<Box<dyn Read + Send + 'a>>> {
    /// The frames of `desc`'s layer, read through the source (which checks
    /// the layer's digest as its last byte arrives).
    fn new(
        source: &'a dyn ImageSource,
        desc: &Descriptor,
        layer: &'a CompressedLayer,
    ) -> Result<Self, ArtifactError> {
        Ok(FrameReader {
            reader: source.open_blob(desc)?.take(desc.size.saturating_add(1)),
            pending: Vec::new(),
            start: 0,
            offset: 0,
            layer,
        })
    }

    /// Decompresses `read` (the layer's bytes read so far) and the rest of
    /// the layer into `out` as one stream, with every check of
    /// [`copy_compressed_layer`].
    fn stream_into(mut self, mut read: Vec<u8>, out: &File) -> Result<u64, ArtifactError> {
        let layer = self.layer;
        read.append(&mut self.pending);
        let rest: Box<dyn Read + Send + 'a> =
            Box::new(std::io::Cursor::new(read).chain(self.reader));
        let decoder =
            zstd::stream::read::Decoder::new(rest).map_err(|e| layer.corrupt(e.to_string()))?;
        stream_layer(decoder, layer, &mut &*out)
    }
}

impl<R: Read> FrameReader<'_, R> {
    /// The next frame, with the size its header names (0 for none: only
    /// a first frame may name none, as the caller then streams), or `None`
    /// at the end of the layer, which the source has checked by then.
    fn next(&mut self) -> Result<Option<(Frame, Vec<u8>)>, ArtifactError> {
        use zstd::zstd_safe;
        const READ: usize = 256 << 10;
        let layer = self.layer;
        loop {
            let found = zstd_safe::find_frame_compressed_size(&self.pending);
            if let Ok(len) = found {
                let rest = self.pending.split_off(len);
                let bytes = std::mem::replace(&mut self.pending, rest);
                let size = match zstd_safe::get_frame_content_size(&bytes) {
                    Ok(Some(size)) => size,
                    _ if self.start == 0 => 0,
                    _ => {
                        return Err(
                            layer.corrupt(format!("frame at byte {} names no size", self.start))
                        )
                    }
                };
                let frame = Frame {
                    start: self.start,
                    offset: self.offset,
                    size,
                };
                self.start += len as u64;
                self.offset = self.offset.saturating_add(size);
                if self.offset > layer.limit {
                    return Err(
                        layer.corrupt(format!("decompresses to more than {} bytes", layer.limit))
                    );
                }
                return Ok(Some((frame, bytes)));
            }
            // Incomplete (or bad, which the end of the layer tells apart).
            let have = self.pending.len();
            self.pending.resize(have + READ, 0);
            let (n, read) = read_full(&mut self.reader, &mut self.pending[have..]);
            self.pending.truncate(have + n);
            read.map_err(|e| layer.corrupt(e.to_string()))?;
            if n == 0 {
                if self.pending.is_empty() {
                    return Ok(None);
                }
                let why = found.err().map_or("incomplete", zstd_safe::get_error_name);
                let at = self.start;
                return Err(layer.corrupt(format!("bad zstd frame at byte {at}: {why}")));
            }
        }
    }
}

/// Decompresses `first` and the rest of `frames` into `out` at their
/// offsets: this thread reads, a thread per core decompresses a frame at
/// a time through one buffer of its own, reused (in a VM, a page fault on
/// fresh memory can cost as much as decompressing the page). The
/// content's length.
fn decompress_frames<R: Read>(
    first: (Frame, Vec<u8>),
    frames: &mut FrameReader<'_, R>,
    layer: &CompressedLayer,
    out: &File,
) -> Result<u64, ArtifactError> {
    let threads = frame_threads();
    let (to_workers, work) = mpsc::sync_channel::<(Frame, Vec<u8>)>(threads);
    let work = Mutex::new(work);
    let writing = Mutex::new(());
    let decompress = || -> Result<(), ArtifactError> {
        let mut dctx = zstd::bulk::Decompressor::new().map_err(|e| layer.corrupt(e.to_string()))?;
        let mut buf = Vec::new();
        loop {
            let next = work.lock().unwrap_or_else(|e| e.into_inner()).recv();
            let Ok((f, bytes)) = next else {
                return Ok(()); // no more frames
            };
            buf.clear();
            buf.reserve(f.size as usize); // the frames' sizes are within the limit
            let n = dctx
                .decompress_to_buffer(&bytes, &mut buf)
                .map_err(|e| layer.corrupt(format!("frame at byte {}: {e}", f.start)))?;
            if n as u64 != f.size {
                return Err(layer.corrupt(format!(
                    "frame at byte {} decompresses to {n} bytes, its header says {}",
                    f.start, f.size
                )));
            }
            // One writer at a time: two writers of one file spin on its
            // lock in the kernel (28% of a mount's CPU in one profile).
            let _writing = writing.lock().unwrap_or_else(|e| e.into_inner());
            lamina_sys::write_all_at_in_pieces(out, &buf, f.offset).map_err(|source| {
                ArtifactError::Write {
                    what: layer.what,
                    source,
                }
            })?;
        }
    };
    // A worker that failed takes no more frames from the reader, but does
    // not leave it waiting to hand one over either.
    let work_or_drain = || {
        let done = decompress();
        if done.is_err() {
            while work
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .recv()
                .is_ok()
            {}
        }
        done
    };
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads).map(|_| scope.spawn(work_or_drain)).collect();
        let mut read = Ok(());
        let mut next = Some(first);
        while let Some(frame) = next {
            if to_workers.send(frame).is_err() {
                break; // cannot happen: the receiver outlives this loop
            }
            match frames.next() {
                Ok(n) => next = n,
                Err(e) => {
                    read = Err(e);
                    break;
                }
            }
        }
        drop(to_workers);
        let decompressed = workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| Err(layer.corrupt("a thread panicked".into())))
            })
            .fold(Ok(()), Result::and);
        read.and(decompressed)
    })?;
    Ok(frames.offset)
}

/// Reads until `buf` is full, the stream ends or a read fails: the bytes
/// read (those before a failure too), and the failure.
pub(crate) fn read_full(reader: &mut impl Read, buf: &mut [u8]) -> (usize, std::io::Result<()>) {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return (filled, Err(e)),
        }
    }
    (filled, Ok(()))
}

/// A zstd lamina layer's decompressing reader.
type LayerDecoder<'a> =
    zstd::stream::read::Decoder<'static, std::io::BufReader<Box<dyn Read + Send + 'a>>>;

/// What a zstd lamina layer's bytes must meet.
struct CompressedLayer {
    what: &'static str,
    /// Most bytes it may decompress to.
    limit: u64,
    /// Its annotated size.
    size: Option<u64>,
    /// Its annotated content digest.
    expected: String,
}

/// Opens `desc`'s layer for decompression, after checking its annotated
/// and compressed sizes against the layer's limit.
fn open_compressed_layer<'a>(
    source: &'a dyn ImageSource,
    desc: &Descriptor,
    what: &'static str,
) -> Result<(LayerDecoder<'a>, CompressedLayer), ArtifactError> {
    let layer = CompressedLayer::of(desc, what)?;
    let raw = source.open_blob(desc)?;
    let decoder =
        zstd::stream::read::Decoder::new(raw).map_err(|e| layer.corrupt(e.to_string()))?;
    Ok((decoder, layer))
}

impl CompressedLayer {
    /// What `desc`'s layer must meet, once its annotated and compressed
    /// sizes are within the layer's limit.
    fn of(desc: &Descriptor, what: &'static str) -> Result<CompressedLayer, ArtifactError> {
        let max = match desc.media_type.as_str() {
            MEDIA_TYPE_METADATA => MAX_METADATA_SIZE,
            MEDIA_TYPE_INDEX => MAX_INDEX_SIZE,
            MEDIA_TYPE_BOOT => MAX_BOOT_PAGES_SIZE,
            MEDIA_TYPE_LOOKUP => MAX_LOOKUP_SIZE,
            MEDIA_TYPE_TAR_INDEX => MAX_TAR_INDEX_SIZE,
            other => {
                return Err(ArtifactError::NotLamina(format!(
                    "{what}: layer type {other} is not a zstd lamina layer"
                )))
            }
        };
        let size = annotated_size(desc, what)?;
        if let Some(size) = size {
            too_large(what, size, max)?;
        }
        // Decompress no further than the annotation says, else the limit.
        let limit = size.unwrap_or(max);
        too_large(what, desc.size, compressed_limit(limit))?;
        let expected = desc
            .annotations
            .get(ANNOTATION_UNCOMPRESSED_DIGEST)
            .ok_or_else(|| ArtifactError::NotLamina(format!("{what} layer has no content digest")))?
            .clone();
        Ok(CompressedLayer {
            what,
            limit,
            size,
            expected,
        })
    }

    fn corrupt(&self, reason: String) -> ArtifactError {
        ArtifactError::Corrupt {
            what: self.what,
            reason,
        }
    }

    /// Checks `len` bytes of digest `actual`, all the layer decompressed
    /// to (at most one byte past its limit).
    fn check(&self, len: u64, actual: Digest) -> Result<(), ArtifactError> {
        self.check_size(len)?;
        if actual.to_string() != self.expected {
            return Err(self.corrupt(format!(
                "content digest {actual} does not match {}",
                self.expected
            )));
        }
        Ok(())
    }

    /// Checks `len`, the bytes the layer decompressed to (at most one past
    /// its limit), against its limit and its annotated size.
    fn check_size(&self, len: u64) -> Result<(), ArtifactError> {
        if len > self.limit {
            return Err(self.corrupt(format!("decompresses to more than {} bytes", self.limit)));
        }
        if let Some(size) = self.size.filter(|&s| s != len) {
            return Err(self.corrupt(format!(
                "{len} bytes uncompressed, the annotation says {size}"
            )));
        }
        Ok(())
    }
}

/// A boot-pages layer's sizes and content digest, checked against the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootLayer {
    /// Size of the compressed layer (its descriptor's).
    pub compressed_size: u64,
    /// Size of the uncompressed boot pages.
    pub size: u64,
    /// Digest of the uncompressed boot pages.
    pub digest: Digest,
    /// Its zstd frames, in read order.
    pub frames: Vec<BootFrame>,
}

/// One zstd frame of a boot-pages layer: one segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootFrame {
    /// Where it starts in the compressed layer.
    pub offset: u64,
    /// Its compressed size.
    pub compressed_size: u64,
    /// Its size decompressed (a whole boot-pages segment).
    pub size: u64,
    /// Digest of its compressed bytes.
    pub digest: Digest,
}

/// The [`ANNOTATION_BOOT_FRAMES`] value for frames of these compressed
/// bytes and sizes, in layer order.
pub fn boot_frames_annotation(frames: &[(&[u8], u64)]) -> String {
    let list: Vec<serde_json::Value> = frames
        .iter()
        .map(|(z, size)| serde_json::json!([z.len(), size, Digest::of_bytes(z).to_string()]))
        .collect();
    serde_json::Value::Array(list).to_string()
}

/// A boot-pages layer's frames, from its annotation (else the whole layer
/// as one), checked to tile the layer and its uncompressed size exactly.
fn boot_frames(desc: &Descriptor, size: u64) -> Result<Vec<BootFrame>, ArtifactError> {
    let corrupt = |reason: String| ArtifactError::Corrupt {
        what: "boot pages",
        reason,
    };
    let Some(list) = desc.annotations.get(ANNOTATION_BOOT_FRAMES) else {
        return Ok(vec![BootFrame {
            offset: 0,
            compressed_size: desc.size,
            size,
            digest: desc.digest.clone(),
        }]);
    };
    let list: Vec<(u64, u64, String)> = serde_json::from_str(list)
        .map_err(|e| corrupt(format!("bad {ANNOTATION_BOOT_FRAMES} annotation: {e}")))?;
    if list.len() > MAX_BOOT_FRAMES {
        return Err(corrupt(format!("more than {MAX_BOOT_FRAMES} frames")));
    }
    let (mut offset, mut total) = (0u64, 0u64);
    let mut frames = Vec::with_capacity(list.len());
    for (compressed_size, frame_size, digest) in list {
        let digest = Digest::parse(&digest).map_err(|e| corrupt(format!("frame digest: {e}")))?;
        if frame_size < size_of::<BootHeader>() as u64 {
            return Err(corrupt(format!("a frame of {frame_size} bytes")));
        }
        too_large(
            "boot pages frame (compressed)",
            compressed_size,
            compressed_limit(frame_size),
        )?;
        frames.push(BootFrame {
            offset,
            compressed_size,
            size: frame_size,
            digest,
        });
        offset = offset.saturating_add(compressed_size);
        total = total.saturating_add(frame_size);
    }
    if offset != desc.size || total != size || frames.is_empty() {
        return Err(corrupt(format!(
            "frames of {offset} bytes ({total} decompressed) in a layer of {} ({size})",
            desc.size
        )));
    }
    Ok(frames)
}

/// Checks an image's boot-pages layers (its segments) before anything is
/// fetched: each as [`boot_layer`], and all together within the same bound
/// as one (a header each).
pub fn boot_layers(
    descs: &[Descriptor],
    index: &[BlobSummary],
) -> Result<Vec<BootLayer>, ArtifactError> {
    let layers = descs
        .iter()
        .map(|d| boot_layer(d, index))
        .collect::<Result<Vec<_>, _>>()?;
    let total = layers.iter().map(|l| l.size).fold(0, u64::saturating_add);
    let frames: usize = layers.iter().map(|l| l.frames.len()).sum();
    if frames > MAX_BOOT_FRAMES {
        return Err(ArtifactError::Corrupt {
            what: "boot pages",
            reason: format!("more than {MAX_BOOT_FRAMES} frames"),
        });
    }
    // Each frame is a segment with a header of its own.
    let headers = (size_of::<BootHeader>() * frames) as u64;
    too_large(
        "boot pages (uncompressed, all segments)",
        total,
        boot_pages_bound(index).saturating_add(headers),
    )?;
    Ok(layers)
}

/// The most boot-pages bytes, uncompressed, without the header, the image's
/// cache files allow: one extent per page at most, each page once.
fn boot_pages_bound(index: &[BlobSummary]) -> u64 {
    let pages: u64 = index
        .iter()
        .map(|b| b.cache_size / BOOT_PAGE)
        .fold(0, u64::saturating_add);
    let per_page = BOOT_PAGE + size_of::<BootExtent>() as u64;
    // And each blob's chunk table at most once (paged index).
    let tables: u64 = index
        .iter()
        .filter_map(|b| b.table_range())
        .map(|(_, len)| len + size_of::<BootTable>() as u64)
        .fold(0, u64::saturating_add);
    pages
        .saturating_mul(per_page)
        .saturating_add(tables)
        .min(MAX_BOOT_PAGES_SIZE)
}

/// Checks a boot-pages layer's descriptor before anything is fetched: the
/// uncompressed size must fit what boot pages over the index's cache files
/// can be (header, one extent per page at most, each page once) and
/// [`MAX_BOOT_PAGES_SIZE`]; the compressed size must fit zstd's bound of it.
pub fn boot_layer(desc: &Descriptor, index: &[BlobSummary]) -> Result<BootLayer, ArtifactError> {
    const WHAT: &str = "boot pages";
    let missing = |key: &str| ArtifactError::Corrupt {
        what: WHAT,
        reason: format!("layer has no {key} annotation"),
    };
    let size = annotated_size(desc, WHAT)?.ok_or_else(|| missing(ANNOTATION_UNCOMPRESSED_SIZE))?;
    let digest = desc
        .annotations
        .get(ANNOTATION_UNCOMPRESSED_DIGEST)
        .ok_or_else(|| missing(ANNOTATION_UNCOMPRESSED_DIGEST))?;
    let digest = Digest::parse(digest).map_err(|e| ArtifactError::Corrupt {
        what: WHAT,
        reason: format!("bad {ANNOTATION_UNCOMPRESSED_DIGEST} annotation: {e}"),
    })?;
    let frames = boot_frames(desc, size)?;
    // A header for each frame (each is a segment of its own).
    let most = boot_pages_bound(index)
        .saturating_add((size_of::<BootHeader>() * frames.len()) as u64)
        .min(MAX_BOOT_PAGES_SIZE);
    too_large("boot pages (uncompressed)", size, most)?;
    if size < size_of::<BootHeader>() as u64 {
        return Err(ArtifactError::Corrupt {
            what: WHAT,
            reason: format!("{size} bytes is shorter than the boot pages header"),
        });
    }
    too_large("boot pages (compressed)", desc.size, compressed_limit(size))?;
    Ok(BootLayer {
        compressed_size: desc.size,
        size,
        digest,
        frames,
    })
}

/// Loads and validates the chunk index (either version: see
/// [`ChunkIndex::parse_top`]), and checks it names the manifest's blobs.
pub fn read_index(
    source: &dyn ImageSource,
    layers: &LaminaLayers,
) -> Result<IndexTop, ArtifactError> {
    let bytes = read_compressed_layer(source, &layers.index, "chunk index")?;
    parse_index(&bytes, layers)
}

/// Parses index bytes (already read and digest-checked) and checks they
/// name the manifest's blobs.
pub fn parse_index(bytes: &[u8], layers: &LaminaLayers) -> Result<IndexTop, ArtifactError> {
    let index = ChunkIndex::parse_top(bytes)?;
    check_blob_table(&index.blobs, layers)?;
    Ok(index)
}

/// Checks an index's blob table names the manifest's blobs, in order.
pub fn check_blob_table(table: &[BlobSummary], layers: &LaminaLayers) -> Result<(), ArtifactError> {
    if table.len() != layers.blobs.len() {
        return Err(ArtifactError::Corrupt {
            what: "chunk index",
            reason: format!(
                "{} blobs in the index, {} in the manifest",
                table.len(),
                layers.blobs.len()
            ),
        });
    }
    for (entry, desc) in table.iter().zip(&layers.blobs) {
        if hex::encode(entry.digest) != desc.digest.hex() || entry.compressed_size != desc.size {
            return Err(ArtifactError::Corrupt {
                what: "chunk index",
                reason: format!("blob {} does not match the manifest", desc.digest),
            });
        }
    }
    Ok(())
}

/// Checks that a lookup table, of which `header` holds at least the first
/// [`lamina_format::lookup::LOOKUP_HEADER_LEN`] bytes, was built for the manifest's metadata image:
/// its image digest must be the metadata layer's content digest. Reads
/// nothing beyond the header; the table's shape is checked where it is
/// parsed.
pub fn check_lookup(header: &[u8], layers: &LaminaLayers) -> Result<(), ArtifactError> {
    check_lookup_for(header, &layers.metadata)
}

/// [`check_lookup`] against the metadata layer `metadata` (a lamina image's
/// or a tar index's).
pub fn check_lookup_for(header: &[u8], metadata: &Descriptor) -> Result<(), ArtifactError> {
    let corrupt = |reason: String| ArtifactError::Corrupt {
        what: "lookup table",
        reason,
    };
    let header = LookupTable::header(header).map_err(|e| corrupt(e.to_string()))?;
    let metadata = metadata
        .annotations
        .get(ANNOTATION_UNCOMPRESSED_DIGEST)
        .ok_or_else(|| ArtifactError::NotLamina("metadata layer has no content digest".into()))?;
    let built_for = Digest::from_sha256(header.image_digest);
    if built_for.to_string() != *metadata {
        return Err(corrupt(format!(
            "built for metadata {built_for}, the manifest's is {metadata}"
        )));
    }
    Ok(())
}

/// Checks a lookup-table layer's descriptor before a worker fetches it:
/// its annotated size within [`MAX_LOOKUP_SIZE`] (required: the worker
/// decompresses to exactly it), the compressed size within zstd's bound of
/// that. Returns the size.
pub fn check_lookup_layer(desc: &Descriptor) -> Result<u64, ArtifactError> {
    const WHAT: &str = "lookup table";
    let size = annotated_size(desc, WHAT)?.ok_or_else(|| ArtifactError::Corrupt {
        what: WHAT,
        reason: format!("layer has no {ANNOTATION_UNCOMPRESSED_SIZE} annotation"),
    })?;
    too_large(WHAT, size, MAX_LOOKUP_SIZE)?;
    too_large(WHAT, desc.size, compressed_limit(size))?;
    Ok(size)
}

/// Layer annotations for a zstd-compressed layer with content `raw`.
pub fn content_annotations(raw: &[u8]) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            ANNOTATION_UNCOMPRESSED_DIGEST.to_string(),
            Digest::of_bytes(raw).to_string(),
        ),
        (
            ANNOTATION_UNCOMPRESSED_SIZE.to_string(),
            raw.len().to_string(),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use lamina_format::index::IndexBlob;
    use lamina_oci::{OciError, SourceImage, VerifyingReader};
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// One blob, served for any descriptor; remembers whether it was opened.
    #[derive(Debug)]
    struct OneBlob {
        image: SourceImage,
        blob: Vec<u8>,
        opened: AtomicBool,
    }

    impl OneBlob {
        fn new(blob: Vec<u8>) -> Self {
            let config = Descriptor::of_bytes("application/vnd.lamina.test", b"{}");
            OneBlob {
                image: SourceImage {
                    manifest: Manifest {
                        schema_version: 2,
                        media_type: None,
                        config,
                        layers: Vec::new(),
                        annotations: BTreeMap::new(),
                        artifact_type: None,
                        subject: None,
                    },
                    manifest_bytes: Vec::new(),
                    manifest_digest: Digest::of_bytes(b""),
                    config_bytes: b"{}".to_vec(),
                    config: serde_json::Value::Null,
                    layers: Vec::new(),
                },
                blob,
                opened: AtomicBool::new(false),
            }
        }
    }

    impl ImageSource for OneBlob {
        fn image(&self) -> &SourceImage {
            &self.image
        }
        fn open_layer(&self, _: usize) -> Result<Box<dyn Read + Send + '_>, OciError> {
            Err(OciError::Unsupported("no layers".into()))
        }
        /// Checked as an image source checks a blob: digest and size.
        fn open_blob(&self, desc: &Descriptor) -> Result<Box<dyn Read + Send + '_>, OciError> {
            self.opened.store(true, Ordering::Relaxed);
            Ok(Box::new(VerifyingReader::new(
                &self.blob[..],
                desc.digest.clone(),
                Some(desc.size),
            )))
        }
    }

    /// A zstd layer descriptor of `raw` compressed to `z`, with `size` as
    /// its uncompressed-size annotation.
    fn layer(media_type: &str, raw: &[u8], z: &[u8], size: Option<u64>) -> Descriptor {
        let mut desc = Descriptor::of_bytes(media_type, z);
        desc.annotations = content_annotations(raw);
        match size {
            Some(s) => desc
                .annotations
                .insert(ANNOTATION_UNCOMPRESSED_SIZE.into(), s.to_string()),
            None => desc.annotations.remove(ANNOTATION_UNCOMPRESSED_SIZE),
        };
        desc
    }

    type LayerReader = fn(&OneBlob, &Descriptor) -> Result<Vec<u8>, ArtifactError>;

    /// The ways to read a zstd layer: into memory, streamed, a frame per
    /// thread, and frames left for later (here one frame: streamed, every
    /// check made).
    const READERS: [(&str, LayerReader); 4] = [
        ("read", |src, desc| {
            read_compressed_layer(src, desc, "metadata")
        }),
        ("copy", |src, desc| {
            let mut out = Vec::new();
            let n = copy_compressed_layer(src, desc, "metadata", &mut out)?;
            assert_eq!(n, out.len() as u64);
            Ok(out)
        }),
        ("parallel", in_parallel),
        ("frames", by_frames),
    ];

    fn in_parallel(src: &OneBlob, desc: &Descriptor) -> Result<Vec<u8>, ArtifactError> {
        let file = tempfile::tempfile().unwrap();
        let n = copy_compressed_layer_in_parallel(src, desc, "metadata", &file)?;
        let mut out = vec![0; file.metadata().unwrap().len() as usize];
        file.read_exact_at(&mut out, 0).unwrap();
        assert_eq!(n, out.len() as u64);
        Ok(out)
    }

    /// [`read_frames_or_copy`], its frames (if any) decompressed as a lazy
    /// FUSE mount does, each checked against the size its header names.
    fn by_frames(src: &OneBlob, desc: &Descriptor) -> Result<Vec<u8>, ArtifactError> {
        let file = tempfile::tempfile().unwrap();
        match read_frames_or_copy(src, desc, "metadata", &file)? {
            FramesOrCopy::Copied(n) => {
                let mut out = vec![0; n as usize];
                file.read_exact_at(&mut out, 0).unwrap();
                assert_eq!(file.metadata().unwrap().len(), n);
                Ok(out)
            }
            FramesOrCopy::Frames(layer) => {
                let mut out = Vec::new();
                for f in &layer.frames {
                    assert_eq!(f.offset, out.len() as u64, "frames in order, back to back");
                    let bytes = &layer.compressed[f.start as usize..(f.start + f.len) as usize];
                    let content = zstd::bulk::decompress(bytes, f.size as usize).unwrap();
                    assert_eq!(content.len() as u64, f.size);
                    out.extend(content);
                }
                Ok(out)
            }
        }
    }

    /// `raw` compressed as frames of `frame` bytes, each naming its size
    /// but the one at `sizeless` (if any).
    fn frames_of(raw: &[u8], frame: usize, sizeless: Option<usize>) -> Vec<u8> {
        let mut z = Vec::new();
        for (i, piece) in raw.chunks(frame).enumerate() {
            let mut c = zstd::bulk::Compressor::new(3).unwrap();
            c.include_contentsize(sizeless != Some(i)).unwrap();
            z.extend(c.compress(piece).unwrap());
        }
        z
    }

    /// A layer of several frames, each naming its size (the metadata's
    /// form), comes out whole with every check but the content digest's,
    /// which is left to whoever records the file.
    #[test]
    fn frames_are_decompressed_in_parallel() {
        let raw: Vec<u8> = (0..(5 * COPY_BLOCK + 12_345) as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        let z = frames_of(&raw, COPY_BLOCK + 7, None);
        let src = OneBlob::new(z.clone());
        for size in [Some(raw.len() as u64), None] {
            let desc = layer(MEDIA_TYPE_METADATA, &raw, &z, size);
            assert!(in_parallel(&src, &desc).unwrap() == raw);
        }
        let mut other = layer(MEDIA_TYPE_METADATA, &raw, &z, Some(raw.len() as u64));
        other.annotations.insert(
            ANNOTATION_UNCOMPRESSED_DIGEST.into(),
            Digest::of_bytes(b"other").to_string(),
        );
        assert!(
            in_parallel(&src, &other).unwrap() == raw,
            "not checked here"
        );
        // Without a size annotation, streamed with every check.
        other.annotations.remove(ANNOTATION_UNCOMPRESSED_SIZE);
        let err = in_parallel(&src, &other).unwrap_err().to_string();
        assert!(err.contains("does not match"), "{err}");

        let len = raw.len() as u64;
        let err =
            |desc: &Descriptor, src: &OneBlob| in_parallel(src, desc).unwrap_err().to_string();
        let short = layer(MEDIA_TYPE_METADATA, &raw, &z, Some(len - 1));
        assert!(err(&short, &src).contains(&format!("more than {} bytes", len - 1)));
        let long = layer(MEDIA_TYPE_METADATA, &raw, &z, Some(len + 1));
        assert!(err(&long, &src).contains("the annotation says"));
        // Bytes other than the manifest's.
        let mut flipped = z.clone();
        flipped[z.len() / 2] ^= 1;
        let desc = layer(MEDIA_TYPE_METADATA, &raw, &z, Some(len));
        assert!(err(&desc, &OneBlob::new(flipped)).contains("digest"));
        // A last frame cut short, under a digest of its own.
        let cut = &z[..z.len() - 5];
        let desc = layer(MEDIA_TYPE_METADATA, &raw, cut, Some(len));
        assert!(err(&desc, &OneBlob::new(cut.to_vec())).contains("bad zstd frame"));
    }

    /// A layer of several sized frames is fetched and checked, not
    /// decompressed: its frames come back as they are in the layer. Any
    /// other layer is decompressed into the file, with every check.
    #[test]
    fn frames_are_left_compressed_for_a_lazy_mount() {
        let raw: Vec<u8> = (0..(5 * COPY_BLOCK + 12_345) as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        let len = raw.len() as u64;
        let z = frames_of(&raw, COPY_BLOCK, None);
        let src = OneBlob::new(z.clone());
        let desc = layer(MEDIA_TYPE_METADATA, &raw, &z, Some(len));
        let file = tempfile::tempfile().unwrap();
        let FramesOrCopy::Frames(got) =
            read_frames_or_copy(&src, &desc, "metadata", &file).unwrap()
        else {
            panic!("several sized frames were decompressed");
        };
        assert!(got.compressed == z);
        assert_eq!(got.frames.len(), 6);
        assert_eq!(got.frames[1].offset, COPY_BLOCK as u64);
        assert_eq!(got.frames[5].size, 12_345);
        assert_eq!(file.metadata().unwrap().len(), 0, "nothing written");
        assert!(by_frames(&src, &desc).unwrap() == raw);

        let err = |desc: &Descriptor, src: &OneBlob| by_frames(src, desc).unwrap_err().to_string();
        let long = layer(MEDIA_TYPE_METADATA, &raw, &z, Some(len + 1));
        assert!(err(&long, &src).contains("the annotation says"));
        let short = layer(MEDIA_TYPE_METADATA, &raw, &z, Some(len - 1));
        assert!(err(&short, &src).contains("more than"));
        let mut flipped = z.clone();
        flipped[z.len() / 2] ^= 1;
        assert!(err(&desc, &OneBlob::new(flipped)).contains("digest"));
        let cut = &z[..z.len() - 5];
        let desc_cut = layer(MEDIA_TYPE_METADATA, &raw, cut, Some(len));
        assert!(err(&desc_cut, &OneBlob::new(cut.to_vec())).contains("bad zstd frame"));

        // One frame (images from before frames), or no size annotation:
        // decompressed now, the content digest checked.
        let one = zstd::bulk::compress(&raw, 3).unwrap();
        let mut lying = layer(MEDIA_TYPE_METADATA, b"other", &one, Some(len));
        assert!(err(&lying, &OneBlob::new(one.clone())).contains("does not match"));
        lying = layer(MEDIA_TYPE_METADATA, b"other", &z, None);
        assert!(err(&lying, &src).contains("does not match"));
        // In more frames than a mount keeps track of: decompressed now.
        let tiny = frames_of(&raw[..MAX_LAZY_FRAMES + 10], 1, None);
        let desc = layer(
            MEDIA_TYPE_METADATA,
            &raw[..MAX_LAZY_FRAMES + 10],
            &tiny,
            None,
        );
        let mut sized = desc.clone();
        sized.annotations.insert(
            ANNOTATION_UNCOMPRESSED_SIZE.into(),
            (MAX_LAZY_FRAMES + 10).to_string(),
        );
        let file = tempfile::tempfile().unwrap();
        let got = read_frames_or_copy(&OneBlob::new(tiny), &sized, "metadata", &file).unwrap();
        assert!(matches!(got, FramesOrCopy::Copied(n) if n == (MAX_LAZY_FRAMES + 10) as u64));
    }

    /// A layer whose size is not annotated is streamed whole, with the
    /// content digest checked; one whose frames stop naming their sizes is
    /// refused.
    #[test]
    fn frames_without_sizes_are_streamed_and_checked() {
        let raw: Vec<u8> = (0..(3 * COPY_BLOCK) as u32)
            .map(|i| (i % 251) as u8)
            .collect();
        let z = frames_of(&raw, COPY_BLOCK, Some(1));
        let src = OneBlob::new(z.clone());
        let desc = layer(MEDIA_TYPE_METADATA, &raw, &z, None);
        assert!(in_parallel(&src, &desc).unwrap() == raw);
        let mut other = desc.clone();
        other.annotations.insert(
            ANNOTATION_UNCOMPRESSED_DIGEST.into(),
            Digest::of_bytes(b"other").to_string(),
        );
        let err = in_parallel(&src, &other).unwrap_err();
        assert!(err.to_string().contains("does not match"), "{err}");
        // Sized first, then a frame without: refused, not guessed.
        let sized = layer(MEDIA_TYPE_METADATA, &raw, &z, Some(raw.len() as u64));
        let err = in_parallel(&src, &sized).unwrap_err();
        assert!(err.to_string().contains("names no size"), "{err}");
    }

    #[test]
    fn compressed_layer_round_trip() {
        // Several copy blocks, the last one partial.
        let raw: Vec<u8> = (0..(3 * COPY_BLOCK + 12_345) as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        let z = zstd::bulk::compress(&raw, 3).unwrap();
        let src = OneBlob::new(z.clone());
        for (how, reader) in READERS {
            for size in [Some(raw.len() as u64), None] {
                let desc = layer(MEDIA_TYPE_METADATA, &raw, &z, size);
                assert!(reader(&src, &desc).unwrap() == raw, "{how}");
            }
            // The content digest of other bytes.
            let mut other = layer(MEDIA_TYPE_METADATA, &raw, &z, None);
            other.annotations.insert(
                ANNOTATION_UNCOMPRESSED_DIGEST.into(),
                Digest::of_bytes(b"other").to_string(),
            );
            let err = reader(&src, &other).unwrap_err();
            assert!(err.to_string().contains("does not match"), "{how}: {err}");
        }
    }

    /// A streamed layer whose writer fails reports the write.
    #[test]
    fn a_failing_writer_is_reported() {
        struct Full;
        impl Write for Full {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::Error::other("disk full"))
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let raw = vec![7u8; 3 * COPY_BLOCK];
        let z = zstd::bulk::compress(&raw, 3).unwrap();
        let src = OneBlob::new(z.clone());
        let desc = layer(MEDIA_TYPE_METADATA, &raw, &z, None);
        let err = copy_compressed_layer(&src, &desc, "metadata", &mut Full).unwrap_err();
        assert!(matches!(err, ArtifactError::Write { .. }), "{err}");
        assert!(err.to_string().contains("disk full"), "{err}");
    }

    /// Sizes beyond the layer's limit are refused before the blob is
    /// opened; a frame larger than its annotation is cut at the annotation.
    #[test]
    fn compressed_layer_sizes_are_bounded() {
        let raw = vec![0u8; 1 << 20];
        let z = zstd::bulk::compress(&raw, 3).unwrap();
        for (how, reader) in READERS {
            sizes_are_bounded(how, reader, &raw, &z);
        }
    }

    fn sizes_are_bounded(how: &str, reader: LayerReader, raw: &[u8], z: &[u8]) {
        let src = OneBlob::new(z.to_vec());
        let refused_unopened = |desc: &Descriptor| {
            let err = reader(&src, desc).unwrap_err();
            assert!(
                matches!(err, ArtifactError::TooLarge { .. }),
                "{how}: {err}"
            );
            assert!(!src.opened.load(Ordering::Relaxed), "{how}");
        };
        refused_unopened(&layer(MEDIA_TYPE_METADATA, raw, z, Some(1 << 40)));
        refused_unopened(&layer(
            MEDIA_TYPE_METADATA,
            raw,
            z,
            Some(MAX_METADATA_SIZE + 1),
        ));
        refused_unopened(&layer(MEDIA_TYPE_INDEX, raw, z, Some(MAX_INDEX_SIZE + 1)));
        let mut huge = layer(MEDIA_TYPE_METADATA, raw, z, None);
        huge.size = u64::MAX;
        refused_unopened(&huge);
        let mut over_bound = layer(MEDIA_TYPE_METADATA, raw, z, Some(1000));
        over_bound.size = compressed_limit(1000) + 1;
        refused_unopened(&over_bound);
        // 1 MiB of zeros whose annotation says 1000 bytes: stops after 1001.
        let lying = layer(MEDIA_TYPE_METADATA, raw, z, Some(1000));
        let err = reader(&src, &lying).unwrap_err();
        assert!(
            err.to_string().contains("more than 1000 bytes"),
            "{how}: {err}"
        );
        let mut blob = layer(MEDIA_TYPE_METADATA, raw, z, None);
        blob.media_type = MEDIA_TYPE_BLOB.into();
        assert!(reader(&src, &blob).is_err(), "{how}");
    }

    fn index_with_cache(cache_size: u64) -> Vec<BlobSummary> {
        vec![IndexBlob {
            digest: [0; 32],
            compressed_size: 0,
            cache_size,
            chunks: Vec::new(),
        }
        .summary()]
    }

    /// Issue 7: a boot-pages annotation of 1 TiB made every worker start
    /// preallocate it and abort.
    #[test]
    fn boot_layer_sizes_are_bounded() {
        let raw = vec![7u8; 64];
        let z = zstd::bulk::compress(&raw, 3).unwrap();
        let index = index_with_cache(8 << 20);
        let good = layer(MEDIA_TYPE_BOOT, &raw, &z, Some(raw.len() as u64));
        let boot = boot_layer(&good, &index).unwrap();
        assert_eq!((boot.size, boot.compressed_size), (64, z.len() as u64));
        assert_eq!(boot.digest, Digest::of_bytes(&raw));

        let too_large = |desc: &Descriptor, index: &[BlobSummary]| {
            let err = boot_layer(desc, index).unwrap_err();
            assert!(matches!(err, ArtifactError::TooLarge { .. }), "{err}");
        };
        too_large(&layer(MEDIA_TYPE_BOOT, &raw, &z, Some(1 << 40)), &index);
        // More than the cache files' pages with their extents could be.
        let most = 16 + 2048 * (4096 + 16);
        assert!(boot_layer(&layer(MEDIA_TYPE_BOOT, &raw, &z, Some(most)), &index).is_ok());
        too_large(&layer(MEDIA_TYPE_BOOT, &raw, &z, Some(most + 1)), &index);
        // The fixed cap, whatever the cache files.
        too_large(
            &layer(MEDIA_TYPE_BOOT, &raw, &z, Some(MAX_BOOT_PAGES_SIZE + 1)),
            &index_with_cache(1 << 40),
        );
        let mut compressed = good.clone();
        compressed.size = 1 << 40;
        too_large(&compressed, &index);

        let corrupt = |desc: &Descriptor| {
            let err = boot_layer(desc, &index).unwrap_err();
            assert!(matches!(err, ArtifactError::Corrupt { .. }), "{err}");
        };
        corrupt(&layer(MEDIA_TYPE_BOOT, &raw, &z, Some(15)));
        corrupt(&layer(MEDIA_TYPE_BOOT, &raw, &z, None));
        let mut bad = good.clone();
        bad.annotations
            .insert(ANNOTATION_UNCOMPRESSED_SIZE.into(), "-1".into());
        corrupt(&bad);
        let mut bad = good.clone();
        bad.annotations
            .insert(ANNOTATION_UNCOMPRESSED_DIGEST.into(), "sha256:zz".into());
        corrupt(&bad);
    }

    /// Issue 29: a boot-pages layer's frames tile it exactly, each
    /// with its digest; a list that does not is refused before a fetch.
    #[test]
    fn boot_frames_tile_their_layer() {
        let index = index_with_cache(8 << 20);
        let raws = [vec![1u8; 4096], vec![2u8; 9000]];
        let zs: Vec<Vec<u8>> = raws
            .iter()
            .map(|r| zstd::bulk::compress(r, 3).unwrap())
            .collect();
        let (raw, z) = (raws.concat(), zs.concat());
        let sizes: Vec<(&[u8], u64)> = zs
            .iter()
            .zip(&raws)
            .map(|(z, r)| (z.as_slice(), r.len() as u64))
            .collect();
        let mut desc = layer(MEDIA_TYPE_BOOT, &raw, &z, Some(raw.len() as u64));
        desc.annotations.insert(
            ANNOTATION_BOOT_FRAMES.into(),
            boot_frames_annotation(&sizes),
        );
        let boot = boot_layer(&desc, &index).unwrap();
        assert_eq!(boot.frames.len(), 2);
        assert_eq!(boot.frames[1].offset, zs[0].len() as u64);
        assert_eq!(boot.frames[1].size, 9000);
        assert_eq!(boot.frames[1].digest, Digest::of_bytes(&zs[1]));
        // Without the annotation: the whole layer, by the layer's digest.
        let plain = layer(MEDIA_TYPE_BOOT, &raw, &z, Some(raw.len() as u64));
        let whole = boot_layer(&plain, &index).unwrap().frames;
        assert_eq!(whole.len(), 1);
        assert_eq!(whole[0].digest, plain.digest);
        let refused = |value: String| {
            let mut bad = desc.clone();
            bad.annotations.insert(ANNOTATION_BOOT_FRAMES.into(), value);
            assert!(boot_layer(&bad, &index).is_err());
        };
        let d = Digest::of_bytes(b"x").to_string();
        let (z0, z1) = (zs[0].len(), zs[1].len());
        refused(format!("[[{z0},4096,\"{d}\"]]")); // short of the layer
        refused(format!("[[{z0},4096,\"{d}\"],[{z1},9001,\"{d}\"]]")); // sizes
        refused(format!("[[{z0},4,\"{d}\"],[{z1},13092,\"{d}\"]]")); // under a header
        refused(format!("[[{z0},4096,\"sha256:zz\"],[{z1},9000,\"{d}\"]]"));
        refused("{}".into());
        refused(format!(
            "[{}]",
            vec![format!("[0,16,\"{d}\"]"); MAX_BOOT_FRAMES + 1].join(",")
        ));
    }

    /// Boot segments: each bounded as one, and all together as one; a
    /// manifest with more than [`MAX_BOOT_SEGMENTS`] of them is refused.
    #[test]
    fn boot_segments_are_bounded_together() {
        let raw = vec![7u8; 64];
        let z = zstd::bulk::compress(&raw, 3).unwrap();
        let index = index_with_cache(8 << 20);
        // The cache files' 2048 pages with an extent each, in two halves.
        let half = 1024 * (4096 + 16) + 16;
        let seg = layer(MEDIA_TYPE_BOOT, &raw, &z, Some(half));
        assert_eq!(
            boot_layers(&[seg.clone(), seg.clone()], &index)
                .unwrap()
                .len(),
            2
        );
        let over = layer(MEDIA_TYPE_BOOT, &raw, &z, Some(half + 1));
        let err = boot_layers(&[seg.clone(), over], &index).unwrap_err();
        assert!(matches!(err, ArtifactError::TooLarge { .. }), "{err}");
        // Three such halves: each fits alone, not together.
        let err = boot_layers(&[seg.clone(), seg.clone(), seg.clone()], &index).unwrap_err();
        assert!(matches!(err, ArtifactError::TooLarge { .. }), "{err}");

        let mut manifest = OneBlob::new(Vec::new()).image.manifest;
        manifest
            .annotations
            .insert(ANNOTATION_FORMAT.into(), FORMAT_VERSION.into());
        manifest.layers = vec![
            layer(MEDIA_TYPE_INDEX, &raw, &z, None),
            layer(MEDIA_TYPE_METADATA, &raw, &z, None),
        ];
        manifest
            .layers
            .extend(std::iter::repeat_n(seg.clone(), MAX_BOOT_SEGMENTS));
        assert_eq!(
            LaminaLayers::from_manifest(&manifest).unwrap().boot.len(),
            MAX_BOOT_SEGMENTS
        );
        manifest.layers.push(seg);
        let err = LaminaLayers::from_manifest(&manifest).unwrap_err();
        assert!(err.to_string().contains("boot-pages layers"), "{err}");

        // Segmented images, images with a lookup table and paged images
        // say so in their version; this build reads all four, and nothing
        // newer.
        manifest.layers.pop();
        assert_eq!(format_version(), FORMAT_VERSION_PAGED);
        for (version, ok) in [
            ("1", true),
            ("2", true),
            ("3", true),
            ("4", true),
            ("5", false),
        ] {
            manifest
                .annotations
                .insert(ANNOTATION_FORMAT.into(), version.into());
            let read = LaminaLayers::from_manifest(&manifest);
            assert_eq!(read.is_ok(), ok, "version {version}: {:?}", read.err());
        }
    }

    /// A tiny EROFS image (a root with one file) and its lookup table.
    fn image_and_table() -> (Vec<u8>, Vec<u8>) {
        use lamina_format::erofs::{write_image, FileChunks};
        use lamina_tree::{DirEntry, Node, NodeKind, Tree};
        let mut tree: Tree<FileChunks> = Tree::new();
        let id = tree.add_node(Node {
            meta: Default::default(),
            kind: NodeKind::Symlink {
                target: b"x".to_vec(),
            },
        });
        if let NodeKind::Directory { entries } = &mut tree.nodes[0].kind {
            entries.insert(b"a".to_vec(), DirEntry { node: id, layer: 0 });
        }
        let (image, _) = write_image(&tree, &[]).unwrap();
        let table = lamina_format::lookup::build_from_image(&image).unwrap();
        (image, table)
    }

    #[test]
    fn a_lookup_table_is_bound_to_the_manifests_metadata() {
        let (image, table) = image_and_table();
        let z = zstd::bulk::compress(&image, 3).unwrap();
        let mut manifest = OneBlob::new(Vec::new()).image.manifest;
        manifest
            .annotations
            .insert(ANNOTATION_FORMAT.into(), format_version().into());
        let table_z = zstd::bulk::compress(&table, 3).unwrap();
        manifest.layers = vec![
            layer(MEDIA_TYPE_INDEX, &image, &z, None),
            layer(MEDIA_TYPE_METADATA, &image, &z, None),
            layer(MEDIA_TYPE_LOOKUP, &table, &table_z, None),
        ];
        let layers = LaminaLayers::from_manifest(&manifest).unwrap();
        assert!(layers.lookup.is_some());
        check_lookup(&table, &layers).unwrap();
        // Another image's metadata in the manifest: refused.
        manifest.layers[1] = layer(MEDIA_TYPE_METADATA, b"other", &z, None);
        let layers = LaminaLayers::from_manifest(&manifest).unwrap();
        let err = check_lookup(&table, &layers).unwrap_err();
        assert!(err.to_string().contains("built for metadata"), "{err}");
        // Not a table at all.
        let err = check_lookup(&image, &layers).unwrap_err();
        assert!(err.to_string().contains("lookup table"), "{err}");
        // Two lookup layers: not an image this build wrote.
        manifest.layers.push(manifest.layers[2].clone());
        assert!(LaminaLayers::from_manifest(&manifest).is_err());
    }
}
