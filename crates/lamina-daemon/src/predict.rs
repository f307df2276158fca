//! Predicted misses: on a reader's first miss in a file, what it will
//! read next is fetched in the background, chosen by two rules measured on
//! heavy starts (docs/lazy.md):
//!
//! - **Small files of one directory with one extension** (`.py` with `.py`,
//!   `.js` with `.js`, up to [`SMALL_FILE`] each, in groups of at most
//!   [`GROUP_MAX`]): an interpreter importing a package reads its modules
//!   one after another, each a round trip of its own, in the order the
//!   imports run rather than the order the files lie in the blob.
//! - **A shared library or executable** larger than that (up to the
//!   mount's `predict_max`): programs map these, and the loader touches
//!   their pages in no order a stream shows (headers, relocations near
//!   the end, code here and there), one page fault and one round trip at
//!   a time.
//! - **A window of a larger one** ([`WINDOW`] bytes of the file, aligned),
//!   once a second chunk of it is missed ([`WindowMisses`]): a 99 MB
//!   `node` binary is read here and there over much of its code, and
//!   fetching it whole costs more than its start reads.
//!
//! Both turn a chain of dependent round trips into a few requests in
//! flight at once, at the cost of what is fetched and never read
//! (`ahead_chunk_bytes - ahead_used_bytes` in status). So a group is
//! fetched only when the start has shown it is large enough to read most
//! of it ([`worth_fetching`]). The map is built
//! from the image's EROFS metadata (names, modes and chunk addresses: no
//! data is read) and is only a hint: what it fetches is verified and
//! recorded like every other fill.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use lamina_format::erofs::{Chunk, Chunks, Image, Kind, ReadError};

/// Directory entries walked at most; a larger image gets no predictions
/// (the walk would compete with its start for CPU).
pub const MAX_ENTRIES: usize = 400_000;

/// Files up to this size are grouped with their directory's files of the
/// same extension.
pub const SMALL_FILE: u64 = 512 << 10;

/// A group of small files holds at most this many bytes: a directory with
/// more is split into several groups, in name order.
pub const GROUP_MAX: u64 = 4 << 20;

/// A mapped file over the mount's `predict_max` is predicted in windows
/// of this many bytes of the file (aligned), each a group of its own.
pub const WINDOW: u64 = 1 << 20;

/// Window groups in one map at most: past them, larger mapped files get
/// none (a hostile image of many huge executables would otherwise cost
/// the worker memory for groups).
pub const MAX_WINDOWS: usize = 1 << 16;

/// Below this rate of miss answers (bytes over the time readers waited
/// for them, round trips included) nothing is predicted: the link's bytes,
/// not its round trips, bound a start there, and predicted bytes would
/// delay the reader's own. 4 MB/s lies between what 256 KiB chunks come
/// at over 10 Mbit/s (about 1.2 MB/s) and over 100 Mbit/s (about 7 MB/s).
pub const MIN_RATE: f64 = 4e6;

/// A group is fetched ahead only if the start's misses have fetched this
/// many times its compressed bytes when it is first met (with the link
/// timed). A small start reads little of a group it meets once, and the
/// group's bytes delay the reader's own: python3's start fetched 1.59x its
/// bytes and took 1.16x its time with every group fetched at its first
/// miss; with this rule 1.03x and 0.99x, while the data-science start
/// kept most of what predictions give it (0.87x the time without them,
/// 0.81x before). docs/coldstart-heavy.md has the runs.
pub const MISSED_PER_PREDICTED: u64 = 4;

/// Whether a group whose unfilled chunks are `cost` compressed bytes is
/// worth fetching ahead once misses have fetched `missed` bytes.
pub fn worth_fetching(cost: u64, missed: u64) -> bool {
    cost > 0 && cost.saturating_mul(MISSED_PER_PREDICTED) <= missed
}

/// The first chunk missed in each window of a mapped file over the
/// limit: a window is fetched ahead only on a miss in a second chunk of
/// it. A start that reads one chunk of a window often reads no other
/// (the data-science start read 53% of what windows fetched on their
/// first miss, and took 1.05x its time at 100 Mbit/s); one that reads
/// two reads most of it.
#[derive(Debug, Default)]
pub struct WindowMisses(Mutex<HashMap<(u32, u32), usize>>);

impl WindowMisses {
    /// Whether `chunk` is a second chunk of window `group` of `blob` to
    /// miss; notes it as the first if none was.
    pub fn second_chunk(&self, blob: u32, group: u32, chunk: usize) -> bool {
        let mut first = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *first.entry((blob, group)).or_insert(chunk) != chunk
    }
}

/// Miss fetches timed before the rate is trusted, and at most kept.
const RATE_MIN_SAMPLES: usize = 8;
const RATE_SAMPLES: usize = 64;

/// The rate of recent miss fetches.
#[derive(Debug, Default)]
pub struct RateMeter {
    samples: Mutex<VecDeque<(Duration, u64)>>,
}

impl RateMeter {
    /// Notes a fetch of `bytes` that took `took`.
    pub fn note(&self, took: Duration, bytes: u64) {
        let mut samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if samples.len() == RATE_SAMPLES {
            samples.pop_front();
        }
        samples.push_back((took, bytes));
    }

    /// Bytes per second over the recent fetches; `None` before
    /// [`RATE_MIN_SAMPLES`] were timed.
    pub fn rate(&self) -> Option<f64> {
        let samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if samples.len() < RATE_MIN_SAMPLES {
            return None;
        }
        let bytes: u64 = samples.iter().map(|s| s.1).sum();
        let secs: f64 = samples.iter().map(|s| s.0.as_secs_f64()).sum();
        Some(if secs > 0.0 {
            bytes as f64 / secs
        } else {
            f64::MAX
        })
    }

    /// Whether misses come fast enough for predictions to pay.
    pub fn fast_enough(&self) -> bool {
        self.rate().is_some_and(|r| r >= MIN_RATE)
    }
}

/// Fetches smaller than this (compressed bytes) say little of the link's
/// rate: their round trip takes most of their time.
const LINK_SAMPLE_MIN: u64 = 128 << 10;

/// The link's rate from the fastest large fetch, less half the quickest
/// small fetch's time (the round trip, the registry's own time and a chunk's decoding),
/// unlike [`RateMeter`], whose small fetches are mostly round trips (a
/// lazy start's misses came at 5-9 MB/s over 100 Mbit/s and 1 Gbit/s
/// alike). Other fetches on the link at the same time count against it.
#[derive(Debug)]
pub struct LinkRate {
    /// The quickest fetch under [`LINK_SAMPLE_MIN`], in ns.
    quickest_ns: AtomicU64,
    /// The best rate so far, bytes per second.
    best_bps: AtomicU64,
}

impl Default for LinkRate {
    fn default() -> Self {
        LinkRate {
            quickest_ns: AtomicU64::new(u64::MAX),
            best_bps: AtomicU64::new(0),
        }
    }
}

impl LinkRate {
    /// Notes a fetch of `bytes` that took `took`.
    pub fn note(&self, took: Duration, bytes: u64) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        if bytes < LINK_SAMPLE_MIN {
            self.quickest_ns.fetch_min(ns, Ordering::Relaxed);
            return;
        }
        // Half the quickest small fetch is taken off (none timed: nothing):
        // that fetch carried bytes of its own.
        let quickest = match self.quickest_ns.load(Ordering::Relaxed) {
            u64::MAX => 0,
            q => q,
        };
        let transfer = ns.saturating_sub(quickest / 2).max(1);
        let bps = bytes as f64 * 1e9 / transfer as f64;
        self.best_bps.fetch_max(bps as u64, Ordering::Relaxed);
    }

    /// Bytes per second; 0 before a fetch large enough was timed.
    pub fn bps(&self) -> u64 {
        self.best_bps.load(Ordering::Relaxed)
    }
}

/// A file's chunks (`chunks`, of a file of `size` bytes): each one's file
/// offset, length, and for data its blob (device `d` is blob `d - 1`; a
/// device 0 names none) and cache-file offset (`None`: a hole).
fn file_chunks<'c>(
    chunks: &'c Chunks<'_>,
    size: u64,
) -> impl Iterator<Item = (u64, u64, Option<(u32, u64)>)> + 'c {
    let chunk_size = 1u64 << chunks.chunk_bits;
    (0..chunks.len()).map(move |i| {
        let at = i as u64 * chunk_size;
        let len = chunk_size.min(size.saturating_sub(at));
        let data = match chunks.get(i) {
            Some(Chunk::Data { device, offset }) => {
                Some((u32::from(device).wrapping_sub(1), offset))
            }
            _ => None,
        };
        (at, len, data)
    })
}

/// `runs` sorted and merged where they overlap or touch.
fn merged(mut runs: Vec<Range<u64>>) -> Vec<Range<u64>> {
    runs.sort_by_key(|r| (r.start, r.end));
    let mut out: Vec<Range<u64>> = Vec::with_capacity(runs.len());
    for r in runs {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// Bytes of one blob that belong to a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Extent {
    start: u64,
    end: u64,
    group: u32,
}

/// What is fetched together: one mapped file, or small files of one
/// directory with one extension.
#[derive(Debug, Default)]
struct Group {
    /// (blob, start, end), in the order the files were met.
    extents: Vec<(u32, u64, u64)>,
    bytes: u64,
    /// A window of a mapped file over the limit.
    window: bool,
}

/// Per blob, the extents of the files that are fetched with others (or
/// whole) on a first miss; see the module doc.
#[derive(Debug, Default)]
pub struct FileMap {
    blobs: Vec<Vec<Extent>>,
    /// Per blob, the cache-file bytes some regular file's data uses, as
    /// sorted runs: what a read of the whole tree fetches (a blob also
    /// holds the data of files a later layer replaced, which nothing reads).
    live: Vec<Vec<Range<u64>>>,
    groups: Vec<Group>,
    mapped: usize,
    windows: usize,
}

/// Why a map was not built.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    /// The metadata could not be read.
    #[error("metadata: {0}")]
    Io(#[from] std::io::Error),
    /// The metadata is not a tree this reader walks.
    #[error("metadata: {0}")]
    Read(#[from] ReadError),
    /// The image has more entries than [`MAX_ENTRIES`].
    #[error("more than {MAX_ENTRIES} directory entries")]
    TooLarge,
}

impl FileMap {
    /// The map of `image` over `blobs` data blobs (device `d` is blob
    /// `d - 1`): its shared libraries and executables of at most
    /// `max_mapped` bytes each (larger ones in windows of `window` bytes;
    /// 0: not at all), and its small files by directory and extension;
    /// with `live`, also the bytes each blob's files use ([`FileMap::live`]).
    pub fn build(
        image: &Image<'_>,
        blobs: usize,
        max_mapped: u64,
        window: u64,
        live: bool,
    ) -> Result<FileMap, MapError> {
        let mut map = FileMap {
            blobs: vec![Vec::new(); blobs],
            live: vec![Vec::new(); blobs],
            ..FileMap::default()
        };
        let mut seen_dirs = HashSet::from([image.root_nid()]);
        let mut seen_files = HashSet::new();
        let mut dirs = vec![image.root_nid()];
        let mut walked = 0usize;
        while let Some(nid) = dirs.pop() {
            let dir = image.inode(nid)?;
            // This directory's open group per extension.
            let mut by_extension: HashMap<&[u8], u32> = HashMap::new();
            for entry in image.entries(&dir)? {
                if entry.name == b"." || entry.name == b".." {
                    continue;
                }
                walked += 1;
                if walked > MAX_ENTRIES {
                    return Err(MapError::TooLarge);
                }
                match entry.kind() {
                    // A directory reached twice (a hostile image) is walked once.
                    Some(Kind::Directory) if seen_dirs.insert(entry.nid) => dirs.push(entry.nid),
                    Some(Kind::Regular) if seen_files.insert(entry.nid) => {
                        let inode = image.inode(entry.nid)?;
                        // Read once, for both: the chunk index of a file.
                        let chunks = image.chunks(&inode)?;
                        if live {
                            map.add_live(&chunks, inode.size);
                        }
                        let name = entry.name;
                        if map.in_windows(name, &inode, max_mapped, window) {
                            map.add_windows(&chunks, inode.size, window);
                        } else if let Some(group) =
                            map.group_for(name, &inode, max_mapped, &mut by_extension)
                        {
                            map.add_file(&chunks, inode.size, |_| group);
                        }
                    }
                    _ => {}
                }
            }
        }
        for extents in &mut map.blobs {
            extents.sort_by_key(|e| (e.start, e.end));
        }
        for runs in &mut map.live {
            *runs = merged(std::mem::take(runs));
        }
        Ok(map)
    }

    /// Notes the cache-file bytes a regular file's data (`chunks`, of a
    /// file of `size` bytes) uses.
    fn add_live(&mut self, chunks: &Chunks<'_>, size: u64) {
        for (_, len, data) in file_chunks(chunks, size) {
            let Some((blob, offset)) = data else { continue };
            if let Some(runs) = self.live.get_mut(blob as usize) {
                match runs.last_mut() {
                    Some(last) if last.end == offset => last.end += len,
                    _ => runs.push(offset..offset + len),
                }
            }
        }
    }

    /// The cache-file bytes of blob `blob` some regular file uses, as
    /// sorted runs that do not touch (none unless built with `live`).
    pub fn live(&self, blob: u32) -> &[Range<u64>] {
        self.live.get(blob as usize).map_or(&[], Vec::as_slice)
    }

    /// The group a regular file joins: a group of its own for a mapped
    /// file over [`SMALL_FILE`] (up to `max_mapped`), its directory's open
    /// group for its extension (`by_extension`) for a small file; `None`
    /// for anything else (empty, too large, no extension).
    fn group_for<'a>(
        &mut self,
        name: &'a [u8],
        inode: &lamina_format::erofs::Inode<'_>,
        max_mapped: u64,
        by_extension: &mut HashMap<&'a [u8], u32>,
    ) -> Option<u32> {
        let size = inode.size;
        if size == 0 {
            return None;
        }
        if size > SMALL_FILE {
            if !is_mapped(name, inode.mode) || size > max_mapped {
                return None;
            }
            self.mapped += 1;
            return Some(self.new_group());
        }
        let ext = extension(name)?;
        match by_extension.get(ext) {
            Some(&g) if self.fits(g, size) => Some(g),
            _ => {
                let g = self.new_group();
                by_extension.insert(ext, g);
                Some(g)
            }
        }
    }

    /// Whether a file is predicted in windows: mapped, over `max_mapped`
    /// (and [`SMALL_FILE`]), windows on, and room for its windows.
    fn in_windows(
        &self,
        name: &[u8],
        inode: &lamina_format::erofs::Inode<'_>,
        max_mapped: u64,
        window: u64,
    ) -> bool {
        let size = inode.size;
        window > 0
            && max_mapped > 0
            && size > max_mapped.max(SMALL_FILE)
            && is_mapped(name, inode.mode)
            && self.windows + size.div_ceil(window) as usize <= MAX_WINDOWS
    }

    /// Adds a mapped file's data in windows of `window` bytes of the
    /// file, a group each.
    fn add_windows(&mut self, chunks: &Chunks<'_>, size: u64, window: u64) {
        let count = size.div_ceil(window) as usize;
        let first = self.groups.len() as u32;
        for _ in 0..count {
            let g = self.new_group();
            self.groups[g as usize].window = true;
        }
        self.windows += count;
        self.add_file(chunks, size, |at| first + (at / window) as u32)
    }

    fn new_group(&mut self) -> u32 {
        self.groups.push(Group::default());
        (self.groups.len() - 1) as u32
    }

    fn fits(&self, group: u32, size: u64) -> bool {
        self.groups[group as usize].bytes + size <= GROUP_MAX
    }

    /// Adds a regular file's data (`chunks`, of a file of `size` bytes), as
    /// runs of adjacent chunks, to the groups `group_of` names by file
    /// offset.
    fn add_file(&mut self, chunks: &Chunks<'_>, size: u64, group_of: impl Fn(u64) -> u32) {
        // (group, blob, start, end)
        let mut runs: Vec<(u32, u32, u64, u64)> = Vec::new();
        for (at, len, data) in file_chunks(chunks, size) {
            let group = group_of(at);
            // Holes count as the file's bytes, as its size does.
            self.groups[group as usize].bytes += len;
            let Some((blob, offset)) = data else {
                continue;
            };
            match runs.last_mut() {
                Some((g, b, _, end)) if *g == group && *b == blob && *end == offset => *end += len,
                _ => runs.push((group, blob, offset, offset + len)),
            }
        }
        for &(group, blob, start, end) in &runs {
            if let Some(extents) = self.blobs.get_mut(blob as usize) {
                extents.push(Extent { start, end, group });
                self.groups[group as usize].extents.push((blob, start, end));
            }
        }
    }

    /// Mapped files in the map.
    pub fn mapped_files(&self) -> usize {
        self.mapped
    }

    /// Windows of mapped files over the limit in the map.
    pub fn windows(&self) -> usize {
        self.windows
    }

    /// Whether `group` is a window of a mapped file over the limit.
    pub fn is_window(&self, group: u32) -> bool {
        self.groups.get(group as usize).is_some_and(|g| g.window)
    }

    /// Groups in the map (mapped files, their windows and small-file groups).
    pub fn groups(&self) -> usize {
        self.groups.len()
    }

    /// The group of the file whose data holds byte `offset` of `blob`.
    pub fn group_at(&self, blob: u32, offset: u64) -> Option<u32> {
        let extents = self.blobs.get(blob as usize)?;
        let after = extents.partition_point(|e| e.start <= offset);
        // Extents may overlap (files sharing data): the nearest one that
        // starts at or before `offset` and reaches past it.
        extents[..after]
            .iter()
            .rev()
            .take(4)
            .find(|e| e.end > offset)
            .map(|e| e.group)
    }

    /// The bytes of `blob` in `group`, as ranges in the order of its files.
    pub fn ranges(&self, group: u32, blob: u32) -> impl Iterator<Item = Range<u64>> + '_ {
        self.groups
            .get(group as usize)
            .into_iter()
            .flat_map(|g| g.extents.iter())
            .filter(move |(b, _, _)| *b == blob)
            .map(|&(_, start, end)| start..end)
    }
}

/// Whether a file is one a program maps rather than reads: a shared
/// library by its name (`libfoo.so`, `libfoo.so.1.2`, `mod.cpython-311.so`)
/// or an executable by its mode.
pub fn is_mapped(name: &[u8], mode: u32) -> bool {
    let shared_library = name.ends_with(b".so")
        || name
            .windows(4)
            .position(|w| w == b".so.")
            .is_some_and(|at| {
                name[at + 4..]
                    .iter()
                    .all(|c| c.is_ascii_digit() || *c == b'.')
            });
    shared_library || mode & 0o111 != 0
}

/// A file name's extension (`py` of `os.py`); none for `Makefile` or
/// `.bashrc`.
fn extension(name: &[u8]) -> Option<&[u8]> {
    let dot = name.iter().rposition(|&c| c == b'.')?;
    (dot > 0 && dot + 1 < name.len()).then(|| &name[dot + 1..])
}

/// The chunks of `group` (sorted, without duplicates) to fetch for a miss
/// on `needed`: those after the miss, then those before it, in batches of
/// at most `batch` adjacent chunks (a reader that misses in a batch being
/// fetched waits for that batch only).
pub fn batches(chunks: &[usize], needed: &Range<usize>, batch: usize) -> Vec<Range<usize>> {
    let batch = batch.max(1);
    let after = chunks.iter().copied().filter(|&c| c >= needed.end);
    let before = chunks.iter().copied().filter(|&c| c < needed.start);
    let mut out: Vec<Range<usize>> = Vec::new();
    for c in after.chain(before) {
        match out.last_mut() {
            Some(r) if r.end == c && r.len() < batch => r.end += 1,
            _ => out.push(c..c + 1),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use lamina_format::erofs::{write_image, ChunkAddr, Device, FileChunks};
    use lamina_tree::{DirEntry, Metadata, Node, NodeId, NodeKind, Tree};

    #[test]
    fn libraries_and_executables_are_mapped_data_is_not() {
        for (name, mode, mapped) in [
            (&b"libc.so.6"[..], 0o644, true),
            (b"libarrow.so.1601", 0o644, true),
            (b"libz.so.1.2.13", 0o644, true),
            (
                b"_multiarray_umath.cpython-311-x86_64-linux-gnu.so",
                0o644,
                true,
            ),
            (b"python3.11", 0o755, true),
            (b"node", 0o700, true),
            (b"os.pyc", 0o644, false),
            (b"libfoo.so.conf", 0o644, false),
            (b"also.sorted", 0o644, false),
            (b"index.js", 0o644, false),
            (b"data.so.txt", 0o644, false),
        ] {
            let what = String::from_utf8_lossy(name);
            assert_eq!(is_mapped(name, mode), mapped, "{what}");
        }
    }

    #[test]
    fn a_group_costs_at_most_a_quarter_of_what_was_missed() {
        let mib = 1 << 20;
        assert!(!worth_fetching(mib, 0), "nothing missed yet");
        assert!(!worth_fetching(mib, MISSED_PER_PREDICTED * mib - 1));
        assert!(worth_fetching(mib, MISSED_PER_PREDICTED * mib));
        assert!(!worth_fetching(0, u64::MAX), "nothing left to fetch");
        assert!(!worth_fetching(u64::MAX, u64::MAX - 1), "no overflow");
    }

    #[test]
    fn live_runs_merge_where_they_touch() {
        let runs = merged(vec![10..20, 0..5, 5..8, 15..30, 40..41]);
        assert_eq!(runs, [0..8, 10..30, 40..41]);
        assert!(merged(Vec::new()).is_empty());
    }

    #[test]
    fn the_link_rate_leaves_out_the_round_trip() {
        let link = LinkRate::default();
        link.note(Duration::from_millis(20), 1_000_000);
        assert_eq!(link.bps(), 50_000_000, "no small fetch timed: all of it");
        // 4 ms for a small fetch: half of it is the round trip of the next.
        let link = LinkRate::default();
        link.note(Duration::from_millis(4), 40 << 10);
        assert_eq!(link.bps(), 0, "a small fetch says nothing of the rate");
        link.note(Duration::from_millis(12), 1_000_000);
        assert_eq!(link.bps(), 100_000_000);
        link.note(Duration::from_millis(52), 1_000_000);
        assert_eq!(link.bps(), 100_000_000, "the fastest fetch is kept");
    }

    #[test]
    fn predictions_wait_for_a_link_fast_enough() {
        let meter = RateMeter::default();
        assert!(!meter.fast_enough(), "nothing timed yet");
        // 40 kB answers in 33 ms: a 10 Mbit/s link.
        for _ in 0..RATE_SAMPLES {
            meter.note(Duration::from_millis(33), 40_000);
        }
        assert!(!meter.fast_enough(), "{:?}", meter.rate());
        // In 5 ms: 100 Mbit/s and a registry's round trip.
        for _ in 0..RATE_SAMPLES {
            meter.note(Duration::from_millis(5), 40_000);
        }
        assert!(meter.fast_enough(), "{:?}", meter.rate());
    }

    #[test]
    fn a_window_waits_for_a_miss_in_a_second_chunk() {
        let misses = WindowMisses::default();
        assert!(!misses.second_chunk(0, 7, 40), "a first miss");
        assert!(!misses.second_chunk(0, 7, 40), "the same chunk again");
        assert!(!misses.second_chunk(1, 7, 41), "another blob's window");
        assert!(!misses.second_chunk(0, 8, 41), "another window");
        assert!(misses.second_chunk(0, 7, 41), "a second chunk");
        assert!(misses.second_chunk(0, 7, 43), "and any after it");
    }

    #[test]
    fn batches_run_from_the_miss_on_then_before_it() {
        let file: Vec<usize> = (10..30).collect();
        assert_eq!(
            batches(&file, &(17..18), 5),
            vec![18..23, 23..28, 28..30, 10..15, 15..17]
        );
        // Chunks apart are never fetched as one batch.
        assert_eq!(batches(&[3, 4, 9, 10, 11], &(9..10), 8), vec![10..12, 3..5]);
        // A miss that covers the whole group leaves nothing to predict.
        assert!(batches(&[10, 11, 12], &(9..20), 8).is_empty());
    }

    fn file(tree: &mut Tree<FileChunks>, dir: NodeId, name: &str, mode: u32, size: u64, at: u32) {
        let blocks = size.div_ceil(4096) as u32;
        let node = tree.add_node(Node {
            meta: Metadata {
                mode,
                ..Metadata::default()
            },
            kind: NodeKind::Regular {
                size,
                content: FileChunks {
                    chunk_bits: 12,
                    chunks: (0..blocks)
                        .map(|b| ChunkAddr::Data {
                            device: 1,
                            blkaddr: at + b,
                        })
                        .collect(),
                },
            },
        });
        if let NodeKind::Directory { entries } = &mut tree.nodes[dir].kind {
            entries.insert(name.into(), DirEntry { node, layer: 0 });
        }
    }

    /// An image of `(name, mode, size)` files in its root, laid out one
    /// after another on one device, and where each starts (bytes).
    fn image(files: &[(&str, u32, u64)]) -> (Vec<u8>, Vec<u64>) {
        let mut tree: Tree<FileChunks> = Tree::new();
        let (root, mut at, mut starts) = (tree.root, 0u32, Vec::new());
        for &(name, mode, size) in files {
            file(&mut tree, root, name, mode, size, at);
            starts.push(u64::from(at) * 4096);
            at += size.div_ceil(4096) as u32;
        }
        let device = Device {
            tag: "0".repeat(64),
            blocks: at,
        };
        let (bytes, _) = write_image(&tree, &[device]).unwrap();
        (bytes, starts)
    }

    #[test]
    fn small_files_group_by_directory_and_extension_libraries_stand_alone() {
        const K: u64 = 1024;
        let files = [
            ("a.py", 0o644, 10 * K),
            ("b.py", 0o644, 20 * K),
            ("big.py", 0o644, SMALL_FILE + 1),
            ("c.txt", 0o644, 5 * K),
            ("libx.so.1", 0o644, 2 * SMALL_FILE),
            ("huge.so", 0o644, 9 << 20),
            ("tool", 0o755, SMALL_FILE + 1),
            ("Makefile", 0o644, 4 * K),
        ];
        let (bytes, at) = image(&files);
        let image = Image::new(&bytes).unwrap();
        let map = FileMap::build(&image, 1, 8 << 20, 0, true).unwrap();
        let group = |i: usize| map.group_at(0, at[i] + 100);
        // The two small .py files go together; the large one stays alone.
        assert_eq!(group(0), group(1));
        assert!(group(0).is_some());
        assert_eq!(group(2), None, "a large file that is not mapped");
        assert!(
            group(3).is_some() && group(3) != group(0),
            "another extension"
        );
        // Mapped files over SMALL_FILE, each its own group, up to the limit.
        assert!(group(4).is_some() && group(4) != group(3));
        assert_eq!(group(5), None, "over max_mapped");
        assert!(group(6).is_some() && group(6) != group(4));
        assert_eq!(group(7), None, "no extension");
        assert_eq!(map.mapped_files(), 2);
        let py: Vec<Range<u64>> = map.ranges(group(0).unwrap(), 0).collect();
        assert_eq!(py, vec![at[0]..at[0] + 10 * K, at[1]..at[1] + 20 * K]);
        let lib: Vec<Range<u64>> = map.ranges(group(4).unwrap(), 0).collect();
        assert_eq!(lib, vec![at[4]..at[4] + 2 * SMALL_FILE]);
        // Past a file's end (block padding) is no file's.
        assert_eq!(map.group_at(0, at[0] + 10 * K + 1), None);
        // Every file's bytes are live, whatever its group; asked for only.
        let live = map.live(0);
        for (i, &(_, _, size)) in files.iter().enumerate() {
            let used = at[i]..at[i] + size;
            assert!(
                live.iter()
                    .any(|r| r.start <= used.start && used.end <= r.end),
                "file {i} not live: {live:?}"
            );
        }
        let unasked = FileMap::build(&image, 1, 8 << 20, 0, false).unwrap();
        assert!(unasked.live(0).is_empty());
    }

    #[test]
    fn a_directory_of_many_small_files_is_split_into_bounded_groups() {
        let names: Vec<String> = (0..40).map(|i| format!("m{i:02}.js")).collect();
        let files: Vec<(&str, u32, u64)> = names
            .iter()
            .map(|n| (n.as_str(), 0o644, 256 << 10))
            .collect();
        let (bytes, at) = image(&files);
        let map = FileMap::build(&Image::new(&bytes).unwrap(), 1, 0, WINDOW, true).unwrap();
        let groups: HashSet<u32> = at.iter().map(|&a| map.group_at(0, a).unwrap()).collect();
        // 40 files of 256 KiB: 10 MiB, in groups of at most GROUP_MAX.
        assert_eq!(
            groups.len(),
            (40 * (256 << 10) as u64).div_ceil(GROUP_MAX) as usize
        );
        for g in groups {
            let bytes: u64 = map.ranges(g, 0).map(|r| r.end - r.start).sum();
            assert!(bytes <= GROUP_MAX, "{bytes}");
        }
    }

    #[test]
    fn a_mapped_file_over_the_limit_is_predicted_in_aligned_windows() {
        const K: u64 = 1024;
        let files = [
            ("node", 0o755, 3 * WINDOW + 100 * K),
            ("libsmall.so", 0o644, 2 * SMALL_FILE),
            ("data.bin", 0o644, 3 * WINDOW),
        ];
        let (bytes, at) = image(&files);
        let image = Image::new(&bytes).unwrap();
        let map = FileMap::build(&image, 1, 2 << 20, WINDOW, true).unwrap();
        let group = |file: usize, offset: u64| map.group_at(0, at[file] + offset);
        // Four windows of the binary: the first three whole, the last its tail.
        let windows: Vec<u32> = (0..4).map(|w| group(0, w * WINDOW).unwrap()).collect();
        assert_eq!(windows.iter().collect::<HashSet<_>>().len(), 4);
        assert_eq!(group(0, WINDOW - 1), Some(windows[0]));
        assert_eq!(group(0, 3 * WINDOW + 100 * K - 1), Some(windows[3]));
        for (w, &g) in windows.iter().enumerate() {
            let start = at[0] + w as u64 * WINDOW;
            let end = (start + WINDOW).min(at[0] + 3 * WINDOW + 100 * K);
            assert_eq!(map.ranges(g, 0).collect::<Vec<_>>(), vec![start..end]);
        }
        assert_eq!(map.windows(), 4);
        assert!(windows.iter().all(|&g| map.is_window(g)));
        // A library under the limit stays whole; data is not mapped.
        let lib = group(1, 0).unwrap();
        assert!(!map.is_window(lib));
        assert_eq!(
            map.ranges(lib, 0).collect::<Vec<_>>(),
            vec![at[1]..at[1] + 2 * SMALL_FILE]
        );
        assert_eq!(group(2, 0), None);
        // Without windows, or without predictions, the binary is no group.
        let map = FileMap::build(&image, 1, 2 << 20, 0, true).unwrap();
        assert_eq!(map.group_at(0, at[0]), None);
        assert_eq!(map.windows(), 0);
        let map = FileMap::build(&image, 1, 0, WINDOW, true).unwrap();
        assert_eq!(map.group_at(0, at[0]), None);
    }

    #[test]
    fn windows_are_bounded_per_map() {
        // One block per window: a file of more windows than MAX_WINDOWS
        // gets none, a smaller one after it still does.
        let files = [
            ("huge", 0o755, 4096 * (MAX_WINDOWS as u64 + 1)),
            ("tool", 0o755, SMALL_FILE + 4096),
        ];
        let (bytes, at) = image(&files);
        let map = FileMap::build(&Image::new(&bytes).unwrap(), 1, 4096, 4096, true).unwrap();
        assert_eq!(map.group_at(0, at[0]), None);
        assert!(map.group_at(0, at[1]).is_some_and(|g| map.is_window(g)));
        assert_eq!(map.windows() as u64, SMALL_FILE / 4096 + 1);
    }
}
