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
use std::sync::Mutex;
use std::time::Duration;

use lamina_format::erofs::{Chunk, Image, Kind, ReadError};

/// Directory entries walked at most; a larger image gets no predictions
/// (the walk would compete with its start for CPU).
pub const MAX_ENTRIES: usize = 400_000;

/// Files up to this size are grouped with their directory's files of the
/// same extension.
pub const SMALL_FILE: u64 = 512 << 10;

/// A group of small files holds at most this many bytes: a directory with
/// more is split into several groups, in name order.
pub const GROUP_MAX: u64 = 4 << 20;

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
}

/// Per blob, the extents of the files that are fetched with others (or
/// whole) on a first miss; see the module doc.
#[derive(Debug, Default)]
pub struct FileMap {
    blobs: Vec<Vec<Extent>>,
    groups: Vec<Group>,
    mapped: usize,
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
    /// `max_mapped` bytes each, and its small files by directory and
    /// extension.
    pub fn build(image: &Image<'_>, blobs: usize, max_mapped: u64) -> Result<FileMap, MapError> {
        let mut map = FileMap {
            blobs: vec![Vec::new(); blobs],
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
                        let name = entry.name;
                        if let Some(group) =
                            map.group_for(name, &inode, max_mapped, &mut by_extension)
                        {
                            map.add_file(image, &inode, group)?;
                        }
                    }
                    _ => {}
                }
            }
        }
        for extents in &mut map.blobs {
            extents.sort_by_key(|e| (e.start, e.end));
        }
        Ok(map)
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

    fn new_group(&mut self) -> u32 {
        self.groups.push(Group::default());
        (self.groups.len() - 1) as u32
    }

    fn fits(&self, group: u32, size: u64) -> bool {
        self.groups[group as usize].bytes + size <= GROUP_MAX
    }

    /// Adds a regular file's data to `group`, as runs of adjacent chunks.
    fn add_file(
        &mut self,
        image: &Image<'_>,
        inode: &lamina_format::erofs::Inode<'_>,
        group: u32,
    ) -> Result<(), ReadError> {
        let chunks = image.chunks(inode)?;
        let chunk_size = 1u64 << chunks.chunk_bits;
        let mut runs: Vec<(u32, u64, u64)> = Vec::new();
        for i in 0..chunks.len() {
            let Some(Chunk::Data { device, offset }) = chunks.get(i) else {
                continue;
            };
            let len = chunk_size.min(inode.size - i as u64 * chunk_size);
            let blob = u32::from(device) - 1;
            match runs.last_mut() {
                Some((b, _, end)) if *b == blob && *end == offset => *end += len,
                _ => runs.push((blob, offset, offset + len)),
            }
        }
        let g = &mut self.groups[group as usize];
        g.bytes += inode.size;
        for &(blob, start, end) in &runs {
            if let Some(extents) = self.blobs.get_mut(blob as usize) {
                extents.push(Extent { start, end, group });
                g.extents.push((blob, start, end));
            }
        }
        Ok(())
    }

    /// Mapped files in the map.
    pub fn mapped_files(&self) -> usize {
        self.mapped
    }

    /// Groups in the map (mapped files and small-file groups).
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
        let map = FileMap::build(&image, 1, 8 << 20).unwrap();
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
    }

    #[test]
    fn a_directory_of_many_small_files_is_split_into_bounded_groups() {
        let names: Vec<String> = (0..40).map(|i| format!("m{i:02}.js")).collect();
        let files: Vec<(&str, u32, u64)> = names
            .iter()
            .map(|n| (n.as_str(), 0o644, 256 << 10))
            .collect();
        let (bytes, at) = image(&files);
        let map = FileMap::build(&Image::new(&bytes).unwrap(), 1, 0).unwrap();
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
}
