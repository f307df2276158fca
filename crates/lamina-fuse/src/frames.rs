//! A lazy FUSE mount's metadata, filled a zstd frame at a time.
//!
//! The metadata layer is a run of independent zstd frames: 64 KiB of
//! content first (superblock, device table, root), then 4 MiB each. The
//! manifest lists them with their content digests
//! (`dev.lamina.metadata.frames`): a lazy mount fetches only the first
//! frame and checks it, and the daemon maps the metadata file while it is
//! still sparse and writes into it, as they are needed, only the frames a
//! request reads (the reader asks through [`Gate`] before it reads a
//! byte): each fetched by range from the image's source, checked against
//! its digest as it is decompressed, written. The rest follow on a thread
//! in the background. A million-file image's metadata (7 to 27 MB
//! compressed) is then not on the link before the mount returns, only its
//! first frame. Images from before the list: the mount fetches the layer
//! whole and checks it against its digest, and the daemon decompresses its
//! frames as they are needed from that copy.
//!
//! A frame is written once, before anything reads it: the mapping never
//! shows a byte that changes later. A frame that could not be fetched or
//! checked fails the reads that need it (EIO) and is fetched again by the
//! next one. A frame of a layer fetched whole that does not decompress to
//! the size its header names fails every read that needs it, and is never
//! retried: the layer matched its digest, so the image itself is bad. Once
//! every frame is written the file is hashed against the content digest and
//! only then recorded, so later mounts trust it
//! ([`lamina_fetch::store::adopt_whole`]).

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use lamina_daemon::config::SourceSpec;
use lamina_fetch::fetch::{
    decode_chunk, fetch_chunks, BlobChunks, ChunkCodec, FetchOptions, FetchStats, RangeSource,
};
use lamina_format::erofs::Gate;
use lamina_format::index::{ChunkEntry, CHUNK_ZSTD};
use lamina_oci::Digest;
use serde::{Deserialize, Serialize};

/// The metadata's frames, as the mount hands them to the daemon.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MetadataFrames {
    /// The layer's bytes, checked against its digest by the mount.
    pub compressed_path: PathBuf,
    /// Its frames, in order, back to back in the content.
    pub frames: Vec<FrameSpan>,
    /// The content digest (`sha256:<hex>`) the whole file must hash to
    /// before it is recorded.
    pub digest: String,
    /// When the frames are fetched as they are needed: from where, and
    /// their digests. `None`: the whole layer is at `compressed_path`.
    #[serde(default)]
    pub remote: Option<RemoteFrames>,
}

/// Where a layer's frames are fetched from, one by one by range.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RemoteFrames {
    /// The image's source.
    pub source: SourceSpec,
    /// The layer's digest (what is fetched).
    pub layer: String,
    /// Each frame's content digest (`sha256:<hex>`), in order, from the
    /// manifest.
    pub digests: Vec<String>,
    /// How many frames, from the first, the mount fetched and wrote at
    /// `compressed_path` (checked again before use).
    pub local: usize,
    /// How long a reader waits for a frame, seconds.
    pub timeout_secs: u64,
}

/// The fetching side of [`RemoteFrames`].
struct Remote {
    source: Arc<dyn RangeSource>,
    layer: Digest,
    digests: Vec<[u8; 32]>,
    local: usize,
    opts: FetchOptions,
    stats: FetchStats,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("layer", &self.layer)
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

/// Why a frame is not written: `retry` when a later read may fetch it
/// again (the network), not when the image itself is bad.
struct FrameError {
    why: String,
    retry: bool,
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
    /// Where frames not at `compressed` come from.
    remote: Option<Remote>,
    /// When the fill began, and when a read last needed the metadata
    /// (milliseconds after).
    born: Instant,
    last_read_ms: AtomicU64,
    /// Whether a read has needed a frame to be fetched.
    demanded: AtomicBool,
}

/// Frames fetched by range beyond the mount's: at most this many are
/// fetched at once in the background, more wait for the start (below):
/// 8 MiB of content in frames of the default 1 MiB. A start's lookups in
/// metadata of a few MiB touch most of it anyway, and the worker predicts
/// from the whole metadata only (a Debian image's is 1 MiB); a million
/// files' is 120 MiB, of which a start reads a few frames. (Two frames
/// when they held 4 MiB each.) Counted in frames, not bytes: a request
/// each.
const AT_ONCE_FRAMES: usize = 8;
/// Frames fetched in the background wait for a read that needs a frame
/// to be fetched, this long at most...
const FIRST_AT_MOST: Duration = Duration::from_secs(10);
/// ...then until no read has needed the metadata for this long...
const QUIET: Duration = Duration::from_secs(1);
/// ...or this long at most.
const QUIET_AT_MOST: Duration = Duration::from_secs(10);

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
    /// `spec.compressed_path`, or fetched from `spec.remote`'s source. The
    /// spans must cover `out` back to back, and those at the file lie in
    /// it.
    pub fn new(spec: &MetadataFrames, out: File) -> std::io::Result<FrameFill> {
        let source = match &spec.remote {
            // A frame is a read a reader waits on: around P2P daemons.
            Some(r) => Some(lamina_daemon::miss_source(&r.source, r.timeout_secs)?),
            None => None,
        };
        FrameFill::with_source(spec, out, source)
    }

    /// [`FrameFill::new`], remote frames fetched from `source`.
    fn with_source(
        spec: &MetadataFrames,
        out: File,
        source: Option<Arc<dyn RangeSource>>,
    ) -> std::io::Result<FrameFill> {
        let compressed = File::open(&spec.compressed_path)?;
        let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
        let (zlen, olen) = (compressed.metadata()?.len(), out.metadata()?.len());
        let local = spec.remote.as_ref().map_or(spec.frames.len(), |r| r.local);
        let mut offset = 0u64;
        for (i, f) in spec.frames.iter().enumerate() {
            let end = f.start.checked_add(f.len);
            let outside = match i < local {
                true => end.is_none_or(|e| e > zlen),
                // Fetched alone: a chunk of the layer, sizes in 32 bits.
                false => end.is_none() || u32::try_from(f.len.max(f.size)).is_err(),
            };
            if f.offset != offset || outside {
                return Err(bad(format!("metadata frame {i}: {f:?} out of place")));
            }
            offset = offset.saturating_add(f.size);
        }
        if offset != olen {
            return Err(bad(format!(
                "metadata frames cover {offset} bytes, the file has {olen}"
            )));
        }
        let remote = match (&spec.remote, source) {
            (Some(r), Some(source)) => Some(Remote::new(r, spec.frames.len(), source)?),
            (Some(_), None) => return Err(bad("remote metadata frames without a source".into())),
            (None, _) => None,
        };
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
            remote,
            born: Instant::now(),
            last_read_ms: AtomicU64::new(0),
            demanded: AtomicBool::new(false),
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
        self.last_read_ms
            .store(self.born.elapsed().as_millis() as u64, Ordering::Relaxed);
        let frames = &self.spec.frames;
        let first = frames.partition_point(|f| f.offset + f.size <= range.start);
        let mut buffers = Buffers::default();
        for (i, f) in frames.iter().enumerate().skip(first) {
            if f.offset >= range.end {
                break;
            }
            let fetched = self.remote.as_ref().is_some_and(|r| i >= r.local);
            if fetched && self.state[i].load(Ordering::Acquire) != DONE {
                self.demanded.store(true, Ordering::Relaxed);
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
                if self
                    .remote
                    .as_ref()
                    .is_some_and(|r| r.deferred(self.spec.frames.len()))
                {
                    self.wait_for_quiet();
                }
                let done = self.frame(i, &mut buffers);
                first_error = first_error.and(done);
            }
        }
    }

    /// Returns once a read has needed a frame to be fetched (or after
    /// [`FIRST_AT_MOST`]: the mount is idle) and then no read has needed
    /// the metadata for [`QUIET`] (or [`QUIET_AT_MOST`] has passed):
    /// frames fetched in the background wait for the start's own to be
    /// answered first (the link is the start's), as the worker's later
    /// layers do.
    fn wait_for_quiet(&self) {
        while !self.demanded.load(Ordering::Relaxed) && self.born.elapsed() < FIRST_AT_MOST {
            std::thread::sleep(Duration::from_millis(20));
        }
        let began = Instant::now();
        loop {
            let last = Duration::from_millis(self.last_read_ms.load(Ordering::Relaxed));
            let quiet = self.born.elapsed().saturating_sub(last);
            if quiet >= QUIET || began.elapsed() >= QUIET_AT_MOST {
                return;
            }
            std::thread::sleep(QUIET - quiet);
        }
    }

    /// Whether a frame can never be written (the image is bad).
    fn failed_for_good(&self) -> bool {
        self.state
            .iter()
            .any(|s| s.load(Ordering::Acquire) == FAILED)
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
                    let next = match &written {
                        Ok(()) => DONE,
                        Err(e) if e.retry => PENDING,
                        Err(_) => FAILED,
                    };
                    if let Err(e) = &written {
                        tracing::error!("{}", e.why);
                        self.errors().insert(i, e.why.clone());
                    }
                    state.store(next, Ordering::Release);
                    if written.is_ok() {
                        self.left.fetch_sub(1, Ordering::AcqRel);
                    }
                    let _lock = self.settled.0.lock().unwrap_or_else(|e| e.into_inner());
                    self.settled.1.notify_all();
                    return written.map_err(|e| e.why);
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
    fn write_frame(&self, i: usize, b: &mut Buffers) -> Result<(), FrameError> {
        let f = self.spec.frames[i];
        let fail = |why: String, retry: bool| FrameError {
            why: format!("metadata frame {i} (layer byte {}): {why}", f.start),
            retry,
        };
        if let Some(remote) = &self.remote {
            let content = remote
                .frame(i, &f, &self.compressed)
                .map_err(|(why, retry)| fail(why, retry))?;
            return self
                .write_content(&content, f.offset)
                .map_err(|e| fail(e, true));
        }
        let fail = |why: String| fail(why, false);
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
        let content = std::mem::take(&mut b.content);
        let written = self.write_content(&content, f.offset).map_err(fail);
        b.content = content;
        written
    }

    /// Writes a frame's checked content at `offset`.
    fn write_content(&self, content: &[u8], offset: u64) -> Result<(), String> {
        self.decompressed.fetch_add(1, Ordering::Relaxed);
        let _writing = self.writing.lock().unwrap_or_else(|e| e.into_inner());
        lamina_sys::write_all_at_in_pieces(&self.out, content, offset)
            .map_err(|e| format!("writing: {e}"))
    }

    /// The fill's figures for the daemon's status file: frames, those
    /// written, and for remote frames the compressed bytes fetched, the
    /// requests and the answers that failed their digest.
    pub fn to_json(&self) -> serde_json::Value {
        let (fetched_bytes, requests, bad_answers) = self.fetched();
        serde_json::json!({
            "frames": self.spec.frames.len(),
            "written": self.decompressed(),
            "complete": self.complete(),
            "fetched_bytes": fetched_bytes,
            "requests": requests,
            "bad_answers": bad_answers,
        })
    }

    /// For remote frames so far: compressed bytes fetched, requests, and
    /// answers that failed their digest (fetched again).
    pub fn fetched(&self) -> (u64, u64, u64) {
        self.remote.as_ref().map_or((0, 0, 0), |r| {
            (
                r.stats.bytes.load(Ordering::Relaxed),
                r.stats.requests.load(Ordering::Relaxed),
                r.stats.bad_chunks.load(Ordering::Relaxed),
            )
        })
    }
}

impl Remote {
    /// Whether the background waits for the start before it fetches the
    /// frames of a layer of `frames` ([`AT_ONCE_FRAMES`]).
    fn deferred(&self, frames: usize) -> bool {
        frames.saturating_sub(self.local) > AT_ONCE_FRAMES
    }

    fn new(
        spec: &RemoteFrames,
        frames: usize,
        source: Arc<dyn RangeSource>,
    ) -> std::io::Result<Remote> {
        let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
        if spec.digests.len() != frames || spec.local > frames {
            return Err(bad(format!(
                "{} digests and {} frames at hand for {frames} metadata frames",
                spec.digests.len(),
                spec.local
            )));
        }
        let sha256 = |d: &String| -> std::io::Result<[u8; 32]> {
            crate::sha256_digest(d).ok_or_else(|| bad(format!("bad frame digest {d}")))
        };
        let timeout = std::time::Duration::from_secs(spec.timeout_secs.max(1));
        Ok(Remote {
            source,
            layer: Digest::parse(&spec.layer).map_err(|e| bad(e.to_string()))?,
            digests: spec.digests.iter().map(sha256).collect::<Result<_, _>>()?,
            local: spec.local,
            // A frame is one request; a reader waits at most the timeout.
            opts: FetchOptions {
                deadline: timeout,
                parallel: 1,
                ..FetchOptions::default()
            },
            stats: FetchStats::default(),
        })
    }

    /// Frame `i`'s content, checked against its digest: from `compressed`
    /// when the mount put it there, else fetched. The error says whether
    /// a later read may try again.
    fn frame(&self, i: usize, f: &FrameSpan, compressed: &File) -> Result<Vec<u8>, (String, bool)> {
        let entry = frame_entry(f, self.digests[i]);
        if i < self.local {
            let mut stored = vec![0; f.len as usize];
            compressed
                .read_exact_at(&mut stored, f.start)
                .map_err(|e| (e.to_string(), true))?;
            return decode_frame(f, self.digests[i], &stored).map_err(|e| (e, false));
        }
        let got = Mutex::new(None);
        let blob = BlobChunks {
            digest: &self.layer,
            chunks: std::slice::from_ref(&entry),
            codec: ChunkCodec::Lamina,
        };
        fetch_chunks(
            &self.source,
            blob,
            &[0],
            &self.opts,
            &self.stats,
            |_, bytes| {
                *got.lock().unwrap_or_else(|e| e.into_inner()) = Some(bytes);
                Ok(())
            },
        )
        .map_err(|e| (e.to_string(), true))?;
        got.into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .ok_or_else(|| ("fetched, not delivered".to_string(), true))
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
            // Frames fetched by range may fail for a while (the registry):
            // they are tried again, a few times, a while later.
            let rounds = if fill.remote.is_some() { 4 } else { 1 };
            for round in 1..=rounds {
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
                match filled {
                    Ok(()) => break,
                    Err(e) if round < rounds && !fill.failed_for_good() => {
                        tracing::warn!("metadata frames: {e}; trying again in 10 s");
                        std::thread::sleep(Duration::from_secs(10));
                    }
                    Err(e) => {
                        tracing::error!("metadata left incomplete, never recorded: {e}");
                        return;
                    }
                }
            }
            let (fetched_bytes, requests, bad_answers) = fill.fetched();
            tracing::info!(
                frames = fill.spec.frames.len(),
                decompressed = fill.decompressed(),
                fetched_bytes,
                requests,
                bad_answers,
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

/// A listed frame as the chunk fetcher takes it: zstd, of `digest`'s
/// content. Its sizes fit (checked where the frames are: `with_source`,
/// `lamina_image::artifact::metadata_frames`).
fn frame_entry(f: &FrameSpan, digest: [u8; 32]) -> ChunkEntry {
    ChunkEntry {
        cache_offset: f.offset.into(),
        compressed_offset: f.start.into(),
        compressed_size: (f.len as u32).into(),
        size: (f.size as u32).into(),
        flags: CHUNK_ZSTD.into(),
        reserved: 0.into(),
        digest,
    }
}

/// Frame `f`'s content from its compressed bytes `stored`, checked: it
/// decompresses to its size and hashes to `digest` (SHA-256). What the
/// mount checks the first frame with before it hands it over, and the
/// daemon before it writes it.
pub fn decode_frame(f: &FrameSpan, digest: [u8; 32], stored: &[u8]) -> Result<Vec<u8>, String> {
    if f.len != stored.len() as u64 || f.len > u64::from(u32::MAX) || f.size > u64::from(u32::MAX) {
        return Err(format!(
            "a frame of {} bytes, {} stored",
            f.len,
            stored.len()
        ));
    }
    let mut dctx = zstd::bulk::Decompressor::new().map_err(|e| e.to_string())?;
    decode_chunk(&mut dctx, &frame_entry(f, digest), stored)
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
            remote: None,
        };
        (content, spec)
    }

    /// A layer's bytes served by range, corrupted in the next `bad`
    /// answers; counts the requests.
    #[derive(Debug, Default)]
    struct Served {
        bytes: Vec<u8>,
        bad: AtomicUsize,
        requests: AtomicUsize,
    }

    impl RangeSource for Served {
        fn read_range(&self, _: &Digest, offset: u64, len: u64) -> std::io::Result<Vec<u8>> {
            self.requests.fetch_add(1, Ordering::SeqCst);
            let mut out = self.bytes[offset as usize..(offset + len) as usize].to_vec();
            let bad = self.bad.load(Ordering::SeqCst);
            if bad > 0 {
                self.bad.store(bad - 1, Ordering::SeqCst);
                out.iter_mut().for_each(|b| *b ^= 0x5a);
            }
            Ok(out)
        }
    }

    /// `layer`'s frames listed for fetching from `served`: the compressed
    /// file holds only the first frame, as the mount leaves it.
    fn listed(dir: &Path, frame: usize, frames: usize) -> (Vec<u8>, MetadataFrames, Arc<Served>) {
        let (content, mut spec) = layer(dir, frame, frames);
        let whole = std::fs::read(&spec.compressed_path).unwrap();
        let first = spec.frames[0];
        std::fs::write(&spec.compressed_path, &whole[..first.len as usize]).unwrap();
        let digests = spec
            .frames
            .iter()
            .map(|f| {
                let piece = &content[f.offset as usize..(f.offset + f.size) as usize];
                format!("sha256:{}", hex::encode(sha256(piece)))
            })
            .collect();
        spec.remote = Some(RemoteFrames {
            source: SourceSpec::Layout { dir: dir.into() },
            layer: format!("sha256:{}", hex::encode(sha256(&whole))),
            digests,
            local: 1,
            timeout_secs: 2,
        });
        let served = Arc::new(Served {
            bytes: whole,
            ..Served::default()
        });
        (content, spec, served)
    }

    fn listed_fill(spec: &MetadataFrames, out: File, served: &Arc<Served>) -> FrameFill {
        let source: Arc<dyn RangeSource> = served.clone();
        FrameFill::with_source(spec, out, Some(source)).unwrap()
    }

    /// Issue 44: frames listed in the manifest are fetched one by one as
    /// reads need them (the first from the mount's copy), each checked
    /// against its digest; a corrupt answer is fetched again, never
    /// written; then the file is whole, hashed and recorded.
    #[test]
    fn listed_frames_are_fetched_as_they_are_needed() {
        let dir = tempfile::tempdir().unwrap();
        let (content, spec, served) = listed(dir.path(), 4096, 3);
        let path = dir.path().join("meta.erofs");
        let fill = Arc::new(listed_fill(&spec, sparse(&path, content.len()), &served));
        fill.ensure(0..100).unwrap();
        assert_eq!(
            served.requests.load(Ordering::SeqCst),
            0,
            "frame 0 is local"
        );
        served.bad.store(1, Ordering::SeqCst);
        fill.ensure(5000..5010).unwrap();
        assert_eq!(
            served.requests.load(Ordering::SeqCst),
            2,
            "one bad answer, one good"
        );
        let now = read_all(&path);
        assert!(now[..8192] == content[..8192], "frames 0 and 1 written");
        assert!(now[8192..].iter().all(|&b| b == 0), "frames 2, 3 not yet");

        fill_in_background(fill.clone(), path.clone(), 2);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while spec.compressed_path.exists() {
            assert!(std::time::Instant::now() < deadline, "never finished");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(read_all(&path) == content);
        assert_eq!(served.requests.load(Ordering::SeqCst), 4, "each frame once");
        let file = File::open(&path).unwrap();
        assert!(lamina_fetch::store::recorded_whole(&file, &path, &sha256(&content)).unwrap());
    }

    /// A frame whose every answer is wrong fails the reads that need it,
    /// and only those, and nothing of it is written; a later read fetches
    /// it again, and once the source answers right the frame is there.
    #[test]
    fn a_listed_frame_that_cannot_be_had_is_fetched_again() {
        let dir = tempfile::tempdir().unwrap();
        let (content, spec, served) = listed(dir.path(), 4096, 3);
        let path = dir.path().join("meta.erofs");
        let fill = listed_fill(&spec, sparse(&path, content.len()), &served);
        served.bad.store(usize::MAX, Ordering::SeqCst);
        let err = fill.ensure(4096..4097).unwrap_err();
        assert!(err.contains("metadata frame 1"), "{err}");
        assert!(read_all(&path)[4096..8192].iter().all(|&b| b == 0));
        fill.ensure(0..4096).unwrap();
        served.bad.store(0, Ordering::SeqCst);
        fill.ensure(4096..4097).unwrap();
        assert!(read_all(&path)[..8192] == content[..8192]);

        // The mount's copy of the first frame is checked too.
        let (content, spec, served) = listed(dir.path(), 4096, 3);
        let mut first = std::fs::read(&spec.compressed_path).unwrap();
        let last = first.len() - 5;
        first[last] ^= 1;
        std::fs::write(&spec.compressed_path, &first).unwrap();
        let path = dir.path().join("meta2.erofs");
        let fill = listed_fill(&spec, sparse(&path, content.len()), &served);
        assert!(fill.ensure(0..1).is_err());
        assert!(read_all(&path).iter().all(|&b| b == 0));
    }

    /// Metadata of a few frames beyond the mount's is fetched whole at
    /// once (the worker's predictions wait for it); more waits for the
    /// start's reads to be over.
    #[test]
    fn only_many_listed_frames_wait_for_the_start() {
        let dir = tempfile::tempdir().unwrap();
        for (frames, deferred) in [(1, false), (8, false), (9, true), (30, true)] {
            let (content, spec, served) = listed(dir.path(), 4096, frames);
            let path = dir.path().join("meta.erofs");
            let fill = listed_fill(&spec, sparse(&path, content.len()), &served);
            // `frames` full frames and a short one; the first is the mount's.
            let remote = fill.remote.as_ref().unwrap();
            assert_eq!(remote.deferred(spec.frames.len()), deferred, "{frames}");
        }
    }

    /// Digests that do not match the frames in number, or frames that do
    /// not fit a chunk's 32-bit sizes, are refused before anything is read.
    #[test]
    fn listed_frames_must_be_whole() {
        let dir = tempfile::tempdir().unwrap();
        let (content, spec, served) = listed(dir.path(), 4096, 3);
        let path = dir.path().join("meta.erofs");
        let source: Arc<dyn RangeSource> = served.clone();
        let mut s = spec.clone();
        s.remote.as_mut().unwrap().digests.pop();
        let mut local = spec.clone();
        local.remote.as_mut().unwrap().local = 2; // frame 1 is not in the file
        let mut digest = spec.clone();
        digest.remote.as_mut().unwrap().digests[2] = "sha256:zz".into();
        for bad in [s, local, digest] {
            let err =
                FrameFill::with_source(&bad, sparse(&path, content.len()), Some(source.clone()))
                    .unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{err}");
        }
        let mut big = spec.clone();
        big.frames[3].len = 1 << 32;
        let err = FrameFill::with_source(&big, sparse(&path, content.len()), Some(source.clone()))
            .unwrap_err();
        assert!(err.to_string().contains("out of place"), "{err}");
        assert!(FrameFill::with_source(&spec, sparse(&path, content.len()), Some(source)).is_ok());
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
