//! The worker: fills misses and prefetches. It may crash or be killed at any
//! time; the holder keeps the events and starts another, which re-verifies
//! the fill records and carries on.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use lamina_fetch::fetch::{
    fetch_chunks, BlobChunks, ChunkCodec, FetchOptions, FetchStats, RangeSource,
};
use lamina_fetch::hedge::{read_first_answer, Hedging};
use lamina_fetch::locator::ChunkLocator;
use lamina_fetch::store::{load_table, save_table, BlobStore, SAVE_INTERVAL};
use lamina_format::boot::BootPages;
use lamina_format::erofs::Image;
use lamina_format::index::{BlobSummary, ChunkIndex, IndexBlob, IndexTop};
use lamina_format::tar_index::TarIndex;
use lamina_oci::Digest;
use lamina_sys::{FanotifyGroup, Response};

use crate::config::{
    write_atomic, AdoptSpec, BlobSpec, BootFrameSpec, BootPagesSpec, DaemonConfig, LayerSpec,
    MetadataFill,
};
use crate::latency::{Histogram, Recorder};
use crate::pool::{MissPool, MAX_MISS_THREADS};
use crate::predict::{FileMap, MapError, RateMeter};
use crate::protocol::{self, Message};
use crate::readahead::Stream;
use crate::windows::{SpanWindows, WindowEntries};

mod located;
use rustix::event::{poll, PollFd, PollFlags};

/// Live figures, written to `<run_dir>/status.json`.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Status {
    /// Worker pid.
    pub pid: u32,
    /// Image reference.
    pub image: String,
    /// Mountpoint.
    pub mountpoint: String,
    /// Compressed bytes fetched by this worker.
    pub fetched_bytes: u64,
    /// Range requests sent.
    pub requests: u64,
    /// Misses served.
    pub misses: u64,
    /// Misses that failed (reader got EIO).
    pub failed_misses: u64,
    /// Chunks that failed verification and were fetched again.
    pub bad_chunks: u64,
    /// Bytes present in the cache / total, over all blobs.
    pub cached_bytes: u64,
    /// Total uncompressed bytes of all chunks.
    pub total_bytes: u64,
    /// Boot-set / prefetch chunks done.
    pub prefetch_done: u64,
    /// Boot-set / prefetch chunks planned.
    pub prefetch_total: u64,
    /// Bytes written into the cache from the image's boot pages.
    #[serde(default)]
    pub boot_page_bytes: u64,
    /// Boot-pages frames to load (0: none, or not asked to).
    #[serde(default)]
    pub boot_frames: u64,
    /// Of `boot_frames`, those applied or given up on.
    #[serde(default)]
    pub boot_frames_done: u64,
    /// Of `fetched_bytes`, what readers waited for (misses).
    #[serde(default)]
    pub miss_fetched_bytes: u64,
    /// Of `requests`, those for misses.
    #[serde(default)]
    pub miss_requests: u64,
    /// Of `fetched_bytes`, what was fetched ahead of a reader reading in
    /// blob order (`fill_ahead`).
    #[serde(default)]
    pub ahead_fetched_bytes: u64,
    /// Of `requests`, those fetched ahead.
    #[serde(default)]
    pub ahead_requests: u64,
    /// Of `fetched_bytes`, what was fetched for predicted misses (files
    /// fetched together on a first miss, `lamina_daemon::predict`).
    #[serde(default)]
    pub predicted_fetched_bytes: u64,
    /// Of `requests`, those for predicted misses.
    #[serde(default)]
    pub predicted_requests: u64,
    /// Chunk bytes (uncompressed) fetched ahead of readers, in order or
    /// predicted.
    #[serde(default)]
    pub ahead_chunk_bytes: u64,
    /// Of `ahead_chunk_bytes`, those a reader has read since: the rest is
    /// what fetching ahead cost without use (so far).
    #[serde(default)]
    pub ahead_used_bytes: u64,
    /// First misses in a shared library or a group of small files that
    /// fetched the rest of it (`crate::predict`); its bytes count in
    /// `ahead_chunk_bytes`.
    #[serde(default)]
    pub predictions: u64,
    /// Requests sent a second time because the first had not answered
    /// within the hedging bound (see `lamina_fetch::hedge`).
    #[serde(default)]
    pub hedges: u64,
    /// Of `hedges`, those whose answer was the one used.
    #[serde(default)]
    pub hedge_wins: u64,
    /// The current hedging bound for a 256 KiB request, in ms.
    #[serde(default)]
    pub hedge_bound_ms: u64,
    /// How long readers waited on misses: from the miss's arrival in the
    /// worker to its answer (EIO included).
    #[serde(default)]
    pub miss_latency: Histogram,
    /// Chunks copied from other images' cache files on this node instead
    /// of fetched (`lamina_fetch::locator`), and their bytes.
    #[serde(default)]
    pub located_chunks: u64,
    /// Bytes of `located_chunks` (uncompressed).
    #[serde(default)]
    pub located_bytes: u64,
    /// Per blob: (digest, chunks filled, chunks, complete).
    pub blobs: Vec<BlobStatus>,
}

/// One blob's progress.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct BlobStatus {
    /// Digest.
    pub digest: String,
    /// Chunks present.
    pub filled_chunks: usize,
    /// Chunks in all.
    pub chunks: usize,
    /// Whether complete.
    pub complete: bool,
}

/// A blob's store. With a paged index it is opened when the blob is first
/// needed: its chunk table is loaded from the cache, or fetched, then.
struct LazyStore {
    summary: BlobSummary,
    /// The mount found the cache file complete.
    complete: bool,
    store: Mutex<Option<BlobStore>>,
    /// Why the store can never be opened (its cache file is not the
    /// mount's any more): every read of the blob fails, at once.
    refused: OnceLock<String>,
}

/// A locked, opened store.
struct StoreGuard<'a>(std::sync::MutexGuard<'a, Option<BlobStore>>);

impl std::ops::Deref for StoreGuard<'_> {
    type Target = BlobStore;
    fn deref(&self) -> &BlobStore {
        // Made only over an opened store (`Shared::lock_store`).
        self.0.as_ref().expect("an opened store")
    }
}

impl std::ops::DerefMut for StoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut BlobStore {
        self.0.as_mut().expect("an opened store")
    }
}

/// Opens the store of `blob` in `dir`, which must be the very cache file
/// the mount was made with (`spec`); fills it through a quiet fd.
fn open_store(dir: &Path, blob: IndexBlob, spec: &BlobSpec) -> io::Result<BlobStore> {
    let mut store = BlobStore::open(dir, blob)?;
    spec.check_file(store.cache_file())?;
    if !store.is_complete() {
        // Background fills must not become misses in other mounts
        // that share this cache file: write them through a quiet fd.
        match lamina_sys::open_quiet(store.cache_file()).and_then(|f| store.set_writer(f)) {
            Ok(()) => {}
            Err(e) => tracing::warn!("quiet fd for {}: {e}", store.cache_path.display()),
        }
    }
    Ok(store)
}

struct Shared {
    config: DaemonConfig,
    digests: Vec<Digest>,
    /// log2 of the chunk size (to check fetched chunk tables).
    chunk_bits: u8,
    stores: Vec<LazyStore>,
    /// A tar index's windows (`None`: a lamina image).
    windows: Option<SpanWindows>,
    source: Arc<dyn RangeSource>,
    /// Hedging of miss and boot requests (not of fill-ahead).
    hedging: Arc<Hedging>,
    fetch: FetchOptions,
    /// Boot-set requests: gaps up to 128 KiB are fetched rather than split.
    boot_fetch: FetchOptions,
    /// Fill-ahead requests: no gaps (chunks a reader's misses filled in a
    /// window are not fetched again, so a whole read moves each byte once),
    /// and given up early: a reader that meets a window in flight waits
    /// for it, and must have most of its timeout left to fetch the chunks
    /// itself if the window fails.
    ahead_fetch: FetchOptions,
    /// Predicted requests: as fill-ahead's, and hedged, since a reader
    /// that meets a predicted chunk in flight waits for it.
    predict_fetch: FetchOptions,
    /// Everything fetched (misses, boot pages, background).
    stats: FetchStats,
    /// Fetched because a reader was waiting.
    miss_stats: FetchStats,
    /// Fetched ahead of a reader reading in blob order.
    ahead_stats: FetchStats,
    /// Fetched for predicted misses.
    predict_stats: FetchStats,
    /// Per blob: how it is being read, to fetch ahead of a stream.
    streams: Vec<Mutex<Stream>>,
    /// Chunks fetched ahead that no reader has read yet.
    ahead_unread: Mutex<HashSet<(u32, usize)>>,
    /// Chunk bytes fetched ahead, and of those, read since.
    ahead_chunk_bytes: AtomicU64,
    ahead_used_bytes: AtomicU64,
    /// Windows to fetch ahead, for the fill-ahead threads (None: off).
    ahead: Option<mpsc::SyncSender<(u32, std::ops::Range<usize>)>>,
    /// Files fetched together on a first miss (`crate::predict`), once
    /// built.
    file_map: OnceLock<FileMap>,
    /// How fast misses are fetched: predictions wait for a fast link.
    miss_rate: RateMeter,
    /// Groups queued so far, by (blob, group).
    predicted: Mutex<HashSet<(u32, u32)>>,
    predictions: AtomicU64,
    /// Batches of predicted chunks, for the prediction threads (None: off).
    predict: Option<mpsc::Sender<(u32, std::ops::Range<usize>)>>,
    /// When the last miss arrived (ms since the worker started).
    last_miss_ms: AtomicU64,
    started: Instant,
    inflight: Mutex<HashSet<(u32, usize)>>,
    landed: Condvar,
    misses: AtomicU64,
    failed: AtomicU64,
    miss_latency: Recorder,
    active_misses: AtomicU64,
    prefetch_done: AtomicU64,
    prefetch_total: AtomicU64,
    complete_sent: Vec<AtomicBool>,
    boot_set: Vec<(u32, u32)>,
    /// The boot set, to look up: a miss on one of these chunks waits for
    /// the boot pages still on their way instead of fetching it.
    boot_chunks: HashSet<(u32, u32)>,
    /// Boot-pages frames to load, and those not yet applied (or given up on).
    boot_frames: AtomicUsize,
    boot_pending: AtomicUsize,
    sock: OwnedFd,
    trace: Option<Mutex<File>>,
    /// A copy of the holder's group: it stays open if the holder dies.
    group: OnceLock<FanotifyGroup>,
    /// A copy of the holder's watch on the mount's root.
    superblock: OnceLock<OwnedFd>,
    /// The holder died: misses are answered through `group`.
    holder_gone: AtomicBool,
    /// This very `Shared`, for work handed to threads of its own.
    me: OnceLock<std::sync::Weak<Shared>>,
    /// Where verified copies of chunks lie on this node (`None`: it could
    /// not be opened; chunks are fetched).
    locator: Option<ChunkLocator>,
    located_chunks: AtomicU64,
    located_bytes: AtomicU64,
}

/// How long a miss waits for chunks another mount claimed before it
/// fetches them too (the mounts may reach different registries, one of
/// them slow or stalled).
const HEDGE_AFTER: Duration = Duration::from_secs(1);

/// No miss for this long after the first one: the start is over.
const START_QUIET: Duration = Duration::from_millis(500);
/// No miss at all for this long after the worker started: the mount is
/// idle, or walked without reads (lookups only); later layers go now.
const START_AT_MOST: Duration = Duration::from_secs(10);

/// Chunks per predicted request: a reader that misses in a batch being
/// fetched waits for that batch only (2 MiB of 256 KiB chunks).
const PREDICT_BATCH: usize = 8;

/// Metadata larger than this is not read to predict misses.
const PREDICT_METADATA_MAX: u64 = 128 << 20;

/// Boot-pages frames fetched at once (after the first, which goes alone).
const BOOT_STREAMS: usize = 4;

/// The cache's chunk locator; without one, chunks are only fetched.
fn open_locator(blob_dir: &Path) -> Option<ChunkLocator> {
    ChunkLocator::open(blob_dir)
        .inspect_err(|e| tracing::warn!("no chunk locator, chunks are only fetched: {e}"))
        .ok()
}

/// Decompresses zstd `compressed` to exactly `size` bytes (bounded at
/// mount: nothing is allocated for what a frame header claims).
fn decompress_exactly(compressed: &[u8], size: u64) -> io::Result<Vec<u8>> {
    let decoder = zstd::stream::read::Decoder::new(compressed)?;
    let mut raw = Vec::with_capacity(size as usize);
    io::copy(
        &mut io::Read::take(decoder, size.saturating_add(1)),
        &mut raw,
    )?;
    if raw.len() as u64 != size {
        return Err(io::Error::other("wrong uncompressed size"));
    }
    Ok(raw)
}

/// The mount's chunk index as the worker serves it; for a tar index, its
/// spans are the chunks (all inline) and its windows come along.
fn load_index(config: &DaemonConfig) -> io::Result<(IndexTop, Option<SpanWindows>)> {
    let bytes = std::fs::read(&config.index_path)?;
    if !config.tar_index {
        return Ok((
            ChunkIndex::parse_top(&bytes).map_err(io::Error::other)?,
            None,
        ));
    }
    let index = TarIndex::from_bytes(&bytes).map_err(io::Error::other)?;
    let (inline, windows): (Vec<IndexBlob>, WindowEntries) = index
        .layers
        .into_iter()
        .map(|layer| (layer.blob, layer.windows))
        .unzip();
    let top = IndexTop {
        chunk_bits: index.span_bits,
        blobs: inline.iter().map(IndexBlob::summary).collect(),
        prefetch: index.prefetch,
        inline,
    };
    let windows = SpanWindows::new(windows, config.tar_windows.as_ref(), config.timeout_secs)?;
    Ok((top, Some(windows)))
}

/// How often a miss looks for fills by others while it waits.
const SETTLE_TICK: Duration = Duration::from_millis(10);

/// A fetch a miss waits for, in the background.
enum Fetch {
    /// Not started.
    NotYet,
    /// Under way: its result comes on the channel.
    Running(mpsc::Receiver<io::Result<()>>),
    /// Done, and it worked (the chunks are filled, or were by others).
    Done,
    /// Done, and it failed.
    Failed(io::Error),
}

impl Fetch {
    fn not_yet(&self) -> bool {
        matches!(self, Fetch::NotYet)
    }

    fn failed(&self) -> bool {
        matches!(self, Fetch::Failed(_))
    }

    /// Waits up to `tick` for a running fetch to end; true when it did
    /// (look again at what is filled).
    fn wait(&mut self, tick: Duration) -> bool {
        let Fetch::Running(done) = self else {
            return false;
        };
        let result = match done.recv_timeout(tick) {
            Ok(result) => result,
            Err(mpsc::RecvTimeoutError::Timeout) => return false,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(io::Error::other("the fetch thread is gone"))
            }
        };
        *self = match result {
            Ok(()) => Fetch::Done,
            Err(e) => Fetch::Failed(e),
        };
        true
    }

    fn into_error(self) -> Option<io::Error> {
        match self {
            Fetch::Failed(e) => Some(e),
            _ => None,
        }
    }
}

/// Every fd number the holder could have had (its limit, which this worker
/// inherited): see `take_over_after_holder`.
fn orphan_fd_bound() -> i32 {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let bound = limit.current.unwrap_or(1 << 20).min(1 << 20);
    i32::try_from(bound).unwrap_or(i32::MAX)
}

/// Runs the worker on the socket `sock` from the holder.
pub fn run_worker(config_path: &Path, sock: OwnedFd) -> io::Result<()> {
    let config = DaemonConfig::load(config_path)?;
    adopt_in_background(config.adopt.clone());
    let (index, windows) = load_index(&config)?;
    let boot_set = index.prefetch.clone();
    let mut stores = Vec::new();
    let mut digests = Vec::new();
    let mut inline = index.inline.into_iter();
    for (spec, summary) in config.blobs.iter().zip(index.blobs) {
        digests.push(Digest::parse(&spec.digest).map_err(io::Error::other)?);
        // A paged blob whose table is cached opens now (its fill record
        // counts); one that no mount has read yet, at its first read.
        let table = match summary.table_digest {
            None => inline.next(),
            Some(_) => {
                load_table(&config.blob_dir, &summary, index.chunk_bits).unwrap_or_else(|e| {
                    tracing::warn!("{e}; fetching it again");
                    None
                })
            }
        };
        let refused = OnceLock::new();
        let store = match table
            .map(|t| open_store(&config.blob_dir, t, spec))
            .transpose()
        {
            Ok(store) => store,
            Err(e) => {
                tracing::error!("blob {}: {e}; failing its reads", spec.digest);
                let _ = refused.set(e.to_string());
                None
            }
        };
        stores.push(LazyStore {
            summary,
            complete: spec.complete,
            store: Mutex::new(store),
            refused,
        });
    }
    let source = crate::sources::range_source(&config.source, config.timeout_secs)?;
    let trace = match &config.record_trace {
        Some(p) => Some(Mutex::new(
            File::options().create(true).append(true).open(p)?,
        )),
        None => None,
    };
    let n = stores.len();
    let hedging = Arc::new(Hedging::default());
    // A few windows queued are plenty: each is up to `fill_ahead` bytes.
    let (ahead_tx, ahead_rx) = mpsc::sync_channel(8);
    // Unbounded: a batch per 2 MiB of the mapped files the start touches.
    let (predict_tx, predict_rx) = mpsc::channel();
    let predicting = config.predict_max > 0 && config.metadata_fill.is_some();
    let locator = open_locator(&config.blob_dir);
    let shared = Arc::new(Shared {
        file_map: OnceLock::new(),
        predicted: Mutex::new(HashSet::new()),
        miss_rate: RateMeter::default(),
        predictions: AtomicU64::new(0),
        predict: predicting.then_some(predict_tx),
        ahead: (config.fill_ahead > 0).then_some(ahead_tx),
        streams: (0..n).map(|_| Mutex::new(Stream::default())).collect(),
        ahead_unread: Mutex::new(HashSet::new()),
        ahead_chunk_bytes: AtomicU64::new(0),
        ahead_used_bytes: AtomicU64::new(0),
        ahead_stats: FetchStats::default(),
        predict_stats: FetchStats::default(),
        fetch: FetchOptions {
            deadline: Duration::from_secs(config.timeout_secs),
            hedging: config.hedge.then(|| hedging.clone()),
            ..FetchOptions::default()
        },
        boot_fetch: FetchOptions {
            deadline: Duration::from_secs(config.timeout_secs),
            merge_gap: 128 << 10,
            hedging: config.hedge.then(|| hedging.clone()),
            ..FetchOptions::default()
        },
        ahead_fetch: FetchOptions {
            deadline: Duration::from_secs(config.timeout_secs) / 4,
            attempts: 2,
            merge_gap: 0,
            ..FetchOptions::default()
        },
        predict_fetch: FetchOptions {
            deadline: Duration::from_secs(config.timeout_secs) / 4,
            attempts: 2,
            merge_gap: 0,
            hedging: config.hedge.then(|| hedging.clone()),
            ..FetchOptions::default()
        },
        config,
        digests,
        chunk_bits: index.chunk_bits,
        stores,
        windows,
        source,
        hedging,
        stats: FetchStats::default(),
        miss_stats: FetchStats::default(),
        last_miss_ms: AtomicU64::new(0),
        started: Instant::now(),
        inflight: Mutex::new(HashSet::new()),
        landed: Condvar::new(),
        misses: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        miss_latency: Recorder::default(),
        active_misses: AtomicU64::new(0),
        prefetch_done: AtomicU64::new(0),
        prefetch_total: AtomicU64::new(0),
        complete_sent: (0..n).map(|_| AtomicBool::new(false)).collect(),
        boot_chunks: boot_set.iter().copied().collect(),
        boot_set,
        boot_frames: AtomicUsize::new(0),
        boot_pending: AtomicUsize::new(0),
        sock,
        trace,
        group: OnceLock::new(),
        superblock: OnceLock::new(),
        holder_gone: AtomicBool::new(false),
        me: OnceLock::new(),
        locator,
        located_chunks: AtomicU64::new(0),
        located_bytes: AtomicU64::new(0),
    });
    let _ = shared.me.set(Arc::downgrade(&shared));
    // Blobs completed by an earlier worker: tell the holder again.
    for b in 0..n {
        shared.check_complete(b as u32);
    }
    // Boot pages go in while misses are served: the start they were
    // recorded from is about to read exactly these pages, in the order of
    // the segments. A miss on a boot-set chunk waits for them (it would
    // fetch the whole chunk otherwise); any other miss is served at once.
    if shared.config.prefetch && !shared.config.boot_pages.is_empty() {
        let frames = shared.config.boot_pages.iter().map(|b| b.frames().len());
        let frames: usize = frames.sum();
        // Pending first: `boot_frames_done` never reads more than done.
        shared.boot_pending.store(frames, Ordering::SeqCst);
        shared.boot_frames.store(frames, Ordering::SeqCst);
        let shared = shared.clone();
        std::thread::spawn(move || shared.load_boot_pages());
    }
    if !shared.config.later_layers.is_empty() {
        let shared = shared.clone();
        std::thread::spawn(move || shared.store_later_layers());
    }
    // Quiet periods count from now: misses queued in the holder arrive next.
    shared.last_miss_ms.store(
        shared.started.elapsed().as_millis() as u64,
        Ordering::Relaxed,
    );
    protocol::send_owned(&shared.sock, Message::Hello, None)?;
    tracing::info!(image = %shared.config.image, blobs = n, "serving misses");

    let jobs = {
        let shared = shared.clone();
        MissPool::new(shared.config.workers, MAX_MISS_THREADS, move |job| {
            shared.serve_job(job)
        })
    };
    {
        let shared = shared.clone();
        // Status is checked every 25 ms and written only when it changed, so
        // `lamina status` is at most ~25 ms behind without steady writes.
        std::thread::spawn(move || {
            let mut last = Vec::new();
            loop {
                shared.save_records(SAVE_INTERVAL);
                if let Ok(json) = shared.status_json() {
                    if json != last {
                        let _ = write_atomic(&shared.config.run_dir.join("status.json"), &json);
                        last = json;
                    }
                }
                std::thread::sleep(Duration::from_millis(25));
            }
        });
    }
    if shared.config.prefetch || shared.config.prefetch_all {
        let shared = shared.clone();
        std::thread::spawn(move || shared.prefetch());
    }
    // Two threads each: the next window is requested while one is in flight.
    serve_ahead(&shared, ahead_rx, 2, |s| (&s.ahead_fetch, &s.ahead_stats));
    if predicting {
        serve_ahead(&shared, predict_rx, 2, |s| {
            (&s.predict_fetch, &s.predict_stats)
        });
        let shared = shared.clone();
        std::thread::spawn(move || shared.build_file_map());
    }

    loop {
        match protocol::recv(std::os::fd::AsFd::as_fd(&shared.sock))? {
            Some((Message::Shutdown, _)) => {
                shared.save_records(Duration::ZERO);
                let _ = shared.write_status();
                return Ok(()); // the mount is gone
            }
            None => {
                // The holder died without a word (kill -9).
                shared.holder_gone.store(true, Ordering::SeqCst);
                shared.take_over_after_holder(&jobs)?;
                shared.save_records(Duration::ZERO);
                let _ = shared.write_status();
                return Ok(());
            }
            Some((Message::GroupFd, Some(fd))) => {
                let _ = shared.group.set(FanotifyGroup::from_fd(fd));
            }
            Some((Message::SuperblockFd, Some(fd))) => {
                let _ = shared.superblock.set(fd);
            }
            Some((
                Message::Miss {
                    id,
                    blob,
                    offset,
                    count,
                    response_fd,
                },
                fd,
            )) => {
                shared.misses.fetch_add(1, Ordering::Relaxed);
                shared.active_misses.fetch_add(1, Ordering::Relaxed);
                shared.last_miss_ms.store(
                    shared.started.elapsed().as_millis() as u64,
                    Ordering::Relaxed,
                );
                if blob as usize >= shared.stores.len() {
                    let _ = protocol::send_owned(
                        &shared.sock,
                        Message::Done {
                            id,
                            errno: libc::EIO,
                        },
                        None,
                    );
                    continue;
                }
                if shared.answer_if_ready(id, blob, offset, count, response_fd) {
                    shared.miss_latency.observe(Duration::ZERO);
                    shared.active_misses.fetch_sub(1, Ordering::Relaxed);
                    continue;
                }
                let _ = jobs.submit(Job {
                    id,
                    blob,
                    offset,
                    count,
                    file: fd.map(File::from),
                    response_fd,
                    received: Instant::now(),
                });
            }
            Some(_) => {}
        }
    }
}

/// A miss to serve: the event's range, its fd, and how to answer it.
struct Job {
    id: u64,
    blob: u32,
    offset: u64,
    count: u64,
    /// The fanotify event's quiet fd (none for a FUSE read: the cache file
    /// is written through the worker's own quiet fd).
    file: Option<File>,
    /// The event's fd number in the holder.
    response_fd: i32,
    /// When the miss reached the worker: its wait is measured from here.
    received: Instant,
}

/// Hashes, syncs and records the layer files the mount wrote without a
/// record, off the mount's path; a failure only means a later mount hashes
/// them again. This is where such a file's content digest (the layer's
/// annotation) is checked: the mount checked the layer's own digest, so
/// the file holds the layer's content either way, but only a file that
/// hashes to the annotation is recorded for later mounts to trust.
fn adopt_in_background(files: Vec<AdoptSpec>) {
    if files.is_empty() {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("lamina-adopt".into())
        .spawn(move || {
            for f in files {
                let digest = Digest::parse(&f.digest)
                    .ok()
                    .and_then(|d| <[u8; 32]>::try_from(hex::decode(d.hex()).ok()?).ok());
                let Some(digest) = digest else {
                    tracing::warn!("{}: bad digest {:?}, not recorded", f.path.display(), f.digest);
                    continue;
                };
                match lamina_fetch::store::adopt_whole(&f.path, &digest) {
                    Ok(true) => tracing::debug!("{} synced and recorded", f.path.display()),
                    Ok(false) => tracing::error!(
                        "{} does not hash to its content digest {}: not recorded (the layer's annotation is wrong, or the file was replaced after the mount wrote it)",
                        f.path.display(),
                        f.digest
                    ),
                    Err(e) => tracing::warn!("{}: not recorded: {e}", f.path.display()),
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the thread that records layer files: {e}");
    }
}

/// Starts `threads` threads fetching the windows `rx` gives, ahead of
/// readers, with the options and into the stats `how` picks of `Shared`.
fn serve_ahead(
    shared: &Arc<Shared>,
    rx: mpsc::Receiver<(u32, std::ops::Range<usize>)>,
    threads: usize,
    how: fn(&Shared) -> (&FetchOptions, &FetchStats),
) {
    let rx = Arc::new(Mutex::new(rx));
    for _ in 0..threads {
        let (shared, rx) = (shared.clone(), rx.clone());
        std::thread::spawn(move || loop {
            let job = match rx.lock() {
                Ok(r) => r.recv(),
                Err(_) => return,
            };
            let Ok((blob, chunks)) = job else { return };
            let (opts, stats) = how(&shared);
            shared.fetch_ahead(blob, chunks, opts, stats);
        });
    }
}

fn add_stats(to: &FetchStats, from: &FetchStats) {
    for (t, f) in [
        (&to.bytes, &from.bytes),
        (&to.requests, &from.requests),
        (&to.bad_chunks, &from.bad_chunks),
    ] {
        t.fetch_add(f.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

impl Shared {
    /// The store of `blob`, opened first if need be (its chunk table
    /// fetched: other users of the blob wait for it, as they need it too).
    fn lock_store(&self, blob: u32) -> io::Result<StoreGuard<'_>> {
        let mut slot = self.stores[blob as usize]
            .store
            .lock()
            .map_err(|_| io::Error::other("store lock poisoned"))?;
        if slot.is_none() {
            let lazy = &self.stores[blob as usize];
            if let Some(why) = lazy.refused.get() {
                return Err(io::Error::other(why.clone()));
            }
            let table = self.table_of(blob)?;
            *slot = Some(self.open_or_refuse(blob, table)?);
        }
        Ok(StoreGuard(slot))
    }

    /// Opens the store of `blob` with `table`, its chunk table as boot pages
    /// carry it (checked against the index), unless it is open already.
    fn take_table(&self, blob: u32, table: &[u8]) -> io::Result<()> {
        let lazy = &self.stores[blob as usize];
        let mut slot = lazy
            .store
            .lock()
            .map_err(|_| io::Error::other("store lock poisoned"))?;
        if slot.is_none() {
            let parsed = IndexBlob::from_table(&lazy.summary, self.chunk_bits, table)
                .map_err(io::Error::other)?;
            self.keep_table(blob, table);
            *slot = Some(self.open_or_refuse(blob, parsed)?);
        }
        Ok(())
    }

    /// Opens the store of `blob` (see [`open_store`]); a cache file that is
    /// not the mount's any more refuses the blob for good.
    fn open_or_refuse(&self, blob: u32, table: IndexBlob) -> io::Result<BlobStore> {
        let spec = &self.config.blobs[blob as usize];
        open_store(&self.config.blob_dir, table, spec).inspect_err(|e| {
            tracing::error!("blob {blob}: {e}; failing its reads");
            let _ = self.stores[blob as usize].refused.set(e.to_string());
        })
    }

    /// The store of `blob` if it is open (status and records never fetch).
    fn opened_store(&self, blob: u32) -> io::Result<Option<StoreGuard<'_>>> {
        let slot = self.stores[blob as usize]
            .store
            .lock()
            .map_err(|_| io::Error::other("store lock poisoned"))?;
        Ok(slot.is_some().then_some(StoreGuard(slot)))
    }

    /// The chunk table of `blob`: kept by another mount of it (since this
    /// worker started), or fetched, whichever comes first: a mount whose
    /// registry is dead or stalled takes the table another mount fetched
    /// (every mount sharing the cache file must allow each read of it).
    fn table_of(&self, blob: u32) -> io::Result<IndexBlob> {
        let summary = &self.stores[blob as usize].summary;
        let kept = || {
            load_table(&self.config.blob_dir, summary, self.chunk_bits)
                .ok()
                .flatten()
        };
        if let Some(table) = kept() {
            return Ok(table);
        }
        let Some(me) = self.me.get().and_then(std::sync::Weak::upgrade) else {
            return self.fetch_table(blob);
        };
        let (tx, rx) = mpsc::sync_channel(1);
        let started = Instant::now();
        let mine = me.clone();
        std::thread::Builder::new()
            .name("table-fetch".into())
            .spawn(move || {
                let _ = tx.send(mine.fetch_table(blob));
            })?;
        let mut failed: Option<(io::Error, Instant)> = None;
        let mut borrowed = false;
        loop {
            // Ours failed, or is slow: other mounts' registries too (a
            // table fetched there is kept, and found below).
            if !borrowed && (failed.is_some() || started.elapsed() >= HEDGE_AFTER) {
                borrowed = true;
                let me = me.clone();
                std::thread::Builder::new()
                    .name("table-borrow".into())
                    .spawn(move || {
                        let sources = crate::sources::of_other_mounts(&me.config, blob as usize);
                        for source in &sources {
                            match me.fetch_table_from(blob, source.as_ref()) {
                                Ok(_) => break,
                                Err(e) => tracing::warn!(blob, "another mount's registry: {e}"),
                            }
                        }
                    })?;
            }
            if failed.is_none() {
                match rx.recv_timeout(SETTLE_TICK * 5) {
                    Ok(Ok(table)) => return Ok(table),
                    Ok(Err(e)) => failed = Some((e, Instant::now())),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        failed = Some((io::Error::other("the table fetch is gone"), Instant::now()))
                    }
                }
            } else {
                std::thread::sleep(SETTLE_TICK * 5);
            }
            if let Some(table) = kept() {
                return Ok(table);
            }
            // Ours failed: another mount's may still land, for a while.
            if let Some((e, at)) = failed.take() {
                if at.elapsed() >= HEDGE_AFTER * 4 {
                    return Err(e);
                }
                failed = Some((e, at));
            }
        }
    }

    /// Fetches the chunk table at the end of `blob` (paged index): one
    /// range request, checked against the digest the index gives, retried
    /// on a fresh connection; kept beside the cache file for later mounts.
    fn fetch_table(&self, blob: u32) -> io::Result<IndexBlob> {
        self.fetch_table_from(blob, self.source.as_ref())
    }

    /// [`fetch_table`](Self::fetch_table) from `source`.
    fn fetch_table_from(&self, blob: u32, source: &dyn RangeSource) -> io::Result<IndexBlob> {
        let summary = &self.stores[blob as usize].summary;
        let Some((at, len)) = summary.table_range() else {
            return Err(io::Error::other("a version 1 blob without its chunks"));
        };
        let digest = &self.digests[blob as usize];
        let what = format!("chunk table of blob {blob}");
        let deadline = Instant::now() + Duration::from_secs(self.config.timeout_secs);
        let fetched = self.retried(&what, Some(deadline), |fresh| {
            let bytes = match fresh {
                false => source.read_range(digest, at, len),
                true => source.read_range_again(digest, at, len),
            }?;
            self.stats
                .bytes
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            self.stats.requests.fetch_add(1, Ordering::Relaxed);
            let table = IndexBlob::from_table(summary, self.chunk_bits, &bytes).map_err(|e| {
                // Counted with bad chunks: per-chunk data that failed its
                // digest.
                self.stats.bad_chunks.fetch_add(1, Ordering::Relaxed);
                io::Error::other(e)
            })?;
            Ok((bytes, table))
        });
        match fetched {
            Ok((bytes, table)) => {
                self.keep_table(blob, &bytes);
                Ok(table)
            }
            Err(e) => {
                tracing::error!("{what}: {e}; failing its reads");
                Err(e)
            }
        }
    }

    /// Keeps a verified chunk table beside its blob's cache file, for later
    /// workers; one that cannot be kept is only fetched again.
    fn keep_table(&self, blob: u32, table: &[u8]) {
        let summary = &self.stores[blob as usize].summary;
        if let Err(e) = save_table(&self.config.blob_dir, summary, table) {
            tracing::warn!("keeping the chunk table of blob {blob}: {e}");
        }
    }

    /// Runs `attempt` (given whether to use a fresh connection) until it
    /// succeeds: at most 4 times, 100, 200 and 400 ms apart, and with a
    /// `deadline` none starts after it.
    fn retried<T>(
        &self,
        what: &str,
        deadline: Option<Instant>,
        mut attempt: impl FnMut(bool) -> io::Result<T>,
    ) -> io::Result<T> {
        let mut tries = 0u32;
        loop {
            match attempt(tries > 0) {
                Ok(value) => return Ok(value),
                // At once on a fresh connection, then after 0.1 to 1.6 s.
                Err(e) if tries < 6 && deadline.is_none_or(|d| Instant::now() < d) => {
                    tracing::warn!("{what}: {e}; retrying");
                    if tries > 0 {
                        std::thread::sleep(Duration::from_millis(100 << (tries - 1)));
                    }
                    tries += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Answers a served miss: to the holder, or, once the holder is gone,
    /// to the kernel through the group copy, by the event's fd number in the
    /// dead holder (unique among its pending events; no new event is read
    /// before every forwarded one is answered, so none can share it).
    fn answer(&self, id: u64, response_fd: i32, errno: i32) {
        if !self.holder_gone.load(Ordering::SeqCst)
            && protocol::send_owned(&self.sock, Message::Done { id, errno }, None).is_ok()
        {
            return;
        }
        if let Some(group) = self.group.get() {
            let response = match errno {
                0 => Response::Allow,
                e => Response::DenyErrno(e),
            };
            if let Err(e) = group.respond(response_fd, response) {
                tracing::error!("answering event {response_fd} for the dead holder: {e}");
            }
        }
    }

    /// After the holder was killed: the group stays open in this process, so
    /// the kernel does not let reads of unfilled ranges see zeros, and this
    /// worker takes the holder's place. The misses in hand are finished and
    /// answered by the holder's fd numbers. Events the holder read but never
    /// forwarded are pending under fd numbers of its table, which an answer
    /// of ours could name: every fd number it could have had is answered
    /// EIO first (numbers no event has are refused by the kernel, harmless),
    /// so that none is left. Then this worker reads the group's events and
    /// serves them as misses, answering by its own fd numbers, until the
    /// superblock is gone. Readers of this mount, and of every other mount
    /// of the same cache files (asked too), go on getting the image's bytes.
    fn take_over_after_holder(&self, jobs: &MissPool<Job>) -> io::Result<()> {
        let (Some(group), Some(superblock)) = (self.group.get(), self.superblock.get()) else {
            // A FUSE daemon never hands over a group: its mount dies with
            // it, so no read can see unfilled bytes and there is nothing
            // to guard. A holder that died this early left no group either.
            tracing::warn!(
                "the mount's daemon is gone and left no fanotify group to guard \
                 (a FUSE daemon, or a holder that died before handing it over): exiting"
            );
            return Ok(());
        };
        tracing::error!("the holder died; finishing the misses in hand, then serving the group here until unmounted");
        while self.active_misses.load(Ordering::SeqCst) > 0 {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.save_records(Duration::ZERO);
        let orphans = orphan_fd_bound();
        for fd in 0..orphans {
            let _ = group.respond(fd, Response::DenyErrno(libc::EIO));
        }
        tracing::info!(
            fd_numbers = orphans,
            "events the holder left unanswered failed; serving"
        );
        let watched = self.cache_inodes();
        let mut buf = Vec::new();
        loop {
            let group_fd = group.as_fd();
            let mut fds = [
                PollFd::new(&group_fd, PollFlags::IN),
                PollFd::new(superblock, PollFlags::IN),
            ];
            match poll(&mut fds, None) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
            if !fds[1].revents().is_empty() && crate::holder::superblock_gone(superblock) {
                tracing::info!("the filesystem is gone; exiting");
                return Ok(());
            }
            if fds[0].revents().contains(PollFlags::IN) {
                for ev in group.read_events(&mut buf)? {
                    self.take_event(group, ev, &watched, jobs);
                }
            }
        }
    }

    /// `(device, inode)` of each blob's cache file, as the mount made it.
    fn cache_inodes(&self) -> HashMap<(u64, u64), u32> {
        let mut inodes = HashMap::new();
        for (i, spec) in self.config.blobs.iter().enumerate() {
            match spec.open_checked().and_then(|f| Ok(rustix::fs::fstat(&f)?)) {
                Ok(st) => {
                    inodes.insert((st.st_dev, st.st_ino), i as u32);
                }
                Err(e) => tracing::warn!("blob {i}: {e}; its reads get EIO"),
            }
        }
        inodes
    }

    /// One event read in the holder's place: a read of a watched cache file
    /// becomes a miss served by the miss threads (answered by this
    /// process's fd number); anything else is let through.
    fn take_event(
        &self,
        group: &FanotifyGroup,
        ev: lamina_sys::Event,
        watched: &HashMap<(u64, u64), u32>,
        jobs: &MissPool<Job>,
    ) {
        let Some(file) = ev.file else {
            tracing::error!("fanotify queue overflow");
            return;
        };
        // This worker's own reads and writes (verified data) go through.
        if ev.pid == std::process::id() as i32 {
            let _ = group.respond(ev.response_fd, Response::Allow);
            return;
        }
        let stat = rustix::fs::fstat(&file);
        let blob = stat
            .as_ref()
            .ok()
            .and_then(|st| watched.get(&(st.st_dev, st.st_ino)).copied());
        let (Ok(stat), Some(blob)) = (stat, blob) else {
            let answer = match watched.is_empty() {
                true => Response::DenyErrno(libc::EIO),
                false => Response::Allow,
            };
            let _ = group.respond(ev.response_fd, answer);
            return;
        };
        let (offset, count) = ev.range.unwrap_or((0, stat.st_size as u64));
        self.misses.fetch_add(1, Ordering::Relaxed);
        self.active_misses.fetch_add(1, Ordering::Relaxed);
        let job = Job {
            id: 0,
            blob,
            offset,
            count,
            file: Some(File::from(file)),
            response_fd: ev.response_fd,
            received: Instant::now(),
        };
        if let Err(e) = jobs.submit(job) {
            let _ = group.respond(e.0.response_fd, Response::DenyErrno(libc::EIO));
        }
    }

    /// Saves the fill records whose chunks have waited `interval`: the
    /// cache file is synced without the store's lock, so fills go on.
    /// Serves one miss and answers its reader.
    fn serve_job(self: &Arc<Self>, job: Job) {
        let Job {
            id,
            blob,
            offset,
            count,
            file,
            response_fd,
            received,
        } = job;
        let errno = match self.serve_miss(blob, offset, count, file.as_ref()) {
            Ok(()) => 0,
            Err(e) => {
                tracing::error!(
                    blob,
                    offset,
                    count,
                    "blob {blob} bytes {offset}+{count}: {e}; reader gets EIO"
                );
                self.failed.fetch_add(1, Ordering::Relaxed);
                libc::EIO
            }
        };
        self.answer(id, response_fd, errno);
        let waited = received.elapsed();
        self.miss_latency.observe(waited);
        tracing::debug!(
            blob,
            offset,
            count,
            errno,
            waited_ms = waited.as_secs_f64() * 1e3,
            "miss answered"
        );
        self.active_misses.fetch_sub(1, Ordering::Relaxed);
    }

    fn save_records(&self, interval: Duration) {
        for b in 0..self.stores.len() as u32 {
            let saved = (|| {
                let Some(pending) = self.opened_store(b)?.map(|mut s| s.begin_save(interval))
                else {
                    return Ok(());
                };
                let Some(pending) = pending? else {
                    return Ok(());
                };
                pending.sync()?;
                self.lock_store(b)?.finish_save(pending)
            })();
            if let Err(e) = saved {
                tracing::warn!("saving the fill record of blob {b}: {e}");
            }
        }
    }

    /// Fills the chunks under `[offset, offset + count)` (and the rest of the
    /// fill window around it), writing through the event's `file`. Chunks
    /// that another thread or another mount sharing the cache file is
    /// fetching are waited for and then verified, fetched here too only
    /// once another mount has held them for [`HEDGE_AFTER`]; a fetch that
    /// fails leaves its chunks to the next claimant.
    ///
    /// Mounts of one cache file share its inode, so every mount's worker is
    /// asked about every read of it, and the read fails if any of them
    /// says EIO. So the miss is answered as soon as its chunks are filled
    /// by anyone (verified here), even while this worker's own fetch is
    /// still on its way; and this worker's failure fails the read only when
    /// no other mount is fetching those chunks. A dead registry, expired
    /// credentials or a slow link of one mount never fail, and do not delay
    /// beyond the hedge, a read another mount can serve.
    fn serve_miss(
        self: &Arc<Self>,
        blob: u32,
        offset: u64,
        count: u64,
        file: Option<&File>,
    ) -> io::Result<()> {
        if let Some(trace) = &self.trace {
            // A trace that cannot be written must not fail the reader.
            if let Err(e) = self.record(trace, blob, offset, count) {
                tracing::warn!("trace: {e}");
            }
        }
        let (needed, window) = {
            let store = self.lock_store(blob)?;
            let needed = store.chunks_covering(offset, count.max(1));
            // Landed reads count too: a stream reads mostly what was
            // fetched ahead of it, and must see its reader come near the end.
            self.read_ahead_of(blob, &store, needed.clone());
            if store.range_ready(offset, count) {
                return Ok(());
            }
            drop(store);
            if self.wait_boot_pages(blob, offset, count, needed.clone())? {
                return Ok(());
            }
            self.predict_from(blob, offset, &needed);
            let store = self.lock_store(blob)?;
            let w = self.config.fill_window.max(1);
            let start = offset / w * w;
            let win = store.chunks_covering(start, w.max(offset + count - start));
            (needed, win)
        };
        let started = Instant::now();
        let deadline = started + Duration::from_secs(self.config.timeout_secs);
        let mut wanted: Vec<usize> = window.chain(needed.clone()).collect();
        let (mut own, mut borrowed) = (Fetch::NotYet, Fetch::NotYet);
        loop {
            if self.settled(blob, needed.clone(), file)? {
                return Ok(());
            }
            // Ours landed but chunks are still missing (others held some
            // when we claimed, and may have given them up): claim again.
            if matches!(own, Fetch::Done) {
                own = Fetch::NotYet;
            }
            if own.not_yet() {
                let hedge = started.elapsed() >= HEDGE_AFTER;
                let mine = self.claim(blob, wanted.iter().copied(), file, hedge)?;
                if !mine.is_empty() {
                    own = Fetch::Running(self.fetch_in_background(blob, mine, file)?);
                }
                wanted = needed.clone().collect();
            }
            // Ours failed, or is slow: other mounts' registries too.
            if borrowed.not_yet() && (own.failed() || started.elapsed() >= HEDGE_AFTER) {
                borrowed = match self.fetch_from_others(blob, needed.clone(), file)? {
                    Some(done) => Fetch::Running(done),
                    None => Fetch::Failed(io::Error::other("no other mount of this blob")),
                };
            }
            if Instant::now() >= deadline {
                return Err(own.into_error().unwrap_or_else(|| {
                    io::Error::new(io::ErrorKind::TimedOut, "waiting for chunks")
                }));
            }
            if own.wait(SETTLE_TICK) || borrowed.wait(SETTLE_TICK) {
                continue;
            }
            // Ours failed (and others' registries did not help): only
            // another mount's fetch can still fill the chunks; with none
            // under way, the read fails now.
            if own.failed() && borrowed.failed() && !self.others_fetching(blob, needed.clone())? {
                return Err(own
                    .into_error()
                    .unwrap_or_else(|| io::Error::other("fetch failed")));
            }
            // Others (a thread of ours, another mount) are fetching what
            // we need: a thread of ours wakes us, others' fills are polled.
            self.wait_landed(SETTLE_TICK)?;
        }
    }

    /// Fetches the unfilled chunks of `needed` from the sources of other
    /// mounts of this blob's cache entry (`crate::sources`), on a thread
    /// of its own; `None` when there are none.
    fn fetch_from_others(
        self: &Arc<Self>,
        blob: u32,
        needed: std::ops::Range<usize>,
        via: Option<&File>,
    ) -> io::Result<Option<mpsc::Receiver<io::Result<()>>>> {
        let sources = crate::sources::of_other_mounts(&self.config, blob as usize);
        if sources.is_empty() {
            return Ok(None);
        }
        let via = via.map(File::try_clone).transpose()?;
        let (tx, rx) = mpsc::sync_channel(1);
        let shared = self.clone();
        std::thread::Builder::new()
            .name("miss-borrow".into())
            .spawn(move || {
                let mut result = Err(io::Error::other("no other mount's source served"));
                for source in &sources {
                    let chunks: Vec<usize> = match shared.lock_store(blob) {
                        Ok(store) => needed.clone().filter(|&i| !store.is_filled(i)).collect(),
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    };
                    let (opts, stats) = (&shared.fetch, Some(&shared.miss_stats));
                    result = shared.fetch_from(source, blob, &chunks, via.as_ref(), opts, stats);
                    match &result {
                        Ok(()) => {
                            tracing::info!(blob, "chunks fetched from another mount's registry");
                            break;
                        }
                        Err(e) => tracing::warn!(blob, "another mount's registry: {e}"),
                    }
                }
                let _ = tx.send(result);
            })?;
        Ok(Some(rx))
    }

    /// Whether every chunk of `needed` is filled: verified by this worker,
    /// or recorded, or written and re-hashed here, by another mount's.
    fn settled(
        &self,
        blob: u32,
        needed: std::ops::Range<usize>,
        via: Option<&File>,
    ) -> io::Result<bool> {
        let mut store = self.lock_store(blob)?;
        for i in needed {
            if !store.is_filled(i) && !store.adopt(i, via)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Whether another mount holds the claim of a chunk of `needed` that
    /// is not filled (is fetching it).
    fn others_fetching(&self, blob: u32, needed: std::ops::Range<usize>) -> io::Result<bool> {
        let store = self.lock_store(blob)?;
        for i in needed.filter(|&i| !store.is_filled(i)) {
            if !store.try_lock_chunk(i)? {
                return Ok(true);
            }
            store.unlock_chunk(i)?;
        }
        Ok(false)
    }

    /// Fetches `chunks` (claimed) on a thread of their own, then releases
    /// them: the miss waits for this or for others' fills, whichever comes
    /// first. The result arrives on the returned channel.
    fn fetch_in_background(
        self: &Arc<Self>,
        blob: u32,
        chunks: Vec<usize>,
        via: Option<&File>,
    ) -> io::Result<mpsc::Receiver<io::Result<()>>> {
        let via = via.map(File::try_clone).transpose();
        let via = match via {
            Ok(via) => via,
            Err(e) => {
                self.release(blob, &chunks);
                return Err(e);
            }
        };
        let (tx, rx) = mpsc::sync_channel(1);
        let shared = self.clone();
        let spawned = std::thread::Builder::new()
            .name("miss-fetch".into())
            .spawn(move || {
                let result = shared.fetch_into(blob, &chunks, via.as_ref());
                shared.release(blob, &chunks);
                let _ = tx.send(result);
            });
        spawned.map(|_| rx)
    }

    /// Answers a miss at once, on the thread that receives misses, when
    /// its range is local already; false when it must be served by a miss
    /// thread. Misses waiting on the network then never hold up reads of
    /// local data (a FUSE daemon asks about every read of an incomplete
    /// blob). Not while recording a trace: every miss is written to it.
    fn answer_if_ready(
        &self,
        id: u64,
        blob: u32,
        offset: u64,
        count: u64,
        response_fd: i32,
    ) -> bool {
        if self.trace.is_some() {
            return false;
        }
        // Never wait here: a store held by a fill is served by a thread.
        let Ok(slot) = self.stores[blob as usize].store.try_lock() else {
            return false;
        };
        let Some(store) = slot.as_ref() else {
            return false;
        };
        if !store.range_ready(offset, count) {
            return false;
        }
        self.read_ahead_of(blob, store, store.chunks_covering(offset, count.max(1)));
        drop(slot);
        self.answer(id, response_fd, 0);
        true
    }

    /// While boot pages are still coming and the range lies in boot-set
    /// chunks, waits for them. Returns whether the range is ready (false:
    /// fetch its chunks). Bounded by the miss timeout; a segment that
    /// failed counts as done, so its chunks are fetched instead.
    fn wait_boot_pages(
        &self,
        blob: u32,
        offset: u64,
        count: u64,
        needed: std::ops::Range<usize>,
    ) -> io::Result<bool> {
        let booted = needed
            .into_iter()
            .any(|i| self.boot_chunks.contains(&(blob, i as u32)));
        if !booted {
            return Ok(false);
        }
        let deadline = Instant::now() + Duration::from_secs(self.config.timeout_secs);
        while self.boot_pending.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            self.wait_landed(Duration::from_millis(10))?;
            if self.lock_store(blob)?.range_ready(offset, count) {
                return Ok(true);
            }
        }
        Ok(self.lock_store(blob)?.range_ready(offset, count))
    }

    /// Notes a read of `chunks` and queues the window to fetch ahead of it,
    /// if the blob is being read in order.
    fn read_ahead_of(&self, blob: u32, store: &BlobStore, chunks: std::ops::Range<usize>) {
        let Some(ahead) = &self.ahead else { return };
        self.note_ahead_read(blob, store, chunks.clone());
        let Ok(mut stream) = self.streams[blob as usize].lock() else {
            return;
        };
        let entries = &store.blob.chunks;
        let size = |i: usize| u64::from(entries[i].size.get());
        if let Some(window) = stream.observe(chunks, entries.len(), self.config.fill_ahead, size) {
            tracing::debug!(blob, ?window, "fetching ahead of a stream");
            if ahead.try_send((blob, window)).is_err() {
                tracing::debug!(blob, "fill-ahead queue full; the reader's misses fetch it");
            }
        }
    }

    /// Reads the metadata's tree into the map of files fetched together
    /// on a first miss (`crate::predict`); without it (too large,
    /// unreadable) nothing is predicted, and the log says why.
    fn build_file_map(&self) {
        let file = match &self.config.metadata_fill {
            Some(MetadataFill::Whole) => File::open(&self.config.metadata_path),
            Some(MetadataFill::Frames { digest }) => match self.wait_metadata_whole(digest) {
                Some(file) => Ok(file),
                None => return,
            },
            None => return,
        };
        let map = file.map_err(MapError::from).and_then(|mut file| {
            let len = file.metadata()?.len();
            if len > PREDICT_METADATA_MAX {
                return Err(MapError::Io(io::Error::other(format!(
                    "{len} bytes, too large"
                ))));
            }
            let mut bytes = Vec::with_capacity(len as usize);
            io::Read::read_to_end(&mut file, &mut bytes)?;
            let image = Image::new(&bytes)?;
            FileMap::build(&image, self.stores.len(), self.config.predict_max)
        });
        match map {
            Ok(map) => {
                tracing::info!(
                    groups = map.groups(),
                    mapped = map.mapped_files(),
                    "predicting misses: files fetched together on a first miss"
                );
                let _ = self.file_map.set(map);
            }
            Err(e) => tracing::info!("no predicted misses: {e}"),
        }
    }

    /// Waits until the metadata, filled frame by frame by the FUSE
    /// daemon, is recorded whole with the content the image names, and
    /// returns the file the record describes; `None` (and a log line) if
    /// it is not within `START_AT_MOST`.
    fn wait_metadata_whole(&self, named: &str) -> Option<File> {
        let path = &self.config.metadata_path;
        let mut digest = [0u8; 32];
        if hex::decode_to_slice(named, &mut digest).is_err() {
            tracing::info!("no predicted misses: the metadata's digest {named:?} is not SHA-256");
            return None;
        }
        let deadline = Instant::now() + START_AT_MOST;
        while Instant::now() < deadline {
            if let Ok(file) = lamina_fetch::private::open_existing(path) {
                if lamina_fetch::store::recorded_whole(&file, path, &digest).unwrap_or(false) {
                    return Some(file);
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        tracing::info!("no predicted misses: the metadata was not recorded whole in time");
        None
    }

    /// On the first miss in a mapped file or a group of small files
    /// (`crate::predict`), queues the rest of it, from the miss on.
    fn predict_from(&self, blob: u32, offset: u64, needed: &std::ops::Range<usize>) {
        let (Some(tx), Some(map)) = (&self.predict, self.file_map.get()) else {
            return;
        };
        let Some(group) = map.group_at(blob, offset) else {
            return;
        };
        // Not marked as queued: a later miss asks again, once the link
        // proved fast.
        if !self.miss_rate.fast_enough() {
            return;
        }
        let first = self
            .predicted
            .lock()
            .is_ok_and(|mut queued| queued.insert((blob, group)));
        if !first {
            return;
        }
        let Ok(store) = self.lock_store(blob) else {
            return;
        };
        let mut chunks: Vec<usize> = map
            .ranges(group, blob)
            .flat_map(|r| store.chunks_covering(r.start, r.end - r.start))
            .collect();
        drop(store);
        chunks.sort_unstable();
        chunks.dedup();
        self.predictions.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(blob, group, chunks = chunks.len(), "fetching a file group");
        for batch in crate::predict::batches(&chunks, needed, PREDICT_BATCH) {
            let _ = tx.send((blob, batch));
        }
    }

    /// Counts the chunks of a read that were fetched ahead (once each).
    fn note_ahead_read(&self, blob: u32, store: &BlobStore, chunks: std::ops::Range<usize>) {
        let Ok(mut unread) = self.ahead_unread.lock() else {
            return;
        };
        if unread.is_empty() {
            return;
        }
        for i in chunks {
            if unread.remove(&(blob, i)) {
                let size = u64::from(store.blob.chunks[i].size.get());
                self.ahead_used_bytes.fetch_add(size, Ordering::Relaxed);
            }
        }
    }

    /// Fetches a window ahead of a reader: what no one else holds.
    fn fetch_ahead(
        &self,
        blob: u32,
        chunks: std::ops::Range<usize>,
        opts: &FetchOptions,
        stats: &FetchStats,
    ) {
        let Ok(mine) = self.claim(blob, chunks, None, false) else {
            return;
        };
        if mine.is_empty() {
            return;
        }
        // Noted before the fetch: a reader that meets a chunk in flight
        // has used what was fetched ahead too.
        if let Ok(mut unread) = self.ahead_unread.lock() {
            unread.extend(mine.iter().map(|&i| (blob, i)));
        }
        if let Err(e) = self.fetch_with(blob, &mine, None, opts, Some(stats)) {
            // Not fatal: the reader's own misses fetch (and retry) these.
            tracing::warn!("fetching ahead: {e}");
        }
        self.note_fetched_ahead(blob, &mine);
        self.release(blob, &mine);
    }

    /// Counts the chunks of `mine` that a fetch ahead filled; forgets the
    /// others (a reader's miss fetches them).
    fn note_fetched_ahead(&self, blob: u32, mine: &[usize]) {
        let Ok(store) = self.lock_store(blob) else {
            return;
        };
        let (filled, failed): (Vec<usize>, Vec<usize>) =
            mine.iter().partition(|&&i| store.is_filled(i));
        let bytes: u64 = filled
            .iter()
            .map(|&i| u64::from(store.blob.chunks[i].size.get()))
            .sum();
        drop(store);
        self.ahead_chunk_bytes.fetch_add(bytes, Ordering::Relaxed);
        if let Ok(mut unread) = self.ahead_unread.lock() {
            for i in failed {
                unread.remove(&(blob, i));
            }
        }
    }

    fn wait_landed(&self, at_most: Duration) -> io::Result<()> {
        let inflight = self
            .inflight
            .lock()
            .map_err(|_| io::Error::other("lock poisoned"))?;
        drop(
            self.landed
                .wait_timeout(inflight, at_most)
                .map_err(|_| io::Error::other("lock poisoned"))?,
        );
        Ok(())
    }

    /// Appends a miss to the trace: the part of each chunk it reads.
    fn record(&self, trace: &Mutex<File>, blob: u32, offset: u64, count: u64) -> io::Result<()> {
        let store = self.lock_store(blob)?;
        let end = offset.saturating_add(count.max(1));
        let mut lines = String::new();
        for i in store.chunks_covering(offset, count.max(1)) {
            let c = &store.blob.chunks[i];
            let start = c.cache_offset.get();
            let from = offset.max(start);
            let to = end.min(start + u64::from(c.size.get()));
            if to > from {
                lines.push_str(&format!(
                    "{} {} {}\n",
                    hex::encode(c.digest),
                    from - start,
                    to - from
                ));
            }
        }
        drop(store);
        let mut t = trace
            .lock()
            .map_err(|_| io::Error::other("trace lock poisoned"))?;
        t.write_all(lines.as_bytes())
    }

    /// Fetches and applies the boot pages, frame by frame in read order:
    /// the first alone (the start's first pages, as soon as possible), then
    /// [`BOOT_STREAMS`] at a time, each applied as soon as it is verified,
    /// so the start reads (and computes) while later frames are on the wire.
    fn load_boot_pages(&self) {
        let frames: Vec<(usize, &BootPagesSpec, BootFrameSpec)> = self
            .config
            .boot_pages
            .iter()
            .flat_map(|spec| {
                spec.frames()
                    .into_iter()
                    .enumerate()
                    .map(move |(k, f)| (k, spec, f))
            })
            .collect();
        let apply = |(k, spec, frame): &(usize, &BootPagesSpec, BootFrameSpec)| {
            if let Err(e) = self.apply_boot_frame(*k, spec, frame) {
                tracing::warn!("boot pages frame {k} of {}: {e}", spec.layer_digest);
            }
            self.boot_pending.fetch_sub(1, Ordering::SeqCst);
            self.landed.notify_all();
        };
        let Some((first, rest)) = frames.split_first() else {
            return;
        };
        apply(first);
        let next = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..BOOT_STREAMS.min(rest.len()) {
                scope.spawn(|| {
                    while let Some(frame) = rest.get(next.fetch_add(1, Ordering::Relaxed)) {
                        apply(frame);
                    }
                });
            }
        });
    }

    /// Loads frame `k` of a boot-pages layer (a cached copy that still
    /// hashes right, else a range of the layer, retried and hedged, checked
    /// against the frame's digest), decompresses it to exactly its size and
    /// writes its pages into the cache files.
    fn apply_boot_frame(
        &self,
        k: usize,
        spec: &BootPagesSpec,
        frame: &BootFrameSpec,
    ) -> io::Result<()> {
        let digest = Digest::parse(&frame.digest).map_err(io::Error::other)?;
        let cache_path = spec.frame_path(k);
        let cached = std::fs::read(&cache_path)
            .ok()
            .filter(|z| Digest::of_bytes(z) == digest);
        let fresh = cached.is_none();
        let compressed = match cached {
            Some(z) => z,
            None => self.fetch_boot_frame(spec, frame, &digest)?,
        };
        let raw = decompress_exactly(&compressed, frame.size)?;
        let sizes: Vec<u64> = self.stores.iter().map(|s| s.summary.cache_size).collect();
        let table_lens: Vec<u64> = self
            .stores
            .iter()
            .map(|s| s.summary.table_range().map_or(0, |(_, len)| len))
            .collect();
        let boot = BootPages::from_bytes(&raw, &sizes, &table_lens).map_err(io::Error::other)?;
        for (blob, table) in &boot.tables {
            self.take_table(*blob, table)?;
        }
        let mut written = 0;
        for (extent, bytes) in boot.iter() {
            written += self
                .lock_store(extent.blob.get())?
                .fill_pages(extent.cache_offset.get(), bytes)?;
        }
        tracing::debug!(
            "boot pages frame {k}: {} runs, {written} bytes written {:.0} ms after the worker started",
            boot.extents.len(),
            self.started.elapsed().as_secs_f64() * 1e3
        );
        if fresh {
            // Kept for later workers, which check it against the frame's
            // digest before use, so a torn copy is only fetched again.
            let _ = write_atomic(&cache_path, &compressed);
        }
        Ok(())
    }

    /// One frame of a boot-pages layer from the registry: a range, retried
    /// and hedged like a miss's, checked against the frame's digest.
    fn fetch_boot_frame(
        &self,
        spec: &BootPagesSpec,
        frame: &BootFrameSpec,
        digest: &Digest,
    ) -> io::Result<Vec<u8>> {
        let layer = Digest::parse(&spec.layer_digest).map_err(io::Error::other)?;
        let range = (frame.offset, frame.compressed_size);
        let hedging = self.config.hedge.then_some(self.hedging.as_ref());
        let z = self.retried("boot pages", None, |fresh| {
            let z = read_first_answer(&self.source, hedging, &layer, range, fresh)?;
            self.stats
                .bytes
                .fetch_add(z.len() as u64, Ordering::Relaxed);
            self.stats.requests.fetch_add(1, Ordering::Relaxed);
            match Digest::of_bytes(&z) == *digest {
                true => Ok(z),
                false => Err(io::Error::other(format!(
                    "frame at {} does not match its digest {digest}",
                    frame.offset
                ))),
            }
        })?;
        Ok(z)
    }

    /// A zstd lamina layer, fetched whole (one request, retried), checked
    /// against its digest and decompressed to exactly `size` bytes (bounded
    /// at mount: nothing is allocated for what a frame header claims).
    fn fetch_layer(
        &self,
        what: &str,
        digest: &str,
        layer_size: u64,
        size: u64,
    ) -> io::Result<Vec<u8>> {
        let layer = Digest::parse(digest).map_err(io::Error::other)?;
        let compressed = self.retried(what, None, |fresh| match fresh {
            false => self.source.read_range(&layer, 0, layer_size),
            true => self.source.read_range_again(&layer, 0, layer_size),
        })?;
        self.stats
            .bytes
            .fetch_add(compressed.len() as u64, Ordering::Relaxed);
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        if Digest::of_bytes(&compressed) != layer {
            return Err(io::Error::other(format!(
                "{what} layer does not match its digest {layer}"
            )));
        }
        decompress_exactly(&compressed, size).map_err(|e| io::Error::other(format!("{what}: {e}")))
    }

    /// Fetches the layers the mount left for later (after the boot pages:
    /// the start comes first), each stored synced with its fill record.
    fn store_later_layers(&self) {
        while self.boot_pending.load(Ordering::SeqCst) > 0 {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.wait_start_over();
        for spec in &self.config.later_layers {
            match self.store_layer(spec) {
                Ok(()) => tracing::info!(
                    "{} stored {:.0} ms after the worker started",
                    spec.what,
                    self.started.elapsed().as_secs_f64() * 1e3
                ),
                Err(e) => tracing::error!("{}: {e}; not stored", spec.what),
            }
        }
    }

    fn store_layer(&self, spec: &LayerSpec) -> io::Result<()> {
        let digest = Digest::parse(&spec.digest).map_err(io::Error::other)?;
        let content = <[u8; 32]>::try_from(hex::decode(digest.hex()).map_err(io::Error::other)?)
            .map_err(|_| io::Error::other("not a SHA-256 digest"))?;
        if lamina_fetch::store::adopt_whole(&spec.path, &content).unwrap_or(false) {
            return Ok(()); // another mount stored it
        }
        let raw = self.fetch_layer(&spec.what, &spec.layer_digest, spec.layer_size, spec.size)?;
        if lamina_oci::sha256(&raw) != content {
            return Err(io::Error::other(format!(
                "content does not match its digest {digest}"
            )));
        }
        let file = lamina_fetch::private::write_atomic_file(&spec.path, &raw, true)?;
        lamina_fetch::store::record_whole(&file, &spec.path, &content)
    }

    /// Makes the chunks among `chunks` that nobody is fetching ours: in
    /// this process (the in-flight set) and across processes (the chunk's
    /// lock in the cache file). A chunk whose bytes another process already
    /// wrote is verified (read through `via` or the quiet writer) and
    /// adopted instead of fetched. Returns the chunks to fetch.
    ///
    /// With `hedge`, a chunk another mount has claimed is taken all the
    /// same (its claim is not ours to release): that fetch has taken too
    /// long, and the bytes both write are the same verified bytes.
    fn claim(
        &self,
        blob: u32,
        chunks: impl Iterator<Item = usize>,
        via: Option<&File>,
        hedge: bool,
    ) -> io::Result<Vec<usize>> {
        let mut inflight = self
            .inflight
            .lock()
            .map_err(|_| io::Error::other("lock poisoned"))?;
        let mut store = self.lock_store(blob)?;
        let mut mine = Vec::new();
        for i in chunks {
            if store.is_filled(i) || inflight.contains(&(blob, i)) {
                continue;
            }
            let locked = store.try_lock_chunk(i)?;
            if !locked && !hedge {
                continue; // another mount is fetching it
            }
            if store.adopt(i, via)? {
                if locked {
                    store.unlock_chunk(i)?;
                }
                continue;
            }
            inflight.insert((blob, i));
            mine.push(i);
        }
        Ok(mine)
    }

    fn release(&self, blob: u32, chunks: &[usize]) {
        if let Ok(store) = self.lock_store(blob) {
            for &i in chunks {
                if let Err(e) = store.unlock_chunk(i) {
                    tracing::warn!("unlocking chunk {i} of blob {blob}: {e}");
                }
            }
        }
        if let Ok(mut inflight) = self.inflight.lock() {
            for i in chunks {
                inflight.remove(&(blob, *i));
            }
        }
        self.landed.notify_all();
    }

    /// Fetches chunks a reader is waiting for.
    fn fetch_into(&self, blob: u32, chunks: &[usize], via: Option<&File>) -> io::Result<()> {
        let (started, mine) = (Instant::now(), FetchStats::default());
        let result = self.fetch_with(blob, chunks, via, &self.fetch, Some(&mine));
        add_stats(&self.miss_stats, &mine);
        if result.is_ok() {
            let bytes = mine.bytes.load(Ordering::Relaxed);
            self.miss_rate.note(started.elapsed(), bytes);
        }
        result
    }

    fn fetch_with(
        &self,
        blob: u32,
        chunks: &[usize],
        via: Option<&File>,
        opts: &FetchOptions,
        also_count: Option<&FetchStats>,
    ) -> io::Result<()> {
        let source = &self.source;
        self.fetch_from(source, blob, chunks, via, opts, also_count)
    }

    /// [`fetch_with`](Self::fetch_with) from `source`.
    fn fetch_from(
        &self,
        source: &Arc<dyn RangeSource>,
        blob: u32,
        chunks: &[usize],
        via: Option<&File>,
        opts: &FetchOptions,
        also_count: Option<&FetchStats>,
    ) -> io::Result<()> {
        let (entries, key) = {
            let store = self.lock_store(blob)?;
            (store.blob.chunks.clone(), store.key)
        };
        let chunks = &self.copy_located(blob, (&entries, &key), chunks, via)?;
        let counted = FetchStats::default();
        let fetch = |codec: ChunkCodec<'_>| {
            let target = BlobChunks {
                digest: &self.digests[blob as usize],
                chunks: &entries,
                codec,
            };
            fetch_chunks(source, target, chunks, opts, &counted, |i, data| {
                self.lock_store(blob)?.fill(i, &data, via)?;
                self.note_located(&entries[i], &key);
                Ok(())
            })
        };
        let result = match &self.windows {
            Some(windows) => windows.with_windows(blob, chunks, opts, &counted, fetch),
            None => fetch(ChunkCodec::Lamina),
        };
        add_stats(&self.stats, &counted);
        if let Some(stats) = also_count {
            add_stats(stats, &counted);
        }
        self.landed.notify_all();
        self.check_complete(blob);
        result.map_err(io::Error::other)
    }

    fn check_complete(&self, blob: u32) {
        let complete = match self.opened_store(blob) {
            Ok(Some(s)) => s.is_complete(),
            Ok(None) => self.stores[blob as usize].complete,
            Err(_) => false,
        };
        if complete && !self.complete_sent[blob as usize].swap(true, Ordering::Relaxed) {
            let _ = protocol::send_owned(&self.sock, Message::Complete { blob }, None);
        }
    }

    /// Background fetching. The boot set goes first and at once: the
    /// workload it was recorded from is starting right now and will miss on
    /// exactly these chunks, so they are fetched in recorded order, a few MiB
    /// at a time, each window sorted and merged into few large requests, and
    /// misses on them wait for the chunks in flight. The rest of the image
    /// (`--prefetch-all`) then yields to every miss.
    fn prefetch(&self) {
        // Boot pages first: they are what the start reads next.
        while self.boot_pending.load(Ordering::SeqCst) > 0 {
            let _ = self.wait_landed(Duration::from_millis(10));
        }
        let mut planned = HashSet::new();
        let mut boot: Vec<(u32, usize)> = Vec::new();
        // With boot pages the boot set is already in; its chunks only lead
        // the order of --prefetch-all.
        let chunk_boot_set = self.config.prefetch && self.config.boot_pages.is_empty();
        if chunk_boot_set {
            for &(b, i) in &self.boot_set {
                if (b as usize) < self.stores.len() && planned.insert((b, i as usize)) {
                    boot.push((b, i as usize));
                }
            }
        }
        let mut rest: Vec<(u32, usize)> = Vec::new();
        // With boot pages, the boot set's whole chunks follow once the start
        // is over (no miss for a while), so that the pages around those it
        // read are local too: starts differ by a page or two.
        let boot_chunks_later =
            self.config.prefetch && self.config.boot_chunks && !self.config.boot_pages.is_empty();
        if self.config.prefetch_all || boot_chunks_later {
            for &(b, i) in &self.boot_set {
                if (b as usize) < self.stores.len() && planned.insert((b, i as usize)) {
                    rest.push((b, i as usize));
                }
            }
            // Fetched after the start, so blob order (fewer, merged
            // requests) beats the order they were read in.
            rest.sort_unstable();
        }
        if self.config.prefetch_all {
            for b in 0..self.stores.len() {
                let chunks = self.stores[b].summary.chunk_count;
                for i in 0..chunks {
                    if planned.insert((b as u32, i)) {
                        rest.push((b as u32, i));
                    }
                }
            }
        }
        self.prefetch_total
            .store((boot.len() + rest.len()) as u64, Ordering::Relaxed);

        const WINDOW: u64 = 4 << 20;
        let mut at = 0;
        while at < boot.len() {
            let mut end = at;
            let mut bytes = 0u64;
            while end < boot.len() && (bytes < WINDOW || end == at) {
                let (b, i) = boot[end];
                bytes += self
                    .lock_store(b)
                    .map(|s| u64::from(s.blob.chunks[i].compressed_size.get()))
                    .unwrap_or(0);
                end += 1;
            }
            for blob in 0..self.stores.len() as u32 {
                let mut chunks: Vec<usize> = boot[at..end]
                    .iter()
                    .filter(|p| p.0 == blob)
                    .map(|p| p.1)
                    .collect();
                if chunks.is_empty() {
                    continue;
                }
                chunks.sort_unstable();
                self.prefetch_chunks(blob, chunks, &self.boot_fetch);
            }
            self.prefetch_done
                .fetch_add((end - at) as u64, Ordering::Relaxed);
            at = end;
        }

        if boot_chunks_later {
            self.wait_quiet(Duration::from_millis(500));
        }
        let mut at = 0;
        while at < rest.len() {
            while self.active_misses.load(Ordering::Relaxed) > 0 {
                std::thread::sleep(Duration::from_millis(2));
            }
            let blob = rest[at].0;
            let mut end = at;
            while end < rest.len() && end - at < 32 && rest[end].0 == blob {
                end += 1;
            }
            let mut chunks: Vec<usize> = rest[at..end].iter().map(|p| p.1).collect();
            chunks.sort_unstable(); // boot-set order is not blob order: merge what is adjacent
            self.prefetch_chunks(blob, chunks, &self.fetch);
            self.prefetch_done
                .fetch_add((end - at) as u64, Ordering::Relaxed);
            at = end;
        }
    }

    /// Returns once the start the mount was made for seems over: its first
    /// miss came and then none for [`START_QUIET`], or no miss came for
    /// [`START_AT_MOST`]. Layers no reader waits for (the FUSE lookup table:
    /// 8.5 MB of a million-file image) go on the wire after it, not
    /// before the first read or beside the start's misses.
    fn wait_start_over(&self) {
        while self.misses.load(Ordering::Relaxed) == 0 && self.started.elapsed() < START_AT_MOST {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.wait_quiet(START_QUIET);
    }

    /// Returns once no miss has arrived for `quiet` and none is in progress.
    fn wait_quiet(&self, quiet: Duration) {
        loop {
            let now = self.started.elapsed().as_millis() as u64;
            let last = self.last_miss_ms.load(Ordering::Relaxed);
            let idle = Duration::from_millis(now.saturating_sub(last));
            if idle >= quiet && self.active_misses.load(Ordering::Relaxed) == 0 {
                return;
            }
            std::thread::sleep((quiet - idle.min(quiet)).max(Duration::from_millis(20)));
        }
    }

    fn prefetch_chunks(&self, blob: u32, chunks: Vec<usize>, opts: &FetchOptions) {
        if let Ok(mine) = self.claim(blob, chunks.into_iter(), None, false) {
            if let Err(e) = self.fetch_with(blob, &mine, None, opts, None) {
                tracing::warn!("prefetch: {e}");
            }
            self.release(blob, &mine);
        }
    }

    fn write_status(&self) -> io::Result<()> {
        write_atomic(
            &self.config.run_dir.join("status.json"),
            &self.status_json()?,
        )
    }

    fn status_json(&self) -> io::Result<Vec<u8>> {
        let mut status = Status {
            pid: std::process::id(),
            image: self.config.image.clone(),
            mountpoint: self.config.mountpoint.display().to_string(),
            fetched_bytes: self.stats.bytes.load(Ordering::Relaxed),
            requests: self.stats.requests.load(Ordering::Relaxed),
            miss_fetched_bytes: self.miss_stats.bytes.load(Ordering::Relaxed),
            miss_requests: self.miss_stats.requests.load(Ordering::Relaxed),
            ahead_fetched_bytes: self.ahead_stats.bytes.load(Ordering::Relaxed),
            ahead_requests: self.ahead_stats.requests.load(Ordering::Relaxed),
            predicted_fetched_bytes: self.predict_stats.bytes.load(Ordering::Relaxed),
            predicted_requests: self.predict_stats.requests.load(Ordering::Relaxed),
            ahead_chunk_bytes: self.ahead_chunk_bytes.load(Ordering::Relaxed),
            ahead_used_bytes: self.ahead_used_bytes.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            failed_misses: self.failed.load(Ordering::Relaxed),
            bad_chunks: self.stats.bad_chunks.load(Ordering::Relaxed),
            prefetch_done: self.prefetch_done.load(Ordering::Relaxed),
            prefetch_total: self.prefetch_total.load(Ordering::Relaxed),
            miss_latency: self.miss_latency.snapshot(),
            boot_frames: self.boot_frames.load(Ordering::SeqCst) as u64,
            boot_frames_done: (self.boot_frames.load(Ordering::SeqCst))
                .saturating_sub(self.boot_pending.load(Ordering::SeqCst))
                as u64,
            predictions: self.predictions.load(Ordering::Relaxed),
            hedges: self.hedging.hedges.load(Ordering::Relaxed),
            hedge_wins: self.hedging.wins.load(Ordering::Relaxed),
            hedge_bound_ms: self.hedging.bound(256 << 10).as_millis() as u64,
            located_chunks: self.located_chunks.load(Ordering::Relaxed),
            located_bytes: self.located_bytes.load(Ordering::Relaxed),
            ..Status::default()
        };
        for (b, digest) in self.digests.iter().enumerate() {
            let lazy = &self.stores[b];
            let Some(s) = self.opened_store(b as u32)? else {
                // No chunk table yet: nothing was filled (fills need it),
                // unless the mount found the blob complete.
                let (count, size) = (lazy.summary.chunk_count, lazy.summary.data_size);
                status.total_bytes += size.unwrap_or(0);
                status.cached_bytes += if lazy.complete { size.unwrap_or(0) } else { 0 };
                status.blobs.push(BlobStatus {
                    digest: digest.to_string(),
                    filled_chunks: if lazy.complete { count } else { 0 },
                    chunks: count,
                    complete: lazy.complete,
                });
                continue;
            };
            let (filled, bytes) = s.filled();
            status.cached_bytes += bytes;
            status.boot_page_bytes += s.boot_bytes();
            status.total_bytes += s
                .blob
                .chunks
                .iter()
                .map(|c| u64::from(c.size.get()))
                .sum::<u64>();
            status.blobs.push(BlobStatus {
                digest: digest.to_string(),
                filled_chunks: filled,
                chunks: s.blob.chunks.len(),
                complete: s.is_complete(),
            });
        }
        serde_json::to_vec_pretty(&status).map_err(io::Error::other)
    }
}
