//! A layer in independent zstd frames that name their sizes (the
//! metadata's): decompressed a frame per thread, or fetched and left
//! compressed for a lazy mount to decompress as it needs them.

use std::fs::File;
use std::io::Read;
use std::sync::{mpsc, Mutex};

use lamina_oci::ImageSource;

use super::layer::{read_full, stream_layer, CompressedLayer};
use super::*;

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

/// One frame of a layer whose descriptor lists its frames
/// ([`ANNOTATION_METADATA_FRAMES`], [`ANNOTATION_BOOT_FRAMES`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedFrame {
    /// Where it starts in the compressed layer.
    pub offset: u64,
    /// Its compressed size.
    pub compressed_size: u64,
    /// Its size decompressed.
    pub size: u64,
    /// The digest its annotation names: of its content (metadata), of its
    /// compressed bytes (boot pages).
    pub digest: Digest,
}

/// A frames annotation's value: `[compressed size, size, digest]` per
/// frame, in layer order.
pub fn frames_annotation(frames: &[(u64, u64, &Digest)]) -> String {
    let list: Vec<serde_json::Value> = frames
        .iter()
        .map(|(len, size, digest)| serde_json::json!([len, size, digest.to_string()]))
        .collect();
    serde_json::Value::Array(list).to_string()
}

/// Parses the frames annotation `list` (named `key`) of a `what` layer of
/// `(compressed, uncompressed)` sizes: at most `max` frames, none empty
/// of compressed bytes or larger than zstd's bound of its size, tiling
/// the layer and its content exactly.
pub(crate) fn listed_frames(
    list: &str,
    key: &str,
    what: &'static str,
    (layer_size, size): (u64, u64),
    max: usize,
) -> Result<Vec<ListedFrame>, ArtifactError> {
    let corrupt = |reason: String| ArtifactError::Corrupt { what, reason };
    let list: Vec<(u64, u64, String)> =
        serde_json::from_str(list).map_err(|e| corrupt(format!("bad {key} annotation: {e}")))?;
    if list.len() > max {
        return Err(corrupt(format!("more than {max} frames")));
    }
    let (mut offset, mut total) = (0u64, 0u64);
    let mut frames = Vec::with_capacity(list.len());
    for (compressed_size, frame_size, digest) in list {
        let digest = Digest::parse(&digest).map_err(|e| corrupt(format!("frame digest: {e}")))?;
        if compressed_size == 0 {
            return Err(corrupt("a frame of no compressed bytes".into()));
        }
        too_large(what, compressed_size, compressed_limit(frame_size))?;
        frames.push(ListedFrame {
            offset,
            compressed_size,
            size: frame_size,
            digest,
        });
        offset = offset.saturating_add(compressed_size);
        total = total.saturating_add(frame_size);
    }
    if offset != layer_size || total != size || frames.is_empty() {
        return Err(corrupt(format!(
            "frames of {offset} bytes ({total} decompressed) in a layer of {layer_size} ({size})"
        )));
    }
    Ok(frames)
}

/// The metadata layer's frames as its [`ANNOTATION_METADATA_FRAMES`]
/// lists them (`None`: no such annotation, images from before it),
/// checked before anything is fetched: within [`MAX_METADATA_SIZE`] and
/// [`MAX_LAZY_FRAMES`], each frame's content within 4 GiB, together
/// tiling the layer and its annotated size.
pub fn metadata_frames(desc: &Descriptor) -> Result<Option<Vec<ListedFrame>>, ArtifactError> {
    const WHAT: &str = "metadata";
    let Some(list) = desc.annotations.get(ANNOTATION_METADATA_FRAMES) else {
        return Ok(None);
    };
    let size = annotated_size(desc, WHAT)?.ok_or_else(|| ArtifactError::Corrupt {
        what: WHAT,
        reason: format!("frames listed without a {ANNOTATION_UNCOMPRESSED_SIZE} annotation"),
    })?;
    too_large("metadata (uncompressed)", size, MAX_METADATA_SIZE)?;
    let frames = listed_frames(
        list,
        ANNOTATION_METADATA_FRAMES,
        WHAT,
        (desc.size, size),
        MAX_LAZY_FRAMES,
    )?;
    if let Some(f) = frames.iter().find(|f| f.size > u64::from(u32::MAX)) {
        return Err(ArtifactError::Corrupt {
            what: WHAT,
            reason: format!("a frame of {} bytes", f.size),
        });
    }
    Ok(Some(frames))
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
