//! The lookup table stored beside an EROFS image: `(parent nid, name) ->
//! child nid` for every directory entry but `.` and `..`, and `path -> nid`
//! for every path, each answered with one hash and one exact verification.
//!
//! ```text
//! LookupHeader  (128 bytes)
//! entry MPHF:   U32 x (parts + 1)  slot starts
//!               u8  x (parts * buckets_per_part)  pilots
//!               U32 x (slots - entry_count)  remap
//! path MPHF:    the same three arrays, with its own counts
//! EntryRecord   x entry_count  (24 bytes each, at the index the entry MPHF gives)
//! U32           x entry_count  path order: the record of the path at each index
//!                              the path MPHF gives
//! names         (names_len bytes: for each record, in record order, a length
//!                byte and the name's bytes)
//! ```
//! All integers little-endian. Version 1.
//!
//! Keys. An entry's key is [`mphf::entry_hash`]`(seed, parent nid, name)`. A
//! path has no leading or trailing `/`, and its components are joined by
//! single `/`s: `usr/bin/env`. The root is not in the table (its nid is in
//! the header; [`LookupTable::lookup_path`] answers the empty path with it),
//! so every path is the path of exactly one entry record. A path's key is
//! [`mphf::path_hash`]`(seed, path)`, defined component by component so the
//! builder derives each path's hash from its parent's.
//!
//! Verification. The entry MPHF sends a key to a record, which holds the
//! parent nid, the child nid and the name: a hit is one whose parent nid and
//! name bytes equal the query's. The path MPHF sends a path to a record too;
//! each record names the record of its parent directory, so the query walks
//! up from the record comparing one component per level, and a hit is one
//! where the components run out exactly at the root. This costs a 4-byte
//! parent index per entry instead of storing every full path (whose bytes
//! repeat each directory's path for every entry below it); the walk reads
//! one record per component.
//!
//! Binding. The header holds the SHA-256 of the image the table was built
//! for ([`LookupTable::check_image`]) and the SHA-256 of the table itself
//! (checked by [`LookupTable::parse`]), so a damaged table is refused
//! rather than trusted to give nids.

mod builder;
pub mod mphf;

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::erofs::ReadError;
use mphf::{Mphf, MphfError};

pub use builder::{build, build_from_image, BuildEntry};

/// `LookupHeader::magic`.
pub const LOOKUP_MAGIC: [u8; 8] = *b"LAMLOOK\x01";
/// The only version this code reads and writes.
pub const LOOKUP_VERSION: u32 = 1;
/// Bytes of [`LookupHeader`].
pub const LOOKUP_HEADER_LEN: usize = size_of::<LookupHeader>();
/// Most entries a table holds.
pub const MAX_ENTRIES: u32 = mphf::MAX_KEYS;
/// `EntryRecord::parent_record` of an entry in the root directory.
pub const NO_PARENT: u32 = u32::MAX;
/// Seeds the builder tries before giving up.
const SEEDS: u64 = 16;
/// Bytes of the header the table digest covers (all but the digest).
const DIGESTED_HEADER: usize = 96;

/// The shape of one MPHF's arrays.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct MphfHeader {
    /// Parts (0 for an empty table).
    pub part_count: U32,
    /// Buckets in every part (pilots: `part_count * buckets_per_part`).
    pub buckets_per_part: U32,
    /// Total slots (`>= entry_count`; remap: `slot_count - entry_count`).
    pub slot_count: U32,
}

/// Start of a lookup table.
#[derive(Debug, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct LookupHeader {
    /// [`LOOKUP_MAGIC`].
    pub magic: [u8; 8],
    /// [`LOOKUP_VERSION`].
    pub version: U32,
    /// Zero.
    pub flags: U32,
    /// The seed every key hash takes (the first that built both MPHFs).
    pub seed: U64,
    /// The image's root directory nid.
    pub root_nid: U64,
    /// Entries (and paths).
    pub entry_count: U32,
    /// Bytes of the names area.
    pub names_len: U32,
    /// The `(parent, name)` MPHF.
    pub entry_mphf: MphfHeader,
    /// The path MPHF.
    pub path_mphf: MphfHeader,
    /// SHA-256 of the image's bytes.
    pub image_digest: [u8; 32],
    /// SHA-256 of the header's first 96 bytes and everything after the header.
    pub table_digest: [u8; 32],
}

/// One directory entry.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct EntryRecord {
    /// The directory holding the entry.
    pub parent_nid: U64,
    /// The inode the entry names.
    pub child_nid: U64,
    /// Offset in the names area of the name's length byte.
    pub name_offset: U32,
    /// The record of the parent directory's own entry, or [`NO_PARENT`] in
    /// the root directory.
    pub parent_record: U32,
}

const _: () = assert!(size_of::<MphfHeader>() == 12);
const _: () = assert!(size_of::<LookupHeader>() == 128);
const _: () = assert!(size_of::<EntryRecord>() == 24);
const _: () = assert!(DIGESTED_HEADER == size_of::<LookupHeader>() - 32);

/// A table that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    /// Shorter or longer than its header says.
    #[error("lookup table has the wrong length")]
    Length,
    /// Not a lookup table, or a version this build does not know.
    #[error("not a lamina lookup table (bad magic or version)")]
    BadMagic,
    /// Counts that do not fit together or exceed the limits.
    #[error("lookup table inconsistent: {0}")]
    Inconsistent(&'static str),
    /// The table's digest does not match: a damaged table.
    #[error("lookup table checksum mismatch")]
    Checksum,
    /// Built for another image.
    #[error("lookup table was built for another image")]
    WrongImage,
}

/// Why a table could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The image could not be read.
    #[error(transparent)]
    Image(#[from] ReadError),
    /// Entries that do not form a tree under the root.
    #[error("entries do not form a tree: {0}")]
    NotATree(String),
    /// The same name twice in one directory.
    #[error("directory {parent} holds {name:?} twice")]
    DuplicateEntry {
        /// The directory.
        parent: u64,
        /// The name, lossily.
        name: String,
    },
    /// More entries or name bytes than the format counts.
    #[error("too large for a lookup table: {0}")]
    TooLarge(&'static str),
    /// No seed gave both functions (a hash collision every time).
    #[error("no seed of {SEEDS} built the hash functions: {0}")]
    NoSeed(MphfError),
}

/// A table over its bytes: queries read them in place.
#[derive(Debug, Clone, Copy)]
pub struct LookupTable<'a> {
    seed: u64,
    root_nid: u64,
    image_digest: [u8; 32],
    entry_mphf: Mphf<'a>,
    path_mphf: Mphf<'a>,
    records: &'a [EntryRecord],
    path_order: &'a [U32],
    names: &'a [u8],
}

fn sha256(parts: &[&[u8]]) -> [u8; 32] {
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    for part in parts {
        context.update(part);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(context.finish().as_ref());
    out
}

/// The next `count` items of `T` from `rest`.
fn take<'a, T: FromBytes + Immutable + KnownLayout>(
    rest: &mut &'a [u8],
    count: u64,
) -> Result<&'a [T], LookupError> {
    let len = count
        .checked_mul(size_of::<T>() as u64)
        .and_then(|len| usize::try_from(len).ok())
        .filter(|&len| len <= rest.len())
        .ok_or(LookupError::Length)?;
    let (head, tail) = rest.split_at(len);
    *rest = tail;
    <[T]>::ref_from_bytes(head).map_err(|_| LookupError::Length)
}

/// One MPHF's arrays, after checking its counts against `n` keys. The
/// bounds only refuse shapes no builder makes; the length check does the
/// rest.
fn take_mphf<'a>(
    rest: &mut &'a [u8],
    n: u32,
    header: &MphfHeader,
) -> Result<Mphf<'a>, LookupError> {
    let parts = u64::from(header.part_count.get());
    let buckets = u64::from(header.buckets_per_part.get());
    let slots = u64::from(header.slot_count.get());
    let n64 = u64::from(n);
    let shape_ok = if n == 0 {
        parts == 0 && buckets == 0 && slots == 0
    } else {
        (1..=n64).contains(&parts)
            && buckets >= 1
            && parts * buckets <= 5 * n64 + 5
            && (n64..=3 * n64 + 2).contains(&slots)
    };
    if !shape_ok {
        return Err(LookupError::Inconsistent("hash function shape"));
    }
    let slot_starts: &[U32] = take(rest, if n == 0 { 0 } else { parts + 1 })?;
    if n != 0 && slot_starts.last().map(|s| u64::from(s.get())) != Some(slots) {
        return Err(LookupError::Inconsistent("hash function slot count"));
    }
    Ok(Mphf {
        n,
        buckets_per_part: header.buckets_per_part.get(),
        slot_starts,
        pilots: take(rest, parts * buckets)?,
        remap: take(rest, slots - n64)?,
    })
}

impl<'a> LookupTable<'a> {
    /// Checks the header, every count and region bound, and the table's
    /// digest (a pass over its bytes). Allocates nothing.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, LookupError> {
        let table = Self::parse_unverified(bytes)?;
        let (header, body) = bytes.split_at(size_of::<LookupHeader>());
        if sha256(&[&header[..DIGESTED_HEADER], body]) != header[DIGESTED_HEADER..] {
            return Err(LookupError::Checksum);
        }
        Ok(table)
    }

    /// [`Self::parse`], then [`Self::check_image`].
    pub fn parse_for(bytes: &'a [u8], image_bytes: &[u8]) -> Result<Self, LookupError> {
        let table = Self::parse(bytes)?;
        table.check_image(image_bytes)?;
        Ok(table)
    }

    /// Everything [`Self::parse`] checks but the table's own digest, so no
    /// pass over its bytes: for bytes whose content digest the caller has
    /// checked already (a layer fetched by digest, a cache file with a
    /// record of its check). Lookups stay in bounds either way.
    pub fn parse_without_digest(bytes: &'a [u8]) -> Result<Self, LookupError> {
        Self::parse_unverified(bytes)
    }

    /// The header at the start of `bytes` (a table, or just its first
    /// [`LOOKUP_HEADER_LEN`] bytes), if its magic and version are right:
    /// what a table is bound to, without reading the table.
    pub fn header(bytes: &[u8]) -> Result<&LookupHeader, LookupError> {
        let (header, _) = LookupHeader::ref_from_prefix(bytes).map_err(|_| LookupError::Length)?;
        if header.magic != LOOKUP_MAGIC || header.version.get() != LOOKUP_VERSION {
            return Err(LookupError::BadMagic);
        }
        Ok(header)
    }

    /// Everything [`Self::parse`] checks but the digest.
    fn parse_unverified(bytes: &'a [u8]) -> Result<Self, LookupError> {
        let header = Self::header(bytes)?;
        let mut rest = &bytes[size_of::<LookupHeader>()..];
        let n = header.entry_count.get();
        let names_len = header.names_len.get();
        if header.flags.get() != 0 || n > MAX_ENTRIES {
            return Err(LookupError::Inconsistent("flags or entry count"));
        }
        if u64::from(names_len) > u64::from(n) * 256 {
            return Err(LookupError::Inconsistent("names area"));
        }
        let table = LookupTable {
            seed: header.seed.get(),
            root_nid: header.root_nid.get(),
            image_digest: header.image_digest,
            entry_mphf: take_mphf(&mut rest, n, &header.entry_mphf)?,
            path_mphf: take_mphf(&mut rest, n, &header.path_mphf)?,
            records: take(&mut rest, n.into())?,
            path_order: take(&mut rest, n.into())?,
            names: take(&mut rest, names_len.into())?,
        };
        if !rest.is_empty() {
            return Err(LookupError::Length);
        }
        Ok(table)
    }

    /// Refuses an image other than the one the table was built for (a
    /// SHA-256 of `image_bytes`).
    pub fn check_image(&self, image_bytes: &[u8]) -> Result<(), LookupError> {
        if sha256(&[image_bytes]) == self.image_digest {
            Ok(())
        } else {
            Err(LookupError::WrongImage)
        }
    }

    /// SHA-256 of the image the table was built for.
    pub fn image_digest(&self) -> [u8; 32] {
        self.image_digest
    }

    /// The image's root directory nid.
    pub fn root_nid(&self) -> u64 {
        self.root_nid
    }

    /// Entries in the table (also its number of paths).
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether the image has no entries but the root.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The nid `name` names in directory `parent`, or `None` (for `.`, `..`
    /// and the empty name too).
    pub fn lookup(&self, parent: u64, name: &[u8]) -> Option<u64> {
        let index = self
            .entry_mphf
            .index(mphf::entry_hash(self.seed, parent, name))?;
        let record = self.records.get(index as usize)?;
        let hit = record.parent_nid.get() == parent && self.name(record)? == name;
        hit.then(|| record.child_nid.get())
    }

    /// The nid at `path` (see the module doc for its form; the empty path
    /// is the root), or `None`.
    pub fn lookup_path(&self, path: &[u8]) -> Option<u64> {
        if path.is_empty() {
            return Some(self.root_nid);
        }
        let index = self.path_mphf.index(mphf::path_hash(self.seed, path))?;
        let first = self.path_order.get(index as usize)?.get();
        let found = self.records.get(first as usize)?;
        let mut record = found;
        let mut components = path.rsplit(|&b| b == b'/');
        // Up from the entry: each component its record's name, each
        // record's parent the next one's child, ending at the root.
        loop {
            if self.name(record)? != components.next()? {
                return None;
            }
            let parent = record.parent_record.get();
            if parent == NO_PARENT {
                let at_root = record.parent_nid.get() == self.root_nid;
                return (at_root && components.next().is_none()).then(|| found.child_nid.get());
            }
            let above = self.records.get(parent as usize)?;
            if above.child_nid.get() != record.parent_nid.get() {
                return None;
            }
            record = above;
        }
    }

    fn name(&self, record: &EntryRecord) -> Option<&'a [u8]> {
        let at = record.name_offset.get() as usize;
        let len = usize::from(*self.names.get(at)?);
        self.names.get(at + 1..at + 1 + len)
    }
}

#[cfg(test)]
mod tests {
    use super::builder::image_entries;
    use super::mphf::MphfParams;
    use super::*;
    use crate::erofs::test_tree::add;
    use crate::erofs::{write_image, FileChunks, Image};
    use lamina_tree::{DirEntry, Metadata, Node, NodeKind, Tree};

    fn dir() -> Node<FileChunks> {
        Node {
            meta: Metadata {
                mode: 0o755,
                ..Metadata::default()
            },
            kind: NodeKind::Directory {
                entries: Default::default(),
            },
        }
    }

    fn file() -> Node<FileChunks> {
        Node {
            meta: Metadata {
                mode: 0o644,
                ..Metadata::default()
            },
            kind: NodeKind::Regular {
                size: 0,
                content: FileChunks {
                    chunk_bits: 12,
                    chunks: Vec::new(),
                },
            },
        }
    }

    /// Nested directories, a large one, prefixes of names, a 255-byte name,
    /// a hard link, and a directory with the same name as its parent.
    fn sample(variant: u8) -> Tree<FileChunks> {
        let mut t: Tree<FileChunks> = Tree::new();
        let root = t.root;
        let usr = add(&mut t, root, b"usr", dir());
        let bin = add(&mut t, usr, b"bin", dir());
        let env = add(&mut t, bin, b"env", file());
        add(&mut t, bin, b"en", file());
        add(&mut t, bin, b"envy", file());
        let deep = add(&mut t, usr, b"usr", dir());
        add(&mut t, deep, b"usr", dir());
        add(&mut t, root, &[b'n'; 255], file());
        add(&mut t, root, &[b'n'; 254], file());
        let big = add(&mut t, root, b"big", dir());
        for i in 0..1500u32 {
            add(&mut t, big, format!("f{i}").as_bytes(), file());
        }
        if let NodeKind::Directory { entries } = &mut t.nodes[root].kind {
            entries.insert(
                b"env-link".to_vec(),
                DirEntry {
                    node: env,
                    layer: 0,
                },
            );
        }
        add(&mut t, root, &[b'v', b'0' + variant], file());
        t
    }

    fn image(variant: u8) -> Vec<u8> {
        write_image(&sample(variant), &[]).unwrap().0
    }

    /// Every path of the tree and its nid, resolved by the reader.
    fn paths(tree: &Tree<FileChunks>, img: &Image<'_>) -> Vec<(Vec<u8>, u64)> {
        let mut out = Vec::new();
        tree.walk(|path, _| {
            let mut nid = img.root_nid();
            for component in path.split(|&b| b == b'/').filter(|c| !c.is_empty()) {
                let dir = img.inode(nid).unwrap();
                nid = img.lookup(&dir, component).unwrap().unwrap().nid;
            }
            out.push((path.to_vec(), nid));
        });
        out
    }

    #[test]
    fn finds_every_entry_and_path() {
        let bytes = image(0);
        let table_bytes = build_from_image(&bytes).unwrap();
        let table = LookupTable::parse_for(&table_bytes, &bytes).unwrap();
        let img = Image::new(&bytes).unwrap();
        let entries = image_entries(&img).unwrap();
        assert_eq!(table.len(), entries.len());
        for e in &entries {
            assert_eq!(table.lookup(e.parent, e.name), Some(e.child), "{e:?}");
        }
        let all = paths(&sample(0), &img);
        assert_eq!(all.len(), entries.len() + 1);
        for (path, nid) in &all {
            assert_eq!(table.lookup_path(path), Some(*nid), "{path:?}");
        }
    }

    #[test]
    fn absent_keys_answer_none() {
        let bytes = image(0);
        let table_bytes = build_from_image(&bytes).unwrap();
        let table = LookupTable::parse(&table_bytes).unwrap();
        let img = Image::new(&bytes).unwrap();
        let root = table.root_nid();
        let usr = table.lookup(root, b"usr").unwrap();
        let bin = table.lookup_path(b"usr/bin").unwrap();
        let long = [b'n'; 255];
        let absent_names: [(u64, &[u8]); 11] = [
            (root, b""),
            (root, b"."),
            (root, b".."),
            (root, &[b'm'; 255]),
            (root, &long[..253]),
            (bin, b"e"),
            (bin, b"envyy"),
            (bin, b"usr"),  // a name of another directory
            (usr, b"env"),  // a name one level down
            (root, b"bin"), // a name two levels down
            (u64::MAX, b"usr"),
        ];
        for (parent, name) in absent_names {
            assert_eq!(table.lookup(parent, name), None, "{parent} {name:?}");
        }
        for path in [
            &b"/usr"[..],
            b"usr/",
            b"usr//bin",
            b"./usr",
            b"usr/./bin",
            b"usr/bin/..",
            b"bin/env",
            b"usr/usr/usr/usr",
            b"usr/bin/env/x",
            b"big/f1500",
            b"big/f",
            b"e",
            b"usr/bi",
            b"sr/bin",
        ] {
            assert_eq!(table.lookup_path(path), None, "{path:?}");
        }
        assert_eq!(table.lookup_path(b""), Some(img.root_nid()));
        assert!(table.lookup_path(b"usr/usr/usr").is_some());
    }

    #[test]
    fn another_images_table_is_refused() {
        let (one, two) = (image(1), image(2));
        let table_bytes = build_from_image(&one).unwrap();
        assert!(LookupTable::parse_for(&table_bytes, &one).is_ok());
        assert_eq!(
            LookupTable::parse_for(&table_bytes, &two).err(),
            Some(LookupError::WrongImage)
        );
        let table = LookupTable::parse(&table_bytes).unwrap();
        assert_eq!(table.check_image(&two), Err(LookupError::WrongImage));
        assert_eq!(table.image_digest(), sha256(&[&one]));
    }

    #[test]
    fn output_is_deterministic() {
        let bytes = image(0);
        let table = build_from_image(&bytes).unwrap();
        assert_eq!(build_from_image(&bytes).unwrap(), table);
        let img = Image::new(&bytes).unwrap();
        let entries = image_entries(&img).unwrap();
        // Another parent-first order: breadth-first, by the entries' depth.
        let mut by_depth: Vec<BuildEntry<'_>> = Vec::new();
        let mut level = vec![img.root_nid()];
        while !level.is_empty() {
            let this: Vec<_> = entries
                .iter()
                .filter(|e| level.contains(&e.parent))
                .copied()
                .collect();
            level = this.iter().filter(|e| e.is_dir).map(|e| e.child).collect();
            by_depth.extend(this.into_iter().rev());
        }
        assert_eq!(by_depth.len(), entries.len());
        let digest = sha256(&[&bytes]);
        for threads in [1, 3] {
            let rebuilt = build(
                img.root_nid(),
                digest,
                by_depth.iter().copied(),
                &MphfParams::default(),
                threads,
            );
            assert_eq!(rebuilt.unwrap(), table);
        }
    }

    /// A table large enough that several threads write its records gives
    /// the same bytes on any number of threads, in any parent-first order.
    #[test]
    fn large_tables_do_not_depend_on_threads() {
        let n = 140_000usize;
        let names: Vec<Vec<u8>> = (0..n).map(|i| format!("n{i:x}").into_bytes()).collect();
        // Entry `i` is nid `i + 100`; every tenth a directory of 20.
        let entries: Vec<BuildEntry<'_>> = (0..n)
            .map(|i| BuildEntry {
                parent: match i / 20 {
                    0 => 1,
                    k => ((k - 1) * 10 + 100) as u64,
                },
                name: &names[i],
                child: i as u64 + 100,
                is_dir: i % 10 == 0,
            })
            .collect();
        let params = MphfParams::default();
        let one = build(1, [7; 32], entries.iter().copied(), &params, 1).unwrap();
        for threads in [2, 3] {
            let more = build(1, [7; 32], entries.iter().copied(), &params, threads).unwrap();
            assert!(more == one, "{threads} threads");
        }
        // Directories stay before their entries when each directory's
        // entries are reversed.
        let reordered: Vec<BuildEntry<'_>> = entries
            .chunks(20)
            .flat_map(|c| c.iter().rev().copied())
            .collect();
        assert!(build(1, [7; 32], reordered, &params, 2).unwrap() == one);
        let table = LookupTable::parse(&one).unwrap();
        for e in &entries {
            assert_eq!(table.lookup(e.parent, e.name), Some(e.child));
        }
        // 0x118 is in 0x82 (entry 130), in 0x32, in 0xa, in the root.
        assert_eq!(table.lookup_path(b"na/n32/n82/n118"), Some(0x118 + 100));
    }

    #[test]
    fn malformed_input_is_refused() {
        let entry = |parent, name: &'static [u8], child, is_dir| BuildEntry {
            parent,
            name,
            child,
            is_dir,
        };
        let params = MphfParams::default();
        let refused = |entries: Vec<BuildEntry<'static>>| build(1, [0; 32], entries, &params, 1);
        assert!(matches!(
            refused(vec![entry(1, b"a", 2, false), entry(1, b"a", 3, false)]),
            Err(BuildError::DuplicateEntry { .. })
        ));
        assert!(matches!(
            refused(vec![entry(5, b"a", 2, false)]),
            Err(BuildError::NotATree(_))
        ));
        assert!(matches!(
            refused(vec![entry(1, b"a", 2, true), entry(2, b"b", 2, true)]),
            Err(BuildError::NotATree(_))
        ));
        for name in [&b""[..], b".", b"..", &[b'x'; 256]] {
            let e = BuildEntry {
                parent: 1,
                name,
                child: 2,
                is_dir: false,
            };
            assert!(matches!(refused(vec![e]), Err(BuildError::NotATree(_))));
        }
        let empty = build(1, [0; 32], Vec::new(), &params, 1).unwrap();
        let table = LookupTable::parse(&empty).unwrap();
        assert!(table.is_empty());
        assert_eq!(table.lookup(1, b"a"), None);
        assert_eq!(table.lookup_path(b"a"), None);
        assert_eq!(table.lookup_path(b""), Some(1));
    }

    /// Damage is refused by the digest; and queries over damaged contents
    /// (the digest not checked) never panic and never read out of bounds.
    #[test]
    fn corrupt_tables_are_refused_and_never_panic() {
        let bytes = image(0);
        let good = build_from_image(&bytes).unwrap();
        let img = Image::new(&bytes).unwrap();
        let entries = image_entries(&img).unwrap();
        let all = paths(&sample(0), &img);
        let mut next = crate::erofs::test_tree::xorshift();
        for round in 0..300 {
            let mut damaged = good.clone();
            for _ in 0..1 + round % 4 {
                let at = (next() % damaged.len() as u64) as usize;
                damaged[at] ^= 1 << (next() % 8);
            }
            if round % 3 == 0 {
                damaged.truncate((next() % damaged.len() as u64) as usize);
            }
            assert!(LookupTable::parse(&damaged).is_err(), "round {round}");
            let Ok(table) = LookupTable::parse_unverified(&damaged) else {
                continue;
            };
            for e in entries.iter().step_by(7) {
                let _ = table.lookup(e.parent, e.name);
                let _ = table.lookup(e.parent ^ 1, e.name);
            }
            for (path, _) in all.iter().step_by(7) {
                let _ = table.lookup_path(path);
            }
        }
        for len in 0..size_of::<LookupHeader>() + 64 {
            assert!(LookupTable::parse(&good[..len]).is_err());
        }
    }

    /// Bytes outside the records' nid fields carry no nid: damage there,
    /// with the digest not checked, gives the right nid or `None`.
    #[test]
    fn damaged_hash_functions_and_names_never_give_a_wrong_nid() {
        let bytes = image(0);
        let good = build_from_image(&bytes).unwrap();
        let img = Image::new(&bytes).unwrap();
        let entries = image_entries(&img).unwrap();
        let all = paths(&sample(0), &img);
        let n = entries.len();
        let records_start =
            good.len() - n * (24 + 4) - LookupTable::parse(&good).unwrap().names.len();
        let records_end = records_start + n * 24;
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for round in 0..300u64 {
            let mut damaged = good.clone();
            for _ in 0..1 + round % 4 {
                state = mphf::key_hash(state, b"flip");
                let mut at =
                    size_of::<LookupHeader>() + (state % (good.len() - 128) as u64) as usize;
                // A nid field of a record: move to its name offset instead.
                if (records_start..records_end).contains(&at) && (at - records_start) % 24 < 16 {
                    at = records_start + (at - records_start) / 24 * 24 + 16;
                }
                damaged[at] ^= 1 << (state >> 61);
            }
            let Ok(table) = LookupTable::parse_unverified(&damaged) else {
                continue;
            };
            for e in &entries {
                let found = table.lookup(e.parent, e.name);
                assert!(found.is_none() || found == Some(e.child), "round {round}");
            }
            for (path, nid) in &all {
                let found = table.lookup_path(path);
                assert!(found.is_none() || found == Some(*nid), "round {round}");
            }
        }
    }
}
