//! EROFS on-disk structures, little-endian, as zerocopy structs.
//!
//! Mirrors the kernel's `fs/erofs/erofs_fs.h` as of Linux 6.1 (the 128-byte
//! superblock with `extra_devices`/`devt_slotoff`, no `sb_extslots` use), which
//! is also what erofs-utils 1.5's `fsck.erofs` understands. lamina writes only
//! the subset below: no compression, no shared xattrs, no long xattr prefixes.

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// `erofs_super_block.magic`.
pub const EROFS_MAGIC: u32 = 0xE0F5_E1E2;
/// The superblock lives at this byte offset of block 0.
pub const SUPERBLOCK_OFFSET: usize = 1024;
/// log2 of the block size of converted images: 4 KiB blocks.
pub const BLOCK_BITS: u8 = 12;
/// log2 of the block size of tar-index images: 512-byte blocks, tar's own
/// alignment, so a chunk can point at a file's data inside its layer's
/// uncompressed tar. Linux mounts EROFS with blocks smaller than a page
/// (checked on 6.18, docs/format.md).
pub const TAR_BLOCK_BITS: u8 = 9;
/// Block size in bytes.
pub const BLOCK_SIZE: usize = 1 << BLOCK_BITS;
/// Inode slots are this many bytes; a nid is `offset / 32`.
pub const INODE_SLOT_SIZE: usize = 32;
/// A chunk index whose block address is this maps a hole (reads as zeros).
pub const NULL_ADDR: u32 = u32::MAX;
/// Longest file name EROFS stores.
pub const MAX_NAME_LEN: usize = 255;

/// Incompat feature: chunk-based files.
pub const FEATURE_INCOMPAT_CHUNKED_FILE: u32 = 0x4;
/// Incompat feature: a device table for extra blob devices.
pub const FEATURE_INCOMPAT_DEVICE_TABLE: u32 = 0x8;

/// `i_format` bit 0: 0 = compact (32-byte) inode, 1 = extended (64-byte).
pub const INODE_LAYOUT_EXTENDED: u16 = 1;
/// Data layouts (`i_format` bits 1..=3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum DataLayout {
    /// Data in consecutive blocks from `raw_blkaddr`.
    FlatPlain = 0,
    /// Like `FlatPlain`, but the last partial block sits right after the inode.
    FlatInline = 2,
    /// Data in chunks, each addressed by a chunk index (device + block).
    ChunkBased = 4,
}

impl DataLayout {
    /// The `i_format` value for this layout and inode version.
    pub fn i_format(self, extended: bool) -> u16 {
        ((self as u16) << 1) | u16::from(extended)
    }
}

/// `erofs_inode_chunk_info.format`: chunk bits above the block bits.
pub const CHUNK_FORMAT_BLKBITS_MASK: u16 = 0x1F;
/// `erofs_inode_chunk_info.format`: 8-byte chunk indexes (with device ids).
pub const CHUNK_FORMAT_INDEXES: u16 = 0x20;

/// Directory entry file types (`erofs_dirent.file_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FileType {
    /// Regular file.
    Regular = 1,
    /// Directory.
    Directory = 2,
    /// Character device.
    CharDevice = 3,
    /// Block device.
    BlockDevice = 4,
    /// Named pipe.
    Fifo = 5,
    /// Unix socket.
    Socket = 6,
    /// Symbolic link.
    Symlink = 7,
}

/// Xattr name prefixes EROFS encodes as an index (`e_name_index`).
pub const XATTR_PREFIXES: &[(u8, &[u8])] = &[
    (1, b"user."),
    (2, b"system.posix_acl_access"),
    (3, b"system.posix_acl_default"),
    (4, b"trusted."),
    (6, b"security."),
];

/// `struct erofs_super_block` (128 bytes at byte 1024).
#[derive(Debug, Default, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct SuperBlock {
    /// `EROFS_MAGIC`.
    pub magic: U32,
    /// crc32c of the superblock block; only checked with the SB_CHKSUM feature (unused).
    pub checksum: U32,
    /// Compatible features (none used).
    pub feature_compat: U32,
    /// log2 of the block size.
    pub blkszbits: u8,
    /// Superblock size = 128 + sb_extslots * 16 (0 here).
    pub sb_extslots: u8,
    /// nid of the root directory (must be < 65536).
    pub root_nid: U16,
    /// Number of inodes.
    pub inos: U64,
    /// mtime of every compact inode, seconds.
    pub build_time: U64,
    /// mtime of every compact inode, nanoseconds.
    pub build_time_nsec: U32,
    /// Blocks of the primary device (this image), for statfs.
    pub blocks: U32,
    /// Block where the inode area starts (nids count from here).
    pub meta_blkaddr: U32,
    /// Block of the shared xattr area (unused: lamina inlines xattrs).
    pub xattr_blkaddr: U32,
    /// Volume UUID (lamina: derived from the image bytes, so reproducible).
    pub uuid: [u8; 16],
    /// Volume name.
    pub volume_name: [u8; 16],
    /// Incompatible features: unknown bits make the kernel refuse the mount.
    pub feature_incompat: U32,
    /// Compression algorithms (unused).
    pub available_compr_algs: U16,
    /// Number of extra devices (one per data blob).
    pub extra_devices: U16,
    /// Device table byte offset = devt_slotoff * 128.
    pub devt_slotoff: U16,
    /// Directory block size bits above blkszbits (must be 0).
    pub dirblkbits: u8,
    /// Long xattr prefixes (unused).
    pub xattr_prefix_count: u8,
    /// Long xattr prefix table start (unused).
    pub xattr_prefix_start: U32,
    /// nid of the packed inode (unused).
    pub packed_nid: U64,
    /// Xattr bloom filter reserved byte (unused).
    pub xattr_filter_reserved: u8,
    /// Zero.
    pub reserved: [u8; 23],
}

/// `struct erofs_deviceslot` (128 bytes): one extra device (a data blob).
#[derive(Debug, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct DeviceSlot {
    /// Device tag (lamina: the blob digest's hex).
    pub tag: [u8; 64],
    /// Size of the device in blocks.
    pub blocks: U32,
    /// Start in a flat address space (0: lamina gives each device its own file).
    pub mapped_blkaddr: U32,
    /// Zero.
    pub reserved: [u8; 56],
}

/// `struct erofs_inode_compact` (32 bytes); mtime is the superblock's build time.
#[derive(Debug, Default, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct InodeCompact {
    /// Layout version and data layout.
    pub i_format: U16,
    /// Inline xattr size: 12 + 4 * (icount - 1) bytes, or none when 0.
    pub i_xattr_icount: U16,
    /// File type and permission bits.
    pub i_mode: U16,
    /// Link count.
    pub i_nlink: U16,
    /// Size in bytes.
    pub i_size: U32,
    /// Zero (newer kernels: mtime relative to build time; 0 keeps both readings equal).
    pub i_reserved: U32,
    /// raw_blkaddr, rdev, or chunk format, by data layout and type.
    pub i_u: U32,
    /// Inode number reported by stat.
    pub i_ino: U32,
    /// Owner.
    pub i_uid: U16,
    /// Group.
    pub i_gid: U16,
    /// Zero.
    pub i_reserved2: U32,
}

/// `struct erofs_inode_extended` (64 bytes).
#[derive(Debug, Default, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct InodeExtended {
    /// Layout version and data layout.
    pub i_format: U16,
    /// Inline xattr size, as in the compact inode.
    pub i_xattr_icount: U16,
    /// File type and permission bits.
    pub i_mode: U16,
    /// Zero.
    pub i_reserved: U16,
    /// Size in bytes.
    pub i_size: U64,
    /// raw_blkaddr, rdev, or chunk format, by data layout and type.
    pub i_u: U32,
    /// Inode number reported by stat.
    pub i_ino: U32,
    /// Owner.
    pub i_uid: U32,
    /// Group.
    pub i_gid: U32,
    /// Modification time, seconds.
    pub i_mtime: U64,
    /// Modification time, nanoseconds.
    pub i_mtime_nsec: U32,
    /// Link count.
    pub i_nlink: U32,
    /// Zero.
    pub i_reserved2: [u8; 16],
}

/// `struct erofs_xattr_ibody_header` (12 bytes), first in the inline xattr area.
#[derive(Debug, Default, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct XattrIbodyHeader {
    /// Name filter (only with the XATTR_FILTER feature; zero).
    pub h_name_filter: U32,
    /// Number of shared xattr ids that follow (0: lamina shares none).
    pub h_shared_count: u8,
    /// Zero.
    pub h_reserved2: [u8; 7],
}

/// `struct erofs_xattr_entry` (4 bytes), followed by name suffix and value,
/// padded to 4 bytes.
#[derive(Debug, Default, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct XattrEntry {
    /// Length of the name suffix.
    pub e_name_len: u8,
    /// Prefix index (see [`XATTR_PREFIXES`]).
    pub e_name_index: u8,
    /// Length of the value.
    pub e_value_size: U16,
}

/// `struct erofs_inode_chunk_index` (8 bytes).
#[derive(Debug, Default, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct ChunkIndex {
    /// Zero.
    pub advise: U16,
    /// 0 for the primary device, 1.. for the extra devices in table order.
    pub device_id: U16,
    /// First block of the chunk on that device, or [`NULL_ADDR`] for a hole.
    pub blkaddr: U32,
}

/// `struct erofs_dirent` (12 bytes); names follow the dirent array of a block.
#[derive(Debug, Default, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct Dirent {
    /// nid of the entry's inode.
    pub nid: U64,
    /// Offset of the name within the directory block.
    pub nameoff: U16,
    /// [`FileType`].
    pub file_type: u8,
    /// Zero.
    pub reserved: u8,
}

const _: () = assert!(size_of::<SuperBlock>() == 128);
const _: () = assert!(size_of::<DeviceSlot>() == 128);
const _: () = assert!(size_of::<InodeCompact>() == 32);
const _: () = assert!(size_of::<InodeExtended>() == 64);
const _: () = assert!(size_of::<XattrIbodyHeader>() == 12);
const _: () = assert!(size_of::<XattrEntry>() == 4);
const _: () = assert!(size_of::<ChunkIndex>() == 8);
const _: () = assert!(size_of::<Dirent>() == 12);
