//! How a lamina image sits in an OCI registry or layout: an ordinary OCI
//! image manifest whose layers are the data blobs, the chunk index and the
//! EROFS metadata image, each with a lamina media type. The media types start
//! with `application/vnd.oci.image.layer.` because containerd hands only such
//! descriptors to a snapshotter.

use std::collections::BTreeMap;

use lamina_format::zstd_bound;
use lamina_oci::{Descriptor, Digest, Manifest};

mod binding;
mod boot;
mod frames;
mod layer;
mod tables;

pub use binding::{
    bind, bound_entry, bound_index, ANNOTATION_REFERENCE_DIGEST, ANNOTATION_REFERENCE_TYPE,
    REFERENCE_TYPE_TAR_INDEX,
};
pub use boot::{boot_frames_annotation, boot_layer, boot_layers, BootFrame, BootLayer};
pub use frames::{
    copy_compressed_layer_in_parallel, frames_annotation, metadata_frames, read_frames_or_copy,
    FramesOrCopy, LayerFrame, LayerFrames, ListedFrame, MAX_LAZY_FRAMES,
};
pub(crate) use layer::read_full;
pub use layer::{copy_compressed_layer, read_compressed_layer};
pub use tables::{check_blob_table, check_lookup_for, check_lookup_layer, parse_index, read_index};

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
/// Metadata layer annotation: its zstd frames, in layer order, as a JSON
/// array of `[compressed size, size, "sha256:<digest of the frame's
/// content>"]`, so that a mount may fetch a frame alone by range and check
/// it before it decompresses a byte more than the size named. Without it
/// (images before it) the layer is fetched whole and checked against its
/// own digest.
pub const ANNOTATION_METADATA_FRAMES: &str = "dev.lamina.metadata.frames";
/// Annotation on a boot-pages layer made from the image alone (`lamina
/// convert --boot-exec`), value [`BOOT_SOURCE_IMAGE`]; absent on pages a
/// recorded start read. A mount keeps its readahead for such pages: they
/// were not recorded at readahead 0 and hold only part of what a start
/// reads.
pub const ANNOTATION_BOOT_SOURCE: &str = "dev.lamina.boot.source";
/// [`ANNOTATION_BOOT_SOURCE`]'s value for boot pages known from the image.
pub const BOOT_SOURCE_IMAGE: &str = "image";

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
/// both read the same. A lazy FUSE mount fetches the frames its requests
/// need (`lamina_fuse::frames`): reading one file of a million with names
/// and mtimes of their own fetched 0.76 MB of frames and data in frames of
/// 1 MiB, 2.1 MB in frames of 4 MiB (docs/bench-scale.md), and that
/// metadata (126 MB) compresses to 27.25 MB against 27.23 MB. A kernel
/// mount fetches all of it: metadata that repeats itself a lot (a million
/// files, every directory with the same 1,000 names, 85 MB) compresses to
/// 7.46 MB in frames of 1 MiB, 6.92 MB in frames of 4 MiB.
pub const METADATA_FRAME_SIZE: usize = 1 << 20;

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
    use super::layer::COPY_BLOCK;
    use super::*;
    use lamina_format::index::{BlobSummary, IndexBlob, MAX_INDEX_SIZE};
    use lamina_oci::ImageSource;
    use lamina_oci::{OciError, SourceImage, VerifyingReader};
    use std::io::{Read, Write};
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
                    index_entries: Vec::new(),
                    index_digest: None,
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
        // More than the cache files' pages with their extents (and those in
        // the directory, with its record) could be.
        let most = 16 + 2048 * (4096 + 32) + 16;
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

    /// Issue 44: the metadata layer lists its frames with their content
    /// digests (convert writes the list); a list that does not tile the
    /// layer and its size, or names an absurd size, is refused before a
    /// fetch; without one the layer is fetched whole.
    #[test]
    fn metadata_frames_tile_their_layer() {
        let raw: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let z = crate::convert::compress_frames(&raw, 100_000, 3).unwrap();
        let mut desc = layer(MEDIA_TYPE_METADATA, &raw, &z.bytes, Some(raw.len() as u64));
        assert_eq!(metadata_frames(&desc).unwrap(), None);
        let listed = z.annotation.clone().unwrap();
        desc.annotations
            .insert(ANNOTATION_METADATA_FRAMES.into(), listed.clone());
        let frames = metadata_frames(&desc).unwrap().unwrap();
        // 64 KiB, then 100,000 bytes a frame.
        let sizes: Vec<u64> = frames.iter().map(|f| f.size).collect();
        assert_eq!(sizes, [65_536, 100_000, 100_000, 34_464]);
        let mut content = 0;
        for f in &frames {
            let at = f.offset as usize..(f.offset + f.compressed_size) as usize;
            let bytes = zstd::bulk::decompress(&z.bytes[at], f.size as usize).unwrap();
            assert_eq!(f.digest, Digest::of_bytes(&bytes));
            assert_eq!(bytes, raw[content..content + bytes.len()]);
            content += bytes.len();
        }
        let refused = |value: String, size: Option<u64>| {
            let mut bad = layer(MEDIA_TYPE_METADATA, &raw, &z.bytes, size);
            bad.annotations
                .insert(ANNOTATION_METADATA_FRAMES.into(), value);
            assert!(metadata_frames(&bad).is_err(), "{bad:?}");
        };
        let d = Digest::of_bytes(b"x").to_string();
        let len = z.bytes.len();
        let size = Some(raw.len() as u64);
        refused(listed, None); // no size to tile
        refused(format!("[[{len},300001,\"{d}\"]]"), size); // sizes
        refused(format!("[[{},300000,\"{d}\"]]", len - 1), size); // short
        refused(format!("[[0,0,\"{d}\"],[{len},300000,\"{d}\"]]"), size);
        refused(format!("[[{len},5000000000,\"{d}\"]]"), Some(5_000_000_000));
        refused(format!("[[{len},300000,\"sha256:zz\"]]"), size);
        refused(format!("[[{len},300000]]"), size);
        refused(
            format!(
                "[{}]",
                vec![format!("[1,1,\"{d}\"]"); MAX_LAZY_FRAMES + 1].join(",")
            ),
            Some(MAX_LAZY_FRAMES as u64 + 1),
        );
    }

    /// Boot segments: each bounded as one, and all together as one; a
    /// manifest with more than [`MAX_BOOT_SEGMENTS`] of them is refused.
    #[test]
    fn boot_segments_are_bounded_together() {
        let raw = vec![7u8; 64];
        let z = zstd::bulk::compress(&raw, 3).unwrap();
        let index = index_with_cache(8 << 20);
        // The cache files' 2048 pages with an extent each and each in the
        // directory, with its record, in two halves (a header each).
        let half = 1024 * (4096 + 32) + 8 + 16;
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
        check_lookup_for(&table, &layers.metadata).unwrap();
        // Another image's metadata in the manifest: refused.
        manifest.layers[1] = layer(MEDIA_TYPE_METADATA, b"other", &z, None);
        let layers = LaminaLayers::from_manifest(&manifest).unwrap();
        let err = check_lookup_for(&table, &layers.metadata).unwrap_err();
        assert!(err.to_string().contains("built for metadata"), "{err}");
        // Not a table at all.
        let err = check_lookup_for(&image, &layers.metadata).unwrap_err();
        assert!(err.to_string().contains("lookup table"), "{err}");
        // Two lookup layers: not an image this build wrote.
        manifest.layers.push(manifest.layers[2].clone());
        assert!(LaminaLayers::from_manifest(&manifest).is_err());
    }
}
