//! Building a tar index: an unmodified image's layers read once each
//! (streamed: memory bounded by the tree, not the layers), out come the
//! EROFS metadata of the merged tree in 512-byte blocks, pointing into each
//! layer's uncompressed tar, and the span table that lets a mount fetch and
//! verify any part of a tar from the original compressed layer.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::io::{self, Read};

use lamina_format::boot::{BootPages, BOOT_PAGE};
use lamina_format::erofs::{self, ChunkAddr, Device, FileChunks, TAR_BLOCK_BITS};
use lamina_format::index::{ChunkEntry, IndexBlob};
use lamina_format::tar_index::{
    window_entry, TarIndex, TarLayer, SPAN_GZIP, SPAN_PLAIN, SPAN_WINDOW, SPAN_ZSTD,
};
use lamina_oci::{Compression, DigestReader, ImageSource, SourceLayer};
use lamina_tree::{apply_layer, Tree};
use lamina_zran::{Codec, LayerSpans, Span, SpanIndexer, SpanKind};

use crate::boot::{read_chunks, ChunkRead, TraceEntry};
use crate::static_boot::Units;

/// Span size (compressed bytes between random-access points) when not
/// told otherwise: the smallest the indexer takes, since a start fetches
/// whole spans and their windows only (measured in docs/index.md: python3
/// on the Debian image moves 6.8 MB at 64 KiB, 7.9 MB at 128 KiB, 19 MB at
/// 1 MiB); the cost is the windows' registry storage (about a fifth of the
/// image at 64 KiB).
pub const DEFAULT_SPAN_SIZE: u64 = 64 << 10;

/// The largest span size `lamina index` takes.
pub const MAX_SPAN_SIZE: u64 = 64 << 20;

/// Why an index could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TarIndexError {
    /// Reading the source.
    #[error(transparent)]
    Oci(#[from] lamina_oci::OciError),
    /// A layer's compressed stream.
    #[error("layer {layer} ({digest}): {source}")]
    Layer {
        /// 0-based.
        layer: usize,
        /// Its blob digest.
        digest: String,
        /// Cause.
        #[source]
        source: lamina_zran::ZranError,
    },
    /// A layer's tar.
    #[error(transparent)]
    Apply(#[from] lamina_tree::ApplyError),
    /// A layer's tar is not the one its config's diff_id names.
    #[error("layer {layer}: its tar has digest {got}, the image config says {want}")]
    DiffId {
        /// 0-based.
        layer: usize,
        /// From the config.
        want: String,
        /// Of the tar read.
        got: String,
    },
    /// A file's last tar block holds other bytes than zeros after its end.
    #[error(
        "layer {layer}: the tar holds non-zero bytes after the end of a file, at offset {offset}; \
         a kernel mount reads a file's last block whole, so an mmap would show them past the \
         file's end: convert the image (`lamina convert`) instead of indexing it"
    )]
    Padding {
        /// 0-based.
        layer: usize,
        /// In the uncompressed tar.
        offset: u64,
    },
    /// Writing the EROFS metadata.
    #[error(transparent)]
    Format(#[from] erofs::FormatError),
    /// A span size outside what this build takes, or a layer too large.
    #[error("{0}")]
    Limit(String),
    /// Local I/O.
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
}

/// What [`build`] made.
#[derive(Debug)]
pub struct BuiltTarIndex {
    /// The EROFS metadata image (512-byte blocks; device i+1 = layer i's tar).
    pub metadata: Vec<u8>,
    /// The span table.
    pub index: TarIndex,
    /// The windows blob: one zstd frame per window, where the table's
    /// window entries say.
    pub windows: Vec<u8>,
    /// Regular files in the merged tree.
    pub files: u64,
    /// Uncompressed bytes of all tars.
    pub tar_bytes: u64,
}

/// Reads every layer of `source` once and builds its tar index with spans
/// of about `span_size` compressed bytes. `progress` gets each layer's
/// number as it starts.
pub fn build(
    source: &dyn ImageSource,
    span_size: u64,
    progress: &dyn Fn(usize),
) -> Result<BuiltTarIndex, TarIndexError> {
    if !(lamina_zran::MIN_SPAN_SIZE..=MAX_SPAN_SIZE).contains(&span_size) {
        return Err(TarIndexError::Limit(format!(
            "span size {span_size}: from {} to {MAX_SPAN_SIZE} bytes",
            lamina_zran::MIN_SPAN_SIZE
        )));
    }
    let image = source.image();
    let mut tree: Tree<FileChunks> = Tree::new();
    let mut layers = Vec::with_capacity(image.layers.len());
    let mut windows = Vec::new();
    for (i, layer) in image.layers.iter().enumerate() {
        progress(i);
        let spans = index_layer(source, &mut tree, i, layer, span_size)?;
        layers.push(tar_layer(layer, spans, &mut windows)?);
    }
    let devices = layers
        .iter()
        .map(|l| {
            let blocks = l.blob.cache_size.div_ceil(1 << TAR_BLOCK_BITS);
            Ok(Device {
                tag: hex::encode(l.blob.digest),
                blocks: u32::try_from(blocks)
                    .map_err(|_| TarIndexError::Limit("a layer's tar over 2 TiB".into()))?,
            })
        })
        .collect::<Result<Vec<_>, TarIndexError>>()?;
    let (metadata, stats) = erofs::write_image_with(&tree, &devices, TAR_BLOCK_BITS)?;
    let tar_bytes = layers.iter().map(|l| l.blob.cache_size).sum();
    // The bound a mount holds spans to: the largest one (the indexer cuts
    // spans at 16 span sizes of output, but a zstd frame cannot be cut).
    let largest = layers
        .iter()
        .flat_map(|l| &l.blob.chunks)
        .map(|c| u64::from(c.size.get()))
        .max()
        .unwrap_or(0);
    let span_bits = largest.next_power_of_two().trailing_zeros().max(16) as u8;
    Ok(BuiltTarIndex {
        metadata,
        index: TarIndex {
            span_bits,
            layers,
            prefetch: Vec::new(),
        },
        windows,
        files: stats.inodes,
        tar_bytes,
    })
}

/// The reads of a trace recorded through a mount of this index (`lamina
/// mount --record-trace`: its lines name spans by digest and give offsets
/// inside them), as (layer, span) reads. Lines naming spans this index does
/// not have are skipped.
pub fn trace_span_reads(index: &TarIndex, trace: &[TraceEntry]) -> Vec<ChunkRead> {
    let mut at: HashMap<[u8; 32], (usize, usize)> = HashMap::new();
    for (l, layer) in index.layers.iter().enumerate() {
        for (k, span) in layer.blob.chunks.iter().enumerate() {
            at.entry(span.digest).or_insert((l, k));
        }
    }
    trace
        .iter()
        .filter_map(|entry| {
            let &(blob, chunk) = at.get(&entry.digest)?;
            // A line without a range puts its span in the boot set, no page.
            let (offset, len) = entry.range.unwrap_or((0, 0));
            Some(ChunkRead {
                blob,
                chunk,
                offset,
                len,
            })
        })
        .collect()
}

/// The boot pages and boot set of `reads` (spans of this index, in the
/// order a start reads them). The boot set becomes `index.prefetch`, the
/// spans in the order first read; the pages read are read back from the
/// layers' tars (each layer that has any streamed once more, every span
/// holding a page checked against its digest).
pub fn boot_pages(
    source: &dyn ImageSource,
    index: &mut TarIndex,
    reads: &[ChunkRead],
) -> Result<BootPages, TarIndexError> {
    let (mut pages, mut seen) = (Vec::new(), HashSet::new());
    for read in reads {
        let (l, k) = (read.blob, read.chunk);
        let span = &index.layers[l].blob.chunks[k];
        let (base, size) = (span.cache_offset.get(), u64::from(span.size.get()));
        let start = base + read.offset.min(size);
        let end = base + read.offset.saturating_add(read.len).min(size);
        for page in start / BOOT_PAGE..end.div_ceil(BOOT_PAGE) {
            if seen.insert((l, page)) {
                pages.push((l, page));
            }
        }
    }
    index.prefetch = read_chunks(reads)
        .into_iter()
        .map(|(l, k)| (l as u32, k as u32))
        .collect();
    let mut bytes: HashMap<(usize, u64), Vec<u8>> = HashMap::new();
    for (l, layer) in index.layers.iter().enumerate() {
        let wanted: BTreeSet<u64> = pages.iter().filter(|p| p.0 == l).map(|p| p.1).collect();
        if !wanted.is_empty() {
            let got = read_pages(source, l, &layer.blob, &wanted)?;
            bytes.extend(got.into_iter().map(|(page, data)| ((l, page), data)));
        }
    }
    let mut boot = BootPages::default();
    for (l, page) in pages {
        let Some(data) = bytes.remove(&(l, page)) else {
            continue;
        };
        boot.push_page(l as u32, page, &data);
    }
    Ok(boot)
}

/// The largest span [`SpanUnits`] decodes: a walk reads headers and
/// tables, and a zstd layer of one frame is one span of the whole tar.
const MAX_WALK_SPAN: u64 = 64 << 20;

/// An indexed image's spans for a walk over its files
/// ([`crate::static_boot`]): each fetched from its layer's compressed blob
/// as a range, decoded alone with its window and checked against its
/// digest, then kept.
pub struct SpanUnits<'a> {
    source: &'a dyn ImageSource,
    index: &'a TarIndex,
    /// The windows blob the index's window entries point into.
    windows: &'a [u8],
    spans: HashMap<(usize, usize), Vec<u8>>,
}

impl std::fmt::Debug for SpanUnits<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpanUnits")
            .field("spans", &self.spans.len())
            .finish_non_exhaustive()
    }
}

impl<'a> SpanUnits<'a> {
    /// The spans of `built`, read from `source` (the image it indexes).
    pub fn new(source: &'a dyn ImageSource, built: &'a BuiltTarIndex) -> Self {
        SpanUnits {
            source,
            index: &built.index,
            windows: &built.windows,
            spans: HashMap::new(),
        }
    }

    /// Span `k` of layer `l`, decoded and checked.
    fn decode(&self, l: usize, k: usize) -> io::Result<Vec<u8>> {
        let layer = &self.index.layers[l];
        let span = &layer.blob.chunks[k];
        if u64::from(span.size.get()) > MAX_WALK_SPAN {
            return Err(io::Error::other("a span too large to read for a boot set"));
        }
        let window = match &layer.windows[k] {
            Some(entry) => Some(self.window(entry)?),
            None => None,
        };
        let descriptor = &self.source.image().layers[l].descriptor;
        let stored = self
            .source
            .read_blob_range(
                descriptor,
                span.compressed_offset.get(),
                u64::from(span.compressed_size.get()),
            )
            .map_err(io::Error::other)?
            .ok_or_else(|| {
                io::Error::other(
                    "this source reads layers whole only: index from oci: or docker:// \
                     for --boot-exec",
                )
            })?;
        lamina_zran::decode_entry(span, window.as_deref(), &stored).map_err(io::Error::other)
    }

    /// A window, from the windows blob, checked against its digest.
    fn window(&self, entry: &ChunkEntry) -> io::Result<Vec<u8>> {
        let at = entry.compressed_offset.get() as usize;
        let stored = self
            .windows
            .get(at..at + entry.compressed_size.get() as usize)
            .ok_or_else(|| io::Error::other("a window outside the windows blob"))?;
        let window = zstd::bulk::decompress(stored, entry.size.get() as usize)?;
        if lamina_oci::sha256(&window) != entry.digest {
            return Err(io::Error::other("a window does not match its digest"));
        }
        Ok(window)
    }
}

impl Units for SpanUnits<'_> {
    fn unit_at(&self, blob: usize, offset: u64) -> Option<(usize, u64, u64)> {
        let spans = &self.index.layers.get(blob)?.blob.chunks;
        let k = spans
            .partition_point(|s| s.cache_offset.get() <= offset)
            .checked_sub(1)?;
        let within = offset - spans[k].cache_offset.get();
        let size = u64::from(spans[k].size.get());
        (within < size).then_some((k, within, size - within))
    }

    fn unit(&mut self, blob: usize, unit: usize) -> io::Result<&[u8]> {
        if !self.spans.contains_key(&(blob, unit)) {
            let data = self.decode(blob, unit)?;
            self.spans.insert((blob, unit), data);
        }
        Ok(&self.spans[&(blob, unit)])
    }
}

/// The `wanted` pages of layer `l`'s tar (each [`BOOT_PAGE`] bytes, the
/// last zero-padded), read from its stream span by span; every span that
/// holds part of a wanted page must match its digest.
fn read_pages(
    source: &dyn ImageSource,
    l: usize,
    blob: &IndexBlob,
    wanted: &BTreeSet<u64>,
) -> Result<HashMap<u64, Vec<u8>>, TarIndexError> {
    let mut tar = source.open_layer(l)?;
    let mut out: HashMap<u64, Vec<u8>> = HashMap::new();
    let mut buf = Vec::new();
    for span in &blob.chunks {
        let start = span.cache_offset.get();
        let end = start + u64::from(span.size.get());
        buf.resize(span.size.get() as usize, 0);
        tar.read_exact(&mut buf)?;
        let inside: Vec<u64> = wanted
            .range(start / BOOT_PAGE..end.div_ceil(BOOT_PAGE))
            .copied()
            .collect();
        if inside.is_empty() {
            continue;
        }
        if lamina_oci::sha256(&buf) != span.digest {
            return Err(TarIndexError::Limit(format!(
                "layer {l}: the tar's bytes {start}..{end} are not the span the index gives"
            )));
        }
        for page in inside {
            let page_at = page * BOOT_PAGE;
            let data = out
                .entry(page)
                .or_insert_with(|| vec![0; BOOT_PAGE as usize]);
            let from = page_at.max(start);
            let to = (page_at + BOOT_PAGE).min(end);
            data[(from - page_at) as usize..(to - page_at) as usize]
                .copy_from_slice(&buf[(from - start) as usize..(to - start) as usize]);
        }
    }
    // The stream checks its digests at its end.
    io::copy(&mut tar, &mut io::sink())?;
    Ok(out)
}

/// Applies layer `i` to `tree` from its compressed blob, recording its
/// spans on the way; checks the tar against the config's diff_id.
fn index_layer(
    source: &dyn ImageSource,
    tree: &mut Tree<FileChunks>,
    i: usize,
    layer: &SourceLayer,
    span_size: u64,
) -> Result<LayerSpans, TarIndexError> {
    let zran_err = |source| TarIndexError::Layer {
        layer: i,
        digest: layer.descriptor.digest.to_string(),
        source,
    };
    let codec = match layer.compression {
        Compression::None => Codec::Plain,
        Compression::Gzip => Codec::Gzip,
        Compression::Zstd => Codec::Zstd,
    };
    // The blob reader checks the compressed digest and size at its end.
    let blob = source.open_blob(&layer.descriptor)?;
    let indexer = SpanIndexer::new(blob, codec, span_size).map_err(zran_err)?;
    let mut tar = DigestReader::new(indexer);
    let device =
        u16::try_from(i + 1).map_err(|_| TarIndexError::Limit("more than 65534 layers".into()))?;
    let tails = ZeroTails::default();
    let mut checked = tails.reader(&mut tar);
    apply_layer(tree, i as u32, &mut checked, |_, _, size, offset| {
        tails.expect(offset + size);
        Ok(file_chunks(device, size, offset))
    })?;
    if let Some(offset) = checked.non_zero() {
        return Err(TarIndexError::Padding { layer: i, offset });
    }
    // apply_layer read the tar to its end; the trailer may follow.
    io::copy(&mut tar, &mut io::sink())?;
    let (indexer, got, _) = tar.finish();
    if got != layer.diff_id {
        return Err(TarIndexError::DiffId {
            layer: i,
            want: layer.diff_id.to_string(),
            got: got.to_string(),
        });
    }
    indexer.finish().map_err(zran_err)
}

/// The ends of the files' last tar blocks, which must be zeros: a tar
/// index points a file at its bytes in the tar, and the kernel reads its
/// last 512-byte block whole (`lamina_format::erofs::TAR_BLOCK_BITS`).
#[derive(Default)]
struct ZeroTails(Tails);

/// The tails still to come, in tar order; shared by the tar reader's
/// callback (which learns of them) and the reader that checks them.
type Tails = std::rc::Rc<std::cell::RefCell<std::collections::VecDeque<std::ops::Range<u64>>>>;

impl ZeroTails {
    /// A file ends at `end`: the rest of its block must be zeros.
    fn expect(&self, end: u64) {
        let block_end = end.next_multiple_of(1 << TAR_BLOCK_BITS);
        if block_end > end {
            self.0.borrow_mut().push_back(end..block_end);
        }
    }

    /// `tar` read through, its bytes checked where [`Self::expect`] said
    /// as they pass (the tar reader learns of a file before its bytes).
    fn reader<R: Read>(&self, tar: R) -> TailChecker<R> {
        TailChecker {
            tar,
            at: 0,
            tails: self.0.clone(),
            non_zero: None,
        }
    }
}

struct TailChecker<R> {
    tar: R,
    at: u64,
    tails: Tails,
    non_zero: Option<u64>,
}

impl<R> TailChecker<R> {
    /// The first offset in a file's tail that held a non-zero byte, or
    /// that was read before it was known to be a tail (never seen: the
    /// check fails closed).
    fn non_zero(&self) -> Option<u64> {
        self.non_zero
    }
}

impl<R: Read> Read for TailChecker<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.tar.read(buf)?;
        let (start, end) = (self.at, self.at + n as u64);
        let mut tails = self.tails.borrow_mut();
        while let Some(tail) = tails.front() {
            if tail.start >= end {
                break;
            }
            let from = tail.start.max(start);
            let to = tail.end.min(end);
            let first_non_zero = match tail.start >= start {
                true => buf[(from - start) as usize..(to - start) as usize]
                    .iter()
                    .position(|&b| b != 0)
                    .map(|k| from + k as u64),
                false => Some(tail.start),
            };
            self.non_zero = self.non_zero.or(first_non_zero);
            if tail.end > end {
                // The rest of this tail comes with the next read.
                tails[0] = end..tail.end;
                break;
            }
            tails.pop_front();
        }
        self.at = end;
        Ok(n)
    }
}

/// A file of `size` bytes at tar offset `offset` (512-aligned) of device
/// `device`: one chunk over all of it (its bytes are contiguous in the
/// tar), so its inode carries one chunk index.
fn file_chunks(device: u16, size: u64, offset: u64) -> FileChunks {
    let bits = size
        .next_power_of_two()
        .trailing_zeros()
        .max(u32::from(TAR_BLOCK_BITS)) as u8;
    let chunks = match size {
        0 => Vec::new(),
        _ => vec![ChunkAddr::Data {
            device,
            // A tar over 2 TiB was refused when its device was sized.
            blkaddr: (offset >> TAR_BLOCK_BITS) as u32,
        }],
    };
    FileChunks {
        chunk_bits: bits,
        chunks,
    }
}

/// zstd level of windows: they are compressed once, at index time.
const WINDOW_LEVEL: i32 = 12;

/// A layer's spans as the index stores them, their windows appended to
/// the windows blob `windows`.
fn tar_layer(
    layer: &SourceLayer,
    spans: LayerSpans,
    windows_blob: &mut Vec<u8>,
) -> Result<TarLayer, TarIndexError> {
    let digest = layer.descriptor.digest.to_sha256();
    let mut chunks = Vec::with_capacity(spans.spans.len());
    let mut windows = Vec::with_capacity(spans.spans.len());
    for span in &spans.spans {
        let (entry, window) = span_entry(span)?;
        chunks.push(entry);
        let stored = window
            .map(|w| {
                let frame = zstd::bulk::compress(&w, WINDOW_LEVEL)?;
                let at = windows_blob.len() as u64;
                windows_blob.extend_from_slice(&frame);
                Ok::<_, io::Error>(window_entry(&w, at, frame.len() as u32))
            })
            .transpose()?;
        windows.push(stored);
    }
    Ok(TarLayer {
        blob: IndexBlob {
            digest,
            compressed_size: spans.compressed_size,
            cache_size: spans.uncompressed_size,
            chunks,
        },
        windows,
    })
}

fn span_entry(span: &Span) -> Result<(ChunkEntry, Option<Vec<u8>>), TarIndexError> {
    let too_big = || TarIndexError::Limit("a span over 4 GiB".into());
    let (flags, extra, window) = match span.kind {
        SpanKind::Plain => (SPAN_PLAIN, 0, None),
        SpanKind::Zstd => (SPAN_ZSTD, 0, None),
        SpanKind::GzipMemberStart => (SPAN_GZIP, 0, None),
        SpanKind::GzipInside => (
            SPAN_GZIP,
            SPAN_WINDOW | u32::from(span.skip_bits),
            Some(span.window.clone()),
        ),
    };
    let entry = ChunkEntry {
        cache_offset: span.uncompressed.start.into(),
        compressed_offset: span.compressed.start.into(),
        compressed_size: u32::try_from(span.compressed.end - span.compressed.start)
            .map_err(|_| too_big())?
            .into(),
        size: u32::try_from(span.len()).map_err(|_| too_big())?.into(),
        flags: flags.into(),
        reserved: extra.into(),
        digest: span.digest,
    };
    Ok((entry, window))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::build::tests::{layer, noise};
    use lamina_format::erofs::{Chunk, Image};
    use lamina_format::tar_index::TarIndex;
    use lamina_oci::{Descriptor, Digest, Manifest, OciError, SourceImage};
    use std::io::{Read, Write};

    /// An image of in-memory layers.
    #[derive(Debug)]
    pub(crate) struct Layers {
        image: SourceImage,
        blobs: Vec<Vec<u8>>,
        /// Whether it reads blob ranges (a docker-archive source does not).
        pub(crate) ranges: bool,
    }

    impl Layers {
        fn blob(&self, desc: &Descriptor) -> &[u8] {
            let i = self
                .image
                .layers
                .iter()
                .position(|l| l.descriptor.digest == desc.digest)
                .expect("a layer");
            &self.blobs[i]
        }
    }

    impl ImageSource for Layers {
        fn image(&self) -> &SourceImage {
            &self.image
        }
        fn open_layer(&self, _: usize) -> Result<Box<dyn Read + Send + '_>, OciError> {
            unreachable!("a tar index reads compressed blobs")
        }
        fn open_blob(&self, desc: &Descriptor) -> Result<Box<dyn Read + Send + '_>, OciError> {
            Ok(Box::new(self.blob(desc)))
        }
        fn read_blob_range(
            &self,
            desc: &Descriptor,
            offset: u64,
            len: u64,
        ) -> Result<Option<Vec<u8>>, OciError> {
            let blob = self.blob(desc);
            Ok(self
                .ranges
                .then(|| blob[offset as usize..(offset + len) as usize].to_vec()))
        }
    }

    pub(crate) fn gzip(tar: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(tar).unwrap();
        e.finish().unwrap()
    }

    pub(crate) fn image(layers: Vec<(Vec<u8>, Vec<u8>, &str)>) -> Layers {
        let mut descs = Vec::new();
        let mut diff_ids = Vec::new();
        let mut blobs = Vec::new();
        for (tar, blob, media_type) in layers {
            descs.push(Descriptor {
                media_type: media_type.into(),
                digest: Digest::of_bytes(&blob),
                size: blob.len() as u64,
                annotations: Default::default(),
                platform: None,
                artifact_type: None,
            });
            diff_ids.push(Digest::of_bytes(&tar).to_string());
            blobs.push(blob);
        }
        let config = serde_json::json!({"rootfs": {"type": "layers", "diff_ids": diff_ids}});
        let config = serde_json::to_vec(&config).unwrap();
        let manifest = Manifest {
            schema_version: 2,
            media_type: Some(lamina_oci::media_types::OCI_MANIFEST.into()),
            config: Descriptor {
                media_type: lamina_oci::media_types::OCI_CONFIG.into(),
                digest: Digest::of_bytes(&config),
                size: config.len() as u64,
                annotations: Default::default(),
                platform: None,
                artifact_type: None,
            },
            layers: descs,
            annotations: Default::default(),
            artifact_type: None,
            subject: None,
        };
        let bytes = serde_json::to_vec(&manifest).unwrap();
        let digest = Digest::of_bytes(&bytes);
        let image = SourceImage::from_parts(manifest, bytes, digest, config).unwrap();
        Layers {
            image,
            blobs,
            ranges: true,
        }
    }

    /// Each file of the merged tree reads, through its chunk in the EROFS
    /// metadata, its bytes at that place of its layer's tar; the spans of
    /// every layer decode alone to their part of the tar.
    #[test]
    fn files_point_into_their_layers_tars() {
        let lower = layer(&[
            ("a", noise(300_000, 1)),
            ("b", b"lower b".to_vec()),
            ("gone", noise(1000, 2)),
        ]);
        let upper = layer(&[
            ("b", noise(200_000, 3)),
            (".wh.gone", Vec::new()),
            ("c", noise(70_000, 4)),
        ]);
        let src = image(vec![
            (
                lower.clone(),
                gzip(&lower),
                lamina_oci::media_types::OCI_LAYER_GZIP,
            ),
            (
                upper.clone(),
                upper.clone(),
                lamina_oci::media_types::OCI_LAYER_TAR,
            ),
        ]);
        let built = build(&src, 64 << 10, &|_| {}).unwrap();
        let tars = [&lower, &upper];
        let meta = Image::new(&built.metadata).unwrap();
        assert_eq!(meta.block_bits(), TAR_BLOCK_BITS);
        let want = [
            ("a", noise(300_000, 1)),
            ("b", noise(200_000, 3)),
            ("c", noise(70_000, 4)),
        ];
        let root = meta.inode(meta.root_nid()).unwrap();
        assert!(meta.lookup(&root, b"gone").unwrap().is_none(), "whited out");
        for (name, bytes) in want {
            let entry = meta.lookup(&root, name.as_bytes()).unwrap().unwrap();
            let inode = meta.inode(entry.nid).unwrap();
            let chunks = meta.chunks(&inode).unwrap();
            let Some(Chunk::Data { device, offset }) = chunks.get(0) else {
                panic!("{name}: no data chunk");
            };
            let tar = tars[usize::from(device) - 1];
            let at = offset as usize;
            assert!(tar[at..at + bytes.len()] == bytes[..], "{name}");
        }
        let index = TarIndex::from_bytes(&built.index.to_bytes()).unwrap();
        for (layer, tar) in index.layers.iter().zip(tars) {
            assert_eq!(layer.blob.cache_size, tar.len() as u64);
            let blob = &src.blobs[index.layers.iter().position(|l| l == layer).unwrap()];
            for (span, window) in layer.blob.chunks.iter().zip(&layer.windows) {
                let at = span.cache_offset.get() as usize;
                let want = &tar[at..at + span.size.get() as usize];
                let c = span.compressed_offset.get() as usize;
                let stored = &blob[c..c + span.compressed_size.get() as usize];
                let window = window.as_ref().map(|w| {
                    let at = w.compressed_offset.get() as usize;
                    let frame = &built.windows[at..at + w.compressed_size.get() as usize];
                    let bytes = zstd::bulk::decompress(frame, w.size.get() as usize).unwrap();
                    assert_eq!(lamina_oci::sha256(&bytes), w.digest);
                    bytes
                });
                let got = lamina_zran::decode_entry(span, window.as_deref(), stored).unwrap();
                assert!(got == want, "span at {at}");
            }
        }
        assert!(
            index.layers[0].blob.chunks.len() > 2,
            "the gzip layer has spans"
        );
    }

    /// A layer whose tar is not what the config's diff_id says is refused.
    #[test]
    fn a_tar_other_than_its_diff_id_is_refused() {
        let tar = layer(&[("a", b"x".to_vec())]);
        let mut src = image(vec![(
            tar.clone(),
            gzip(&tar),
            lamina_oci::media_types::OCI_LAYER_GZIP,
        )]);
        src.image.layers[0].diff_id = Digest::of_bytes(b"another tar");
        let err = build(&src, 64 << 10, &|_| {}).unwrap_err();
        assert!(matches!(err, TarIndexError::DiffId { .. }), "{err}");
    }

    /// Issue 42 point 6: the bytes after a file's end in its last tar
    /// block would show past its end in an mmap of a kernel mount; a tar
    /// with other bytes than zeros there is refused, naming the offset.
    #[test]
    fn a_tar_with_bytes_after_a_files_end_is_refused() {
        let clean = layer(&[("a", b"x".to_vec()), ("b", b"yz".to_vec())]);
        let at = clean.windows(2).position(|w| w == b"yz").unwrap() + 2;
        for (dirty_at, refused) in [(None, false), (Some(513), true), (Some(at + 100), true)] {
            let mut tar = clean.clone();
            if let Some(k) = dirty_at {
                tar[k] = b'!';
            }
            let src = image(vec![(
                tar.clone(),
                gzip(&tar),
                lamina_oci::media_types::OCI_LAYER_GZIP,
            )]);
            match build(&src, 64 << 10, &|_| {}) {
                Ok(_) => assert!(!refused, "byte at {dirty_at:?} not seen"),
                Err(TarIndexError::Padding { layer, offset }) => {
                    assert!(refused, "{offset}");
                    assert_eq!((layer, Some(offset as usize)), (0, dirty_at));
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
}
