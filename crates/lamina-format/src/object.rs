//! The object record: what makes a passed-through file's own copy (an
//! "object", see `lamina_fuse`) trustworthy.
//!
//! An object holds one image file's bytes from offset 0, copied from
//! verified blob data, so the kernel can read it directly (FUSE
//! passthrough). Its record names the object by identity (inode number and
//! birth time, as a fill record names its cache file) and gives the file's
//! size and the SHA-256 of its bytes. A process trusts an object only when
//! the record names that very file, the size matches the image's inode and
//! the object's bytes hash to the record's digest.
//!
//! ```text
//! ObjectHeader (72 bytes)
//! checksum     (32 bytes: sha256 of the header)
//! ```
//! All integers little-endian. Version 1.

use zerocopy::little_endian::{I64, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::fill::FileIdentity;

/// `ObjectHeader::magic`.
pub const OBJECT_MAGIC: [u8; 8] = *b"LAMOBJ\x00\x01";
/// The only version this code reads and writes.
pub const OBJECT_VERSION: u32 = 1;
const CHECKSUM_LEN: usize = 32;

/// An object record on disk.
#[derive(Debug, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct ObjectHeader {
    /// [`OBJECT_MAGIC`].
    pub magic: [u8; 8],
    /// [`OBJECT_VERSION`].
    pub version: U32,
    /// Birth time of the object file, nanoseconds within the second.
    pub file_btime_nsec: U32,
    /// Size of the file (and of the object).
    pub size: U64,
    /// Inode number of the object file.
    pub file_ino: U64,
    /// Birth time of the object file, seconds since the epoch.
    pub file_btime_sec: I64,
    /// sha256 of the file's bytes (holes read as zeros).
    pub content_sha256: [u8; 32],
}

const _: () = assert!(size_of::<ObjectHeader>() == 72);

/// A parsed object record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectRecord {
    /// The object file described.
    pub file: FileIdentity,
    /// Size of the file.
    pub size: u64,
    /// sha256 of its bytes.
    pub content_sha256: [u8; 32],
}

/// A malformed object record.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ObjectError {
    /// Not exactly header and checksum.
    #[error("object record has the wrong length")]
    Length,
    /// Not a record, or a version this build does not know.
    #[error("not a lamina object record (bad magic or version)")]
    BadMagic,
    /// The checksum does not match: a damaged record.
    #[error("object record checksum mismatch")]
    Checksum,
}

impl ObjectRecord {
    /// Serialises.
    pub fn to_bytes(&self) -> Vec<u8> {
        let header = ObjectHeader {
            magic: OBJECT_MAGIC,
            version: OBJECT_VERSION.into(),
            file_btime_nsec: self.file.btime_nsec.into(),
            size: self.size.into(),
            file_ino: self.file.ino.into(),
            file_btime_sec: self.file.btime_sec.into(),
            content_sha256: self.content_sha256,
        };
        let mut out = header.as_bytes().to_vec();
        let sum = ring::digest::digest(&ring::digest::SHA256, &out);
        out.extend_from_slice(sum.as_ref());
        out
    }

    /// Parses and checks a record.
    pub fn from_bytes(bytes: &[u8]) -> Result<ObjectRecord, ObjectError> {
        if bytes.len() != size_of::<ObjectHeader>() + CHECKSUM_LEN {
            return Err(ObjectError::Length);
        }
        let (header, sum) =
            ObjectHeader::read_from_prefix(bytes).map_err(|_| ObjectError::Length)?;
        if header.magic != OBJECT_MAGIC || header.version.get() != OBJECT_VERSION {
            return Err(ObjectError::BadMagic);
        }
        let body = &bytes[..size_of::<ObjectHeader>()];
        if ring::digest::digest(&ring::digest::SHA256, body).as_ref() != sum {
            return Err(ObjectError::Checksum);
        }
        Ok(ObjectRecord {
            file: FileIdentity {
                ino: header.file_ino.get(),
                btime_sec: header.file_btime_sec.get(),
                btime_nsec: header.file_btime_nsec.get(),
            },
            size: header.size.get(),
            content_sha256: header.content_sha256,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> ObjectRecord {
        ObjectRecord {
            file: FileIdentity {
                ino: 42,
                btime_sec: 1_700_000_000,
                btime_nsec: 123,
            },
            size: 1 << 20,
            content_sha256: [9; 32],
        }
    }

    #[test]
    fn round_trip() {
        let bytes = record().to_bytes();
        assert_eq!(bytes.len(), 104);
        assert_eq!(ObjectRecord::from_bytes(&bytes).unwrap(), record());
    }

    #[test]
    fn rejects_damage() {
        let bytes = record().to_bytes();
        for cut in [0, 71, 72, 103] {
            assert_eq!(
                ObjectRecord::from_bytes(&bytes[..cut]),
                Err(ObjectError::Length)
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(ObjectRecord::from_bytes(&longer), Err(ObjectError::Length));
        let mut flipped = bytes.clone();
        flipped[40] ^= 1; // a bit of the content digest
        assert_eq!(
            ObjectRecord::from_bytes(&flipped),
            Err(ObjectError::Checksum)
        );
        let mut magic = bytes;
        magic[0] = b'X';
        assert_eq!(ObjectRecord::from_bytes(&magic), Err(ObjectError::BadMagic));
    }
}
