//! Boot pages: the exact 4 KiB pages of the cache files that a recorded
//! start read, in the order it read them, packed into one blob.
//!
//! A boot set at chunk granularity fetches whole chunks (256 KiB) for every
//! page touched; python3's start touches ~1,000 scattered pages (4.1 MB) but
//! ~50 chunks (9.5 MB). Boot pages carry only the touched pages, compressed
//! as one stream (so small pieces still compress well), fetched with one
//! request at mount. The blob is verified as a whole against its OCI digest,
//! like the chunk index, so its pages may fill the cache before any chunk
//! digest can be checked.
//!
//! ```text
//! BootHeader  (16 bytes)
//! BootExtent  x extent_count  (16 bytes each)
//! BootTable   x table_count   (16 bytes each)
//! page data   (4096 x the sum of extent pages, in extent order)
//! table data  (the tables' bytes, in table order)
//! ```
//! All integers little-endian. The blob in the registry is this, zstd-compressed.
//!
//! With a paged chunk index (docs/format.md), boot pages also carry the
//! chunk tables of the blobs their pages are in, so that the pages can be
//! accounted to chunks without a request per blob; each table goes in the
//! segment with its blob's first pages. Boot pages written before tables
//! have `table_count` 0 (the field was reserved, zero).
//!
//! The first segment also carries the boot pages' *directory*: every extent
//! of every segment, as a record of [`BOOT_RECORD_DIRECTORY`] kind among
//! the tables (its bytes: `BootExtent`s). A worker thus knows, once the
//! first frame is in, which pages the later frames bring: a read of a page
//! that none brings is fetched at once instead of waiting for them all
//! (Node.js at 100 Mbit/s waited 0.27-0.33 s so in 2 of 3 starts). Boot
//! pages written before the directory have none; their readers wait.
//!
//! An image carries its boot pages as several such blobs, *segments*, each
//! a complete boot-pages blob of its own (its own extents and tables), in
//! read order: see [`BootPages::segments`]. Each segment is one zstd frame
//! of the boot-pages layer, with its own digest in the layer's frame list
//! (an annotation, see docs/format.md), so a worker fetches the frames as
//! ranges, several in flight in read order, and applies each as soon as
//! it is verified: a start reads its first pages while the later ones are
//! still on the wire, and a read waits only for the frame of its pages.
//! Older images carry segments as layers of their own (one frame each).

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// `BootHeader::magic`.
pub const BOOT_MAGIC: [u8; 8] = *b"LAMBOOT\x01";
/// The page size boot extents are counted in.
pub const BOOT_PAGE: u64 = 4096;
/// Pages in the first boot segment (256 KiB: python3's start reads ~1,000
/// pages, so its first segment is a few milliseconds on a 100 Mbit/s link).
pub const FIRST_SEGMENT_PAGES: u64 = 64;
/// Pages in each later segment (512 KiB: at 100 Mbit/s with four in
/// flight, one lands every ~40 ms; smaller ones compress worse).
pub const SEGMENT_PAGES: u64 = 128;
/// `BootTable::kind` of a blob's chunk table.
pub const BOOT_RECORD_TABLE: u32 = 0;
/// `BootTable::kind` of the directory (`blob` 0): `len` bytes of
/// [`BootExtent`]s, every extent of the boot pages in all segments.
pub const BOOT_RECORD_DIRECTORY: u32 = 1;

/// Start of a boot-pages blob.
#[derive(Debug, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct BootHeader {
    /// [`BOOT_MAGIC`].
    pub magic: [u8; 8],
    /// Number of [`BootExtent`] records.
    pub extent_count: U32,
    /// Number of [`BootTable`] records.
    pub table_count: U32,
}

/// A record carried after the pages: a blob's chunk table, or the
/// directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct BootTable {
    /// Data blob (device order, 0-based); 0 for the directory.
    pub blob: U32,
    /// [`BOOT_RECORD_TABLE`] or [`BOOT_RECORD_DIRECTORY`] (this field was
    /// reserved, zero, before the directory).
    pub kind: U32,
    /// Length in bytes (a chunk table: the blob's table length in the
    /// index; the directory: 16 per extent).
    pub len: U64,
}

/// A run of pages of one cache file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct BootExtent {
    /// Byte offset in the cache file, a multiple of [`BOOT_PAGE`].
    pub cache_offset: U64,
    /// Data blob (device order, 0-based).
    pub blob: U32,
    /// Length in pages.
    pub pages: U32,
}

const _: () = assert!(size_of::<BootHeader>() == 16);
const _: () = assert!(size_of::<BootExtent>() == 16);
const _: () = assert!(size_of::<BootTable>() == 16);

/// Why boot pages were refused.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// Too short for what it claims.
    #[error("boot pages truncated")]
    Truncated,
    /// Not boot pages.
    #[error("not lamina boot pages (bad magic)")]
    BadMagic,
    /// Extents outside their cache file, overlapping, or misaligned.
    #[error("boot pages inconsistent: {0}")]
    Inconsistent(String),
}

/// Parsed boot pages: extents and the data they carry.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BootPages {
    /// Extents, in the order the recorded start read them.
    pub extents: Vec<BootExtent>,
    /// Their pages, concatenated in extent order.
    pub data: Vec<u8>,
    /// Chunk tables carried (paged index): (blob, the table's bytes).
    pub tables: Vec<(u32, Vec<u8>)>,
    /// The first segment's directory: every extent of all segments (empty
    /// in the others, and in boot pages written before it).
    pub directory: Vec<BootExtent>,
}

impl BootPages {
    /// Appends page `page` (of [`BOOT_PAGE`] bytes, `data`) of blob `blob`:
    /// to the last extent when it is the page after it, else as a new one.
    pub fn push_page(&mut self, blob: u32, page: u64, data: &[u8]) {
        let at = page * BOOT_PAGE;
        match self.extents.last_mut() {
            Some(last)
                if last.blob.get() == blob
                    && last.cache_offset.get() + u64::from(last.pages.get()) * BOOT_PAGE == at =>
            {
                last.pages += 1;
            }
            _ => self.extents.push(BootExtent {
                cache_offset: at.into(),
                blob: blob.into(),
                pages: 1.into(),
            }),
        }
        self.data.extend_from_slice(data);
    }

    /// Serialises.
    pub fn to_bytes(&self) -> Vec<u8> {
        let directory: Vec<u8> = self.directory.as_bytes().to_vec();
        let mut records: Vec<(BootTable, &[u8])> = self
            .tables
            .iter()
            .map(|(blob, table)| (record(*blob, BOOT_RECORD_TABLE, table), &table[..]))
            .collect();
        if !directory.is_empty() {
            records.push((record(0, BOOT_RECORD_DIRECTORY, &directory), &directory[..]));
        }
        let header = BootHeader {
            magic: BOOT_MAGIC,
            extent_count: (self.extents.len() as u32).into(),
            table_count: (records.len() as u32).into(),
        };
        let mut out = header.as_bytes().to_vec();
        out.extend_from_slice(self.extents.as_bytes());
        for (r, _) in &records {
            out.extend_from_slice(r.as_bytes());
        }
        out.extend_from_slice(&self.data);
        for (_, bytes) in &records {
            out.extend_from_slice(bytes);
        }
        out
    }

    /// Parses and checks against the image's blobs, given as their cache
    /// file sizes and chunk table lengths (0: none, a version 1 index):
    /// every extent aligned, inside its cache file, not overlapping another;
    /// each table for a blob that has one, once, of its length.
    pub fn from_bytes(
        bytes: &[u8],
        cache_sizes: &[u64],
        table_lens: &[u64],
    ) -> Result<BootPages, BootError> {
        let (header, rest) =
            BootHeader::read_from_prefix(bytes).map_err(|_| BootError::Truncated)?;
        if header.magic != BOOT_MAGIC {
            return Err(BootError::BadMagic);
        }
        // The extent and table records must fit in the input before they
        // are allocated.
        let count = header.extent_count.get() as usize;
        let table = count
            .checked_mul(size_of::<BootExtent>())
            .filter(|&n| n <= rest.len())
            .ok_or(BootError::Truncated)?;
        let (table, rest) = rest.split_at(table);
        let (records, data) = split_table_records(rest, header.table_count.get(), table_lens)?;
        let extents = read_extents(table)?;
        let total = check_extents(&extents, cache_sizes)?;
        let bad = |m: String| Err(BootError::Inconsistent(m));
        let table_bytes = records
            .iter()
            .try_fold(0u64, |sum, r| sum.checked_add(r.len.get()))
            .ok_or_else(|| BootError::Inconsistent("records overflow".into()))?;
        if total.checked_add(table_bytes) != Some(data.len() as u64) {
            return bad(format!(
                "extents cover {total} bytes and tables {table_bytes}, data has {}",
                data.len()
            ));
        }
        let (data, mut table_data) = data.split_at(total as usize);
        let mut tables = Vec::with_capacity(records.len());
        let mut directory = Vec::new();
        for r in &records {
            let (bytes, rest) = table_data.split_at(r.len.get() as usize);
            match r.kind.get() {
                BOOT_RECORD_DIRECTORY => {
                    directory = read_extents(bytes)?;
                    check_extents(&directory, cache_sizes)?;
                }
                _ => tables.push((r.blob.get(), bytes.to_vec())),
            }
            table_data = rest;
        }
        Ok(BootPages {
            extents,
            data: data.to_vec(),
            tables,
            directory,
        })
    }

    /// Splits into segments in read order: the first holds up to
    /// [`FIRST_SEGMENT_PAGES`] pages, each next one up to [`SEGMENT_PAGES`].
    /// The first pages a start reads thus arrive in a small frame of their
    /// own, and every later page with few others. An extent that does not
    /// fit is cut at a page.
    pub fn segments(&self) -> Vec<BootPages> {
        let page = BOOT_PAGE as usize;
        let mut out = Vec::new();
        let mut cap = FIRST_SEGMENT_PAGES;
        let mut current = BootPages::default();
        let mut room = cap;
        for (extent, mut bytes) in self.iter() {
            let mut offset = extent.cache_offset.get();
            while !bytes.is_empty() {
                let pages = (bytes.len() / page).min(room as usize);
                let (head, tail) = bytes.split_at(pages * page);
                current.extents.push(BootExtent {
                    cache_offset: offset.into(),
                    blob: extent.blob,
                    pages: (pages as u32).into(),
                });
                current.data.extend_from_slice(head);
                offset += head.len() as u64;
                bytes = tail;
                room -= pages as u64;
                if room == 0 {
                    out.push(std::mem::take(&mut current));
                    cap = SEGMENT_PAGES;
                    room = cap;
                }
            }
        }
        if !current.extents.is_empty() {
            out.push(current);
        }
        // Each table with its blob's first pages (else in the first segment).
        for (blob, table) in &self.tables {
            let at = out
                .iter()
                .position(|s| s.extents.iter().any(|e| e.blob.get() == *blob))
                .unwrap_or(0);
            if let Some(segment) = out.get_mut(at) {
                segment.tables.push((*blob, table.clone()));
            }
        }
        // What every segment brings, known from the first.
        if out.len() > 1 {
            out[0].directory = self.extents.clone();
        }
        out
    }

    /// Each extent with its bytes.
    pub fn iter(&self) -> impl Iterator<Item = (&BootExtent, &[u8])> {
        let mut at = 0usize;
        self.extents.iter().map(move |e| {
            let len = e.pages.get() as usize * BOOT_PAGE as usize;
            let bytes = &self.data[at..at + len];
            at += len;
            (e, bytes)
        })
    }
}

/// A record's header for `bytes`.
fn record(blob: u32, kind: u32, bytes: &[u8]) -> BootTable {
    BootTable {
        blob: blob.into(),
        kind: kind.into(),
        len: (bytes.len() as u64).into(),
    }
}

/// `BootExtent` records (the input's length a multiple of theirs).
fn read_extents(raw: &[u8]) -> Result<Vec<BootExtent>, BootError> {
    if !raw.len().is_multiple_of(size_of::<BootExtent>()) {
        return Err(BootError::Inconsistent("a partial extent record".into()));
    }
    raw.chunks_exact(size_of::<BootExtent>())
        .map(|raw| BootExtent::read_from_bytes(raw).map_err(|_| BootError::Truncated))
        .collect()
}

/// Every extent aligned, inside its cache file and apart from the others;
/// returns their bytes in all.
fn check_extents(extents: &[BootExtent], cache_sizes: &[u64]) -> Result<u64, BootError> {
    let bad = |m: String| Err(BootError::Inconsistent(m));
    let mut total = 0u64;
    let mut ranges: Vec<(u32, u64, u64)> = Vec::with_capacity(extents.len());
    for e in extents {
        let (blob, start, pages) = (e.blob.get(), e.cache_offset.get(), u64::from(e.pages.get()));
        let Some(&size) = cache_sizes.get(blob as usize) else {
            return bad(format!("extent names blob {blob} of {}", cache_sizes.len()));
        };
        let len = pages.checked_mul(BOOT_PAGE);
        let end = len.and_then(|len| start.checked_add(len));
        let (Some(len), Some(end)) = (len, end) else {
            return bad(format!("extent of {pages} pages at {start} overflows"));
        };
        if pages == 0 || !start.is_multiple_of(BOOT_PAGE) || end > size {
            return bad(format!(
                "extent of {pages} pages at {start} in blob {blob} (cache size {size})"
            ));
        }
        // Extents may still overlap here (checked below), so their sum is
        // not yet bounded by the cache sizes.
        total = total
            .checked_add(len)
            .ok_or_else(|| BootError::Inconsistent("extents overflow".into()))?;
        ranges.push((blob, start, end));
    }
    ranges.sort_unstable();
    if ranges
        .windows(2)
        .any(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2)
    {
        return bad("overlapping extents".into());
    }
    Ok(total)
}

/// Reads `count` records from the front of `rest`: a chunk table for a
/// blob with one (`table_lens`, by blob), once, of that table's length; at
/// most one directory, last. Returns them and the bytes after them.
fn split_table_records<'a>(
    rest: &'a [u8],
    count: u32,
    table_lens: &[u64],
) -> Result<(Vec<BootTable>, &'a [u8]), BootError> {
    // At most one table per blob and one directory: bounded before
    // anything is allocated.
    if count as usize > table_lens.len() + 1 {
        return Err(BootError::Inconsistent(format!(
            "{count} records for {} blobs",
            table_lens.len()
        )));
    }
    let len = count as usize * size_of::<BootTable>();
    if len > rest.len() {
        return Err(BootError::Truncated);
    }
    let (raw, rest) = rest.split_at(len);
    let mut seen = vec![false; table_lens.len()];
    let mut directory = false;
    let mut records = Vec::with_capacity(count as usize);
    let last = count as usize;
    for (n, raw) in raw.chunks_exact(size_of::<BootTable>()).enumerate() {
        let r = BootTable::read_from_bytes(raw).map_err(|_| BootError::Truncated)?;
        let blob = r.blob.get() as usize;
        match r.kind.get() {
            // One form only (the last record, not empty), as written: what
            // parses writes back to the same bytes. Its length is bounded
            // by the input, which must hold it.
            BOOT_RECORD_DIRECTORY
                if !directory
                    && blob == 0
                    && n + 1 == last
                    && (1..=rest.len() as u64).contains(&r.len.get()) =>
            {
                directory = true
            }
            BOOT_RECORD_DIRECTORY => {
                return Err(BootError::Inconsistent(
                    "a directory not last, empty or a second".into(),
                ));
            }
            BOOT_RECORD_TABLE => {
                let want = table_lens.get(blob).copied().unwrap_or(0);
                if want == 0 || r.len.get() != want || seen[blob] {
                    return Err(BootError::Inconsistent(format!(
                        "chunk table of blob {blob}: {} bytes, the index says {want}",
                        r.len.get()
                    )));
                }
                seen[blob] = true;
            }
            kind => return Err(BootError::Inconsistent(format!("record kind {kind}"))),
        }
        records.push(r);
    }
    Ok((records, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extent(blob: u32, page: u64, pages: u32) -> BootExtent {
        BootExtent {
            cache_offset: (page * BOOT_PAGE).into(),
            blob: blob.into(),
            pages: pages.into(),
        }
    }

    #[test]
    fn round_trip_and_iteration() {
        let boot = BootPages {
            extents: vec![extent(1, 3, 2), extent(0, 0, 1)],
            data: (0..3 * BOOT_PAGE as usize)
                .map(|i| (i / 4096) as u8)
                .collect(),
            tables: Vec::new(),
            directory: Vec::new(),
        };
        let bytes = boot.to_bytes();
        let back = BootPages::from_bytes(&bytes, &[4096, 5 * 4096], &[]).unwrap();
        assert_eq!(back, boot);
        let parts: Vec<(u32, u8, usize)> = back
            .iter()
            .map(|(e, b)| (e.blob.get(), b[0], b.len()))
            .collect();
        assert_eq!(parts, vec![(1, 0, 8192), (0, 2, 4096)]);
    }

    /// Every page with its place: (blob, cache offset, bytes), in order.
    fn pages_of(boot: &BootPages) -> Vec<(u32, u64, &[u8])> {
        boot.iter()
            .flat_map(|(e, bytes)| {
                bytes
                    .chunks_exact(BOOT_PAGE as usize)
                    .enumerate()
                    .map(move |(k, page)| {
                        (
                            e.blob.get(),
                            e.cache_offset.get() + k as u64 * BOOT_PAGE,
                            page,
                        )
                    })
            })
            .collect()
    }

    #[test]
    fn segments_keep_every_page_in_read_order() {
        // 400 pages in three extents, read out of blob order.
        let extents = vec![extent(1, 400, 50), extent(0, 0, 30), extent(1, 0, 320)];
        let data: Vec<u8> = (0..400 * BOOT_PAGE as usize)
            .map(|i| (i / 4096 % 251) as u8)
            .collect();
        let boot = BootPages {
            extents,
            data,
            tables: Vec::new(),
            directory: Vec::new(),
        };
        let segments = boot.segments();
        let pages: Vec<u64> = segments
            .iter()
            .map(|s| s.data.len() as u64 / BOOT_PAGE)
            .collect();
        assert_eq!(pages, vec![64, 128, 128, 80]);
        // Concatenated, the segments are the same pages at the same places.
        let flat: Vec<(u32, u64, &[u8])> = segments.iter().flat_map(pages_of).collect();
        assert_eq!(flat, pages_of(&boot));
        // Each segment is valid boot pages on its own.
        for s in &segments {
            BootPages::from_bytes(&s.to_bytes(), &[30 * 4096, 450 * 4096], &[]).unwrap();
        }
        assert!(BootPages::default().segments().is_empty());
    }

    #[test]
    fn bad_boot_pages_are_refused() {
        let ok = BootPages {
            extents: vec![extent(0, 1, 1)],
            data: vec![7; 4096],
            tables: Vec::new(),
            directory: Vec::new(),
        };
        let sizes = [2 * 4096];
        assert!(BootPages::from_bytes(&ok.to_bytes(), &sizes, &[]).is_ok());
        let mut truncated = ok.to_bytes();
        truncated.pop();
        assert!(BootPages::from_bytes(&truncated, &sizes, &[]).is_err());
        assert!(matches!(
            BootPages::from_bytes(&ok.to_bytes()[..10], &sizes, &[]),
            Err(BootError::Truncated)
        ));
        let mut magic = ok.to_bytes();
        magic[0] ^= 1;
        assert!(matches!(
            BootPages::from_bytes(&magic, &sizes, &[]),
            Err(BootError::BadMagic)
        ));
        for extents in [
            vec![extent(0, 2, 1)],                  // past the cache file
            vec![extent(1, 0, 1)],                  // no such blob
            vec![extent(0, 0, 0)],                  // empty
            vec![extent(0, 0, 2), extent(0, 1, 1)], // overlap
        ] {
            let pages: u64 = extents.iter().map(|e| u64::from(e.pages.get())).sum();
            let b = BootPages {
                extents,
                data: vec![0; (pages * BOOT_PAGE) as usize],
                tables: Vec::new(),
                directory: Vec::new(),
            };
            assert!(
                matches!(
                    BootPages::from_bytes(&b.to_bytes(), &sizes, &[]),
                    Err(BootError::Inconsistent(_))
                ),
                "{b:?}"
            );
        }
        let mut misaligned = ok.clone();
        misaligned.extents[0].cache_offset = 100.into();
        assert!(BootPages::from_bytes(&misaligned.to_bytes(), &[1 << 20], &[]).is_err());
    }

    /// Hostile counts and sizes: an extent table larger than the input is
    /// refused before it is allocated; extents whose end or total would
    /// overflow are refused, not wrapped.
    #[test]
    fn hostile_sizes_are_refused() {
        let mut huge = BootHeader {
            magic: BOOT_MAGIC,
            extent_count: u32::MAX.into(),
            table_count: 0.into(),
        }
        .as_bytes()
        .to_vec();
        huge.extend_from_slice(&[0; 64]);
        assert!(matches!(
            BootPages::from_bytes(&huge, &[u64::MAX], &[]),
            Err(BootError::Truncated)
        ));
        let near_end = u64::MAX - u64::MAX % BOOT_PAGE - BOOT_PAGE;
        let b = BootPages {
            extents: vec![BootExtent {
                cache_offset: near_end.into(),
                blob: 0.into(),
                pages: u32::MAX.into(),
            }],
            data: Vec::new(),
            tables: Vec::new(),
            directory: Vec::new(),
        };
        assert!(matches!(
            BootPages::from_bytes(&b.to_bytes(), &[u64::MAX], &[]),
            Err(BootError::Inconsistent(_))
        ));
        // A directory record claiming 2^64-1 bytes: refused, not summed.
        let mut claim = BootPages::default().to_bytes();
        claim[12] = 1;
        claim.extend_from_slice(
            BootTable {
                blob: 0.into(),
                kind: BOOT_RECORD_DIRECTORY.into(),
                len: u64::MAX.into(),
            }
            .as_bytes(),
        );
        claim.extend_from_slice(&[0; 64]);
        assert!(matches!(
            BootPages::from_bytes(&claim, &[u64::MAX], &[]),
            Err(BootError::Inconsistent(_))
        ));
        // Overlapping extents of 2^32-1 pages each: their sum passes 2^64.
        let b = BootPages {
            extents: vec![extent(0, 0, u32::MAX); (1 << 20) + 1],
            data: Vec::new(),
            tables: Vec::new(),
            directory: Vec::new(),
        };
        assert!(matches!(
            BootPages::from_bytes(&b.to_bytes(), &[u64::MAX], &[]),
            Err(BootError::Inconsistent(_))
        ));
    }

    /// Chunk tables (paged index) travel after the pages, each in the
    /// segment with its blob's first pages, and are refused unless the
    /// index gives that blob a table of that length, once.
    #[test]
    fn chunk_tables_ride_with_their_blobs_first_pages() {
        let mut extents = vec![extent(0, 0, 64)];
        extents.push(extent(1, 0, 10)); // blob 1 starts in segment 1
        let boot = BootPages {
            extents,
            data: vec![5; 74 * BOOT_PAGE as usize],
            tables: vec![(1, vec![1; 128]), (0, vec![9; 64])],
            directory: Vec::new(),
        };
        let (sizes, lens) = ([64 * 4096, 10 * 4096], [64, 128]);
        let back = BootPages::from_bytes(&boot.to_bytes(), &sizes, &lens).unwrap();
        assert_eq!(back, boot);
        let segments = boot.segments();
        assert_eq!(segments.len(), 2);
        assert_eq!(segments[0].tables, vec![(0, vec![9; 64])]);
        assert_eq!(segments[1].tables, vec![(1, vec![1; 128])]);
        for s in &segments {
            assert_eq!(
                BootPages::from_bytes(&s.to_bytes(), &sizes, &lens).unwrap(),
                *s
            );
        }
        for (tables, lens) in [
            (vec![(0, vec![9; 64])], [0, 128]),  // blob 0 has no table
            (vec![(0, vec![9; 63])], [64, 128]), // wrong length
            (vec![(0, vec![9; 64]), (0, vec![9; 64])], [64, 128]), // twice
            (vec![(2, vec![9; 64])], [64, 128]), // no such blob
        ] {
            let b = BootPages {
                tables,
                ..boot.clone()
            };
            assert!(
                BootPages::from_bytes(&b.to_bytes(), &sizes, &lens).is_err(),
                "{:?}",
                b.tables
                    .iter()
                    .map(|t| (t.0, t.1.len()))
                    .collect::<Vec<_>>()
            );
        }
        let mut cut = boot.to_bytes();
        cut.pop();
        assert!(BootPages::from_bytes(&cut, &sizes, &lens).is_err());
    }

    /// The first segment lists every extent of all segments, so a reader
    /// knows from it which pages the others bring; a directory that names
    /// pages outside the cache files, a second one or an unknown record
    /// is refused.
    #[test]
    fn the_first_segment_knows_what_the_others_bring() {
        let extents = vec![extent(1, 400, 50), extent(0, 0, 30), extent(1, 0, 120)];
        let boot = BootPages {
            extents: extents.clone(),
            data: vec![3; 200 * BOOT_PAGE as usize],
            ..BootPages::default()
        };
        let sizes = [30 * 4096, 450 * 4096];
        let segments = boot.segments();
        assert_eq!(segments.len(), 3);
        assert_eq!(segments[0].directory, extents);
        assert!(segments[1..].iter().all(|s| s.directory.is_empty()));
        let first = BootPages::from_bytes(&segments[0].to_bytes(), &sizes, &[]).unwrap();
        assert_eq!(first, segments[0]);
        // One segment alone needs no directory.
        let small = BootPages {
            extents: vec![extent(0, 0, 30)],
            data: vec![3; 30 * BOOT_PAGE as usize],
            ..BootPages::default()
        };
        assert!(small.segments()[0].directory.is_empty());
        for directory in [
            vec![extent(0, 30, 1)],                 // past the cache file
            vec![extent(2, 0, 1)],                  // no such blob
            vec![extent(1, 0, 2), extent(1, 1, 1)], // overlap
        ] {
            let b = BootPages {
                directory,
                ..segments[0].clone()
            };
            assert!(
                BootPages::from_bytes(&b.to_bytes(), &sizes, &[]).is_err(),
                "{:?}",
                b.directory
            );
        }
        let bytes = segments[0].to_bytes();
        let records = 16 + 16 * segments[0].extents.len();
        // The directory's record, made a second one: a third record.
        let mut twice = bytes.clone();
        twice[12] = 2;
        twice.splice(records..records, bytes[records..records + 16].to_vec());
        twice.extend_from_slice(&bytes[bytes.len() - 48..]);
        assert!(BootPages::from_bytes(&twice, &sizes, &[]).is_err());
        // An empty directory would write back as none: refused.
        let mut empty = BootPages {
            extents: Vec::new(),
            data: Vec::new(),
            ..BootPages::default()
        }
        .to_bytes();
        empty[12] = 1;
        empty.extend_from_slice(record(0, BOOT_RECORD_DIRECTORY, &[]).as_bytes());
        assert!(BootPages::from_bytes(&empty, &sizes, &[]).is_err());
        let mut unknown = bytes.clone();
        unknown[records + 4] = 7;
        assert!(matches!(
            BootPages::from_bytes(&unknown, &sizes, &[]),
            Err(BootError::Inconsistent(_))
        ));
    }
}
