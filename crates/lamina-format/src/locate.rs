//! The chunk locator: where on this node a verified copy of a chunk lies,
//! by the chunk's digest (sha256 of its uncompressed bytes, as chunk tables
//! and span tables give it).
//!
//! A miss looks here before it fetches: a chunk that another image (an
//! older version of this one, or any image sharing files with it) already
//! holds is copied from that image's cache file instead. The locator is a
//! hint, never a source of trust: the copied bytes are hashed against the
//! reading image's own table before they are written and recorded, like
//! bytes from the network. A stale, torn or forged slot costs a read and a
//! hash, then the chunk is fetched.
//!
//! One file per cache, of fixed size: a hash table of [`SLOTS`] slots,
//! [`SLOT_LEN`] bytes each, in [`LEVELS`] levels, level `L` of
//! `LEVEL0_SLOTS << L` slots. A digest has a window of [`PROBE`] slots in
//! each level, from its home there (its first 8 bytes modulo the level's
//! slots); a note takes the first free slot of its windows, level by
//! level, so slots are written densely from the file's start and a sparse
//! file of a few thousand chunks takes that many slots' bytes on disk, not
//! a 4 KiB block each (version 1, one level, took a block a chunk). When
//! every window is full, the note overwrites one slot of the last level's
//! (chosen by the digest), so the file never grows: the newest copies are
//! found, older ones fade. Writers write whole slots at their offsets
//! without a lock; a slot whose check does not match its content is empty.
//!
//! ```text
//! LocatorHeader (64 bytes)
//! slots         (SLOTS x 96 bytes, level 0 first, sparse until written)
//! ```
//! All integers little-endian. Version 2.
//!
//! Files are found by content too, beside the slots: a cache file's
//! *named ranges* list (`<entry>.named`) holds the packed files of it that
//! a `--share-files` mount named by the sha256 of their bytes, and its
//! *skipped ranges* list (`<entry>.skipped`) the packed files a fill did not
//! write there because the node held their bytes elsewhere. Both are
//! [`ContentRange`] lists ([`ranges_bytes`]): dense (48 bytes a file, where
//! a slot would take a block of the sparse table each) and hints only, like
//! the slots: bytes found through them are hashed before they are used.

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// `LocatorHeader::magic`.
pub const LOCATOR_MAGIC: [u8; 8] = *b"LAMLOC\x00\x01";
/// The only version this code reads and writes (one of another version is
/// replaced by an empty one: it only costs fetches).
pub const LOCATOR_VERSION: u32 = 2;
/// Levels of slots.
pub const LEVELS: u32 = 12;
/// Slots of level 0; level `L` has `LEVEL0_SLOTS << L`.
pub const LEVEL0_SLOTS: u64 = 64;
/// Slots in a locator: 262,080, 24 MiB of file (sparse: only slots
/// written take disk). At the default chunk size that remembers ~256k
/// chunks, far more than a node's cache holds at once.
pub const SLOTS: u64 = LEVEL0_SLOTS * ((1 << LEVELS) - 1);
/// Slots probed for one digest in each level.
pub const PROBE: u64 = 8;
/// Bytes of a slot.
pub const SLOT_LEN: usize = size_of::<ChunkSlot>();
/// Bytes of the header.
pub const HEADER_LEN: usize = size_of::<LocatorHeader>();

/// Start of a locator file.
#[derive(Debug, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct LocatorHeader {
    /// [`LOCATOR_MAGIC`].
    pub magic: [u8; 8],
    /// [`LOCATOR_VERSION`].
    pub version: U32,
    /// Bytes per slot ([`SLOT_LEN`]).
    pub slot_len: U32,
    /// Slots ([`SLOTS`]).
    pub slots: U64,
    /// Zero.
    pub reserved: [u8; 40],
}

/// Where one chunk's verified bytes lie: a range of a cache entry's file.
#[derive(Debug, Clone, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct ChunkSlot {
    /// sha256 of the chunk's uncompressed bytes.
    pub digest: [u8; 32],
    /// The cache entry's blob digest (first part of its file name).
    pub blob: [u8; 32],
    /// The first 16 bytes of the entry's id (second part of its file name).
    pub entry: [u8; 16],
    /// Offset of the chunk in the entry's cache file.
    pub cache_offset: U64,
    /// Length of the chunk.
    pub size: U32,
    /// First 4 bytes of sha256 over the slot's other bytes: a torn or
    /// never-written slot does not match.
    pub check: [u8; 4],
}

const _: () = assert!(HEADER_LEN == 64);
const _: () = assert!(SLOT_LEN == 96);

impl LocatorHeader {
    /// The header of a new locator.
    pub fn new() -> LocatorHeader {
        LocatorHeader {
            magic: LOCATOR_MAGIC,
            version: LOCATOR_VERSION.into(),
            slot_len: (SLOT_LEN as u32).into(),
            slots: SLOTS.into(),
            reserved: [0; 40],
        }
    }

    /// Whether `bytes` start with a header this code reads.
    pub fn is_valid(bytes: &[u8]) -> bool {
        LocatorHeader::read_from_prefix(bytes).is_ok_and(|(h, _)| {
            h.magic == LOCATOR_MAGIC
                && h.version.get() == LOCATOR_VERSION
                && h.slot_len.get() as usize == SLOT_LEN
                && h.slots.get() == SLOTS
        })
    }
}

impl Default for LocatorHeader {
    fn default() -> Self {
        LocatorHeader::new()
    }
}

impl ChunkSlot {
    /// A slot saying chunk `digest` lies at `cache_offset` (`size` bytes)
    /// of the entry `(blob, entry)`, its check computed.
    pub fn new(
        digest: [u8; 32],
        (blob, entry): ([u8; 32], [u8; 16]),
        cache_offset: u64,
        size: u32,
    ) -> ChunkSlot {
        let mut slot = ChunkSlot {
            digest,
            blob,
            entry,
            cache_offset: cache_offset.into(),
            size: size.into(),
            check: [0; 4],
        };
        slot.check = slot.expected_check();
        slot
    }

    /// The slot in `bytes` ([`SLOT_LEN`] of them), if its check matches.
    pub fn parse(bytes: &[u8]) -> Option<ChunkSlot> {
        let slot = ChunkSlot::read_from_bytes(bytes).ok()?;
        (slot.check == slot.expected_check()).then_some(slot)
    }

    fn expected_check(&self) -> [u8; 4] {
        let bytes = self.as_bytes();
        let d = ring::digest::digest(&ring::digest::SHA256, &bytes[..SLOT_LEN - 4]);
        let mut check = [0; 4];
        check.copy_from_slice(&d.as_ref()[..4]);
        check
    }
}

/// The slots probed for `digest`, in order: its window in each level,
/// level 0 first.
pub fn probe(digest: &[u8; 32]) -> impl Iterator<Item = u64> {
    let digest = *digest;
    (0..LEVELS).flat_map(move |level| level_window(&digest, level))
}

/// `digest`'s window in `level`: [`PROBE`] slots from its home there,
/// wrapping inside the level.
pub fn level_window(digest: &[u8; 32], level: u32) -> impl Iterator<Item = u64> {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let (base, len) = (LEVEL0_SLOTS * ((1 << level) - 1), LEVEL0_SLOTS << level);
    let home = u64::from_le_bytes(first) % len;
    (0..PROBE).map(move |k| base + (home + k) % len)
}

/// The slot a note of `digest` overwrites when all its windows are full:
/// one of the last level's (chosen by the digest).
pub fn victim(digest: &[u8; 32]) -> u64 {
    level_window(digest, LEVELS - 1)
        .nth(usize::from(digest[8]) % PROBE as usize)
        .unwrap_or(0)
}

/// Byte offset of slot `i` in the file.
pub fn slot_offset(i: u64) -> u64 {
    HEADER_LEN as u64 + i * SLOT_LEN as u64
}

/// Length of a locator file.
pub const FILE_LEN: u64 = HEADER_LEN as u64 + SLOTS * SLOT_LEN as u64;

/// A range of a cache file known by the sha256 of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ContentRange {
    /// Where it is in the cache file.
    pub offset: u64,
    /// Its length.
    pub len: u64,
    /// The sha256 of its bytes.
    pub sha256: [u8; 32],
}

/// For (offset, length) ranges sorted by offset, whether each overlaps
/// neither neighbour. Files that overlap (two at one offset, one a prefix
/// of the other) are neither named nor skipped alone: each holds bytes of
/// the other.
pub fn apart(ranges: &[(u64, u64)]) -> Vec<bool> {
    let overlaps = |a: (u64, u64), b: (u64, u64)| a.0 + a.1 > b.0;
    (0..ranges.len())
        .map(|k| {
            let after = ranges.get(k + 1).is_some_and(|&n| overlaps(ranges[k], n));
            let before = k > 0 && overlaps(ranges[k - 1], ranges[k]);
            !after && !before
        })
        .collect()
}

/// Bytes of one record of a ranges list.
const RANGE_LEN: usize = 48;

/// A ranges list's bytes: each range as offset and length (u64,
/// little-endian) then sha256, sorted by offset, nothing else.
pub fn ranges_bytes(ranges: &[ContentRange]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ranges.len() * RANGE_LEN);
    for r in ranges {
        out.extend_from_slice(&r.offset.to_le_bytes());
        out.extend_from_slice(&r.len.to_le_bytes());
        out.extend_from_slice(&r.sha256);
    }
    out
}

/// Parses a ranges list; `None` unless it is whole records, sorted, none
/// overlapping the next.
pub fn parse_ranges(bytes: &[u8]) -> Option<Vec<ContentRange>> {
    if !bytes.len().is_multiple_of(RANGE_LEN) {
        return None;
    }
    let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let list: Vec<ContentRange> = bytes
        .chunks_exact(RANGE_LEN)
        .map(|r| ContentRange {
            offset: u64_at(&r[..8]),
            len: u64_at(&r[8..16]),
            sha256: r[16..].try_into().expect("32 bytes"),
        })
        .collect();
    let ordered = list.windows(2).all(|w| {
        w[0].offset
            .checked_add(w[0].len)
            .is_some_and(|end| end <= w[1].offset)
    });
    ordered.then_some(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_apart_overlap_no_neighbour() {
        // The second and third start at one offset; the last touches the
        // one before it without overlapping.
        let ranges = [(0, 10), (4096, 100), (4096, 50), (8192, 10), (8202, 5)];
        assert_eq!(apart(&ranges), vec![true, false, false, true, true]);
        assert!(apart(&[]).is_empty());
    }

    #[test]
    fn ranges_lists_read_back_and_refuse_overlaps() {
        let r = |offset, len, b| ContentRange {
            offset,
            len,
            sha256: [b; 32],
        };
        let list = vec![r(0, 100, 1), r(4096, 4096, 2)];
        assert_eq!(parse_ranges(&ranges_bytes(&list)), Some(list.clone()));
        assert_eq!(parse_ranges(&ranges_bytes(&list)[..47]), None);
        let overlapping = vec![r(0, 5000, 1), r(4096, 10, 2)];
        assert_eq!(parse_ranges(&ranges_bytes(&overlapping)), None);
        let unsorted = vec![list[1], list[0]];
        assert_eq!(parse_ranges(&ranges_bytes(&unsorted)), None);
    }

    #[test]
    fn a_slot_round_trips_and_a_torn_one_is_empty() {
        let slot = ChunkSlot::new([7; 32], ([1; 32], [2; 16]), 4096, 65536);
        let bytes = slot.as_bytes().to_vec();
        assert_eq!(ChunkSlot::parse(&bytes), Some(slot));
        let mut torn = bytes.clone();
        torn[40] ^= 1;
        assert_eq!(ChunkSlot::parse(&torn), None);
        assert_eq!(ChunkSlot::parse(&[0; SLOT_LEN]), None, "a hole is empty");
    }

    #[test]
    fn probes_stay_in_their_levels_and_the_victim_is_in_the_last() {
        let digest = [0xff; 32];
        let slots: Vec<u64> = probe(&digest).collect();
        assert_eq!(slots.len(), (PROBE * u64::from(LEVELS)) as usize);
        for (level, window) in slots.chunks(PROBE as usize).enumerate() {
            let base = LEVEL0_SLOTS * ((1 << level) - 1);
            let len = LEVEL0_SLOTS << level;
            assert!(window.iter().all(|&s| (base..base + len).contains(&s)));
        }
        assert!(slots.iter().all(|&s| s < SLOTS));
        assert!(slots[slots.len() - PROBE as usize..].contains(&victim(&digest)));
        assert_eq!(slot_offset(SLOTS), FILE_LEN);
    }

    #[test]
    fn only_this_header_is_valid() {
        let header = LocatorHeader::new();
        assert!(LocatorHeader::is_valid(header.as_bytes()));
        let mut other = header.clone();
        other.slots = (SLOTS * 2).into();
        assert!(!LocatorHeader::is_valid(other.as_bytes()));
        assert!(!LocatorHeader::is_valid(&[0; HEADER_LEN]));
    }
}
