//! Building a lookup table: the entries of an image walked from its root,
//! both hash functions for the first seed that builds them, and the
//! table's bytes, each written once in place.

use crate::erofs::{Image, Kind};

use super::mphf::{BuiltMphf, MphfParams};
use super::*;

/// One directory entry for [`build`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildEntry<'a> {
    /// The directory holding it.
    pub parent: u64,
    /// Its name (1 to 255 bytes, not `.` or `..`).
    pub name: &'a [u8],
    /// The inode it names.
    pub child: u64,
    /// Whether that inode is a directory (entries inside it may follow).
    pub is_dir: bool,
}

/// Builds the table for the EROFS image `image_bytes`, walking its
/// directories from the root (iteratively; each directory once).
pub fn build_from_image(image_bytes: &[u8]) -> Result<Vec<u8>, BuildError> {
    let image = Image::new(image_bytes)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The image's digest is one pass over all its bytes: taken on another
    // thread while the entries are walked and hashed.
    std::thread::scope(|scope| {
        let digest = scope.spawn(|| sha256(&[image_bytes]));
        let entries = image_entries(&image);
        let digest = digest
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
        build(
            image.root_nid(),
            digest,
            entries?,
            &MphfParams::default(),
            threads,
        )
    })
}

/// Every entry but `.` and `..`, each directory's own entry before those
/// inside it.
pub(super) fn image_entries<'a>(image: &Image<'a>) -> Result<Vec<BuildEntry<'a>>, BuildError> {
    let root = image.root_nid();
    let mut pending = vec![root];
    let mut seen = std::collections::HashSet::from([root]);
    let mut out = Vec::new();
    while let Some(nid) = pending.pop() {
        let dir = image.inode(nid)?;
        for entry in image.entries(&dir)? {
            if entry.name == b"." || entry.name == b".." {
                continue;
            }
            let is_dir = entry.kind() == Some(Kind::Directory);
            if is_dir {
                if !seen.insert(entry.nid) {
                    return Err(BuildError::NotATree(format!(
                        "directory {} reached twice",
                        entry.nid
                    )));
                }
                pending.push(entry.nid);
            }
            out.push(BuildEntry {
                parent: nid,
                name: entry.name,
                child: entry.nid,
                is_dir,
            });
        }
    }
    Ok(out)
}

/// Builds a table from `entries`: every entry of a tree under `root_nid`,
/// in any order where a directory's own entry comes before the entries
/// inside it. The output depends only on the set of entries (not their
/// order, nor `threads`).
pub fn build<'a>(
    root_nid: u64,
    image_digest: [u8; 32],
    entries: impl IntoIterator<Item = BuildEntry<'a>>,
    params: &MphfParams,
    threads: usize,
) -> Result<Vec<u8>, BuildError> {
    let entries: Vec<BuildEntry<'a>> = entries.into_iter().collect();
    if entries.len() > MAX_ENTRIES as usize {
        return Err(BuildError::TooLarge("entries"));
    }
    let names_len = check_names(&entries)?;
    let parents = parent_entries(&entries, root_nid)?;
    let mut last = MphfError::TooManyKeys(entries.len());
    for seed in 0..SEEDS {
        let built = Built::new(seed, &entries, &parents, params, threads);
        match built {
            Ok(built) => {
                return Ok(built.to_bytes(
                    root_nid,
                    image_digest,
                    &entries,
                    &parents,
                    names_len,
                    threads,
                ))
            }
            Err(MphfError::DuplicateHash(hash)) => {
                check_duplicate(seed, &entries, hash)?;
                last = MphfError::DuplicateHash(hash);
            }
            Err(e) => last = e,
        }
    }
    Err(BuildError::NoSeed(last))
}

/// The names area's size: names of 1 to 255 bytes, not `.` or `..`.
fn check_names(entries: &[BuildEntry<'_>]) -> Result<u32, BuildError> {
    let mut total = 0u64;
    for e in entries {
        if e.name.is_empty() || e.name.len() > 255 || e.name == b"." || e.name == b".." {
            return Err(BuildError::NotATree(format!(
                "entry name {:?}",
                String::from_utf8_lossy(e.name)
            )));
        }
        total += 1 + e.name.len() as u64;
    }
    u32::try_from(total).map_err(|_| BuildError::TooLarge("names"))
}

/// For each entry, the index of its directory's own entry ([`NO_PARENT`]
/// in the root), which must come before it.
fn parent_entries(entries: &[BuildEntry<'_>], root_nid: u64) -> Result<Vec<u32>, BuildError> {
    let mut dirs =
        std::collections::HashMap::with_capacity(entries.iter().filter(|e| e.is_dir).count());
    let mut parents = Vec::with_capacity(entries.len());
    // A directory's entries usually come together: the last one's parent
    // is asked of the map once.
    let mut last = None;
    for (i, e) in entries.iter().enumerate() {
        let parent = match last {
            Some((nid, index)) if nid == e.parent => index,
            _ if e.parent == root_nid => NO_PARENT,
            _ => *dirs.get(&e.parent).ok_or_else(|| {
                BuildError::NotATree(format!("entry {i}: directory {} not seen", e.parent))
            })?,
        };
        last = Some((e.parent, parent));
        parents.push(parent);
        if e.is_dir && (e.child == root_nid || dirs.insert(e.child, i as u32).is_some()) {
            return Err(BuildError::NotATree(format!(
                "directory {} named twice",
                e.child
            )));
        }
    }
    Ok(parents)
}

/// A duplicate hash is either two equal keys (an error) or a collision
/// (the next seed will do).
fn check_duplicate(seed: u64, entries: &[BuildEntry<'_>], hash: u64) -> Result<(), BuildError> {
    let mut same = entries
        .iter()
        .filter(|e| mphf::entry_hash(seed, e.parent, e.name) == hash);
    if let (Some(a), Some(b)) = (same.next(), same.next()) {
        if (a.parent, a.name) == (b.parent, b.name) {
            return Err(BuildError::DuplicateEntry {
                parent: a.parent,
                name: String::from_utf8_lossy(a.name).into_owned(),
            });
        }
    }
    Ok(())
}

/// Both functions for one seed, and where each entry goes.
struct Built {
    seed: u64,
    entry_fn: BuiltMphf,
    path_fn: BuiltMphf,
    /// The record index of each entry (input order).
    record_of: Vec<u32>,
    /// The path index of each entry (input order).
    path_of: Vec<u32>,
}

impl Built {
    fn new(
        seed: u64,
        entries: &[BuildEntry<'_>],
        parents: &[u32],
        params: &MphfParams,
        threads: usize,
    ) -> Result<Built, MphfError> {
        // Entry hashes in chunks on other threads while this one derives
        // each path's hash from its parent's (parents come first).
        let (entry_hashes, path_hashes) = std::thread::scope(|scope| {
            let chunk = entries.len().div_ceil(threads.max(1)).max(1 << 14);
            let handles: Vec<_> = entries
                .chunks(chunk)
                .map(|chunk| {
                    scope.spawn(move || {
                        chunk
                            .iter()
                            .map(|e| mphf::entry_hash(seed, e.parent, e.name))
                            .collect::<Vec<u64>>()
                    })
                })
                .collect();
            let mut path_hashes: Vec<u64> = Vec::with_capacity(entries.len());
            for (e, &parent) in entries.iter().zip(parents) {
                let above = match parent {
                    NO_PARENT => mphf::path_root(seed),
                    p => path_hashes[p as usize],
                };
                path_hashes.push(mphf::key_hash(above, e.name));
            }
            let mut entry_hashes = Vec::with_capacity(entries.len());
            for handle in handles {
                entry_hashes.extend(
                    handle
                        .join()
                        .unwrap_or_else(|e| std::panic::resume_unwind(e)),
                );
            }
            (entry_hashes, path_hashes)
        });
        let entry_fn = mphf::build(&entry_hashes, params, threads)?;
        let path_fn = mphf::build(&path_hashes, params, threads)?;
        // Where each key went, in chunks on up to `threads` threads.
        let indexes = |built: &BuiltMphf, hashes: &[u64]| -> Result<Vec<u32>, MphfError> {
            let view = built.view();
            let chunk = hashes.len().div_ceil(threads.max(1)).max(1 << 14);
            std::thread::scope(|scope| {
                let handles: Vec<_> = hashes
                    .chunks(chunk)
                    .map(|chunk| {
                        scope.spawn(move || {
                            chunk
                                .iter()
                                .map(|&h| view.index(h).ok_or(MphfError::NoPilots(0)))
                                .collect::<Result<Vec<u32>, MphfError>>()
                        })
                    })
                    .collect();
                let mut out = Vec::with_capacity(hashes.len());
                for handle in handles {
                    out.extend(
                        handle
                            .join()
                            .unwrap_or_else(|e| std::panic::resume_unwind(e))?,
                    );
                }
                Ok(out)
            })
        };
        Ok(Built {
            seed,
            record_of: indexes(&entry_fn, &entry_hashes)?,
            path_of: indexes(&path_fn, &path_hashes)?,
            entry_fn,
            path_fn,
        })
    }

    fn to_bytes(
        &self,
        root_nid: u64,
        image_digest: [u8; 32],
        entries: &[BuildEntry<'_>],
        parents: &[u32],
        names_len: u32,
        threads: usize,
    ) -> Vec<u8> {
        let n = entries.len();
        let mphf_bytes = |built: &BuiltMphf| {
            built.slot_starts.as_bytes().len() + built.pilots.len() + built.remap.as_bytes().len()
        };
        let header_len = size_of::<LookupHeader>();
        let records_at = header_len + mphf_bytes(&self.entry_fn) + mphf_bytes(&self.path_fn);
        let path_order_at = records_at + n * size_of::<EntryRecord>();
        let names_at = path_order_at + n * size_of::<U32>();
        // Every byte is written once, in place.
        let mut out = vec![0u8; names_at + names_len as usize];
        let (head, rest) = out.split_at_mut(records_at);
        let (records, rest) = rest.split_at_mut(path_order_at - records_at);
        let (path_order, names) = rest.split_at_mut(names_at - path_order_at);
        let mut at = header_len;
        for built in [&self.entry_fn, &self.path_fn] {
            for part in [
                built.slot_starts.as_bytes(),
                &built.pilots,
                built.remap.as_bytes(),
            ] {
                head[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            }
        }
        let records = <[EntryRecord]>::mut_from_bytes(records).expect("sized for n records");
        let path_order = <[U32]>::mut_from_bytes(path_order).expect("sized for n indexes");
        self.write_records(entries, parents, records, names, threads);
        for (&path, &record) in self.path_of.iter().zip(&self.record_of) {
            path_order[path as usize] = U32::new(record);
        }
        let header = LookupHeader {
            magic: LOOKUP_MAGIC,
            version: LOOKUP_VERSION.into(),
            flags: 0.into(),
            seed: self.seed.into(),
            root_nid: root_nid.into(),
            entry_count: (n as u32).into(),
            names_len: names_len.into(),
            entry_mphf: mphf_header(&self.entry_fn),
            path_mphf: mphf_header(&self.path_fn),
            image_digest,
            table_digest: [0; 32],
        };
        out[..header_len].copy_from_slice(header.as_bytes());
        let digest = sha256(&[&out[..DIGESTED_HEADER], &out[header_len..]]);
        out[DIGESTED_HEADER..header_len].copy_from_slice(&digest);
        out
    }

    /// Writes every record and its name in place, block by block of
    /// records, on up to `threads` threads.
    // Over 100 lines: one counting sort, its block tables read by the threaded write below.
    fn write_records(
        &self,
        entries: &[BuildEntry<'_>],
        parents: &[u32],
        records: &mut [EntryRecord],
        names: &mut [u8],
        threads: usize,
    ) {
        let n = entries.len();
        // Names are in record order. A record's place is random: writing
        // each entry straight to it would touch a random page of a table
        // that may be hundreds of MB. So the entries are first copied, in
        // their order, into groups by block of records (a counting sort),
        // and each block is then written with its records and names in
        // cache.
        const BLOCK_SHIFT: u32 = 14;
        let blocks = n.div_ceil(1 << BLOCK_SHIFT);
        let mut block_starts = vec![0usize; blocks + 1];
        let mut block_names = vec![0u32; blocks + 1];
        for (e, &record) in entries.iter().zip(&self.record_of) {
            let block = (record >> BLOCK_SHIFT) as usize;
            block_starts[block + 1] += 1;
            block_names[block + 1] += 1 + e.name.len() as u32;
        }
        for i in 1..=blocks {
            block_starts[i] += block_starts[i - 1];
            block_names[i] += block_names[i - 1];
        }
        let mut staged = vec![
            (
                0u32,
                <EntryRecord as zerocopy::FromZeros>::new_zeroed(),
                &b""[..]
            );
            n
        ];
        let mut next = block_starts.clone();
        for ((e, &record), &parent) in entries.iter().zip(&self.record_of).zip(parents) {
            let block = (record >> BLOCK_SHIFT) as usize;
            let parent_record = match parent {
                NO_PARENT => NO_PARENT,
                p => self.record_of[p as usize],
            };
            staged[next[block]] = (
                record,
                EntryRecord {
                    parent_nid: e.parent.into(),
                    child_nid: e.child.into(),
                    name_offset: 0.into(),
                    parent_record: parent_record.into(),
                },
                e.name,
            );
            next[block] += 1;
        }
        drop(next);
        // Threads take contiguous runs of blocks (and their records and
        // names).
        let threads = threads.clamp(1, blocks.div_ceil(4).max(1));
        let per_thread = blocks.div_ceil(threads).max(1);
        let mut jobs = Vec::with_capacity(threads);
        let (mut records, mut names) = (records, names);
        for first in (0..blocks).step_by(per_thread) {
            let end = (first + per_thread).min(blocks);
            let record_count = (end << BLOCK_SHIFT).min(n) - (first << BLOCK_SHIFT);
            let name_bytes = (block_names[end] - block_names[first]) as usize;
            let (these, rest) = records.split_at_mut(record_count);
            let (these_names, rest_names) = names.split_at_mut(name_bytes);
            jobs.push((first..end, these, these_names));
            records = rest;
            names = rest_names;
        }
        let write =
            |(blocks, records, names): (std::ops::Range<usize>, &mut [EntryRecord], &mut [u8])| {
                let first_record = (blocks.start << BLOCK_SHIFT) as u32;
                let first_name = block_names[blocks.start];
                let mut name_offsets = vec![0u32; 1 << BLOCK_SHIFT];
                for block in blocks {
                    let base = (block << BLOCK_SHIFT) as u32;
                    let members = &staged[block_starts[block]..block_starts[block + 1]];
                    let offsets = &mut name_offsets[..members.len()];
                    for (record, _, name) in members {
                        offsets[(record - base) as usize] = 1 + name.len() as u32;
                    }
                    let mut at = block_names[block];
                    for offset in offsets.iter_mut() {
                        let len = *offset;
                        *offset = at;
                        at += len;
                    }
                    for &(record, mut entry, name) in members {
                        let name_at = offsets[(record - base) as usize];
                        entry.name_offset = name_at.into();
                        records[(record - first_record) as usize] = entry;
                        let at = (name_at - first_name) as usize;
                        names[at] = name.len() as u8;
                        names[at + 1..at + 1 + name.len()].copy_from_slice(name);
                    }
                }
            };
        if jobs.len() <= 1 {
            jobs.into_iter().for_each(write);
        } else {
            std::thread::scope(|scope| {
                let mut jobs = jobs.into_iter();
                let mine = jobs.next();
                let handles: Vec<_> = jobs.map(|job| scope.spawn(move || write(job))).collect();
                mine.into_iter().for_each(write);
                for handle in handles {
                    handle
                        .join()
                        .unwrap_or_else(|e| std::panic::resume_unwind(e));
                }
            });
        }
        drop(staged);
    }
}

fn mphf_header(built: &BuiltMphf) -> MphfHeader {
    MphfHeader {
        part_count: (built.slot_starts.len().saturating_sub(1) as u32).into(),
        buckets_per_part: built.buckets_per_part.into(),
        slot_count: built.slot_starts.last().map_or(0, |s| s.get()).into(),
    }
}
