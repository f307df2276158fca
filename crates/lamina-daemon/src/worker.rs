//! The worker: fills misses and prefetches. It may crash or be killed at any
//! time; the holder keeps the events and starts another, which re-verifies
//! the fill records and carries on.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use lamina_fetch::fetch::{
    fetch_chunks, BlobChunks, ChunkCodec, FetchOptions, FetchStats, RangeSource,
};
use lamina_fetch::hedge::{read_first_answer, Hedging};
use lamina_fetch::locator::ChunkLocator;
use lamina_fetch::private;
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
use crate::predict::{FileMap, LinkRate, MapError, RateMeter, WindowMisses};
use crate::protocol::{self, Message};
use crate::readahead::Stream;
use crate::windows::{SpanWindows, WindowEntries};

mod ahead;
mod boot;
mod boot_stream;
mod located;
mod misses;
mod prefetch;
mod rest;
mod status;
mod stream;
mod tables;
mod takeover;
mod warm;

use ahead::serve_ahead;
use prefetch::adopt_in_background;
use rustix::event::{poll, PollFd, PollFlags};
pub use status::{BlobStatus, Status};
use tables::{load_index, open_store, LazyStore};

struct Shared {
    config: DaemonConfig,
    digests: Vec<Digest>,
    /// log2 of the chunk size (to check fetched chunk tables).
    chunk_bits: u8,
    stores: Vec<LazyStore>,
    /// A tar index's windows (`None`: a lamina image).
    windows: Option<SpanWindows>,
    /// Where bulk reads go (boot pages, reads ahead, prefetches, layers).
    source: Arc<dyn RangeSource>,
    /// Where misses go: `source` unless hosts.toml marks a host bulk_only.
    miss_source: Arc<dyn RangeSource>,
    /// The other mounts of this mount's cache entries, for when ours fail.
    other_mounts: crate::sources::OtherMounts,
    /// Whether the cache filesystem was last seen at its reserve.
    reserve_reached: AtomicBool,
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
    /// Windows of large mapped files missed in one chunk so far.
    window_misses: WindowMisses,
    /// Compressed bytes of boot pages known from the image applied so far:
    /// bytes the start needed, as its misses' are, when a group's cost is
    /// weighed.
    image_boot_bytes: AtomicU64,
    predictions: AtomicU64,
    /// Batches of predicted chunks, for the prediction threads (None: off).
    predict: Option<mpsc::Sender<(u32, std::ops::Range<usize>)>>,
    /// When the last miss arrived (ms since the worker started).
    last_miss_ms: AtomicU64,
    started: Instant,
    inflight: Mutex<HashSet<(u32, usize)>>,
    landed: Condvar,
    misses: AtomicU64,
    /// Events the holder answered itself, within announced boot pages.
    ready_events: AtomicU64,
    /// Events of this worker's own writes and reads (the holder's count).
    worker_events: AtomicU64,
    /// The device of the mount the holder made (kernel path), through
    /// which boot pages are warmed (`crate::warm`).
    root_dev: OnceLock<u64>,
    /// The map warming reads by.
    warm_map: Mutex<warm::MapState>,
    /// Threads warming runs that waited for the mount's name.
    warm_backlog_users: AtomicUsize,
    /// Bytes of boot pages read into the mount's page cache.
    warmed_bytes: AtomicU64,
    /// Runs to warm once the holder names its mount (`None` after).
    warm_backlog: Mutex<Option<Vec<warm::Run>>>,
    failed: AtomicU64,
    miss_latency: Recorder,
    active_misses: AtomicU64,
    prefetch_done: AtomicU64,
    prefetch_total: AtomicU64,
    complete_sent: Vec<AtomicBool>,
    /// Per blob: whether it is or was streamed whole (`stream.rs`).
    streaming: Vec<AtomicU8>,
    /// When each blob's stream was last asked for, in milliseconds since
    /// `started`: misses wait for an opening stream until a bound past it.
    stream_asked_ms: Vec<AtomicU64>,
    /// When each blob's stream last brought bytes (ms after `started`).
    stream_moved_ms: Vec<AtomicU64>,
    /// Per blob: compressed bytes fetched for misses, and how long readers
    /// waited on those fetches (ns): what `rest.rs` weighs.
    blob_missed: Vec<AtomicU64>,
    blob_waited_ns: Vec<AtomicU64>,
    /// Per blob: whether its rest was fetched on a miss (`rest.rs`).
    rest_asked: Vec<AtomicBool>,
    /// Rests being fetched now, and started in all.
    rests_running: AtomicUsize,
    rests: AtomicU64,
    /// A rest came slower than `rest::REST_STOP_RATE`: no more are fetched.
    rests_slow: AtomicBool,
    /// Fetched as the rest of a blob.
    rest_stats: FetchStats,
    /// The link's rate as large fetches showed it.
    link_rate: LinkRate,
    boot_set: Vec<(u32, u32)>,
    /// Chunks this mount's reads never ask of its cache files
    /// (`BlobSpec::served_elsewhere`): never fetched ahead or streamed.
    served_elsewhere: HashSet<(u32, usize)>,
    /// The boot set, to look up: a miss on one of these chunks waits for
    /// the boot pages still on their way instead of fetching it.
    boot_chunks: HashSet<(u32, u32)>,
    /// Boot-pages frames to load, and those not yet applied (or given up on).
    boot_frames: AtomicUsize,
    boot_pending: AtomicUsize,
    /// The pages the boot frames bring, from the first frame's directory:
    /// a miss outside them does not wait for the frames.
    boot_directory: OnceLock<boot::BootDirectory>,
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
/// The same for a start served from warmed boot pages, whose reads raise
/// no miss at all: long enough for the heavy starts measured (5-6 s in
/// all), after which the chunks are only for later starts.
const WARMED_START_QUIET: Duration = Duration::from_secs(5);
/// No miss at all for this long after the worker started: the mount is
/// idle, or walked without reads (lookups only); later layers go now.
const START_AT_MOST: Duration = Duration::from_secs(10);

/// Chunks per predicted request: a reader that misses in a batch being
/// fetched waits for that batch only (2 MiB of 256 KiB chunks).
const PREDICT_BATCH: usize = 8;

/// Metadata larger than this is not read to predict misses.
const PREDICT_METADATA_MAX: u64 = 128 << 20;

/// Boot-pages frames applied at once after the first, which goes alone
/// (and fetched at once, those that come as ranges).
const BOOT_STREAMS: usize = 4;

/// The cache's chunk locator; without one, chunks are only fetched.
fn open_locator(blob_dir: &Path) -> Option<ChunkLocator> {
    ChunkLocator::open(blob_dir)
        .inspect_err(|e| tracing::warn!("no chunk locator, chunks are only fetched: {e}"))
        .ok()
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

/// Runs the worker on the socket `sock` from the holder.
pub fn run_worker(config_path: &Path, sock: OwnedFd) -> io::Result<()> {
    let config = DaemonConfig::load(config_path)?;
    adopt_in_background(config.adopt.clone());
    let (shared, ahead_rx, predict_rx, predicting) = build_shared(config, sock)?;
    let n = shared.stores.len();
    let _ = shared.me.set(Arc::downgrade(&shared));
    // Blobs completed by an earlier worker: tell the holder again.
    for b in 0..n {
        shared.check_complete(b as u32);
    }
    start_boot_loads(&shared);
    // Quiet periods count from now: misses queued in the holder arrive next.
    shared
        .last_miss_ms
        .store(shared.elapsed_ms(), Ordering::Relaxed);
    protocol::send_owned(&shared.sock, Message::Hello, None)?;
    tracing::info!(image = %shared.config.image, blobs = n, "serving misses");

    let jobs = {
        let shared = shared.clone();
        MissPool::new(shared.config.workers, MAX_MISS_THREADS, move |job| {
            shared.serve_job(job)
        })
    };
    start_background(&shared, ahead_rx, predict_rx, predicting);
    serve_holder(&shared, &jobs)
}

/// Where windows to fetch ahead (or predicted batches) come in: a blob and
/// a range of its chunks.
type WindowReceiver = mpsc::Receiver<(u32, std::ops::Range<usize>)>;

/// Loads the index, opens the stores and sources and builds the `Shared`
/// state; returns it with the receivers of the fill-ahead and prediction
/// queues, and whether misses are predicted.
fn build_shared(
    config: DaemonConfig,
    sock: OwnedFd,
) -> io::Result<(Arc<Shared>, WindowReceiver, WindowReceiver, bool)> {
    let (index, windows) = load_index(&config)?;
    let boot_set = index.prefetch.clone();
    let chunk_bits = index.chunk_bits;
    let (stores, digests) = open_stores(&config, index)?;
    let (source, miss_source) =
        crate::sources::bulk_and_miss_sources(&config.source, config.timeout_secs)?;
    let trace = match &config.record_trace {
        Some(p) => Some(Mutex::new(
            File::options().create(true).append(true).open(p)?,
        )),
        None => None,
    };
    let n = stores.len();
    let served_elsewhere = (config.blobs.iter().enumerate())
        .flat_map(|(b, spec)| {
            spec.served_elsewhere
                .iter()
                .map(move |&i| (b as u32, i as usize))
        })
        .collect();
    let hedging = Arc::new(Hedging::default());
    // A few windows queued are plenty: each is up to `fill_ahead` bytes.
    let (ahead_tx, ahead_rx) = mpsc::sync_channel(8);
    // Unbounded: a batch per 2 MiB of the mapped files the start touches.
    let (predict_tx, predict_rx) = mpsc::channel();
    let predicting = config.predict_max > 0 && config.metadata_fill.is_some();
    let locator = open_locator(&config.blob_dir);
    let [fetch, boot_fetch, ahead_fetch, predict_fetch] = fetch_options(&config, &hedging);
    let shared = Arc::new(Shared {
        other_mounts: Default::default(),
        reserve_reached: AtomicBool::new(false),
        file_map: OnceLock::new(),
        predicted: Mutex::new(HashSet::new()),
        window_misses: WindowMisses::default(),
        image_boot_bytes: AtomicU64::new(0),
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
        fetch,
        boot_fetch,
        ahead_fetch,
        predict_fetch,
        config,
        digests,
        chunk_bits,
        stores,
        windows,
        source,
        miss_source,
        hedging,
        stats: FetchStats::default(),
        miss_stats: FetchStats::default(),
        last_miss_ms: AtomicU64::new(0),
        started: Instant::now(),
        inflight: Mutex::new(HashSet::new()),
        landed: Condvar::new(),
        misses: AtomicU64::new(0),
        ready_events: AtomicU64::new(0),
        worker_events: AtomicU64::new(0),
        root_dev: OnceLock::new(),
        warm_map: Mutex::new(warm::MapState::default()),
        warm_backlog_users: AtomicUsize::new(0),
        warmed_bytes: AtomicU64::new(0),
        warm_backlog: Mutex::new(Some(Vec::new())),
        failed: AtomicU64::new(0),
        miss_latency: Recorder::default(),
        active_misses: AtomicU64::new(0),
        prefetch_done: AtomicU64::new(0),
        prefetch_total: AtomicU64::new(0),
        complete_sent: (0..n).map(|_| AtomicBool::new(false)).collect(),
        streaming: (0..n).map(|_| AtomicU8::new(0)).collect(),
        stream_asked_ms: (0..n).map(|_| AtomicU64::new(0)).collect(),
        stream_moved_ms: (0..n).map(|_| AtomicU64::new(0)).collect(),
        blob_missed: (0..n).map(|_| AtomicU64::new(0)).collect(),
        blob_waited_ns: (0..n).map(|_| AtomicU64::new(0)).collect(),
        rest_asked: (0..n).map(|_| AtomicBool::new(false)).collect(),
        rests_running: AtomicUsize::new(0),
        rests: AtomicU64::new(0),
        rests_slow: AtomicBool::new(false),
        rest_stats: FetchStats::default(),
        link_rate: LinkRate::default(),
        boot_chunks: boot_set.iter().copied().collect(),
        boot_set,
        served_elsewhere,
        boot_frames: AtomicUsize::new(0),
        boot_pending: AtomicUsize::new(0),
        boot_directory: OnceLock::new(),
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
    Ok((shared, ahead_rx, predict_rx, predicting))
}

/// Opens each blob's store (or leaves it to open at its first read), and
/// parses the blobs' digests, in device order.
fn open_stores(
    config: &DaemonConfig,
    index: IndexTop,
) -> io::Result<(Vec<LazyStore>, Vec<Digest>)> {
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
    Ok((stores, digests))
}

/// The fetch options of misses, boot-set requests, fill-ahead and
/// predicted requests, in that order.
fn fetch_options(config: &DaemonConfig, hedging: &Arc<Hedging>) -> [FetchOptions; 4] {
    [
        FetchOptions {
            deadline: Duration::from_secs(config.timeout_secs),
            hedging: config.hedge.then(|| hedging.clone()),
            ..FetchOptions::default()
        },
        FetchOptions {
            deadline: Duration::from_secs(config.timeout_secs),
            merge_gap: 128 << 10,
            hedging: config.hedge.then(|| hedging.clone()),
            ..FetchOptions::default()
        },
        FetchOptions {
            deadline: Duration::from_secs(config.timeout_secs) / 4,
            attempts: 2,
            merge_gap: 0,
            ..FetchOptions::default()
        },
        FetchOptions {
            deadline: Duration::from_secs(config.timeout_secs) / 4,
            attempts: 2,
            merge_gap: 0,
            hedging: config.hedge.then(|| hedging.clone()),
            ..FetchOptions::default()
        },
    ]
}

/// Starts loading the boot pages and storing the later layers, each on a
/// thread of its own, when there are any.
fn start_boot_loads(shared: &Arc<Shared>) {
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
}

/// Drops the clean pages of a mount's cache files each time it is asked
/// (issue 43). A reader's page is copied into EROFS's page cache (or the
/// FUSE inode's) as it is read, so the cache file's copy is a second one;
/// without this it stayed as long as memory allowed, and a lazy mount read
/// whole held every page twice. Dirty pages stay until a save writes them
/// back; a page dropped before a reader's copy was taken is read from disk
/// again, never wrong.
///
/// The cache files are held open from their first drop on (no live
/// mount's file is replaced or evicted); the chunk locator, probed once
/// per fetch, is opened each time, as a new one may take its name.
struct PageDropper {
    cache_files: Vec<(PathBuf, Option<File>)>,
    locator: PathBuf,
}

impl PageDropper {
    fn of(config: &DaemonConfig) -> PageDropper {
        PageDropper {
            cache_files: config
                .blobs
                .iter()
                .map(|b| (b.cache_path.clone(), None))
                .collect(),
            locator: config.blob_dir.join(lamina_fetch::locator::LOCATOR_FILE),
        }
    }

    fn drop_clean(&mut self) {
        let clean = |file: &File| {
            let _ = rustix::fs::fadvise(file, 0, None, rustix::fs::Advice::DontNeed);
        };
        for (path, file) in &mut self.cache_files {
            if file.is_none() {
                *file = private::open_trusted(path).ok();
            }
            if let Some(file) = file {
                clean(file);
            }
        }
        if let Ok(locator) = private::open_trusted(&self.locator) {
            clean(&locator);
        }
    }
}

/// Starts the background threads: status and fill records, prefetch,
/// fill-ahead, and (when `predicting`) predictions and the file map.
fn start_background(
    shared: &Arc<Shared>,
    ahead_rx: WindowReceiver,
    predict_rx: WindowReceiver,
    predicting: bool,
) {
    {
        let shared = shared.clone();
        // Status is checked every 25 ms and written only when it changed, so
        // `lamina status` is at most ~25 ms behind without steady writes.
        std::thread::spawn(move || {
            let mut last = Vec::new();
            let mut pages = PageDropper::of(&shared.config);
            let mut dropped = std::time::Instant::now();
            loop {
                shared.save_records(SAVE_INTERVAL);
                if dropped.elapsed() >= SAVE_INTERVAL {
                    pages.drop_clean();
                    dropped = std::time::Instant::now();
                }
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
        std::thread::spawn(move || {
            // Fetched ahead of need: its disk writes must not slow a
            // reader's (issue 42, point 10).
            if let Err(e) = lamina_sys::do_io_when_idle() {
                tracing::warn!("prefetch at idle I/O priority: {e}");
            }
            shared.prefetch()
        });
    }
    // Two threads each: the next window is requested while one is in flight.
    serve_ahead(shared, ahead_rx, 2, |s| (&s.ahead_fetch, &s.ahead_stats));
    if predicting {
        serve_ahead(shared, predict_rx, 2, |s| {
            (&s.predict_fetch, &s.predict_stats)
        });
        let shared = shared.clone();
        std::thread::spawn(move || shared.build_file_map());
    }
}

/// Reads the holder's messages until it shuts the worker down or dies:
/// misses are answered at once when their chunks are filled, else queued
/// to `jobs`.
fn serve_holder(shared: &Shared, jobs: &MissPool<Job>) -> io::Result<()> {
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
                shared.take_over_after_holder(jobs)?;
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
            Some((Message::RootDev { dev }, _)) => shared.take_root_dev(dev),
            Some((Message::Answered { readers, worker }, _)) => {
                shared.worker_events.fetch_max(worker, Ordering::Relaxed);
                // Reads answered by the holder are the start going on too:
                // what waits for its end (the boot set's whole chunks) waits.
                if shared.ready_events.fetch_max(readers, Ordering::Relaxed) < readers {
                    shared
                        .last_miss_ms
                        .store(shared.elapsed_ms(), Ordering::Relaxed);
                }
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
                shared
                    .last_miss_ms
                    .store(shared.elapsed_ms(), Ordering::Relaxed);
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
    /// Milliseconds since the worker started: the clock of `last_miss_ms`
    /// and the streams' times.
    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
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

    /// Tells the holder that `[offset, offset + len)` of `blob` may be read,
    /// so that it answers reads there without asking. Only for boot pages:
    /// reads of chunks fetched ahead must still reach this worker, which
    /// follows readers through them (streams, `ahead_used_bytes`). A lost
    /// announcement costs trips here, nothing else.
    fn announce_ready(&self, blob: u32, offset: u64, len: u64) {
        if self.holder_gone.load(Ordering::SeqCst) {
            return;
        }
        let ready = Message::Ready { blob, offset, len };
        if let Err(e) = protocol::send_owned(&self.sock, ready, None) {
            tracing::debug!("announcing ready pages: {e}");
        }
    }

    /// Saves the fill records whose chunks have waited `interval`: the
    /// cache file is synced without the store's lock, so fills go on.
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
}
