//! Fetching chunks: merged range reads, retries with backoff, and a digest
//! check of every chunk before anyone may see its bytes.

use std::fs::File;
use std::io::{self, Seek};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lamina_format::index::{ChunkEntry, CHUNK_ZSTD};
use lamina_oci::sha256;
use lamina_oci::{Digest, RegistryClient};

use crate::hedge::{Answers, Hedging};

/// Where compressed blob bytes come from.
pub trait RangeSource: Send + Sync + std::fmt::Debug {
    /// Reads `len` bytes of blob `digest` from `offset`.
    fn read_range(&self, digest: &Digest, offset: u64, len: u64) -> io::Result<Vec<u8>>;

    /// The same, retrying after a failed or corrupt answer: a network
    /// source uses a new connection, not the one the failure came on.
    fn read_range_again(&self, digest: &Digest, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        self.read_range(digest, offset, len)
    }

    /// The same, as a hedge: a copy of a request that is slow, not failed,
    /// so on a fresh connection but without holding the first answer's
    /// sender to blame.
    fn read_range_beside(&self, digest: &Digest, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        self.read_range_again(digest, offset, len)
    }

    /// Bytes `offset..offset + len` of blob `digest` as one stream, read
    /// as they arrive (at most `len` bytes; fewer when the blob ends or the
    /// answer breaks off). `None`: this source reads whole ranges only. One
    /// try, not retried or hedged: the caller verifies each piece it reads
    /// and asks for what did not come as ranges.
    fn stream_range(
        &self,
        digest: &Digest,
        offset: u64,
        len: u64,
    ) -> io::Result<Option<Box<dyn io::Read + Send>>> {
        let _ = (digest, offset, len);
        Ok(None)
    }

    /// Blob `digest` whole, as one stream to read in order, from a P2P
    /// daemon (a host marked `bulk_only`): one request for all of it, whose
    /// task the daemon's seed fetches whole (it moves 4 MiB pieces per
    /// range asked). `None`: this source reads ranges only; an error: no
    /// such host answered. The caller verifies what it reads, chunk by
    /// chunk.
    fn stream_blob(&self, digest: &Digest) -> io::Result<Option<Box<dyn io::Read + Send>>> {
        let _ = digest;
        Ok(None)
    }
}

/// A registry repository, read with HTTP Range requests over one pooled client.
#[derive(Debug, Clone)]
pub struct RegistrySource {
    /// The client (keep-alive pool, cached bearer tokens).
    pub client: RegistryClient,
    /// Repository name.
    pub repository: String,
}

impl RangeSource for RegistrySource {
    fn read_range(&self, digest: &Digest, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        self.client
            .get_blob_range_once(&self.repository, digest, (offset, len), false)
            .map_err(|e| e.into_io())
    }

    fn read_range_again(&self, digest: &Digest, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        self.client
            .get_blob_range_once(&self.repository, digest, (offset, len), true)
            .map_err(|e| e.into_io())
    }

    fn read_range_beside(&self, digest: &Digest, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        self.client
            .get_blob_range_beside(&self.repository, digest, (offset, len))
            .map_err(|e| e.into_io())
    }

    fn stream_range(
        &self,
        digest: &Digest,
        offset: u64,
        len: u64,
    ) -> io::Result<Option<Box<dyn io::Read + Send>>> {
        self.client
            .get_blob_range_stream(&self.repository, digest, (offset, len))
            .map(Some)
            .map_err(|e| e.into_io())
    }

    fn stream_blob(&self, digest: &Digest) -> io::Result<Option<Box<dyn io::Read + Send>>> {
        // Through the P2P hosts only: through the registry, a whole blob
        // per node is more than a lazy mount fetches in ranges.
        let body = self
            .client
            .for_whole_blobs()
            .get_blob(&self.repository, digest)
            .map_err(|e| e.into_io())?;
        Ok(Some(Box::new(body)))
    }
}

/// An OCI layout directory on local disk.
#[derive(Debug, Clone)]
pub struct LayoutSource {
    /// The layout's root.
    pub dir: PathBuf,
}

impl RangeSource for LayoutSource {
    fn read_range(&self, digest: &Digest, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let path = lamina_oci::layout::blob_path(&self.dir, digest);
        let mut buf = vec![0u8; len as usize];
        File::open(path)?.read_exact_at(&mut buf, offset)?;
        Ok(buf)
    }

    fn stream_range(
        &self,
        digest: &Digest,
        offset: u64,
        len: u64,
    ) -> io::Result<Option<Box<dyn io::Read + Send>>> {
        let mut file = File::open(lamina_oci::layout::blob_path(&self.dir, digest))?;
        file.seek(io::SeekFrom::Start(offset))?;
        Ok(Some(Box::new(io::Read::take(file, len))))
    }
}

/// Fetch tuning.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    /// Chunks closer than this in the blob are fetched in one request.
    pub merge_gap: u64,
    /// Largest single request.
    pub max_request: u64,
    /// Attempts per request before giving up.
    pub attempts: u32,
    /// First backoff; doubles per attempt.
    pub backoff: Duration,
    /// Give up when this much time has passed, whatever the attempts left.
    pub deadline: Duration,
    /// Requests in flight at once.
    pub parallel: usize,
    /// Hedge slow requests (see [`crate::hedge`]); `None`: never.
    pub hedging: Option<Arc<Hedging>>,
}

/// How long one request may wait for its answer and then for each read of
/// its body when readers wait at most `reader_timeout`: short enough that a
/// stalled connection is given up on and retried on a fresh one (about three
/// tries fit in a reader's wait), long enough for a slow link.
pub fn attempt_timeout(reader_timeout: Duration) -> Duration {
    (reader_timeout / 3).clamp(Duration::from_secs(1), Duration::from_secs(10))
}

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            merge_gap: 64 * 1024,
            max_request: 16 << 20,
            // 0, 0.1, 0.2, ... 3.2 s between them: 6.3 s in all, as long
            // as a registry's own retries used to wait.
            attempts: 8,
            backoff: Duration::from_millis(100),
            deadline: Duration::from_secs(30),
            parallel: 4,
            hedging: None,
        }
    }
}

/// Why chunks could not be fetched. Readers get EIO.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Every attempt failed.
    #[error("blob {blob}: bytes {offset}+{len}: {attempts} attempts failed, last: {last}")]
    Exhausted {
        /// Blob digest.
        blob: String,
        /// Request offset.
        offset: u64,
        /// Request length.
        len: u64,
        /// Attempts made.
        attempts: u32,
        /// Last error.
        last: String,
    },
    /// No zstd decompression context could be made.
    #[error("zstd decompressor: {0}")]
    Decoder(String),
}

/// Counters shared by fetching threads.
#[derive(Debug, Default)]
pub struct FetchStats {
    /// Compressed bytes received (including retries).
    pub bytes: AtomicU64,
    /// Requests sent.
    pub requests: AtomicU64,
    /// Chunks that failed verification (then retried).
    pub bad_chunks: AtomicU64,
}

/// Groups chunk indices (sorted by blob offset) into request spans.
fn plan_requests(chunks: &[ChunkEntry], wanted: &[usize], opts: &FetchOptions) -> Vec<Vec<usize>> {
    let mut sorted = wanted.to_vec();
    sorted.sort_by_key(|&i| chunks[i].compressed_offset.get());
    let mut spans: Vec<Vec<usize>> = Vec::new();
    for i in sorted {
        let c = &chunks[i];
        let start = c.compressed_offset.get();
        let end = start + u64::from(c.compressed_size.get());
        if let Some(span) = spans.last_mut() {
            let first = &chunks[span[0]];
            let last = &chunks[*span.last().unwrap_or(&span[0])];
            let span_start = first.compressed_offset.get();
            let span_end = last.compressed_offset.get() + u64::from(last.compressed_size.get());
            if start <= span_end + opts.merge_gap && end - span_start <= opts.max_request {
                span.push(i);
                continue;
            }
        }
        spans.push(vec![i]);
    }
    spans
}

/// The window of span `i`: `Ok(None)` when it needs none; `Err(why)` when
/// it could not be had, and the span then fails at once (fetching it again
/// cannot help).
pub type WindowOf<'a> = &'a (dyn Fn(usize) -> Result<Option<Arc<Vec<u8>>>, String> + Sync);

/// Why a chunk's stored bytes did not decode.
enum DecodeFailure {
    /// Bad bytes: fetched again.
    Retry(String),
    /// Nothing a new fetch of these bytes changes (a span's window is
    /// missing): the request fails now.
    Fatal(String),
}

/// How a blob's fetched bytes become its chunks.
#[derive(Clone, Copy, Default)]
pub enum ChunkCodec<'a> {
    /// A lamina blob: each chunk stored as it is or as one zstd frame
    /// ([`CHUNK_ZSTD`]).
    #[default]
    Lamina,
    /// An unmodified layer read through its tar index: each chunk is a span
    /// (`lamina_format::tar_index`), decoded alone with its window.
    Spans(WindowOf<'a>),
}

impl std::fmt::Debug for ChunkCodec<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ChunkCodec::Lamina => "Lamina",
            ChunkCodec::Spans(_) => "Spans",
        })
    }
}

/// A blob to fetch chunks of: its digest, chunk table and codec.
#[derive(Debug, Clone, Copy)]
pub struct BlobChunks<'a> {
    /// The blob's digest (what is fetched).
    pub digest: &'a Digest,
    /// Its chunks (or spans).
    pub chunks: &'a [ChunkEntry],
    /// How their stored bytes decode.
    pub codec: ChunkCodec<'a>,
}

impl BlobChunks<'_> {
    /// Decodes and verifies chunk `i` from its stored bytes.
    fn decode(
        &self,
        decompressor: &mut zstd::bulk::Decompressor<'_>,
        i: usize,
        stored: &[u8],
    ) -> Result<Vec<u8>, DecodeFailure> {
        let chunk = &self.chunks[i];
        match self.codec {
            ChunkCodec::Lamina => {
                decode_chunk(decompressor, chunk, stored).map_err(DecodeFailure::Retry)
            }
            ChunkCodec::Spans(window_of) => {
                let window = window_of(i).map_err(DecodeFailure::Fatal)?;
                lamina_zran::decode_entry(chunk, window.as_deref().map(Vec::as_slice), stored)
                    .map_err(|e| DecodeFailure::Retry(e.to_string()))
            }
        }
    }
}

/// Decompresses and verifies one chunk's stored bytes. The decompressor is
/// the caller's so that its context is reused across chunks.
pub fn decode_chunk(
    decompressor: &mut zstd::bulk::Decompressor<'_>,
    chunk: &ChunkEntry,
    stored: &[u8],
) -> Result<Vec<u8>, String> {
    let size = chunk.size.get() as usize;
    let data = if chunk.flags.get() & CHUNK_ZSTD != 0 {
        decompressor
            .decompress(stored, size)
            .map_err(|e| format!("zstd: {e}"))?
    } else {
        stored.to_vec()
    };
    if data.len() != size {
        return Err(format!("decoded {} bytes, expected {size}", data.len()));
    }
    if sha256(&data) != chunk.digest {
        return Err("chunk digest mismatch".into());
    }
    Ok(data)
}

/// Fetches, decodes and verifies the chunks `wanted` of a blob, calling
/// `deliver(index, bytes)` for each verified chunk as it arrives. Chunks that
/// fail verification are fetched again; nothing unverified is delivered.
/// Requests go out up to [`FetchOptions::parallel`] at once, in blob order.
pub fn fetch_chunks(
    source: &Arc<dyn RangeSource>,
    blob: BlobChunks<'_>,
    wanted: &[usize],
    opts: &FetchOptions,
    stats: &FetchStats,
    deliver: impl Fn(usize, Vec<u8>) -> io::Result<()> + Sync,
) -> Result<(), FetchError> {
    let spans = plan_requests(blob.chunks, wanted, opts);
    let run = SpanRun {
        source,
        blob,
        chunks: blob.chunks,
        opts,
        stats,
        started: Instant::now(),
        deliver: &deliver,
    };
    let threads = opts.parallel.clamp(1, spans.len().max(1));
    if threads == 1 {
        let mut decompressor = new_decompressor()?;
        return spans
            .into_iter()
            .try_for_each(|span| run.fetch_span(span, &mut decompressor));
    }
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<FetchError>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let mut decompressor = match new_decompressor() {
                    Ok(d) => d,
                    Err(e) => return note_failure(&failed, e),
                };
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some(span) = spans.get(k) else { return };
                    if failed.lock().map_or(true, |f| f.is_some()) {
                        return; // one span failed: the call fails
                    }
                    if let Err(e) = run.fetch_span(span.clone(), &mut decompressor) {
                        return note_failure(&failed, e);
                    }
                }
            });
        }
    });
    match failed.into_inner() {
        Ok(None) => Ok(()),
        Ok(Some(e)) => Err(e),
        Err(_) => Err(FetchError::Decoder("a fetch thread panicked".into())),
    }
}

fn new_decompressor() -> Result<zstd::bulk::Decompressor<'static>, FetchError> {
    zstd::bulk::Decompressor::new().map_err(|e| FetchError::Decoder(e.to_string()))
}

fn note_failure(failed: &Mutex<Option<FetchError>>, e: FetchError) {
    if let Ok(mut f) = failed.lock() {
        f.get_or_insert(e);
    }
}

/// What the requests of one [`fetch_chunks`] call share.
struct SpanRun<'a, D> {
    source: &'a Arc<dyn RangeSource>,
    blob: BlobChunks<'a>,
    chunks: &'a [ChunkEntry],
    opts: &'a FetchOptions,
    stats: &'a FetchStats,
    started: Instant,
    deliver: &'a D,
}

impl<D: Fn(usize, Vec<u8>) -> io::Result<()> + Sync> SpanRun<'_, D> {
    /// Fetches one request's chunks: the first retry goes out at once on
    /// a fresh connection (a reset or a spoilt answer is usually one bad
    /// connection), later ones after a doubling backoff.
    fn fetch_span(
        &self,
        span: Vec<usize>,
        decompressor: &mut zstd::bulk::Decompressor<'_>,
    ) -> Result<(), FetchError> {
        let (chunks, opts) = (self.chunks, self.opts);
        let mut pending = span;
        let mut attempt = 0;
        let mut last_err = String::new();
        while !pending.is_empty() {
            if attempt >= opts.attempts || (attempt > 0 && self.started.elapsed() > opts.deadline) {
                return Err(self.exhausted(&pending, attempt, last_err));
            }
            if attempt > 1 {
                std::thread::sleep(opts.backoff * 2u32.pow(attempt - 2));
            }
            attempt += 1;
            let (start, end) = extent(chunks, &pending);
            self.stats.requests.fetch_add(1, Ordering::Relaxed);
            let mut answers = Answers::send(
                self.source,
                opts.hedging.as_deref(),
                self.blob.digest,
                (start, end - start),
                attempt > 1,
            );
            while let Some((hedge, read)) = answers.next() {
                if hedge {
                    self.stats.requests.fetch_add(1, Ordering::Relaxed);
                }
                let bytes = match read {
                    Ok(b) => b,
                    Err(e) => {
                        last_err = e.to_string();
                        answers.answer_failed();
                        continue;
                    }
                };
                self.stats
                    .bytes
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                let before = pending.len();
                pending = self.take(
                    decompressor,
                    &pending,
                    start,
                    &bytes,
                    attempt,
                    &mut last_err,
                )?;
                if hedge && pending.len() < before {
                    answers.hedge_won();
                }
                if pending.is_empty() {
                    break;
                }
                answers.answer_failed();
            }
        }
        Ok(())
    }

    /// Delivers the chunks of `pending` that `bytes` (read from `start`)
    /// holds intact; returns those it does not.
    fn take(
        &self,
        decompressor: &mut zstd::bulk::Decompressor<'_>,
        pending: &[usize],
        start: u64,
        bytes: &[u8],
        attempt: u32,
        last_err: &mut String,
    ) -> Result<Vec<usize>, FetchError> {
        let mut failed = Vec::new();
        for &i in pending {
            let c = &self.chunks[i];
            let from = (c.compressed_offset.get() - start) as usize;
            let to = from + c.compressed_size.get() as usize;
            let Some(stored) = bytes.get(from..to) else {
                *last_err = format!("short read: {} bytes", bytes.len());
                failed.push(i);
                continue;
            };
            match self.blob.decode(decompressor, i, stored) {
                Ok(data) => (self.deliver)(i, data).map_err(|e| FetchError::Exhausted {
                    blob: self.blob.digest.to_string(),
                    offset: c.compressed_offset.get(),
                    len: u64::from(c.compressed_size.get()),
                    attempts: attempt,
                    last: format!("writing the cache: {e}"),
                })?,
                Err(DecodeFailure::Retry(reason)) => {
                    self.stats.bad_chunks.fetch_add(1, Ordering::Relaxed);
                    *last_err = reason;
                    failed.push(i);
                }
                Err(DecodeFailure::Fatal(reason)) => {
                    return Err(self.exhausted(pending, attempt, reason));
                }
            }
        }
        Ok(failed)
    }

    fn exhausted(&self, pending: &[usize], attempts: u32, last: String) -> FetchError {
        let (start, _) = extent(self.chunks, pending);
        FetchError::Exhausted {
            blob: self.blob.digest.to_string(),
            offset: start,
            len: pending
                .iter()
                .map(|&i| u64::from(self.chunks[i].compressed_size.get()))
                .sum(),
            attempts,
            last,
        }
    }
}

/// The blob bytes from the first to the end of the last of `span`.
fn extent(chunks: &[ChunkEntry], span: &[usize]) -> (u64, u64) {
    let first = &chunks[span[0]];
    let last = &chunks[*span.last().unwrap_or(&span[0])];
    let end = last.compressed_offset.get() + u64::from(last.compressed_size.get());
    (first.compressed_offset.get(), end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::sync::atomic::AtomicBool;
    use std::sync::mpsc;

    /// A layout's blob streams as a range would read it, and no further
    /// than the blob's end.
    #[test]
    fn a_layout_streams_the_range_asked() {
        let dir = tempfile::tempdir().expect("tmp");
        let blob: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        let digest = Digest::of_bytes(&blob);
        let path = lamina_oci::layout::blob_path(dir.path(), &digest);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(&path, &blob).expect("write blob");
        let source = LayoutSource {
            dir: dir.path().to_path_buf(),
        };
        let read = |offset: u64, len: u64| {
            let mut body = source
                .stream_range(&digest, offset, len)
                .expect("open")
                .expect("a layout streams");
            let mut got = Vec::new();
            body.read_to_end(&mut got).expect("read");
            got
        };
        assert_eq!(
            read(3, 4_000),
            source.read_range(&digest, 3, 4_000).unwrap()
        );
        assert_eq!(read(9_000, 5_000), blob[9_000..]);
        assert!(read(20_000, 10).is_empty());
    }

    #[derive(Debug)]
    struct Flaky {
        blob: Vec<u8>,
        /// Per call: 0 ok, 1 error, 2 corrupt a byte, 3 truncate.
        script: Mutex<Vec<u8>>,
    }

    impl RangeSource for Flaky {
        fn read_range(&self, _: &Digest, offset: u64, len: u64) -> io::Result<Vec<u8>> {
            let mode = {
                let mut s = self.script.lock().unwrap();
                if s.is_empty() {
                    0
                } else {
                    s.remove(0)
                }
            };
            let mut b = self.blob[offset as usize..(offset + len) as usize].to_vec();
            match mode {
                1 => Err(io::Error::other("connection reset")),
                2 => {
                    b.iter_mut().for_each(|x| *x ^= 0xFF);
                    Ok(b)
                }
                3 => {
                    b.truncate(b.len() / 3);
                    Ok(b)
                }
                _ => Ok(b),
            }
        }
    }

    fn make(parts: &[Vec<u8>]) -> (Vec<u8>, Vec<ChunkEntry>) {
        let mut blob = Vec::new();
        let mut chunks = Vec::new();
        let mut cache = 0u64;
        for p in parts {
            let z = zstd::bulk::compress(p, 1).unwrap();
            chunks.push(ChunkEntry {
                cache_offset: cache.into(),
                compressed_offset: (blob.len() as u64).into(),
                compressed_size: (z.len() as u32).into(),
                size: (p.len() as u32).into(),
                flags: CHUNK_ZSTD.into(),
                reserved: 0.into(),
                digest: sha256(p),
            });
            blob.extend_from_slice(&z);
            cache += (p.len() as u64).next_multiple_of(4096);
        }
        (blob, chunks)
    }

    type Delivered = Vec<(usize, Vec<u8>)>;

    fn run(script: Vec<u8>) -> (Result<(), FetchError>, Delivered) {
        let parts: Vec<Vec<u8>> = (0..4).map(|i| vec![i as u8 + 1; 10_000 + i * 7]).collect();
        let (blob, chunks) = make(&parts);
        let src: Arc<dyn RangeSource> = Arc::new(Flaky {
            blob,
            script: Mutex::new(script),
        });
        let opts = FetchOptions {
            backoff: Duration::from_millis(1),
            ..FetchOptions::default()
        };
        let got = Mutex::new(Vec::new());
        let digest = Digest::of_bytes(b"x");
        let blob = BlobChunks {
            digest: &digest,
            chunks: &chunks,
            codec: ChunkCodec::Lamina,
        };
        let r = fetch_chunks(
            &src,
            blob,
            &[3, 0, 1],
            &opts,
            &FetchStats::default(),
            |i, d| {
                assert_eq!(d, parts[i]);
                got.lock().unwrap().push((i, d));
                Ok(())
            },
        );
        (r, got.into_inner().unwrap())
    }

    #[test]
    fn merges_and_delivers_verified_chunks() {
        let (r, got) = run(vec![]);
        r.unwrap();
        let mut idx: Vec<usize> = got.iter().map(|g| g.0).collect();
        idx.sort();
        assert_eq!(idx, vec![0, 1, 3]);
    }

    #[test]
    fn retries_errors_corruption_and_truncation() {
        let (r, got) = run(vec![1, 2, 3]);
        r.unwrap();
        assert_eq!(got.len(), 3);
    }

    #[test]
    fn gives_up_after_attempts_without_delivering_bad_bytes() {
        let (r, got) = run(vec![2; FetchOptions::default().attempts as usize]);
        assert!(r.is_err());
        assert!(got.is_empty(), "nothing unverified may be delivered");
    }

    /// The chunks of `wanted` that `fetch_chunks` delivered, in delivery
    /// order, each checked against `parts`.
    fn fetched(
        src: &Arc<dyn RangeSource>,
        parts: &[Vec<u8>],
        chunks: &[ChunkEntry],
        wanted: &[usize],
        opts: &FetchOptions,
    ) -> Result<Vec<usize>, FetchError> {
        let got = Mutex::new(Vec::new());
        let stats = FetchStats::default();
        let digest = Digest::of_bytes(b"x");
        let blob = BlobChunks {
            digest: &digest,
            chunks,
            codec: ChunkCodec::Lamina,
        };
        fetch_chunks(src, blob, wanted, opts, &stats, |i, d| {
            assert_eq!(d, parts[i]);
            got.lock().unwrap().push(i);
            Ok(())
        })?;
        Ok(got.into_inner().unwrap())
    }

    /// Stalls every first copy until the test ends; a hedge (on a fresh
    /// connection) answers at once. A retry fails: a hedge is a copy of a
    /// slow request, not a retry, which would blame the host that last sent
    /// those bytes (a P2P mirror is slow on a blob's first request).
    #[derive(Debug)]
    struct Stalling {
        blob: Vec<u8>,
        release: Mutex<mpsc::Receiver<()>>,
    }

    impl RangeSource for Stalling {
        fn read_range(&self, _: &Digest, _: u64, _: u64) -> io::Result<Vec<u8>> {
            let _ = self.release.lock().unwrap().recv();
            Err(io::Error::other("stalled"))
        }

        fn read_range_again(&self, _: &Digest, _: u64, _: u64) -> io::Result<Vec<u8>> {
            Err(io::Error::other("a hedge was sent as a retry"))
        }

        fn read_range_beside(&self, _: &Digest, offset: u64, len: u64) -> io::Result<Vec<u8>> {
            Ok(self.blob[offset as usize..(offset + len) as usize].to_vec())
        }
    }

    #[test]
    fn a_stalled_request_is_hedged_and_the_hedge_answers() {
        let parts: Vec<Vec<u8>> = (0..3).map(|i| vec![i as u8 + 1; 50_000]).collect();
        let (blob, chunks) = make(&parts);
        let (release, stalled) = mpsc::channel();
        let src: Arc<dyn RangeSource> = Arc::new(Stalling {
            blob,
            release: Mutex::new(stalled),
        });
        let hedging = Arc::new(Hedging::default());
        let opts = FetchOptions {
            merge_gap: 0,
            parallel: 1,
            hedging: Some(hedging.clone()),
            ..FetchOptions::default()
        };
        let got = fetched(&src, &parts, &chunks, &[0, 2], &opts).unwrap();
        assert_eq!(got, vec![0, 2]);
        // Both requests stalled: each was hedged, and each hedge's answer
        // was the one used (the stalled copies never answered).
        assert_eq!(hedging.requests.load(Ordering::Relaxed), 2);
        assert_eq!(hedging.hedges.load(Ordering::Relaxed), 2);
        assert_eq!(hedging.wins.load(Ordering::Relaxed), 2);
        drop(release);
    }

    /// The first copy stalls (until released, or 20 s); the first
    /// `bad_hedges` hedges answer with a flipped byte, later ones with the
    /// true bytes.
    #[derive(Debug)]
    struct StallThenBadHedge {
        blob: Vec<u8>,
        release: Mutex<mpsc::Receiver<()>>,
        bad_hedges: usize,
        hedges: AtomicUsize,
        answered: AtomicBool,
    }

    impl StallThenBadHedge {
        fn new(blob: Vec<u8>, bad_hedges: usize) -> (Arc<Self>, mpsc::Sender<()>) {
            let (release, stalled) = mpsc::channel();
            let source = StallThenBadHedge {
                blob,
                release: Mutex::new(stalled),
                bad_hedges,
                hedges: AtomicUsize::new(0),
                answered: AtomicBool::new(false),
            };
            (Arc::new(source), release)
        }
    }

    impl RangeSource for StallThenBadHedge {
        fn read_range(&self, _: &Digest, _: u64, _: u64) -> io::Result<Vec<u8>> {
            let _ = self
                .release
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(20));
            self.answered.store(true, Ordering::SeqCst);
            Err(io::Error::other("stalled"))
        }

        fn read_range_again(&self, _: &Digest, _: u64, _: u64) -> io::Result<Vec<u8>> {
            Err(io::Error::other("a retry"))
        }

        fn read_range_beside(&self, _: &Digest, offset: u64, len: u64) -> io::Result<Vec<u8>> {
            let mut bytes = self.blob[offset as usize..(offset + len) as usize].to_vec();
            if self.hedges.fetch_add(1, Ordering::SeqCst) < self.bad_hedges {
                bytes[len as usize / 2] ^= 1;
            }
            Ok(bytes)
        }
    }

    /// A hedge that answers with bad bytes while the first copy stalls is
    /// followed by another hedge, not by a wait for the stalled copy.
    #[test]
    fn a_bad_hedge_of_a_stalled_request_is_hedged_again() {
        let parts: Vec<Vec<u8>> = vec![vec![7; 50_000]];
        let (blob, chunks) = make(&parts);
        let (source, release) = StallThenBadHedge::new(blob, 1);
        let src: Arc<dyn RangeSource> = source.clone();
        let hedging = Arc::new(Hedging::default());
        let opts = FetchOptions {
            hedging: Some(hedging.clone()),
            ..FetchOptions::default()
        };
        let got = fetched(&src, &parts, &chunks, &[0], &opts).unwrap();
        assert_eq!(got, vec![0]);
        assert_eq!(hedging.hedges.load(Ordering::Relaxed), 2);
        assert_eq!(hedging.wins.load(Ordering::Relaxed), 1);
        // The stalled copy had not answered (nor timed out) by then.
        assert!(!source.answered.load(Ordering::SeqCst));
        drop(release);
    }

    /// Fetches one chunk whose first copy stalls (20 s) with the hedge cap
    /// spent, while `others` more requests go out 600 ms in; checks that a
    /// hedge answered, not the stalled copy.
    fn stalled_with_the_cap_spent(others: u64) {
        let parts: Vec<Vec<u8>> = vec![vec![9; 50_000]];
        let (blob, chunks) = make(&parts);
        let (source, release) = StallThenBadHedge::new(blob, 0);
        let src: Arc<dyn RangeSource> = source.clone();
        let hedging = Arc::new(Hedging::default());
        hedging
            .hedges
            .store(crate::hedge::HEDGE_BURST, Ordering::Relaxed);
        let sent = {
            let hedging = hedging.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(600));
                hedging.requests.fetch_add(others, Ordering::Relaxed);
            })
        };
        let opts = FetchOptions {
            hedging: Some(hedging.clone()),
            ..FetchOptions::default()
        };
        let got = fetched(&src, &parts, &chunks, &[0], &opts).unwrap();
        assert_eq!(got, vec![0]);
        assert_eq!(hedging.wins.load(Ordering::Relaxed), 1);
        assert!(
            !source.answered.load(Ordering::SeqCst),
            "the stall was waited out"
        );
        drop(release);
        sent.join().unwrap();
    }

    /// A stalled request whose hedge the cap refused (the burst was spent)
    /// is hedged once the requests sent meanwhile allow one, not left to
    /// its stall. (Since `STALLED_AFTER_BOUNDS` its copy goes at two
    /// bounds in any case; the test below has no other request.)
    #[test]
    fn a_hedge_the_cap_refused_is_asked_for_again() {
        stalled_with_the_cap_spent(100);
    }

    /// A request stalled for two bounds gets its copy even when the cap
    /// never allows another hedge (it was spent, and no other request
    /// goes out): it is not left to its stall.
    #[test]
    fn a_stalled_request_gets_a_copy_the_cap_would_refuse() {
        stalled_with_the_cap_spent(0);
    }

    /// A span whose window cannot be had fails after one request: fetching
    /// its bytes again would not bring the window.
    #[test]
    fn a_span_without_its_window_fails_at_once() {
        let parts: Vec<Vec<u8>> = (0..2).map(|i| vec![i as u8 + 1; 10_000]).collect();
        let (blob, chunks) = make(&parts);
        let src: Arc<dyn RangeSource> = Arc::new(Flaky {
            blob,
            script: Mutex::new(vec![]),
        });
        let opts = FetchOptions {
            backoff: Duration::from_millis(1),
            ..FetchOptions::default()
        };
        let digest = Digest::of_bytes(b"x");
        let no_window = |_: usize| Err("its window could not be fetched".to_string());
        let blob = BlobChunks {
            digest: &digest,
            chunks: &chunks,
            codec: ChunkCodec::Spans(&no_window),
        };
        let stats = FetchStats::default();
        let err = fetch_chunks(&src, blob, &[0, 1], &opts, &stats, |_, _| {
            panic!("nothing may be delivered")
        })
        .unwrap_err();
        assert!(err.to_string().contains("window"), "{err}");
        assert_eq!(stats.requests.load(Ordering::Relaxed), 1, "retried");
    }

    #[test]
    fn spans_fetched_in_parallel_deliver_every_chunk_once() {
        let parts: Vec<Vec<u8>> = (0..12).map(|i| vec![i as u8; 30_000 + i]).collect();
        let (blob, chunks) = make(&parts);
        let src: Arc<dyn RangeSource> = Arc::new(Flaky {
            blob,
            script: Mutex::new(vec![1, 0, 2, 0, 3]),
        });
        let opts = FetchOptions {
            merge_gap: 0,
            max_request: 1,
            backoff: Duration::from_millis(1),
            ..FetchOptions::default()
        };
        let wanted: Vec<usize> = (0..12).collect();
        let mut got = fetched(&src, &parts, &chunks, &wanted, &opts).unwrap();
        got.sort();
        assert_eq!(got, wanted);
    }
}
