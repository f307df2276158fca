//! A lazy FUSE mount's metadata, filled a zstd frame at a time.
//!
//! The metadata layer is a run of independent zstd frames: 64 KiB of
//! content first (superblock, device table, root), then 4 MiB each. A lazy
//! mount fetches the layer whole and checks it against
//! its digest (the manifest's), but leaves the frames compressed: the
//! daemon maps the metadata file while it is still sparse and decompresses
//! into it, as they are needed, only the frames a request reads (the
//! reader asks through [`Gate`] before it reads a byte), and the rest on
//! threads in the background. A million-file image's 85 MB are then not
//! decompressed before the mount returns, only the 64 KiB of its first frame.
//!
//! A frame is written once, before anything reads it: the mapping never
//! shows a byte that changes later. A frame that does not decompress to the
//! size its header names fails every read that needs it (EIO), and is never
//! retried: the layer matched its digest, so the image itself is bad. Once
//! every frame is written the file is hashed against the content digest and
//! only then recorded, so later mounts trust it
//! ([`lamina_fetch::store::adopt_whole`]).

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use lamina_format::erofs::Gate;
use serde::{Deserialize, Serialize};

/// The metadata's frames, as the mount hands them to the daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetadataFrames {
    /// The layer's bytes, checked against its digest by the mount.
    pub compressed_path: PathBuf,
    /// Its frames, in order, back to back in the content.
    pub frames: Vec<FrameSpan>,
    /// The content digest (`sha256:<hex>`) the whole file must hash to
    /// before it is recorded.
    pub digest: String,
}

/// One zstd frame: where it lies in the layer and in the content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrameSpan {
    /// Offset in the compressed layer.
    pub start: u64,
    /// Compressed length.
    pub len: u64,
    /// Offset of its content in the metadata file.
    pub offset: u64,
    /// Content size, as its header names it.
    pub size: u64,
}

const PENDING: u8 = 0;
const BUSY: u8 = 1;
const DONE: u8 = 2;
const FAILED: u8 = 3;

/// The frames of one metadata file, and which are written.
#[derive(Debug)]
pub struct FrameFill {
    /// What the mount handed over: the frames, where the compressed layer
    /// is, the content digest.
    spec: MetadataFrames,
    compressed: File,
    out: File,
    state: Vec<AtomicU8>,
    /// Frames not written yet.
    left: AtomicUsize,
    /// Why a frame failed.
    errors: Mutex<HashMap<usize, String>>,
    /// Wakes readers waiting for a frame another thread is writing.
    settled: (Mutex<()>, Condvar),
    /// One writer at a time: writers of one file spin on its lock.
    writing: Mutex<()>,
    /// Frames decompressed so far (each exactly once).
    decompressed: AtomicUsize,
}

/// What a thread decompressing frames keeps between them.
#[derive(Default)]
struct Buffers {
    compressed: Vec<u8>,
    content: Vec<u8>,
    dctx: Option<zstd::bulk::Decompressor<'static>>,
}

impl FrameFill {
    /// The frames of `spec`, to be written into `out` (open for writing,
    /// as long as the frames' content) from the file at
    /// `spec.compressed_path`. The spans must lie in that file and cover
    /// `out` back to back.
    pub fn new(spec: &MetadataFrames, out: File) -> std::io::Result<FrameFill> {
        let compressed = File::open(&spec.compressed_path)?;
        let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
        let (zlen, olen) = (compressed.metadata()?.len(), out.metadata()?.len());
        let mut offset = 0u64;
        for (i, f) in spec.frames.iter().enumerate() {
            if f.offset != offset || f.start.checked_add(f.len).is_none_or(|e| e > zlen) {
                return Err(bad(format!("metadata frame {i}: {f:?} out of place")));
            }
            offset = offset.saturating_add(f.size);
        }
        if offset != olen {
            return Err(bad(format!(
                "metadata frames cover {offset} bytes, the file has {olen}"
            )));
        }
        let n = spec.frames.len();
        Ok(FrameFill {
            spec: spec.clone(),
            compressed,
            out,
            state: (0..n).map(|_| AtomicU8::new(PENDING)).collect(),
            left: AtomicUsize::new(n),
            errors: Mutex::default(),
            settled: (Mutex::new(()), Condvar::new()),
            writing: Mutex::new(()),
            decompressed: AtomicUsize::new(0),
        })
    }

    /// The file being filled.
    pub fn file(&self) -> &File {
        &self.out
    }

    /// Whether every frame is written.
    pub fn complete(&self) -> bool {
        self.left.load(Ordering::Acquire) == 0
    }

    /// Frames decompressed so far.
    pub fn decompressed(&self) -> usize {
        self.decompressed.load(Ordering::Relaxed)
    }

    /// Returns once every frame `range` touches is written (decompressing
    /// those nobody is writing yet on this thread), or why one never will.
    pub fn ensure(&self, range: Range<u64>) -> Result<(), String> {
        if self.complete() || range.is_empty() {
            return Ok(());
        }
        let frames = &self.spec.frames;
        let first = frames.partition_point(|f| f.offset + f.size <= range.start);
        let mut buffers = Buffers::default();
        for (i, f) in frames.iter().enumerate().skip(first) {
            if f.offset >= range.end {
                break;
            }
            self.frame(i, &mut buffers)?;
        }
        Ok(())
    }

    /// Writes every frame not written yet, in order, on this thread (any
    /// number of threads may share the work); the first error.
    pub fn fill_rest(&self, next: &AtomicUsize) -> Result<(), String> {
        let mut buffers = Buffers::default();
        let mut first_error = Ok(());
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= self.spec.frames.len() {
                return first_error;
            }
            if self.state[i].load(Ordering::Acquire) == PENDING {
                let done = self.frame(i, &mut buffers);
                first_error = first_error.and(done);
            }
        }
    }

    /// Frame `i`, written: by this thread if nobody has started it.
    fn frame(&self, i: usize, buffers: &mut Buffers) -> Result<(), String> {
        let state = &self.state[i];
        loop {
            match state.load(Ordering::Acquire) {
                DONE => return Ok(()),
                FAILED => return Err(self.error(i)),
                PENDING => {
                    if state
                        .compare_exchange(PENDING, BUSY, Ordering::AcqRel, Ordering::Acquire)
                        .is_err()
                    {
                        continue;
                    }
                    let written = self.write_frame(i, buffers);
                    if let Err(e) = &written {
                        tracing::error!("{e}");
                        self.errors().insert(i, e.clone());
                    }
                    state.store(
                        if written.is_ok() { DONE } else { FAILED },
                        Ordering::Release,
                    );
                    if written.is_ok() {
                        self.left.fetch_sub(1, Ordering::AcqRel);
                    }
                    let _lock = self.settled.0.lock().unwrap_or_else(|e| e.into_inner());
                    self.settled.1.notify_all();
                    return written;
                }
                _ => {
                    let lock = self.settled.0.lock().unwrap_or_else(|e| e.into_inner());
                    if state.load(Ordering::Acquire) == BUSY {
                        drop(self.settled.1.wait(lock));
                    }
                }
            }
        }
    }

    fn errors(&self) -> std::sync::MutexGuard<'_, HashMap<usize, String>> {
        self.errors.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn error(&self, i: usize) -> String {
        self.errors().get(&i).cloned().unwrap_or_default()
    }

    /// Decompresses frame `i` and writes it in place.
    fn write_frame(&self, i: usize, b: &mut Buffers) -> Result<(), String> {
        let f = self.spec.frames[i];
        let fail = |why: String| format!("metadata frame {i} (layer byte {}): {why}", f.start);
        b.compressed.resize(f.len as usize, 0);
        self.compressed
            .read_exact_at(&mut b.compressed, f.start)
            .map_err(|e| fail(e.to_string()))?;
        let dctx = match &mut b.dctx {
            Some(d) => d,
            None => b
                .dctx
                .insert(zstd::bulk::Decompressor::new().map_err(|e| fail(e.to_string()))?),
        };
        b.content.clear();
        b.content.reserve(f.size as usize); // the spans cover the file: bounded by its size
        let n = dctx
            .decompress_to_buffer(&b.compressed, &mut b.content)
            .map_err(|e| fail(e.to_string()))?;
        if n as u64 != f.size {
            return Err(fail(format!(
                "decompresses to {n} bytes, its header says {}",
                f.size
            )));
        }
        self.decompressed.fetch_add(1, Ordering::Relaxed);
        let _writing = self.writing.lock().unwrap_or_else(|e| e.into_inner());
        lamina_sys::write_all_at_in_pieces(&self.out, &b.content, f.offset)
            .map_err(|e| fail(format!("writing: {e}")))
    }
}

impl Gate for FrameFill {
    fn ready(&self, range: Range<u64>) -> Result<(), String> {
        self.ensure(range)
    }
}

/// Writes the frames nobody has asked for yet on `threads` threads, in
/// the background, only when the CPU is idle (`SCHED_IDLE`: requests
/// decompress the frames they need themselves, and the container started on
/// the mount comes first); once all are written, syncs the file, hashes it against
/// the content digest and records it at `path` (a later mount then trusts
/// it), and removes the compressed layer. Every step is logged.
pub fn fill_in_background(fill: Arc<FrameFill>, path: PathBuf, threads: usize) {
    tracing::info!(
        written = fill.decompressed(),
        frames = fill.spec.frames.len(),
        "metadata frames written before mounting; the rest as needed and in the background"
    );
    let spawned = std::thread::Builder::new()
        .name("metadata-frames".into())
        .spawn(move || {
            let started = std::time::Instant::now();
            if let Err(e) = lamina_sys::run_this_thread_when_idle() {
                tracing::debug!("metadata frames at the daemon's priority: {e}");
            }
            let next = AtomicUsize::new(0);
            let filled = std::thread::scope(|scope| {
                let workers: Vec<_> = (0..threads.max(1))
                    .map(|_| scope.spawn(|| fill.fill_rest(&next)))
                    .collect();
                workers
                    .into_iter()
                    .map(|w| w.join().unwrap_or_else(|_| Err("a thread panicked".into())))
                    .fold(Ok(()), Result::and)
            });
            if let Err(e) = filled {
                tracing::error!("metadata left incomplete, never recorded: {e}");
                return;
            }
            tracing::info!(
                frames = fill.spec.frames.len(),
                decompressed = fill.decompressed(),
                ms = started.elapsed().as_millis() as u64,
                "metadata frames all written"
            );
            match record(&fill, &path) {
                Ok(true) => tracing::info!("metadata hashed and recorded"),
                Ok(false) => tracing::error!(
                    "metadata does not hash to its content digest {}: not recorded",
                    fill.spec.digest
                ),
                Err(e) => tracing::warn!("metadata not recorded: {e}"),
            }
            let _ = std::fs::remove_file(&fill.spec.compressed_path);
        });
    if let Err(e) = spawned {
        tracing::error!("no thread to fill the metadata in the background: {e}");
    }
}

/// Syncs, hashes and records `fill`'s complete metadata file at `path`,
/// if it is still there (another mount may have put a file of its own
/// there).
fn record(fill: &FrameFill, path: &Path) -> std::io::Result<bool> {
    use lamina_fetch::store::identity;
    let there = lamina_fetch::private::open_existing(path)?;
    if identity(&there)? != identity(fill.file())? {
        return Err(std::io::Error::other(
            "another mount has replaced the file meanwhile",
        ));
    }
    let digest = crate::sha256_digest(&fill.spec.digest)
        .ok_or_else(|| std::io::Error::other(format!("bad digest {}", fill.spec.digest)))?;
    lamina_fetch::store::adopt_whole(path, &digest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn sha256(bytes: &[u8]) -> [u8; 32] {
        let d = ring::digest::digest(&ring::digest::SHA256, bytes);
        d.as_ref().try_into().unwrap()
    }

    /// Content of `frames` frames of `frame` bytes and a last one of 100,
    /// the layer (each frame naming its size) in a file, and its spec.
    fn layer(dir: &Path, frame: usize, frames: usize) -> (Vec<u8>, MetadataFrames) {
        let content: Vec<u8> = (0..frame * frames + 100)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let mut z = Vec::new();
        let mut spans = Vec::new();
        for (i, piece) in content.chunks(frame).enumerate() {
            let mut c = zstd::bulk::Compressor::new(3).unwrap();
            c.include_contentsize(true).unwrap();
            let bytes = c.compress(piece).unwrap();
            spans.push(FrameSpan {
                start: z.len() as u64,
                len: bytes.len() as u64,
                offset: (i * frame) as u64,
                size: piece.len() as u64,
            });
            z.extend(bytes);
        }
        let compressed_path = dir.join("layer.zst");
        std::fs::File::create(&compressed_path)
            .unwrap()
            .write_all(&z)
            .unwrap();
        let digest = format!("sha256:{}", hex::encode(sha256(&content)));
        let spec = MetadataFrames {
            compressed_path,
            frames: spans,
            digest,
        };
        (content, spec)
    }

    /// The sparse file the mount makes, `len` bytes.
    fn sparse(path: &Path, len: usize) -> File {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .unwrap();
        f.set_len(len as u64).unwrap();
        f
    }

    fn read_all(path: &Path) -> Vec<u8> {
        std::fs::read(path).unwrap()
    }

    /// A read needs only its frames: those are written, the others stay
    /// holes until asked for or filled in the background; then the file
    /// is whole, hashed and recorded.
    #[test]
    fn frames_are_written_as_they_are_needed() {
        let dir = tempfile::tempdir().unwrap();
        let (content, spec) = layer(dir.path(), 4096, 3);
        let path = dir.path().join("meta.erofs");
        let fill = Arc::new(FrameFill::new(&spec, sparse(&path, content.len())).unwrap());
        fill.ensure(5000..5010).unwrap();
        let now = read_all(&path);
        assert!(now[4096..8192] == content[4096..8192], "frame 1 written");
        assert!(now[..4096].iter().all(|&b| b == 0), "frame 0 not yet");
        assert!(now[8192..].iter().all(|&b| b == 0), "frames 2, 3 not yet");
        fill.ensure(0..0).unwrap();
        assert_eq!(fill.decompressed(), 1, "an empty range needs no frame");
        // Across a boundary: both frames.
        fill.ensure(8000..8300).unwrap();
        fill.ensure(0..1).unwrap();
        assert_eq!(fill.decompressed(), 3);
        assert!(!fill.complete());
        assert!(read_all(&path)[..12288] == content[..12288]);

        fill_in_background(fill.clone(), path.clone(), 2);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while spec.compressed_path.exists() {
            assert!(std::time::Instant::now() < deadline, "never finished");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(fill.complete());
        assert_eq!(fill.decompressed(), 4, "each frame once");
        assert!(read_all(&path) == content);
        let file = File::open(&path).unwrap();
        let digest = sha256(&content);
        assert!(lamina_fetch::store::recorded_whole(&file, &path, &digest).unwrap());
    }

    /// Many readers at once: every frame is decompressed by one of them,
    /// and each reader returns only once its bytes are there.
    #[test]
    fn concurrent_readers_share_each_frame() {
        let dir = tempfile::tempdir().unwrap();
        let (content, spec) = layer(dir.path(), 64 << 10, 16);
        let path = dir.path().join("meta.erofs");
        let fill = FrameFill::new(&spec, sparse(&path, content.len())).unwrap();
        let reader = File::open(&path).unwrap();
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let (fill, reader, content) = (&fill, &reader, &content);
                s.spawn(move || {
                    for k in 0..40u64 {
                        let at = (t * 7919 + k * 104_729) % content.len() as u64;
                        let end = (at + 70_000).min(content.len() as u64);
                        fill.ensure(at..end).unwrap();
                        let mut got = vec![0; (end - at) as usize];
                        reader.read_exact_at(&mut got, at).unwrap();
                        assert!(got == content[at as usize..end as usize], "at {at}");
                    }
                });
            }
        });
        assert_eq!(
            fill.decompressed(),
            fill.spec.frames.len() - fill.left.load(Ordering::Relaxed)
        );
    }

    /// A frame that does not decompress, or not to the size its header
    /// names, fails every read that needs it, and only those; the file is
    /// never recorded.
    #[test]
    fn a_bad_frame_fails_its_readers_only() {
        let dir = tempfile::tempdir().unwrap();
        let (content, mut spec) = layer(dir.path(), 4096, 3);
        let mut z = std::fs::read(&spec.compressed_path).unwrap();
        let f1 = spec.frames[1];
        z[f1.start as usize] ^= 0xff; // its magic number
        std::fs::write(&spec.compressed_path, &z).unwrap();
        let path = dir.path().join("meta.erofs");
        let fill = Arc::new(FrameFill::new(&spec, sparse(&path, content.len())).unwrap());
        let err = fill.ensure(4096..4097).unwrap_err();
        assert!(err.contains("metadata frame 1"), "{err}");
        assert_eq!(fill.ensure(5000..5001).unwrap_err(), err, "not retried");
        fill.ensure(0..4096).unwrap();
        fill.ensure(8192..content.len() as u64).unwrap();
        fill_in_background(fill.clone(), path.clone(), 2);
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(!fill.complete());
        let file = File::open(&path).unwrap();
        let digest = sha256(&content);
        assert!(!lamina_fetch::store::recorded_whole(&file, &path, &digest).unwrap());

        // A header's size that the spec does not match.
        let (content, good) = layer(dir.path(), 4096, 3);
        spec = good;
        spec.frames[0].size += 1;
        spec.frames[1].offset += 1;
        spec.frames[2].offset += 1;
        spec.frames[3].offset += 1;
        let path = dir.path().join("meta2.erofs");
        let fill = FrameFill::new(&spec, sparse(&path, content.len() + 1)).unwrap();
        let err = fill.ensure(0..1).unwrap_err();
        assert!(
            err.contains("decompresses to 4096 bytes, its header says 4097"),
            "{err}"
        );
    }

    /// The daemon records only the file it filled: one another mount has
    /// renamed over its path meanwhile (even with the same bytes) is that
    /// mount's to record.
    #[test]
    fn only_the_file_filled_is_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let (content, spec) = layer(dir.path(), 4096, 3);
        let path = dir.path().join("meta.erofs");
        let fill = FrameFill::new(&spec, sparse(&path, content.len())).unwrap();
        fill.ensure(0..content.len() as u64).unwrap();
        let other = dir.path().join("other");
        std::fs::write(&other, &content).unwrap();
        std::fs::rename(&other, &path).unwrap();
        let err = record(&fill, &path).unwrap_err();
        assert!(err.to_string().contains("replaced"), "{err}");
        let there = File::open(&path).unwrap();
        let digest = sha256(&content);
        assert!(!lamina_fetch::store::recorded_whole(&there, &path, &digest).unwrap());

        let path = dir.path().join("meta2.erofs");
        let fill = FrameFill::new(&spec, sparse(&path, content.len())).unwrap();
        fill.ensure(0..content.len() as u64).unwrap();
        assert!(record(&fill, &path).unwrap());
        let there = File::open(&path).unwrap();
        assert!(lamina_fetch::store::recorded_whole(&there, &path, &digest).unwrap());
    }

    /// Spans that leave gaps, overlap, lie outside the layer or do not
    /// cover the file are refused before anything is read.
    #[test]
    fn spans_must_cover_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let (content, spec) = layer(dir.path(), 4096, 3);
        let path = dir.path().join("meta.erofs");
        let mut bad = Vec::new();
        let mut s = spec.clone();
        s.frames[2].offset += 1;
        bad.push((s, content.len()));
        let mut s = spec.clone();
        s.frames[3].len += 1;
        bad.push((s, content.len()));
        let mut s = spec.clone();
        s.frames.pop();
        bad.push((s, content.len()));
        bad.push((spec.clone(), content.len() + 1));
        for (s, len) in bad {
            let err = FrameFill::new(&s, sparse(&path, len)).unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{s:?}: {err}");
        }
        assert!(FrameFill::new(&spec, sparse(&path, content.len())).is_ok());
    }
}
