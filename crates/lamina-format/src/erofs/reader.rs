//! The EROFS reader: the bytes of a metadata image in; inodes, directory
//! entries, symlink targets, xattrs and chunk addresses out, borrowed from
//! those bytes (a mapped file serves them without copying).
//!
//! The FUSE path serves images through it; before a kernel mount,
//! [`Image::check_tree`] reads every directory and inode with it, so the
//! kernel's parser is handed only metadata it accepted. It reads what the
//! writer writes (uncompressed, 4 KiB blocks, flat and
//! chunk-based layouts, inline xattrs) and refuses anything else by name.
//! Every offset and length read from the image is checked before use: a
//! corrupt image gives [`ReadError`], never a panic or a read out of bounds.

use std::ops::Range;
use std::sync::Arc;

use zerocopy::FromBytes;

use super::format::*;

/// Why an image or one of its inodes cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// No EROFS superblock.
    #[error("not an EROFS image: {0}")]
    NotErofs(String),
    /// A feature or layout this reader does not implement.
    #[error("unsupported EROFS feature: {0}")]
    Unsupported(String),
    /// An offset, length or count that does not fit the image.
    #[error("corrupt EROFS image: {0}")]
    Corrupt(String),
}

fn corrupt<T>(what: impl Into<String>) -> Result<T, ReadError> {
    Err(ReadError::Corrupt(what.into()))
}

/// Makes a range of an image's bytes ready before the reader looks at it:
/// for bytes that arrive after the image is opened (a lazy FUSE mount fills
/// its metadata a zstd frame at a time, the frames a lookup needs first).
pub trait Gate: Send + Sync + std::fmt::Debug {
    /// Returns once `range` holds the image's bytes, or why it never will.
    fn ready(&self, range: Range<u64>) -> Result<(), String>;
}

/// An EROFS image over its bytes.
#[derive(Debug, Clone)]
pub struct Image<'a> {
    bytes: &'a [u8],
    /// Asked before any range is read, when the bytes fill in after open.
    gate: Option<Arc<dyn Gate>>,
    /// Byte offset of nid 0.
    meta_start: u64,
    root_nid: u64,
    build_time: (u64, u32),
    devices: Vec<DeviceInfo<'a>>,
    /// log2 of the block size ([`TAR_BLOCK_BITS`] to [`BLOCK_BITS`]).
    block_bits: u8,
}

/// One extra device (a data blob) of the device table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceInfo<'a> {
    /// The tag, without trailing NULs (lamina: the blob digest's hex).
    pub tag: &'a [u8],
    /// Size in blocks.
    pub blocks: u32,
}

/// An inode's attributes and where its data is.
#[derive(Debug, Clone)]
pub struct Inode<'a> {
    /// Its nid (the inode's byte offset from the inode area, / 32).
    pub nid: u64,
    /// The inode number stat reports.
    pub ino: u32,
    /// File type and permission bits (`S_IF*` | `0o7777`).
    pub mode: u32,
    /// Link count.
    pub nlink: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
    /// Nanoseconds of the modification time.
    pub mtime_nsec: u32,
    layout: DataLayout,
    i_u: u32,
    /// The inline xattr area.
    xattrs: &'a [u8],
    /// Byte offset in the image right after the inode and its xattrs.
    body: u64,
}

/// What kind of file an inode is, from its mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Regular file.
    Regular,
    /// Directory.
    Directory,
    /// Symbolic link.
    Symlink,
    /// Character device.
    CharDevice,
    /// Block device.
    BlockDevice,
    /// Named pipe.
    Fifo,
    /// Unix socket.
    Socket,
}

/// An xattr: its full name (`user.foo`) and its value.
pub type Xattr<'a> = (Vec<u8>, &'a [u8]);

/// One directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry<'a> {
    /// The name (`.` and `..` included, as stored).
    pub name: &'a [u8],
    /// The nid of the inode it names.
    pub nid: u64,
    /// The file type byte ([`FileType`] as u8).
    pub file_type: u8,
}

/// Where one chunk of a regular file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunk {
    /// Zeros.
    Hole,
    /// On extra device `device` (1-based, as in the device table), from
    /// byte `offset` of that device.
    Data {
        /// 1-based index into the device table.
        device: u16,
        /// Byte offset on the device.
        offset: u64,
    },
}

/// The chunk table of a regular file.
#[derive(Debug, Clone, Copy)]
pub struct Chunks<'a> {
    /// log2 of the chunk size.
    pub chunk_bits: u8,
    /// log2 of the image's block size, the unit of chunk addresses.
    block_bits: u8,
    table: &'a [ChunkIndex],
}

impl Chunks<'_> {
    /// Number of chunks.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether the file has no chunks.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Chunk `i`, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<Chunk> {
        let c = self.table.get(i)?;
        let blkaddr = c.blkaddr.get();
        Some(if blkaddr == NULL_ADDR {
            Chunk::Hole
        } else {
            Chunk::Data {
                device: c.device_id.get(),
                offset: u64::from(blkaddr) << self.block_bits,
            }
        })
    }
}

impl<'a> Image<'a> {
    /// Reads and checks the superblock and the device table.
    pub fn new(bytes: &'a [u8]) -> Result<Self, ReadError> {
        Self::open(bytes, None)
    }

    /// [`Image::new`] over bytes that are not all there yet: every range is
    /// read only once `gate` says it is ready (a gate error reads as
    /// [`ReadError::Corrupt`], so a request fails closed).
    pub fn gated(bytes: &'a [u8], gate: Arc<dyn Gate>) -> Result<Self, ReadError> {
        Self::open(bytes, Some(gate))
    }

    fn open(bytes: &'a [u8], gate: Option<Arc<dyn Gate>>) -> Result<Self, ReadError> {
        // Out-of-bounds ranges are refused below, by the reads themselves.
        let ready = |range: Range<usize>| match &gate {
            Some(g) => {
                let (start, end) = (range.start.min(bytes.len()), range.end.min(bytes.len()));
                g.ready(start as u64..end as u64)
                    .map_err(ReadError::Corrupt)
            }
            None => Ok(()),
        };
        ready(0..SUPERBLOCK_OFFSET + size_of::<SuperBlock>())?;
        let sb_bytes = bytes
            .get(SUPERBLOCK_OFFSET..)
            .ok_or_else(|| ReadError::NotErofs(format!("{} bytes", bytes.len())))?;
        let (sb, _) = SuperBlock::read_from_prefix(sb_bytes)
            .map_err(|_| ReadError::NotErofs(format!("{} bytes", bytes.len())))?;
        if sb.magic.get() != EROFS_MAGIC {
            return Err(ReadError::NotErofs(format!(
                "magic {:#010x}",
                sb.magic.get()
            )));
        }
        if !(TAR_BLOCK_BITS..=BLOCK_BITS).contains(&sb.blkszbits) {
            return Err(ReadError::Unsupported(format!(
                "block size 2^{}",
                sb.blkszbits
            )));
        }
        let known = FEATURE_INCOMPAT_CHUNKED_FILE | FEATURE_INCOMPAT_DEVICE_TABLE;
        let unknown = sb.feature_incompat.get() & !known;
        if unknown != 0 {
            return Err(ReadError::Unsupported(format!(
                "incompatible features {unknown:#x}"
            )));
        }
        ready(device_table(&sb))?;
        let devices = read_devices(bytes, &sb)?;
        Ok(Image {
            bytes,
            gate,
            meta_start: u64::from(sb.meta_blkaddr.get()) << sb.blkszbits,
            root_nid: u64::from(sb.root_nid.get()),
            build_time: (sb.build_time.get(), sb.build_time_nsec.get()),
            devices,
            block_bits: sb.blkszbits,
        })
    }

    /// log2 of the block size.
    pub fn block_bits(&self) -> u8 {
        self.block_bits
    }

    fn block_size(&self) -> u64 {
        1 << self.block_bits
    }

    /// The root directory's nid.
    pub fn root_nid(&self) -> u64 {
        self.root_nid
    }

    /// The extra devices, in table order (device 1 first).
    pub fn devices(&self) -> &[DeviceInfo<'a>] {
        &self.devices
    }

    fn slice(&self, range: Range<u64>, what: &str) -> Result<&'a [u8], ReadError> {
        let (start, end) = (
            usize::try_from(range.start).ok(),
            usize::try_from(range.end).ok(),
        );
        let bytes = match (start, end) {
            (Some(s), Some(e)) if s <= e => self.bytes.get(s..e),
            _ => None,
        }
        .ok_or_else(|| ReadError::Corrupt(format!("{what} beyond the image")))?;
        if let Some(gate) = &self.gate {
            gate.ready(range).map_err(ReadError::Corrupt)?;
        }
        Ok(bytes)
    }

    /// Where the on-disk record of inode `nid` starts in the image (for
    /// tools and tests that check or rewrite one inode in place).
    pub fn inode_offset(&self, nid: u64) -> Option<u64> {
        nid.checked_mul(INODE_SLOT_SIZE as u64)?
            .checked_add(self.meta_start)
    }

    /// The inode `nid`.
    pub fn inode(&self, nid: u64) -> Result<Inode<'a>, ReadError> {
        let at = nid
            .checked_mul(INODE_SLOT_SIZE as u64)
            .and_then(|o| o.checked_add(self.meta_start))
            .ok_or_else(|| ReadError::Corrupt(format!("nid {nid}")))?;
        let head = self.slice(
            at..at.saturating_add(64).min(self.bytes.len() as u64),
            "inode",
        )?;
        let format = head
            .get(..2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .ok_or_else(|| ReadError::Corrupt(format!("nid {nid} beyond the image")))?;
        let mut inode = if format & INODE_LAYOUT_EXTENDED != 0 {
            let (i, _) = InodeExtended::read_from_prefix(head)
                .map_err(|_| ReadError::Corrupt(format!("nid {nid}: truncated inode")))?;
            Inode {
                nid,
                ino: i.i_ino.get(),
                mode: u32::from(i.i_mode.get()),
                nlink: i.i_nlink.get(),
                uid: i.i_uid.get(),
                gid: i.i_gid.get(),
                size: i.i_size.get(),
                mtime: i.i_mtime.get() as i64,
                mtime_nsec: i.i_mtime_nsec.get(),
                layout: data_layout(i.i_format.get(), nid)?,
                i_u: i.i_u.get(),
                xattrs: &[],
                body: at + 64,
            }
        } else {
            let (i, _) = InodeCompact::read_from_prefix(head)
                .map_err(|_| ReadError::Corrupt(format!("nid {nid}: truncated inode")))?;
            Inode {
                nid,
                ino: i.i_ino.get(),
                mode: u32::from(i.i_mode.get()),
                nlink: u32::from(i.i_nlink.get()),
                uid: u32::from(i.i_uid.get()),
                gid: u32::from(i.i_gid.get()),
                size: u64::from(i.i_size.get()),
                mtime: self.build_time.0 as i64,
                mtime_nsec: self.build_time.1,
                layout: data_layout(i.i_format.get(), nid)?,
                i_u: i.i_u.get(),
                xattrs: &[],
                body: at + 32,
            }
        };
        if inode.kind().is_none() {
            return corrupt(format!("nid {nid}: mode {:#o}", inode.mode));
        }
        let icount = u64::from(u16::from_le_bytes([head[2], head[3]]));
        if icount > 0 {
            let len = 12 + 4 * (icount - 1);
            inode.xattrs = self.slice(inode.body..inode.body + len, "xattrs")?;
            inode.body += len;
        }
        Ok(inode)
    }

    /// Bytes `block` (0-based) of a directory's or symlink's data: a full
    /// block from `raw_blkaddr`, or the inline tail right after the inode.
    fn flat_block(&self, inode: &Inode<'a>, block: u64) -> Result<&'a [u8], ReadError> {
        let blocks = inode.size.div_ceil(self.block_size());
        if block >= blocks {
            return corrupt(format!("nid {}: block {block} of {blocks}", inode.nid));
        }
        let len = if block + 1 == blocks {
            inode.size - block * self.block_size()
        } else {
            self.block_size()
        };
        let inline = inode.layout == DataLayout::FlatInline && block + 1 == blocks;
        if inline {
            // The tail must not cross the inode's block.
            let end = inode.body + len;
            if inode.body / self.block_size() != (end - 1) / self.block_size() {
                return corrupt(format!("nid {}: inline tail crosses a block", inode.nid));
            }
            return self.slice(inode.body..end, "inline data");
        }
        match inode.layout {
            DataLayout::FlatPlain | DataLayout::FlatInline => {
                let start = (u64::from(inode.i_u) + block) << self.block_bits;
                self.slice(start..start + len, "data block")
            }
            DataLayout::ChunkBased => corrupt(format!(
                "nid {}: chunk-based directory or symlink",
                inode.nid
            )),
        }
    }

    /// A symlink's target.
    pub fn symlink_target(&self, inode: &Inode<'a>) -> Result<Vec<u8>, ReadError> {
        if inode.kind() != Some(Kind::Symlink) {
            return corrupt(format!("nid {}: not a symlink", inode.nid));
        }
        if inode.size > 4096 {
            return corrupt(format!(
                "nid {}: symlink of {} bytes",
                inode.nid, inode.size
            ));
        }
        let mut target = Vec::with_capacity(inode.size as usize);
        for b in 0..inode.size.div_ceil(self.block_size()) {
            target.extend_from_slice(self.flat_block(inode, b)?);
        }
        Ok(target)
    }

    /// A directory's entries, in stored (name) order, `.` and `..` included.
    pub fn entries(&self, dir: &Inode<'a>) -> Result<Vec<Entry<'a>>, ReadError> {
        self.check_dir(dir)?;
        let mut out = Vec::new();
        for b in 0..dir.size.div_ceil(self.block_size()) {
            let block = self.flat_block(dir, b)?;
            let count = dirent_count(block, dir.nid)?;
            for i in 0..count {
                out.push(dirent(block, i, count, dir.nid)?);
            }
        }
        Ok(out)
    }

    /// Up to `max` entries of `dir` from `position` on, each with the
    /// position of the entry after it: a listing resumed at any position
    /// reads only the blocks it returns. Position 0 is the first entry; the
    /// entry at index `i` of block `b` is at `b << 16 | i` (a block holds far
    /// fewer than 2^16 entries), so positions grow along the listing.
    pub fn entries_from(
        &self,
        dir: &Inode<'a>,
        position: u64,
        max: usize,
    ) -> Result<Vec<(u64, Entry<'a>)>, ReadError> {
        self.check_dir(dir)?;
        let blocks = dir.size.div_ceil(self.block_size());
        let (mut b, mut i) = (position >> 16, (position & 0xffff) as usize);
        let mut out = Vec::new();
        while b < blocks && out.len() < max {
            let block = self.flat_block(dir, b)?;
            let count = dirent_count(block, dir.nid)?;
            while i < count && out.len() < max {
                let next = if i + 1 < count {
                    b << 16 | (i as u64 + 1)
                } else {
                    (b + 1) << 16
                };
                out.push((next, dirent(block, i, count, dir.nid)?));
                i += 1;
            }
            if i >= count {
                (b, i) = (b + 1, 0);
            }
        }
        Ok(out)
    }

    /// The entry `name` of `dir`, by binary search over its blocks and then
    /// within one block (names are stored sorted), or `None`.
    pub fn lookup(&self, dir: &Inode<'a>, name: &[u8]) -> Result<Option<Entry<'a>>, ReadError> {
        self.check_dir(dir)?;
        let (mut lo, mut hi) = (0u64, dir.size.div_ceil(self.block_size()));
        // The last block whose first name is <= name holds it, if any does.
        let mut candidate = None;
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let block = self.flat_block(dir, mid)?;
            let count = dirent_count(block, dir.nid)?;
            let first = dirent(block, 0, count, dir.nid)?;
            if first.name <= name {
                candidate = Some((block, count));
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let Some((block, count)) = candidate else {
            return Ok(None);
        };
        let (mut lo, mut hi) = (0usize, count);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let e = dirent(block, mid, count, dir.nid)?;
            match e.name.cmp(name) {
                std::cmp::Ordering::Equal => return Ok(Some(e)),
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
            }
        }
        Ok(None)
    }

    fn check_dir(&self, dir: &Inode<'a>) -> Result<(), ReadError> {
        if dir.kind() != Some(Kind::Directory) {
            return corrupt(format!("nid {}: not a directory", dir.nid));
        }
        Ok(())
    }

    /// The inode's xattrs: full names (`user.foo`) and values, in stored order.
    pub fn xattrs(&self, inode: &Inode<'a>) -> Result<Vec<Xattr<'a>>, ReadError> {
        let area = inode.xattrs;
        if area.is_empty() {
            return Ok(Vec::new());
        }
        let bad = |what: &str| ReadError::Corrupt(format!("nid {}: xattrs: {what}", inode.nid));
        let (header, _) = XattrIbodyHeader::read_from_prefix(area).map_err(|_| bad("header"))?;
        if header.h_shared_count != 0 {
            return Err(ReadError::Unsupported("shared xattrs".into()));
        }
        let mut out = Vec::new();
        let mut pos = size_of::<XattrIbodyHeader>();
        while pos < area.len() {
            let rest = area.get(pos..).ok_or_else(|| bad("entry"))?;
            let (e, _) = XattrEntry::read_from_prefix(rest).map_err(|_| bad("entry"))?;
            let name_len = usize::from(e.e_name_len);
            let value_len = usize::from(e.e_value_size.get());
            let start = pos + size_of::<XattrEntry>();
            let suffix = area
                .get(start..start + name_len)
                .ok_or_else(|| bad("name"))?;
            let value = area
                .get(start + name_len..start + name_len + value_len)
                .ok_or_else(|| bad("value"))?;
            let prefix = XATTR_PREFIXES
                .iter()
                .find(|(i, _)| *i == e.e_name_index)
                .map(|(_, p)| *p)
                .ok_or_else(|| {
                    ReadError::Unsupported(format!("xattr name index {}", e.e_name_index))
                })?;
            out.push(([prefix, suffix].concat(), value));
            pos = (start + name_len + value_len).next_multiple_of(4);
        }
        Ok(out)
    }

    /// A regular file's chunk table (empty for an empty file).
    pub fn chunks(&self, inode: &Inode<'a>) -> Result<Chunks<'a>, ReadError> {
        if inode.kind() != Some(Kind::Regular) {
            return corrupt(format!("nid {}: not a regular file", inode.nid));
        }
        if inode.size == 0 {
            return Ok(Chunks {
                chunk_bits: self.block_bits,
                block_bits: self.block_bits,
                table: &[],
            });
        }
        if inode.layout != DataLayout::ChunkBased {
            return Err(ReadError::Unsupported(format!(
                "nid {}: regular file not chunk-based",
                inode.nid
            )));
        }
        let format = inode.i_u as u16;
        if format & CHUNK_FORMAT_INDEXES == 0 {
            return Err(ReadError::Unsupported("4-byte chunk block maps".into()));
        }
        let chunk_bits = self.block_bits + (format & CHUNK_FORMAT_BLKBITS_MASK) as u8;
        let count = inode.size.div_ceil(1u64 << chunk_bits);
        let start = inode.body.next_multiple_of(size_of::<ChunkIndex>() as u64);
        let len = count
            .checked_mul(size_of::<ChunkIndex>() as u64)
            .ok_or_else(|| ReadError::Corrupt(format!("nid {}: chunk count", inode.nid)))?;
        let bytes = self.slice(start..start.saturating_add(len), "chunk indexes")?;
        let table = <[ChunkIndex]>::ref_from_bytes(bytes)
            .map_err(|_| ReadError::Corrupt(format!("nid {}: chunk indexes", inode.nid)))?;
        for c in table {
            let device = c.device_id.get();
            if c.blkaddr.get() != NULL_ADDR
                && (device == 0 || usize::from(device) > self.devices.len())
            {
                return corrupt(format!("nid {}: chunk on device {device}", inode.nid));
            }
        }
        Ok(Chunks {
            chunk_bits,
            block_bits: self.block_bits,
            table,
        })
    }
}

impl Inode<'_> {
    /// The file type, or `None` for a mode no file has.
    pub fn kind(&self) -> Option<Kind> {
        Some(match self.mode & 0o170000 {
            0o100000 => Kind::Regular,
            0o040000 => Kind::Directory,
            0o120000 => Kind::Symlink,
            0o020000 => Kind::CharDevice,
            0o060000 => Kind::BlockDevice,
            0o010000 => Kind::Fifo,
            0o140000 => Kind::Socket,
            _ => return None,
        })
    }

    /// A device node's number as stored: the kernel's `new_encode_dev`
    /// form, which FUSE also takes; 0 for anything else.
    pub fn encoded_rdev(&self) -> u32 {
        match self.kind() {
            Some(Kind::CharDevice | Kind::BlockDevice) => self.i_u,
            _ => 0,
        }
    }

    /// Device number (major, minor) of a device node, as the kernel's
    /// `new_decode_dev`; (0, 0) for anything else.
    pub fn rdev(&self) -> (u32, u32) {
        let dev = self.encoded_rdev();
        ((dev & 0xfff00) >> 8, (dev & 0xff) | ((dev >> 12) & 0xfff00))
    }
}

impl Entry<'_> {
    /// The file type the entry records, or `None` for a type byte no file
    /// has.
    pub fn kind(&self) -> Option<Kind> {
        Some(match self.file_type {
            t if t == FileType::Regular as u8 => Kind::Regular,
            t if t == FileType::Directory as u8 => Kind::Directory,
            t if t == FileType::Symlink as u8 => Kind::Symlink,
            t if t == FileType::CharDevice as u8 => Kind::CharDevice,
            t if t == FileType::BlockDevice as u8 => Kind::BlockDevice,
            t if t == FileType::Fifo as u8 => Kind::Fifo,
            t if t == FileType::Socket as u8 => Kind::Socket,
            _ => return None,
        })
    }
}

/// What [`Image::check_tree`] walked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeCounts {
    /// Directories.
    pub dirs: u64,
    /// Inodes of every other kind (a hard link's once).
    pub others: u64,
    /// Directory entries, `.` and `..` left out.
    pub entries: u64,
}

impl Image<'_> {
    /// Reads every directory and inode reachable from the root with this
    /// bounded reader, before a kernel mount hands the image to the
    /// kernel's parser: every entry's inode, its file type, xattrs, symlink
    /// target and chunk table must read, names must be sorted and unique
    /// (the kernel's lookups binary-search them), `.` and `..` must be
    /// there naming the directory and its parent, a chunk must name a
    /// device of the table,
    /// and no directory may be reached twice (a loop, or a directory with
    /// two names). Only images with every byte present (no gate).
    pub fn check_tree(&self) -> Result<TreeCounts, ReadError> {
        let slots = (self.bytes.len() as u64).div_ceil(INODE_SLOT_SIZE as u64);
        let mut seen = vec![0u64; slots.div_ceil(64) as usize];
        let mut first_visit = |nid: u64| -> Result<bool, ReadError> {
            let word = seen
                .get_mut((nid / 64) as usize)
                .ok_or_else(|| ReadError::Corrupt(format!("nid {nid} beyond the image")))?;
            let bit = 1 << (nid % 64);
            let first = *word & bit == 0;
            *word |= bit;
            Ok(first)
        };
        let mut counts = TreeCounts::default();
        let root = self.inode(self.root_nid)?;
        self.check_dir(&root)?;
        first_visit(root.nid)?;
        let mut dirs = vec![(root, self.root_nid)];
        while let Some((dir, parent)) = dirs.pop() {
            counts.dirs += 1;
            self.check_other(&dir)?;
            let entries = self.entries(&dir)?;
            self.check_dot_entries(&dir, parent, &entries)?;
            for e in entries.iter().filter(|e| e.name != b"." && e.name != b"..") {
                counts.entries += 1;
                let inode = self.inode(e.nid)?;
                if e.kind() != inode.kind() {
                    return corrupt(format!(
                        "nid {}: entry {:?} says file type {}, its inode mode {:#o}",
                        dir.nid,
                        String::from_utf8_lossy(e.name),
                        e.file_type,
                        inode.mode
                    ));
                }
                if !first_visit(e.nid)? {
                    if inode.kind() == Some(Kind::Directory) {
                        return corrupt(format!("nid {}: a directory reached twice", e.nid));
                    }
                    continue; // a hard link, checked at its first name
                }
                match inode.kind() {
                    Some(Kind::Directory) => dirs.push((inode, dir.nid)),
                    _ => {
                        counts.others += 1;
                        self.check_other(&inode)?;
                    }
                }
            }
        }
        Ok(counts)
    }

    /// Names sorted and unique, `.` and `..` among them (sorted with the
    /// rest: `-x` comes before `.`) naming `dir` and `parent`.
    fn check_dot_entries(
        &self,
        dir: &Inode<'_>,
        parent: u64,
        entries: &[Entry<'_>],
    ) -> Result<(), ReadError> {
        if let Some(w) = entries.windows(2).find(|w| w[0].name >= w[1].name) {
            return corrupt(format!(
                "nid {}: names out of order at {:?}",
                dir.nid,
                String::from_utf8_lossy(w[1].name)
            ));
        }
        let nid_of = |name: &[u8]| entries.iter().find(|e| e.name == name).map(|e| e.nid);
        if (nid_of(b"."), nid_of(b"..")) != (Some(dir.nid), Some(parent)) {
            return corrupt(format!(
                "nid {}: `.` and `..` are not the directory and its parent",
                dir.nid
            ));
        }
        Ok(())
    }

    /// An inode's xattrs, and its symlink target or chunk table.
    fn check_other(&self, inode: &Inode<'_>) -> Result<(), ReadError> {
        self.xattrs(inode)?;
        match inode.kind() {
            Some(Kind::Symlink) => {
                self.symlink_target(inode)?;
            }
            Some(Kind::Regular) => {
                self.chunks(inode)?;
            }
            _ => {}
        }
        Ok(())
    }
}

fn data_layout(i_format: u16, nid: u64) -> Result<DataLayout, ReadError> {
    match (i_format >> 1) & 0x7 {
        0 => Ok(DataLayout::FlatPlain),
        2 => Ok(DataLayout::FlatInline),
        4 => Ok(DataLayout::ChunkBased),
        other => Err(ReadError::Unsupported(format!(
            "nid {nid}: data layout {other} (compressed)"
        ))),
    }
}

/// Where `sb`'s device table lies in the image.
fn device_table(sb: &SuperBlock) -> Range<usize> {
    let n = usize::from(sb.extra_devices.get());
    let start = usize::from(sb.devt_slotoff.get()) * size_of::<DeviceSlot>();
    start..start + n * size_of::<DeviceSlot>()
}

fn read_devices<'a>(bytes: &'a [u8], sb: &SuperBlock) -> Result<Vec<DeviceInfo<'a>>, ReadError> {
    let n = usize::from(sb.extra_devices.get());
    let table = bytes
        .get(device_table(sb))
        .ok_or_else(|| ReadError::Corrupt(format!("device table of {n} beyond the image")))?;
    let slots = <[DeviceSlot]>::ref_from_bytes(table)
        .map_err(|_| ReadError::Corrupt("device table".into()))?;
    Ok(slots
        .iter()
        .map(|s| {
            let len = s.tag.iter().position(|&b| b == 0).unwrap_or(s.tag.len());
            DeviceInfo {
                tag: &s.tag[..len],
                blocks: s.blocks.get(),
            }
        })
        .collect())
}

/// Entries in a directory block: the first entry's name offset / 12.
fn dirent_count(block: &[u8], nid: u64) -> Result<usize, ReadError> {
    let (first, _) = Dirent::read_from_prefix(block)
        .map_err(|_| ReadError::Corrupt(format!("nid {nid}: empty directory block")))?;
    let nameoff = usize::from(first.nameoff.get());
    if nameoff < size_of::<Dirent>() || nameoff % size_of::<Dirent>() != 0 || nameoff > block.len()
    {
        return corrupt(format!("nid {nid}: directory block header"));
    }
    Ok(nameoff / size_of::<Dirent>())
}

/// Entry `i` of a directory block of `count` entries. The last name ends at
/// the block's end or its first NUL, as the kernel reads it.
fn dirent(block: &[u8], i: usize, count: usize, nid: u64) -> Result<Entry<'_>, ReadError> {
    let bad = || ReadError::Corrupt(format!("nid {nid}: directory entry {i}"));
    let at = i * size_of::<Dirent>();
    let (d, _) = Dirent::read_from_prefix(block.get(at..).ok_or_else(bad)?).map_err(|_| bad())?;
    let start = usize::from(d.nameoff.get());
    let end = if i + 1 < count {
        let (next, _) =
            Dirent::read_from_prefix(&block[at + size_of::<Dirent>()..]).map_err(|_| bad())?;
        usize::from(next.nameoff.get())
    } else {
        let tail = block.get(start..).ok_or_else(bad)?;
        start + tail.iter().position(|&b| b == 0).unwrap_or(tail.len())
    };
    let name = block.get(start..end).ok_or_else(bad)?;
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(bad());
    }
    Ok(Entry {
        name,
        nid: d.nid.get(),
        file_type: d.file_type,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::erofs::test_tree::add;
    use crate::erofs::{write_image, write_image_with, ChunkAddr, Device, FileChunks};
    use lamina_tree::{Metadata, Node, NodeKind, Tree};

    fn meta(mode: u32, mtime: i64) -> Metadata {
        Metadata {
            mode,
            mtime,
            ..Metadata::default()
        }
    }

    fn dir(m: Metadata) -> Node<FileChunks> {
        Node {
            meta: m,
            kind: NodeKind::Directory {
                entries: Default::default(),
            },
        }
    }

    fn file(m: Metadata, size: u64, chunk_bits: u8, chunks: Vec<ChunkAddr>) -> Node<FileChunks> {
        Node {
            meta: m,
            kind: NodeKind::Regular {
                size,
                content: FileChunks { chunk_bits, chunks },
            },
        }
    }

    /// Every kind of inode and layout the writer makes.
    // Over 100 lines: one fixture holding every kind of inode and layout, spelled out.
    fn sample() -> (Tree<FileChunks>, Vec<Device>) {
        let mut t: Tree<FileChunks> = Tree::new();
        let root = t.root;
        let big = add(&mut t, root, b"big", dir(meta(0o755, 7)));
        for i in 0..1000u32 {
            let name = format!("entry-{i:04}-{}", "x".repeat((i % 40) as usize));
            let chunks = vec![ChunkAddr::Data {
                device: 1 + (i % 2) as u16,
                blkaddr: i,
            }];
            add(
                &mut t,
                big,
                name.as_bytes(),
                file(meta(0o644, 7), 100, 12, chunks),
            );
        }
        let mut owned = meta(0o4750, -5);
        owned.uid = 70000;
        owned.gid = 3;
        owned.mtime_nsec = 123;
        owned.xattrs.insert(b"user.empty".to_vec(), Vec::new());
        owned
            .xattrs
            .insert(b"security.capability".to_vec(), vec![1, 2, 3]);
        owned
            .xattrs
            .insert(b"trusted.overlay.opaque".to_vec(), b"y".to_vec());
        let chunks = vec![
            ChunkAddr::Data {
                device: 2,
                blkaddr: 9,
            },
            ChunkAddr::Hole,
            ChunkAddr::Data {
                device: 1,
                blkaddr: 4096,
            },
        ];
        add(
            &mut t,
            root,
            b"huge",
            file(owned, (2 << 30) + 5, 30, chunks),
        );
        add(
            &mut t,
            root,
            b"empty",
            file(meta(0o600, 7), 0, 12, Vec::new()),
        );
        for (name, len) in [(&b"short"[..], 5usize), (b"mid", 3000), (b"long", 4095)] {
            let target = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
            add(
                &mut t,
                root,
                name,
                Node {
                    meta: meta(0o777, 7),
                    kind: NodeKind::Symlink { target },
                },
            );
        }
        let dev = NodeKind::CharDevice {
            major: 259,
            minor: 70000,
        };
        add(
            &mut t,
            root,
            b"dev",
            Node {
                meta: meta(0o600, 7),
                kind: dev,
            },
        );
        add(
            &mut t,
            root,
            b"fifo",
            Node {
                meta: meta(0o644, 7),
                kind: NodeKind::Fifo,
            },
        );
        add(
            &mut t,
            root,
            b"sock",
            Node {
                meta: meta(0o644, 7),
                kind: NodeKind::Socket,
            },
        );
        let devices = vec![
            Device {
                tag: "a".repeat(64),
                blocks: 5000,
            },
            Device {
                tag: "b".into(),
                blocks: 10,
            },
        ];
        (t, devices)
    }

    /// The inode at `path`, looked up one component at a time.
    fn resolve<'a>(img: &Image<'a>, path: &[u8]) -> Inode<'a> {
        let mut cur = img.inode(img.root_nid()).unwrap();
        for comp in path.split(|&b| b == b'/').filter(|c| !c.is_empty()) {
            let e = img.lookup(&cur, comp).unwrap().expect("entry present");
            cur = img.inode(e.nid).unwrap();
        }
        cur
    }

    /// A listing resumed at every position it hands out, in steps of any
    /// size, is the whole listing (a directory of many blocks).
    /// Offsets past 32 bits (issue 10): a file of 6 GiB (its size in an
    /// extended inode, chunks past 2^32 in the file) whose chunks lie in
    /// their cache files beyond 4 GiB (block addresses past 2^20) and at the
    /// last block a 32-bit address reaches; written and read back exactly.
    #[test]
    fn sizes_and_cache_offsets_past_32_bits() {
        let mut t: Tree<FileChunks> = Tree::new();
        let root = t.root;
        let size = (6u64 << 30) + 12345;
        let chunk_bits = 18;
        let count = size.div_ceil(1 << chunk_bits) as usize;
        let data = |i: usize| match i {
            0 => Some((1, 7)),
            // Chunk 16384 starts at 4 GiB; cache blocks past 2^20 are past
            // 4 GiB into the cache file.
            16384 => Some((2, (1 << 20) + 3)),
            20000 => Some((2, u32::MAX - 1)),
            _ if i == count - 1 => Some((1, 5 << 20)),
            _ => None,
        };
        let chunks = (0..count)
            .map(|i| match data(i) {
                Some((device, blkaddr)) => ChunkAddr::Data { device, blkaddr },
                None => ChunkAddr::Hole,
            })
            .collect();
        add(
            &mut t,
            root,
            b"huge",
            file(meta(0o644, 7), size, chunk_bits, chunks),
        );
        let devices = vec![
            Device {
                tag: "a".into(),
                blocks: (5 << 20) + 1,
            },
            Device {
                tag: "b".into(),
                blocks: u32::MAX,
            },
        ];
        let (bytes, _) = write_image(&t, &devices).unwrap();
        let img = Image::new(&bytes).unwrap();
        let root = img.inode(img.root_nid()).unwrap();
        let e = img.lookup(&root, b"huge").unwrap().unwrap();
        let inode = img.inode(e.nid).unwrap();
        assert_eq!(inode.size, size);
        let got = img.chunks(&inode).unwrap();
        assert_eq!(got.len(), count);
        for i in 0..count {
            let want = match data(i) {
                Some((device, blkaddr)) => Chunk::Data {
                    device,
                    offset: u64::from(blkaddr) * 4096,
                },
                None => Chunk::Hole,
            };
            assert_eq!(got.get(i), Some(want), "chunk {i}");
        }
        assert_eq!(
            got.get(16384),
            Some(Chunk::Data {
                device: 2,
                offset: (4 << 30) + 3 * 4096
            })
        );
    }

    #[test]
    fn listings_resume_at_their_positions() {
        let (tree, devices) = sample();
        let (bytes, _) = write_image(&tree, &devices).unwrap();
        let img = Image::new(&bytes).unwrap();
        let big = resolve(&img, b"big");
        let all = img.entries(&big).unwrap();
        assert!(big.size > 4 * BLOCK_SIZE as u64, "spans several blocks");
        for step in [1, 7, 100, 5000] {
            let (mut got, mut position) = (Vec::new(), 0);
            loop {
                let batch = img.entries_from(&big, position, step).unwrap();
                let Some(&(next, _)) = batch.last() else {
                    break;
                };
                assert!(next > position, "positions grow");
                got.extend(batch.into_iter().map(|(_, e)| e));
                position = next;
            }
            assert_eq!(got, all, "in steps of {step}");
        }
        assert!(img.entries_from(&big, u64::MAX, 10).unwrap().is_empty());
        let file = resolve(&img, b"big/entry-0000-");
        assert!(img.entries_from(&file, 0, 10).is_err());
    }

    #[test]
    fn reads_back_what_the_writer_wrote() {
        reads_back_in_blocks_of(BLOCK_BITS);
    }

    #[test]
    fn reads_back_what_the_writer_wrote_in_512_byte_blocks() {
        reads_back_in_blocks_of(TAR_BLOCK_BITS);
    }

    fn reads_back_in_blocks_of(block_bits: u8) {
        let (tree, devices) = sample();
        let (bytes, _) = write_image_with(&tree, &devices, block_bits).unwrap();
        assert_eq!(bytes.len() % (1 << block_bits), 0);
        let img = Image::new(&bytes).unwrap();
        assert_eq!(img.block_bits(), block_bits);
        assert_eq!(img.devices().len(), 2);
        assert_eq!(img.devices()[0].tag, "a".repeat(64).as_bytes());
        assert_eq!(
            img.devices()[1],
            DeviceInfo {
                tag: b"b",
                blocks: 10
            }
        );
        let mut seen = 0;
        tree.walk(|path, id| {
            seen += 1;
            let node = &tree.nodes[id];
            let inode = resolve(&img, path);
            let perm = if matches!(node.kind, NodeKind::Symlink { .. }) {
                0o777
            } else {
                node.meta.mode
            };
            assert_eq!(inode.mode, node.file_type_bits() | perm, "{path:?}");
            assert_eq!((inode.uid, inode.gid), (node.meta.uid, node.meta.gid));
            assert_eq!(
                (inode.mtime, inode.mtime_nsec),
                (node.meta.mtime, node.meta.mtime_nsec)
            );
            let xattrs = img.xattrs(&inode).unwrap();
            let want: Vec<(Vec<u8>, &[u8])> = node
                .meta
                .xattrs
                .iter()
                .map(|(k, v)| (k.clone(), v.as_slice()))
                .collect();
            assert_eq!(xattrs, want, "{path:?}");
            match &node.kind {
                NodeKind::Directory { entries } => {
                    let listed = img.entries(&inode).unwrap();
                    let names: Vec<&[u8]> = listed.iter().map(|e| e.name).collect();
                    let mut want: Vec<&[u8]> = vec![b".", b".."];
                    want.extend(entries.keys().map(|k| k.as_slice()));
                    want.sort();
                    assert_eq!(names, want);
                    assert_eq!(listed[0].nid, inode.nid);
                    for e in &listed {
                        let kind = img.inode(e.nid).unwrap().kind();
                        assert_eq!(e.kind(), kind, "{path:?}: entry {:?}", e.name);
                    }
                }
                NodeKind::Regular { size, content } => {
                    assert_eq!(inode.size, *size);
                    let chunks = img.chunks(&inode).unwrap();
                    assert_eq!(chunks.len(), content.chunks.len());
                    if !content.chunks.is_empty() {
                        assert_eq!(chunks.chunk_bits, content.chunk_bits);
                    }
                    for (i, c) in content.chunks.iter().enumerate() {
                        let want = match *c {
                            ChunkAddr::Hole => Chunk::Hole,
                            ChunkAddr::Data { device, blkaddr } => Chunk::Data {
                                device,
                                offset: u64::from(blkaddr) << block_bits,
                            },
                        };
                        assert_eq!(chunks.get(i), Some(want));
                    }
                    assert_eq!(chunks.get(content.chunks.len()), None);
                }
                NodeKind::Symlink { target } => {
                    assert_eq!(&img.symlink_target(&inode).unwrap(), target, "{path:?}");
                }
                NodeKind::CharDevice { major, minor } | NodeKind::BlockDevice { major, minor } => {
                    assert_eq!(inode.rdev(), (*major, *minor));
                }
                NodeKind::Fifo | NodeKind::Socket => assert_eq!(inode.size, 0),
            }
        });
        assert_eq!(seen, 1 + 1 + 1000 + 8);
    }

    #[test]
    fn lookup_misses_anywhere_in_a_directory() {
        let (tree, devices) = sample();
        let (bytes, _) = write_image(&tree, &devices).unwrap();
        let img = Image::new(&bytes).unwrap();
        let big = resolve(&img, b"big");
        assert!(big.size > 4 * BLOCK_SIZE as u64, "spans several blocks");
        for name in [
            &b"!"[..],
            b"entry-0001-",
            b"entry-0001-xx",
            b"entry-0500",
            b"entry-0999-y",
            b"zzz",
            b"-",
        ] {
            assert_eq!(img.lookup(&big, name).unwrap(), None, "{name:?}");
        }
        let root = img.inode(img.root_nid()).unwrap();
        let dot = img.lookup(&root, b"..").unwrap().unwrap();
        assert_eq!(dot.nid, root.nid);
        // Not a directory: an error, not an answer.
        let f = resolve(&img, b"empty");
        assert!(img.lookup(&f, b"x").is_err());
        assert!(img.chunks(&root).is_err());
    }

    #[test]
    fn bad_images_are_errors() {
        let (tree, devices) = sample();
        let (bytes, _) = write_image(&tree, &devices).unwrap();
        assert!(matches!(
            Image::new(&bytes[..1100]),
            Err(ReadError::NotErofs(_))
        ));
        let mut other = bytes.clone();
        other[1024] ^= 1;
        assert!(matches!(Image::new(&other), Err(ReadError::NotErofs(_))));
        let mut compressed = bytes.clone();
        compressed[1024 + 80] |= 0x1; // an incompatible feature the reader lacks
        assert!(matches!(
            Image::new(&compressed),
            Err(ReadError::Unsupported(_))
        ));
        let img = Image::new(&bytes).unwrap();
        assert!(img.inode(u64::MAX).is_err());
        assert!(img.inode(bytes.len() as u64 / 32).is_err());
    }

    /// Whatever bytes change, walking the image answers or errs: it never
    /// panics or reads out of bounds.
    #[test]
    fn corrupt_images_never_panic() {
        let (tree, devices) = sample();
        let (bytes, _) = write_image(&tree, &devices).unwrap();
        let mut next = crate::erofs::test_tree::xorshift();
        for round in 0..300 {
            let mut b = bytes.clone();
            for _ in 0..1 + round % 8 {
                let at = (next() % b.len() as u64) as usize;
                b[at] = next() as u8;
            }
            let cut = if round % 5 == 0 {
                (next() % b.len() as u64) as usize
            } else {
                b.len()
            };
            walk_all(&b[..cut]);
        }
    }

    /// Every inode reachable from the root, described from what the
    /// reader returns for it.
    fn describe(img: &Image<'_>) -> Result<Vec<String>, ReadError> {
        let mut out = Vec::new();
        let mut stack = vec![(b"/".to_vec(), img.root_nid())];
        while let Some((path, nid)) = stack.pop() {
            let inode = img.inode(nid)?;
            let mut line = format!(
                "{path:?} {} {} {:?}",
                inode.mode,
                inode.size,
                img.xattrs(&inode)?
            );
            match inode.kind() {
                Some(Kind::Directory) => {
                    for e in img.entries(&inode)? {
                        if e.name != b"." && e.name != b".." {
                            let found = img.lookup(&inode, e.name)?.map(|f| f.nid);
                            assert_eq!(found, Some(e.nid));
                            stack.push(([&path[..], e.name, b"/"].concat(), e.nid));
                        }
                    }
                }
                Some(Kind::Regular) => {
                    let c = img.chunks(&inode)?;
                    line += &format!(" {:?}", (0..c.len()).map(|i| c.get(i)).collect::<Vec<_>>());
                }
                Some(Kind::Symlink) => line += &format!(" -> {:?}", img.symlink_target(&inode)?),
                _ => line += &format!(" {:?}", inode.rdev()),
            }
            out.push(line);
        }
        Ok(out)
    }

    /// A gate that says yes, and keeps what it was asked.
    #[derive(Debug, Default)]
    struct Recording(std::sync::Mutex<Vec<Range<u64>>>);

    impl Gate for Recording {
        fn ready(&self, range: Range<u64>) -> Result<(), String> {
            self.0.lock().unwrap().push(range);
            Ok(())
        }
    }

    /// A gate that has no bytes past `.0`.
    #[derive(Debug)]
    struct Upto(u64);

    impl Gate for Upto {
        fn ready(&self, range: Range<u64>) -> Result<(), String> {
            match range.end <= self.0 {
                true => Ok(()),
                false => Err(format!("bytes {range:?} not there")),
            }
        }
    }

    /// Through a gate, the reader reads nothing it has not asked the gate
    /// for: the same image with every byte it did not ask for zeroed reads
    /// the same. A gate's refusal is an error of the read that needed it.
    #[test]
    fn a_gated_image_reads_only_ranges_its_gate_made_ready() {
        let (tree, devices) = sample();
        let (bytes, _) = write_image(&tree, &devices).unwrap();
        let asked = Arc::new(Recording::default());
        let img = Image::gated(&bytes, asked.clone()).unwrap();
        let seen = describe(&img).unwrap();
        assert_eq!(seen.len(), 1 + 1 + 1000 + 8);
        let mut masked = vec![0u8; bytes.len()];
        for r in asked.0.lock().unwrap().iter() {
            let r = r.start as usize..r.end as usize;
            masked[r.clone()].copy_from_slice(&bytes[r]);
        }
        assert_eq!(describe(&Image::new(&masked).unwrap()).unwrap(), seen);

        let err = Image::gated(&bytes, Arc::new(Upto(1024))).unwrap_err();
        assert!(
            matches!(&err, ReadError::Corrupt(m) if m.contains("not there")),
            "{err}"
        );
        let img = Image::gated(&bytes, Arc::new(Upto(2 * BLOCK_SIZE as u64))).unwrap();
        let err = describe(&img).unwrap_err();
        assert!(
            matches!(&err, ReadError::Corrupt(m) if m.contains("not there")),
            "{err}"
        );
    }

    fn walk_all(bytes: &[u8]) {
        let Ok(img) = Image::new(bytes) else { return };
        let _ = img.check_tree();
        let mut stack = vec![img.root_nid()];
        let mut visited = std::collections::HashSet::new();
        while let Some(nid) = stack.pop() {
            if !visited.insert(nid) || visited.len() > 5000 {
                continue;
            }
            let Ok(inode) = img.inode(nid) else { continue };
            let _ = img.xattrs(&inode);
            match inode.kind() {
                Some(Kind::Directory) => {
                    if let Ok(entries) = img.entries(&inode) {
                        for e in entries {
                            let _ = img.lookup(&inode, e.name);
                            stack.push(e.nid);
                        }
                    }
                }
                Some(Kind::Regular) => {
                    if let Ok(c) = img.chunks(&inode) {
                        (0..c.len()).for_each(|i| assert!(c.get(i).is_some()));
                    }
                }
                Some(Kind::Symlink) => drop(img.symlink_target(&inode)),
                _ => {
                    let _ = inode.rdev();
                }
            }
        }
    }

    /// Offset in the image of the directory entry `name` of `dir`.
    fn dirent_offset(img: &Image<'_>, bytes: &[u8], dir: &[u8], name: &[u8]) -> usize {
        let dir = resolve(img, dir);
        for b in 0..dir.size.div_ceil(img.block_size()) {
            let block = img.flat_block(&dir, b).unwrap();
            let count = dirent_count(block, dir.nid).unwrap();
            for i in 0..count {
                if dirent(block, i, count, dir.nid).unwrap().name == name {
                    return block.as_ptr() as usize - bytes.as_ptr() as usize + 12 * i;
                }
            }
        }
        panic!("no entry {name:?}")
    }

    /// Issue 42 point 9: the walk a kernel mount waits for reads every
    /// inode of what the writer writes once, and refuses what the kernel's
    /// parser should never be handed.
    #[test]
    fn check_tree_passes_written_images_and_refuses_bad_trees() {
        let (tree, devices) = sample();
        let (bytes, _) = write_image(&tree, &devices).unwrap();
        let img = Image::new(&bytes).unwrap();
        let counts = img.check_tree().unwrap();
        let described = describe(&img).unwrap().len() as u64;
        assert_eq!(counts.dirs + counts.others, described, "{counts:?}");
        assert!(counts.entries >= described - 1, "{counts:?}");

        let refused = |edit: &dyn Fn(&mut Vec<u8>), what: &str| {
            let mut b = bytes.clone();
            edit(&mut b);
            let err = Image::new(&b).unwrap().check_tree().unwrap_err();
            assert!(err.to_string().contains(what), "{what}: {err}");
        };
        let big = dirent_offset(&img, &bytes, b"/", b"big");
        let root_nid = img.root_nid().to_le_bytes();
        // The entry's file type says regular; its inode is a directory.
        refused(&|b| b[big + 10] = FileType::Regular as u8, "file type");
        // A file's entry names the root (as a directory): a loop.
        let file = dirent_offset(&img, &bytes, b"/big", b"entry-0003-xxx");
        refused(
            &|b| {
                b[file..file + 8].copy_from_slice(&root_nid);
                b[file + 10] = FileType::Directory as u8;
            },
            "reached twice",
        );
        // `..` of big names big itself.
        let dotdot = dirent_offset(&img, &bytes, b"/big", b"..");
        let big_nid = resolve(&img, b"/big").nid.to_le_bytes();
        refused(&|b| b[dotdot..dotdot + 8].copy_from_slice(&big_nid), "`..`");
        // Names out of order: the kernel's binary search would miss some.
        let e = dirent_offset(&img, &bytes, b"/big", b"entry-0005-xxxxx");
        let name_at = |b: &[u8]| {
            let block_start = e - (e % img.block_size() as usize);
            let nameoff = u16::from_le_bytes([b[e + 8], b[e + 9]]) as usize;
            block_start + nameoff
        };
        refused(
            &|b| {
                let at = name_at(b);
                b[at] = b'z';
            },
            "out of order",
        );
    }
}
