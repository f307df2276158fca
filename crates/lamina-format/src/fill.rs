//! The fill record: which chunks of a blob's cache file hold bytes that were
//! verified against their digest and made durable.
//!
//! It is the only thing that lets a process serve cache bytes it did not
//! verify itself. It is written after the cache file was synced, as a whole
//! file replaced by rename (never torn), and it names the cache file it
//! describes by identity: inode number and birth time (nanoseconds). A cache
//! file that was deleted and recreated, or replaced, has another identity,
//! and the record no longer applies to it; a cache file of the wrong size is
//! never trusted either. Nothing else (the file's length, a flag, a process
//! being alive) says that cache bytes may be read.
//!
//! A blob's cache file belongs to a *cache entry*, named by what its chunks
//! are verified against ([`entry_id`]): the blob's digest, the cache file's
//! size and the sha256 of the chunk table the image gives for the blob. The
//! record's `subject` is that id, so a record (and the cache file beside it)
//! serves exactly the images that describe the blob the same way; an image
//! that names the same blob with another chunk table gets an entry of its
//! own, and nothing it writes or records reaches the first one.
//!
//! A file cached whole (a metadata image, chunk index or lookup table) has
//! a record of one chunk, all filled: `subject` is then the SHA-256 of the
//! file's content, `cache_size` its size. It lets a mount use the file
//! without hashing it again.
//!
//! ```text
//! FillHeader  (96 bytes)
//! bitmap      (ceil(chunk_count / 8) bytes: bit i % 8 of byte i / 8 is chunk i)
//! checksum    (32 bytes: sha256 of header and bitmap)
//! ```
//! All integers little-endian. Version 1.

use zerocopy::little_endian::{I64, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// `FillHeader::magic`.
pub const FILL_MAGIC: [u8; 8] = *b"LAMFILL\x01";
/// The only version this code reads and writes.
pub const FILL_VERSION: u32 = 1;
/// Most chunks a record may describe (a 1 TiB blob of 4 KiB chunks): bounds
/// the bitmap before anything is allocated.
pub const MAX_FILL_CHUNKS: u32 = 1 << 28;
const CHECKSUM_LEN: usize = 32;

/// Start of a fill record.
#[derive(Debug, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct FillHeader {
    /// [`FILL_MAGIC`].
    pub magic: [u8; 8],
    /// [`FILL_VERSION`].
    pub version: U32,
    /// Chunks of the blob (bits in the bitmap).
    pub chunk_count: U32,
    /// What the record describes: the cache entry's id ([`entry_id`]), or
    /// the content digest of a file cached whole.
    pub subject: [u8; 32],
    /// Size of the cache file.
    pub cache_size: U64,
    /// Inode number of the cache file.
    pub file_ino: U64,
    /// Birth time of the cache file, seconds since the epoch.
    pub file_btime_sec: I64,
    /// Birth time of the cache file, nanoseconds within the second.
    pub file_btime_nsec: U32,
    /// Zero.
    pub reserved: [u8; 20],
}

const _: () = assert!(size_of::<FillHeader>() == 96);

/// Domain separation for [`entry_id`].
const ENTRY_DOMAIN: &[u8] = b"lamina cache entry v1\0";

/// The id of the cache entry that holds blob `blob_digest` as a chunk table
/// of sha256 `table_digest` lays it out in a cache file of `cache_size`
/// bytes: sha256 over a domain string, the blob digest, the size
/// (little-endian) and the table digest. Two images share an entry exactly
/// when they describe the blob the same way.
pub fn entry_id(blob_digest: &[u8; 32], cache_size: u64, table_digest: &[u8; 32]) -> [u8; 32] {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(ENTRY_DOMAIN);
    ctx.update(blob_digest);
    ctx.update(&cache_size.to_le_bytes());
    ctx.update(table_digest);
    let mut out = [0u8; 32];
    out.copy_from_slice(ctx.finish().as_ref());
    out
}

/// Which file a record describes: what tells a recreated or replaced file
/// apart from the one that was filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    /// Inode number.
    pub ino: u64,
    /// Birth time, seconds.
    pub btime_sec: i64,
    /// Birth time, nanoseconds.
    pub btime_nsec: u32,
}

/// A parsed fill record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FillRecord {
    /// The cache entry's id ([`entry_id`]), or a whole file's content digest.
    pub subject: [u8; 32],
    /// Size of the cache file.
    pub cache_size: u64,
    /// The cache file described.
    pub file: FileIdentity,
    /// One flag per chunk: verified and durable.
    pub filled: Vec<bool>,
}

/// A malformed record.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FillError {
    /// Shorter or longer than its header says.
    #[error("fill record has the wrong length")]
    Length,
    /// Not a record, or a version this build does not know.
    #[error("not a lamina fill record (bad magic or version)")]
    BadMagic,
    /// More chunks than any blob may have.
    #[error("fill record claims {0} chunks")]
    TooManyChunks(u32),
    /// The checksum does not match: a damaged record.
    #[error("fill record checksum mismatch")]
    Checksum,
}

impl FillRecord {
    /// Whether this record describes the cache file `file` of `subject`
    /// (an entry id or a content digest) with `chunks` chunks and
    /// `cache_size` bytes.
    pub fn describes(
        &self,
        subject: &[u8; 32],
        cache_size: u64,
        chunks: usize,
        file: FileIdentity,
    ) -> bool {
        self.subject == *subject
            && self.cache_size == cache_size
            && self.filled.len() == chunks
            && self.file == file
    }

    /// Serialises.
    pub fn to_bytes(&self) -> Vec<u8> {
        let header = FillHeader {
            magic: FILL_MAGIC,
            version: FILL_VERSION.into(),
            chunk_count: (self.filled.len() as u32).into(),
            subject: self.subject,
            cache_size: self.cache_size.into(),
            file_ino: self.file.ino.into(),
            file_btime_sec: self.file.btime_sec.into(),
            file_btime_nsec: self.file.btime_nsec.into(),
            reserved: [0; 20],
        };
        let mut out = header.as_bytes().to_vec();
        let mut bitmap = vec![0u8; self.filled.len().div_ceil(8)];
        for (i, _) in self.filled.iter().enumerate().filter(|(_, f)| **f) {
            bitmap[i / 8] |= 1 << (i % 8);
        }
        out.extend_from_slice(&bitmap);
        let sum = ring::digest::digest(&ring::digest::SHA256, &out);
        out.extend_from_slice(sum.as_ref());
        out
    }

    /// Parses and checks a record. The length is checked against the
    /// header's chunk count before the bitmap is read.
    pub fn from_bytes(bytes: &[u8]) -> Result<FillRecord, FillError> {
        let (header, rest) = FillHeader::read_from_prefix(bytes).map_err(|_| FillError::Length)?;
        if header.magic != FILL_MAGIC
            || header.version.get() != FILL_VERSION
            || header.reserved != [0; 20]
        {
            return Err(FillError::BadMagic);
        }
        let chunks = header.chunk_count.get();
        if chunks > MAX_FILL_CHUNKS {
            return Err(FillError::TooManyChunks(chunks));
        }
        let bitmap_len = (chunks as usize).div_ceil(8);
        if rest.len() != bitmap_len + CHECKSUM_LEN {
            return Err(FillError::Length);
        }
        let (body, sum) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
        if ring::digest::digest(&ring::digest::SHA256, body).as_ref() != sum {
            return Err(FillError::Checksum);
        }
        let bitmap = &rest[..bitmap_len];
        let filled = (0..chunks as usize)
            .map(|i| bitmap[i / 8] & (1 << (i % 8)) != 0)
            .collect();
        Ok(FillRecord {
            subject: header.subject,
            cache_size: header.cache_size.get(),
            file: FileIdentity {
                ino: header.file_ino.get(),
                btime_sec: header.file_btime_sec.get(),
                btime_nsec: header.file_btime_nsec.get(),
            },
            filled,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(n: usize) -> FillRecord {
        FillRecord {
            subject: [7; 32],
            cache_size: 4096 * n as u64,
            file: FileIdentity {
                ino: 42,
                btime_sec: 1_700_000_000,
                btime_nsec: 123,
            },
            filled: (0..n).map(|i| i % 3 == 0).collect(),
        }
    }

    #[test]
    fn round_trip() {
        for n in [0, 1, 7, 8, 9, 1000] {
            let r = record(n);
            let bytes = r.to_bytes();
            assert_eq!(bytes.len(), 96 + n.div_ceil(8) + 32);
            assert_eq!(FillRecord::from_bytes(&bytes).unwrap(), r);
        }
    }

    #[test]
    fn describes_only_its_own_file() {
        let r = record(9);
        assert!(r.describes(&[7; 32], 9 * 4096, 9, r.file));
        let other_inode = FileIdentity { ino: 43, ..r.file };
        let recreated = FileIdentity {
            btime_nsec: 124,
            ..r.file
        };
        assert!(!r.describes(&[7; 32], 9 * 4096, 9, other_inode));
        assert!(!r.describes(&[7; 32], 9 * 4096, 9, recreated));
        assert!(!r.describes(&[8; 32], 9 * 4096, 9, r.file));
        assert!(!r.describes(&[7; 32], 8 * 4096, 9, r.file));
        assert!(!r.describes(&[7; 32], 9 * 4096, 10, r.file));
    }

    /// Any difference in how an image describes a blob names another entry.
    #[test]
    fn entry_ids_differ_with_every_part() {
        let id = entry_id(&[1; 32], 8192, &[2; 32]);
        assert_eq!(id, entry_id(&[1; 32], 8192, &[2; 32]));
        assert_ne!(id, entry_id(&[9; 32], 8192, &[2; 32]));
        assert_ne!(id, entry_id(&[1; 32], 4096, &[2; 32]));
        assert_ne!(id, entry_id(&[1; 32], 8192, &[9; 32]));
    }

    #[test]
    fn rejects_damage() {
        let bytes = record(20).to_bytes();
        for cut in [0, 10, 95, 96, bytes.len() - 1] {
            assert_eq!(
                FillRecord::from_bytes(&bytes[..cut]),
                Err(FillError::Length)
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(FillRecord::from_bytes(&longer), Err(FillError::Length));
        let mut flipped = bytes.clone();
        flipped[96] ^= 2; // a bit of the bitmap
        assert_eq!(FillRecord::from_bytes(&flipped), Err(FillError::Checksum));
        let mut magic = bytes.clone();
        magic[0] = b'X';
        assert_eq!(FillRecord::from_bytes(&magic), Err(FillError::BadMagic));
        let mut huge = bytes;
        huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            FillRecord::from_bytes(&huge),
            Err(FillError::TooManyChunks(u32::MAX))
        );
    }
}
