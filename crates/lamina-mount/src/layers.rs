//! Zstd lamina layers (metadata, chunk index, lookup table) kept
//! uncompressed in the cache, each verified and recorded, for every kind of
//! mount.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use lamina_format::lookup::LOOKUP_HEADER_LEN;
use lamina_image::artifact::{self, ArtifactError, LaminaLayers};

use crate::cache::{store_metadata, store_streamed, store_unrecorded};
use crate::common::{io_err, MountError};

/// The image's lookup table (when it has one), cached at
/// `meta/<layer-hex>.lookup` and checked to be built for the manifest's
/// metadata. Only FUSE mounts read it; the kernel does its own lookups.
pub(crate) fn cached_lookup(
    source: &dyn lamina_oci::ImageSource,
    layers: &LaminaLayers,
    meta_dir: &Path,
    record: Record,
) -> Result<Option<PathBuf>, MountError> {
    match &layers.lookup {
        Some(desc) => cached_lookup_for(source, desc, &layers.metadata, meta_dir, record).map(Some),
        None => Ok(None),
    }
}

/// The lookup table layer `desc` cached at `meta/<layer-hex>.lookup` and
/// checked to be built for the metadata layer `metadata` (a lamina
/// image's or a tar index's).
pub(crate) fn cached_lookup_for(
    source: &dyn lamina_oci::ImageSource,
    desc: &lamina_oci::Descriptor,
    metadata: &lamina_oci::Descriptor,
    meta_dir: &Path,
    record: Record,
) -> Result<PathBuf, MountError> {
    let path = meta_dir.join(format!("{}.lookup", desc.digest.hex()));
    cache_layer_file(source, desc, "lookup table", &path, false, record)?;
    let file = fs::File::open(&path).map_err(io_err(&path))?;
    check_lookup_file(file, &path, metadata)?;
    Ok(path)
}

/// Checks that the lookup table in `file` (at `path`) was built for the
/// metadata layer `metadata`. The binding is in the header: the table is
/// not read here.
pub(crate) fn check_lookup_file(
    mut file: fs::File,
    path: &Path,
    metadata: &lamina_oci::Descriptor,
) -> Result<(), MountError> {
    let mut header = [0; LOOKUP_HEADER_LEN];
    file.read_exact(&mut header).map_err(io_err(path))?;
    Ok(artifact::check_lookup_for(&header, metadata)?)
}

/// A zstd-compressed lamina layer (metadata, chunk index, lookup table),
/// kept uncompressed at `path`; its bytes. See [`cache_layer_file`].
pub(crate) fn cached_layer(
    source: &dyn lamina_oci::ImageSource,
    desc: &lamina_oci::Descriptor,
    what: &'static str,
    path: &Path,
    record: Record,
) -> Result<Vec<u8>, MountError> {
    // Asked to read, it always returns the bytes.
    Ok(cache_layer_file(source, desc, what, path, true, record)?.unwrap_or_default())
}

/// When a layer file fetched for a mount is synced and given its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Record {
    /// Before the mount goes on.
    Now,
    /// By the lazy mount's worker, in the background
    /// (`lamina_fetch::store::adopt_whole`): this mount uses the bytes it
    /// wrote from the layer it verified by the layer's digest; the content
    /// digest's check and the sync (some 150 ms for the 85 MB metadata of a
    /// 1M-file image) are off its path. Until the record is written, a
    /// later mount hashes the file again, so a crash costs a re-hash, never
    /// trust in bytes that were not checked and synced.
    Later,
}

/// Makes `path` hold a zstd-compressed lamina layer's content, verified;
/// returns the bytes if `read`. A cached copy is used as is when its fill
/// record (`lamina_fetch::store::recorded_whole`) says so, without hashing
/// it; one without a record (from before records) is hashed once, synced
/// and recorded; anything else is fetched, checked and stored atomically
/// with its record (or for the record later, see [`Record`]). Both mount
/// paths go through here.
pub(crate) fn cache_layer_file(
    source: &dyn lamina_oci::ImageSource,
    desc: &lamina_oci::Descriptor,
    what: &'static str,
    path: &Path,
    read: bool,
    record: Record,
) -> Result<Option<Vec<u8>>, MountError> {
    let expected = content_digest(desc, what)?;
    if let Ok(mut file) = lamina_fetch::private::open_existing(path) {
        if lamina_fetch::store::recorded_whole(&file, path, &expected).unwrap_or(false) {
            if !read {
                return Ok(None);
            }
            let mut bytes = Vec::new();
            file.read_to_end(&mut bytes).map_err(io_err(path))?;
            return Ok(Some(bytes));
        }
        let mut bytes = Vec::new();
        if file.read_to_end(&mut bytes).is_ok()
            && lamina_oci::sha256(&bytes) == expected
            && file.sync_data().is_ok()
        {
            let _ = lamina_fetch::store::record_whole(&file, path, &expected);
            return Ok(read.then_some(bytes));
        }
    }
    if !read {
        // Recorded now, it is hashed as it is written: streamed, never the
        // whole layer in memory. Recorded later, it is the worker that
        // hashes it before it records it, so the mount waits only for the
        // layer's own digest and the frames' decompression, on every core.
        let record_now = (record == Record::Now).then_some(&expected);
        store_streamed::<MountError>(path, record_now, |file| {
            let copied = match record {
                Record::Now => artifact::copy_compressed_layer(source, desc, what, file),
                Record::Later => {
                    artifact::copy_compressed_layer_in_parallel(source, desc, what, file)
                }
            };
            Ok(copied.map(drop)?)
        })?;
        return Ok(None);
    }
    let bytes = artifact::read_compressed_layer(source, desc, what)?;
    match record {
        Record::Now => store_metadata(path, &bytes, &expected)?,
        Record::Later => store_unrecorded(path, &bytes)?,
    }
    Ok(Some(bytes))
}

/// The metadata layer as a lazy FUSE mount hands it to its daemon.
#[derive(Debug)]
pub(crate) enum MetadataFrames {
    /// Fetched whole and checked against its digest; its frames not
    /// decompressed yet.
    Whole(artifact::LayerFrames),
    /// Its frames as its manifest lists them, only the first fetched (its
    /// compressed bytes, checked): the daemon fetches the others by range.
    Listed {
        first: Vec<u8>,
        frames: Vec<artifact::ListedFrame>,
    },
}

/// The metadata layer for a lazy FUSE mount, whose daemon writes its
/// frames into `path` as requests need them ([`lamina_fuse::frames`]):
/// `None` when `path` is recorded already, else `path` made a sparse file
/// of the metadata's size (unrecorded: the daemon records it once written
/// whole and hashed) and the frames. With `by_range` and frames listed in
/// the manifest, only the first frame is fetched, by range, and checked
/// against its listed digest; if that fails, or without a list, the layer
/// is fetched whole and checked against its digest. A layer not in sized
/// frames (images from before them) is decompressed into `path` at once,
/// as [`cache_layer_file`] does for [`Record::Later`].
pub(crate) fn cache_metadata_frames(
    source: &dyn lamina_oci::ImageSource,
    desc: &lamina_oci::Descriptor,
    path: &Path,
    by_range: bool,
) -> Result<Option<MetadataFrames>, MountError> {
    let expected = content_digest(desc, "metadata")?;
    if open_recorded(path, &expected).is_some() {
        return Ok(None);
    }
    let listed = match by_range {
        true => artifact::metadata_frames(desc)?,
        false => None,
    };
    if let Some(frames) = listed {
        match first_frame(source, desc, &frames[0]) {
            Ok(first) => {
                let size = frames.iter().map(|f| f.size).sum();
                store_streamed::<MountError>(path, None, |file| {
                    file.set_len(size).map_err(io_err(path))
                })?;
                return Ok(Some(MetadataFrames::Listed { first, frames }));
            }
            Err(e) => tracing::warn!("metadata: {e}; fetching the layer whole"),
        }
    }
    let mut frames = None;
    store_streamed::<MountError>(path, None, |file| {
        match artifact::read_frames_or_copy(source, desc, "metadata", file)? {
            artifact::FramesOrCopy::Frames(layer) => {
                let size = layer.frames.last().map_or(0, |f| f.offset + f.size);
                file.set_len(size).map_err(io_err(path))?;
                frames = Some(MetadataFrames::Whole(layer));
            }
            artifact::FramesOrCopy::Copied(_) => {}
        }
        Ok(())
    })?;
    Ok(frames)
}

/// The compressed bytes of the metadata layer's first frame, fetched by
/// range and checked: they decompress to the listed size and digest.
fn first_frame(
    source: &dyn lamina_oci::ImageSource,
    desc: &lamina_oci::Descriptor,
    frame: &artifact::ListedFrame,
) -> Result<Vec<u8>, String> {
    if frame.size > artifact::METADATA_FIRST_FRAME_SIZE as u64 {
        return Err(format!("a first frame of {} bytes", frame.size));
    }
    let first = source
        .read_blob_range(desc, frame.offset, frame.compressed_size)
        .map_err(|e| format!("its first frame: {e}"))?
        .ok_or("the source reads layers whole only")?;
    let span = lamina_fuse::frames::FrameSpan {
        start: frame.offset,
        len: frame.compressed_size,
        offset: 0,
        size: frame.size,
    };
    lamina_fuse::frames::decode_frame(&span, frame.digest.to_sha256(), &first)
        .map_err(|e| format!("its first frame: {e}"))?;
    Ok(first)
}

/// The cache file at `path`, open, if its fill record says it holds
/// content of digest `content` (`lamina_fetch::store::recorded_whole`).
pub(crate) fn open_recorded(path: &Path, content: &[u8; 32]) -> Option<std::fs::File> {
    let file = lamina_fetch::private::open_existing(path).ok()?;
    lamina_fetch::store::recorded_whole(&file, path, content)
        .unwrap_or(false)
        .then_some(file)
}

/// A zstd lamina layer's content digest (SHA-256) from its annotation.
pub(crate) fn content_digest(
    desc: &lamina_oci::Descriptor,
    what: &str,
) -> Result<[u8; 32], MountError> {
    let missing =
        || ArtifactError::NotLamina(format!("{what} layer has no SHA-256 content digest"));
    let annotation = desc
        .annotations
        .get(artifact::ANNOTATION_UNCOMPRESSED_DIGEST)
        .ok_or_else(missing)?;
    let digest = lamina_oci::Digest::parse(annotation).map_err(|_| missing())?;
    Ok(digest.to_sha256())
}

/// Reads every directory and inode of the metadata at `path` with
/// lamina's bounded reader ([`lamina_format::erofs::Image::check_tree`],
/// the reader FUSE mounts serve through) before a kernel mount hands it to
/// the kernel's EROFS parser, which runs as root: what the reader refuses
/// is refused here, by name, and never reaches the kernel.
pub(crate) fn check_metadata(path: &Path) -> Result<(), MountError> {
    let started = std::time::Instant::now();
    let file = fs::File::open(path).map_err(io_err(path))?;
    let map = lamina_sys::MappedFile::map(&file).map_err(io_err(path))?;
    let counts = lamina_format::erofs::Image::new(map.bytes())
        .and_then(|image| image.check_tree())
        .map_err(|e| ArtifactError::Corrupt {
            what: "metadata",
            reason: format!("{}: refused before the kernel mount: {e}", path.display()),
        })?;
    tracing::debug!(
        "metadata checked before the kernel mount: {} directories, {} other inodes, {} entries in {:.1} ms",
        counts.dirs,
        counts.others,
        counts.entries,
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lamina_oci::{Descriptor, Digest, ImageSource, Manifest, OciError, SourceImage};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// One zstd layer, served for any descriptor; counts how often.
    #[derive(Debug)]
    struct OneLayer {
        image: SourceImage,
        compressed: Vec<u8>,
        fetches: AtomicUsize,
        ranges: AtomicUsize,
    }

    impl OneLayer {
        fn new(raw: &[u8]) -> (Self, Descriptor) {
            Self::of(raw, zstd::bulk::compress(raw, 3).unwrap())
        }

        /// `raw` as frames of `frame` bytes (the metadata layer's form).
        fn framed(raw: &[u8], frame: usize) -> (Self, Descriptor) {
            let compressed = raw
                .chunks(frame)
                .flat_map(|piece| zstd::bulk::compress(piece, 3).unwrap())
                .collect();
            Self::of(raw, compressed)
        }

        fn of(raw: &[u8], compressed: Vec<u8>) -> (Self, Descriptor) {
            let mut desc = Descriptor::of_bytes(artifact::MEDIA_TYPE_METADATA, &compressed);
            desc.annotations = artifact::content_annotations(raw);
            let image = SourceImage {
                manifest: Manifest {
                    schema_version: 2,
                    media_type: None,
                    config: Descriptor::of_bytes("application/vnd.lamina.test", b"{}"),
                    layers: Vec::new(),
                    annotations: Default::default(),
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
            };
            let source = OneLayer {
                image,
                compressed,
                fetches: AtomicUsize::new(0),
                ranges: AtomicUsize::new(0),
            };
            (source, desc)
        }
    }

    impl ImageSource for OneLayer {
        fn image(&self) -> &SourceImage {
            &self.image
        }
        fn open_layer(&self, _: usize) -> Result<Box<dyn Read + Send + '_>, OciError> {
            Err(OciError::Unsupported("no layers".into()))
        }
        fn open_blob(&self, _: &Descriptor) -> Result<Box<dyn Read + Send + '_>, OciError> {
            self.fetches.fetch_add(1, Ordering::Relaxed);
            Ok(Box::new(&self.compressed[..]))
        }
        fn read_blob_range(
            &self,
            _: &Descriptor,
            offset: u64,
            len: u64,
        ) -> Result<Option<Vec<u8>>, OciError> {
            self.ranges.fetch_add(1, Ordering::Relaxed);
            let range = offset as usize..(offset + len) as usize;
            Ok(self.compressed.get(range).map(<[u8]>::to_vec))
        }
    }

    /// `raw` in a 64 KiB first frame and 1 MiB frames after it, listed in
    /// the descriptor with each frame's content digest (the first one's
    /// `first_digest` when given).
    fn listed(raw: &[u8], first_digest: Option<Digest>) -> (OneLayer, Descriptor) {
        let first = artifact::METADATA_FIRST_FRAME_SIZE;
        let pieces: Vec<&[u8]> = std::iter::once(&raw[..first])
            .chain(raw[first..].chunks(1 << 20))
            .collect();
        let frames: Vec<Vec<u8>> = pieces
            .iter()
            .map(|p| zstd::bulk::compress(p, 3).unwrap())
            .collect();
        let mut digests: Vec<Digest> = pieces.iter().map(|p| Digest::of_bytes(p)).collect();
        if let Some(d) = first_digest {
            digests[0] = d;
        }
        let list: Vec<_> = frames
            .iter()
            .zip(&pieces)
            .zip(&digests)
            .map(|((f, p), d)| (f.len() as u64, p.len() as u64, d))
            .collect();
        let annotation = artifact::frames_annotation(&list);
        let (source, mut desc) = OneLayer::of(raw, frames.concat());
        desc.annotations
            .insert(artifact::ANNOTATION_METADATA_FRAMES.into(), annotation);
        (source, desc)
    }

    /// A lazy FUSE mount reads only the listed first frame, by range, and
    /// hands the rest to its daemon; a first frame that is not what its
    /// listed digest says, or a mount that splits the metadata, fetches
    /// the layer whole (checked against the layer's digest), as before the
    /// list.
    #[test]
    fn a_listed_first_frame_is_read_by_range_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let raw: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let counts = |s: &OneLayer| {
            let n = |a: &AtomicUsize| a.load(Ordering::Relaxed);
            (n(&s.ranges), n(&s.fetches))
        };

        let (source, desc) = listed(&raw, None);
        let path = dir.path().join("right.erofs");
        let got = cache_metadata_frames(&source, &desc, &path, true).unwrap();
        assert!(
            matches!(&got, Some(MetadataFrames::Listed { frames, .. }) if frames.len() == 4),
            "{got:?}"
        );
        assert_eq!(counts(&source), (1, 0));
        assert_eq!(fs::metadata(&path).unwrap().len(), raw.len() as u64);

        let (source, desc) = listed(&raw, Some(Digest::of_bytes(b"another frame")));
        let path = dir.path().join("wrong.erofs");
        let got = cache_metadata_frames(&source, &desc, &path, true).unwrap();
        assert!(matches!(got, Some(MetadataFrames::Whole(_))), "{got:?}");
        assert_eq!(counts(&source), (1, 1));

        let (source, desc) = listed(&raw, None);
        let path = dir.path().join("split.erofs");
        let got = cache_metadata_frames(&source, &desc, &path, false).unwrap();
        assert!(matches!(got, Some(MetadataFrames::Whole(_))), "{got:?}");
        assert_eq!(counts(&source), (0, 1));
    }

    #[test]
    fn a_cached_layer_is_trusted_by_its_record_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta/x.erofs");
        let raw = b"metadata bytes".repeat(100);
        let (source, desc) = OneLayer::new(&raw);
        let fetches = || source.fetches.load(Ordering::Relaxed);
        let get = || cached_layer(&source, &desc, "metadata", &path, Record::Now).unwrap();

        assert_eq!(get(), raw);
        assert_eq!(fetches(), 1);
        let record = lamina_fetch::store::whole_record_path(&path);
        assert!(record.is_file(), "stored without a record");
        assert_eq!(get(), raw, "a recorded copy");
        assert_eq!(fetches(), 1, "a recorded copy was fetched again");

        // From before records: hashed, then recorded.
        fs::remove_file(&record).unwrap();
        assert_eq!(get(), raw);
        assert_eq!(fetches(), 1, "a good copy without a record was fetched");
        assert!(record.is_file(), "the good copy was not recorded");

        // Replaced by other bytes: the record does not describe the new
        // file, whose bytes do not hash right, so it is fetched again.
        let tmp = dir.path().join("meta/replacement");
        fs::write(&tmp, b"wrong bytes").unwrap();
        fs::rename(&tmp, &path).unwrap();
        assert_eq!(get(), raw);
        assert_eq!(fetches(), 2, "a replaced copy was trusted");

        // Another layer's record at this path does not count either.
        let (other, other_desc) = OneLayer::new(b"other layer");
        let bytes = cached_layer(&other, &other_desc, "metadata", &path, Record::Now).unwrap();
        assert_eq!(bytes, b"other layer");
        assert_eq!(other.fetches.load(Ordering::Relaxed), 1);
    }

    /// A layer file a lazy mount writes (recorded later, by its worker) is
    /// the layer's content whatever its content-digest annotation says, but
    /// only a file that hashes to the annotation is ever recorded; a file
    /// left unrecorded is not trusted by a mount that records at once.
    #[test]
    fn a_layer_file_recorded_later_is_trusted_once_it_hashes_right() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta/x.erofs");
        let record = lamina_fetch::store::whole_record_path(&path);
        let raw: Vec<u8> = (0..3_000_000u32).map(|i| (i % 253) as u8).collect();
        let (source, desc) = OneLayer::framed(&raw, 1 << 20);
        let fetches = || source.fetches.load(Ordering::Relaxed);
        let mut lying = desc.clone();
        let other = lamina_oci::sha256(b"other");
        lying.annotations.insert(
            artifact::ANNOTATION_UNCOMPRESSED_DIGEST.into(),
            format!("sha256:{}", hex::encode(other)),
        );

        cache_layer_file(&source, &lying, "metadata", &path, false, Record::Later).unwrap();
        assert!(fs::read(&path).unwrap() == raw, "not the layer's content");
        assert!(!record.exists(), "recorded by the mount");
        assert!(!lamina_fetch::store::adopt_whole(&path, &other).unwrap());
        assert!(!record.exists(), "recorded against a wrong digest");
        let err = cache_layer_file(&source, &lying, "metadata", &path, false, Record::Now);
        assert!(err.unwrap_err().to_string().contains("does not match"));
        assert_eq!(fetches(), 2);

        fs::remove_file(&path).unwrap();
        cache_layer_file(&source, &desc, "metadata", &path, false, Record::Later).unwrap();
        assert!(!record.exists(), "recorded by the mount");
        let content = lamina_oci::sha256(&raw);
        assert!(lamina_fetch::store::adopt_whole(&path, &content).unwrap());
        assert!(record.is_file(), "not recorded once it hashed right");
        cache_layer_file(&source, &desc, "metadata", &path, false, Record::Now).unwrap();
        assert_eq!(fetches(), 3, "a recorded copy was fetched again");
    }
}
