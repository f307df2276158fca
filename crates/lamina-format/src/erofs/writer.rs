//! The EROFS writer: a merged tree whose regular files are already placed in
//! data blobs goes in, the bytes of a mountable metadata image come out.
//!
//! Layout, in one place so that planning and emitting cannot drift:
//! block 0 holds the superblock (byte 1024) and the device table (byte 1152);
//! inodes follow from block 1 in placement order (each directory's children
//! together, directories depth-first, so `ls -lR` reads few blocks); full
//! directory/symlink blocks come after the inodes. Tails of directories and
//! symlinks are inlined right after their inode when they fit in its block.

use std::collections::{BTreeMap, HashMap};

use lamina_tree::{DirEntry, NodeId, NodeKind, Tree};
use zerocopy::IntoBytes;

use super::format::*;

/// Where a regular file's bytes are: one entry per chunk of `1 << chunk_bits`
/// bytes (the last one partial).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileChunks {
    /// log2 of the chunk size; at least one block (12, or 9 in an image of
    /// 512-byte blocks).
    pub chunk_bits: u8,
    /// The chunks, in file order.
    pub chunks: Vec<ChunkAddr>,
}

/// Address of one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChunkAddr {
    /// All zeros; nothing stored.
    Hole,
    /// Stored on extra device `device` (1-based) from block `blkaddr`.
    Data {
        /// 1-based index into the device table.
        device: u16,
        /// First block on that device.
        blkaddr: u32,
    },
}

/// One extra device: a data blob (its uncompressed, block-addressed form).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// Tag, at most 64 bytes (lamina uses the blob digest's hex).
    pub tag: String,
    /// Size in blocks.
    pub blocks: u32,
}

/// Figures about a written image.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageStats {
    /// Inodes written.
    pub inodes: u64,
    /// Of which compact (32-byte).
    pub compact_inodes: u64,
    /// Total image size in blocks.
    pub blocks: u32,
    /// Bytes of inline xattr areas.
    pub xattr_bytes: u64,
}

/// Why a tree cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// A name longer than 255 bytes or containing `/` or NUL.
    #[error("invalid file name {0:?}")]
    InvalidName(String),
    /// An xattr whose namespace EROFS cannot store.
    #[error("xattr {0:?}: EROFS stores only user., trusted., security. and POSIX ACL xattrs")]
    UnsupportedXattr(String),
    /// An xattr name or value too long for the on-disk fields.
    #[error("xattr {0:?} is too long")]
    XattrTooLong(String),
    /// Device numbers that do not fit the 32-bit rdev encoding.
    #[error("device number {major}:{minor} does not fit EROFS's rdev")]
    DeviceNumber {
        /// Major.
        major: u32,
        /// Minor.
        minor: u32,
    },
    /// A file whose chunk list does not match its size.
    #[error("file of {size} bytes has {got} chunks of 2^{bits} bytes")]
    ChunkCount {
        /// File size.
        size: u64,
        /// Chunks given.
        got: usize,
        /// Chunk bits.
        bits: u8,
    },
    /// A chunk naming a device that is not in the table, or bad chunk bits.
    #[error("chunk address invalid: {0}")]
    BadChunk(String),
    /// Too many devices, inodes or blocks for the format.
    #[error("image too large: {0}")]
    TooLarge(&'static str),
}

/// What goes after an inode and how its data is laid out.
#[derive(Debug)]
enum Payload {
    /// No data (devices, fifos, empty files).
    None { rdev: u32 },
    /// Directory or symlink bytes: full blocks elsewhere, tail maybe inline.
    Flat { data: FlatData, inline_tail: bool },
    /// Chunk indexes.
    Chunked {
        format: u16,
        indexes: Vec<ChunkIndex>,
    },
}

#[derive(Debug)]
enum FlatData {
    Dir {
        blocks: Vec<std::ops::Range<usize>>,
        entries: Vec<(Vec<u8>, NodeId, FileType)>,
    },
    Symlink(Vec<u8>),
}

#[derive(Debug)]
struct Plan {
    node: NodeId,
    extended: bool,
    nlink: u32,
    size: u64,
    xattrs: Vec<u8>,
    payload: Payload,
    /// Byte offset of the inode (meta_blkaddr is 0).
    offset: usize,
    /// First full data block, when there are any.
    raw_blkaddr: u32,
}

impl Plan {
    fn inode_size(&self) -> usize {
        if self.extended {
            64
        } else {
            32
        }
    }
    /// Inode plus inline xattrs.
    fn base(&self) -> usize {
        self.inode_size() + self.xattrs.len()
    }
    fn full_blocks(&self, bs: usize) -> u32 {
        match &self.payload {
            Payload::Flat { inline_tail, .. } => {
                let blocks = self.size.div_ceil(bs as u64) as u32;
                blocks - u32::from(*inline_tail)
            }
            _ => 0,
        }
    }
    fn tail_len(&self, bs: usize) -> usize {
        match &self.payload {
            Payload::Flat {
                inline_tail: true, ..
            } => (self.size % bs as u64) as usize,
            _ => 0,
        }
    }
}

/// Writes the EROFS image of `tree` with `devices` as its extra devices,
/// in 4 KiB blocks.
pub fn write_image(
    tree: &Tree<FileChunks>,
    devices: &[Device],
) -> Result<(Vec<u8>, ImageStats), FormatError> {
    write_image_with(tree, devices, BLOCK_BITS)
}

/// [`write_image`] with blocks of `1 << block_bits` bytes
/// ([`TAR_BLOCK_BITS`] to [`BLOCK_BITS`]); chunk addresses and device
/// sizes count in those blocks.
pub fn write_image_with(
    tree: &Tree<FileChunks>,
    devices: &[Device],
    block_bits: u8,
) -> Result<(Vec<u8>, ImageStats), FormatError> {
    if !(TAR_BLOCK_BITS..=BLOCK_BITS).contains(&block_bits) {
        return Err(FormatError::BadChunk(format!("block bits {block_bits}")));
    }
    let bs = 1usize << block_bits;
    if devices.len() > usize::from(u16::MAX) - 1 {
        return Err(FormatError::TooLarge("more than 65534 devices"));
    }
    let (order, parents, nlinks, group_starts) = place_order(tree);
    let build_time = most_common_mtime(tree, &order);

    // Plan every inode's sizes.
    let mut plans = Vec::with_capacity(order.len());
    for (i, &node) in order.iter().enumerate() {
        plans.push(plan_inode(
            tree,
            node,
            nlinks[i],
            parents[i],
            build_time,
            devices.len(),
            block_bits,
        )?);
    }

    let placed_end = place_inodes(&mut plans, &order, &group_starts, devices.len(), bs)?;
    let nid_of: HashMap<NodeId, u64> = plans
        .iter()
        .map(|p| (p.node, (p.offset / INODE_SLOT_SIZE) as u64))
        .collect();
    let root_nid = u16::try_from(nid_of[&tree.root])
        .map_err(|_| FormatError::TooLarge("root inode beyond nid 65535"))?;
    let total_blocks = place_data_blocks(&mut plans, placed_end, bs)?;

    // Emit.
    let mut out = vec![0u8; total_blocks as usize * bs];
    let mut stats = ImageStats {
        inodes: plans.len() as u64,
        blocks: total_blocks,
        ..ImageStats::default()
    };
    for (ino, plan) in plans.iter().enumerate() {
        emit_inode(
            &mut out,
            tree,
            plan,
            ino as u32 + 1,
            &nid_of,
            bs,
            &mut stats,
        );
    }

    let devt_slotoff = (SUPERBLOCK_OFFSET + 128) / size_of::<DeviceSlot>();
    emit_device_table(&mut out, devices, devt_slotoff);

    let mut sb = superblock(
        block_bits,
        root_nid,
        plans.len() as u64,
        build_time,
        total_blocks,
        devices,
        devt_slotoff,
    );
    // The UUID is a digest of everything else, so equal trees give equal images.
    let digest = ring::digest::digest(&ring::digest::SHA256, &out);
    sb.uuid.copy_from_slice(&digest.as_ref()[..16]);
    let mut pos = SUPERBLOCK_OFFSET;
    put(&mut out, &mut pos, sb.as_bytes());
    Ok((out, stats))
}

/// Sets each inode's offset, in placement order, from the block after the
/// device table; returns the end, in bytes, of the inodes and of the data
/// blocks reserved among them.
fn place_inodes(
    plans: &mut [Plan],
    order: &[NodeId],
    group_starts: &GroupStarts,
    device_count: usize,
    bs: usize,
) -> Result<usize, FormatError> {
    // Place inodes. Block 0: superblock + device table. A directory's full
    // data blocks go at the next block boundary just before its children's
    // inodes, so a listing reads dirents and then the inodes they name from
    // one region; the inode cursor flows around such reserved blocks.
    let slot_of: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let devt_end = SUPERBLOCK_OFFSET + 128 + device_count * size_of::<DeviceSlot>();
    let mut cursor = devt_end.next_multiple_of(bs);
    let mut reserved: Vec<std::ops::Range<usize>> = Vec::new(); // byte ranges, increasing
    let mut reserved_end = 0usize; // bytes
    for k in 0..plans.len() {
        if let Some(dir) = group_starts.get(&k) {
            let d = slot_of[dir];
            let full = plans[d].full_blocks(bs) as usize;
            if full > 0 {
                let at = cursor.next_multiple_of(bs).max(reserved_end);
                plans[d].raw_blkaddr =
                    u32::try_from(at / bs).map_err(|_| FormatError::TooLarge("blocks"))?;
                reserved_end = at + full * bs;
                reserved.push(at..reserved_end);
            }
        }
        let plan = &mut plans[k];
        let in_block = plan.base() + plan.tail_len(bs);
        let indexes = match &plan.payload {
            Payload::Chunked { indexes, .. } => indexes.len() * 8,
            _ => 0,
        };
        let mut start = cursor.next_multiple_of(INODE_SLOT_SIZE);
        loop {
            if start % bs + in_block > bs {
                start = start.next_multiple_of(bs);
            }
            let end = (start + in_block).next_multiple_of(size_of::<ChunkIndex>()) + indexes;
            match reserved.iter().find(|r| r.start < end && start < r.end) {
                Some(r) => start = r.end,
                None => break,
            }
        }
        plan.offset = start;
        cursor = start + in_block;
        if indexes > 0 {
            cursor = cursor.next_multiple_of(size_of::<ChunkIndex>()) + indexes;
        }
        reserved.retain(|r| r.end > cursor);
    }
    Ok(cursor.max(reserved_end))
}

/// Gives the full data blocks not yet placed their place from the block
/// at or after `placed_end` bytes on; returns the image's size in blocks.
fn place_data_blocks(plans: &mut [Plan], placed_end: usize, bs: usize) -> Result<u32, FormatError> {
    // Remaining full data blocks (symlinks, and directories placed above
    // already have theirs) after everything else.
    let mut next_block =
        u32::try_from(placed_end.div_ceil(bs)).map_err(|_| FormatError::TooLarge("blocks"))?;
    for plan in plans.iter_mut() {
        let full = plan.full_blocks(bs);
        if full == 0 {
            plan.raw_blkaddr = NULL_ADDR;
        } else if plan.raw_blkaddr == NULL_ADDR {
            plan.raw_blkaddr = next_block;
            next_block = next_block
                .checked_add(full)
                .ok_or(FormatError::TooLarge("blocks"))?;
        }
    }
    Ok(next_block)
}

/// Writes inode number `ino` as `plan` places it, with its xattrs and what
/// follows them, counting it in `stats`.
fn emit_inode(
    out: &mut [u8],
    tree: &Tree<FileChunks>,
    plan: &Plan,
    ino: u32,
    nid_of: &HashMap<NodeId, u64>,
    bs: usize,
    stats: &mut ImageStats,
) {
    let node = &tree.nodes[plan.node];
    // Linux creates every symlink 0777 whatever a tar header says, so an
    // unpacked image (and overlayfs over one) shows 0777: do the same.
    let perm = if matches!(node.kind, NodeKind::Symlink { .. }) {
        0o777
    } else {
        node.meta.mode & 0o7777
    };
    let mode = (node.file_type_bits() | perm) as u16;
    let (layout, i_u) = match &plan.payload {
        Payload::None { rdev } => (DataLayout::FlatPlain, *rdev),
        Payload::Flat { inline_tail, .. } => (
            if *inline_tail {
                DataLayout::FlatInline
            } else {
                DataLayout::FlatPlain
            },
            plan.raw_blkaddr,
        ),
        Payload::Chunked { format, .. } => (DataLayout::ChunkBased, u32::from(*format)),
    };
    let icount = if plan.xattrs.is_empty() {
        0
    } else {
        (1 + (plan.xattrs.len() - 12) / 4) as u16
    };
    let mut pos = plan.offset;
    if plan.extended {
        let inode = InodeExtended {
            i_format: layout.i_format(true).into(),
            i_xattr_icount: icount.into(),
            i_mode: mode.into(),
            i_size: plan.size.into(),
            i_u: i_u.into(),
            i_ino: ino.into(),
            i_uid: node.meta.uid.into(),
            i_gid: node.meta.gid.into(),
            i_mtime: (node.meta.mtime as u64).into(),
            i_mtime_nsec: node.meta.mtime_nsec.into(),
            i_nlink: plan.nlink.into(),
            ..InodeExtended::default()
        };
        put(out, &mut pos, inode.as_bytes());
    } else {
        stats.compact_inodes += 1;
        let inode = InodeCompact {
            i_format: layout.i_format(false).into(),
            i_xattr_icount: icount.into(),
            i_mode: mode.into(),
            i_nlink: (plan.nlink as u16).into(),
            i_size: (plan.size as u32).into(),
            i_u: i_u.into(),
            i_ino: ino.into(),
            i_uid: (node.meta.uid as u16).into(),
            i_gid: (node.meta.gid as u16).into(),
            ..InodeCompact::default()
        };
        put(out, &mut pos, inode.as_bytes());
    }
    put(out, &mut pos, &plan.xattrs);
    stats.xattr_bytes += plan.xattrs.len() as u64;
    emit_payload(out, plan, pos, nid_of, bs);
}

/// Writes what follows `plan`'s inode and xattrs (which end at `pos`): its
/// chunk indexes, or its full data blocks and inline tail.
fn emit_payload(
    out: &mut [u8],
    plan: &Plan,
    mut pos: usize,
    nid_of: &HashMap<NodeId, u64>,
    bs: usize,
) {
    match &plan.payload {
        Payload::None { .. } => {}
        Payload::Chunked { indexes, .. } => {
            pos = pos.next_multiple_of(size_of::<ChunkIndex>());
            for index in indexes {
                put(out, &mut pos, index.as_bytes());
            }
        }
        Payload::Flat { data, inline_tail } => {
            let bytes = match data {
                FlatData::Symlink(target) => target.clone(),
                FlatData::Dir { blocks, entries } => dir_bytes(blocks, entries, nid_of, bs),
            };
            let full = plan.full_blocks(bs) as usize * bs;
            let full_len = full.min(bytes.len());
            if full_len > 0 {
                let at = plan.raw_blkaddr as usize * bs;
                out[at..at + full_len].copy_from_slice(&bytes[..full_len]);
            }
            if *inline_tail {
                put(out, &mut pos, &bytes[full_len..]);
            }
        }
    }
}

/// Writes the device table, from slot `devt_slotoff`.
fn emit_device_table(out: &mut [u8], devices: &[Device], devt_slotoff: usize) {
    for (i, dev) in devices.iter().enumerate() {
        let mut tag = [0u8; 64];
        let t = dev.tag.as_bytes();
        tag[..t.len().min(64)].copy_from_slice(&t[..t.len().min(64)]);
        let slot = DeviceSlot {
            tag,
            blocks: dev.blocks.into(),
            mapped_blkaddr: 0.into(),
            reserved: [0; 56],
        };
        let mut pos = (devt_slotoff + i) * size_of::<DeviceSlot>();
        put(out, &mut pos, slot.as_bytes());
    }
}

/// The superblock, all but its UUID.
fn superblock(
    block_bits: u8,
    root_nid: u16,
    inos: u64,
    build_time: (i64, u32),
    total_blocks: u32,
    devices: &[Device],
    devt_slotoff: usize,
) -> SuperBlock {
    let mut volume_name = [0u8; 16];
    volume_name[..6].copy_from_slice(b"lamina");
    SuperBlock {
        magic: EROFS_MAGIC.into(),
        blkszbits: block_bits,
        root_nid: root_nid.into(),
        inos: inos.into(),
        build_time: (build_time.0 as u64).into(),
        build_time_nsec: build_time.1.into(),
        blocks: total_blocks.into(),
        volume_name,
        feature_incompat: (FEATURE_INCOMPAT_CHUNKED_FILE
            | if devices.is_empty() {
                0
            } else {
                FEATURE_INCOMPAT_DEVICE_TABLE
            })
        .into(),
        extra_devices: (devices.len() as u16).into(),
        devt_slotoff: (if devices.is_empty() {
            0
        } else {
            devt_slotoff as u16
        })
        .into(),
        ..SuperBlock::default()
    }
}

fn put(out: &mut [u8], pos: &mut usize, bytes: &[u8]) {
    out[*pos..*pos + bytes.len()].copy_from_slice(bytes);
    *pos += bytes.len();
}

/// Placement order: root, then each directory's children together,
/// directories depth-first in name order. Returns the order, each inode's
/// parent directory (for `..`) and its link count.
/// Where each directory's group of children starts in the order.
type GroupStarts = HashMap<usize, NodeId>;

fn place_order(tree: &Tree<FileChunks>) -> (Vec<NodeId>, Vec<NodeId>, Vec<u32>, GroupStarts) {
    let mut slot: HashMap<NodeId, usize> = HashMap::new();
    let mut order = vec![tree.root];
    let mut parents = vec![tree.root];
    let mut nlinks = vec![2u32];
    let mut group_starts = GroupStarts::new();
    slot.insert(tree.root, 0);
    let mut stack = vec![tree.root];
    while let Some(dir) = stack.pop() {
        let Some(entries) = tree.entries(dir) else {
            continue;
        };
        group_starts.insert(order.len(), dir);
        let mut subdirs = Vec::new();
        for entry in entries.values() {
            match slot.get(&entry.node) {
                Some(&i) => nlinks[i] += 1,
                None => {
                    slot.insert(entry.node, order.len());
                    order.push(entry.node);
                    parents.push(dir);
                    let is_dir = tree.nodes[entry.node].is_dir();
                    nlinks.push(if is_dir { 2 } else { 1 });
                    if is_dir {
                        subdirs.push(entry.node);
                    }
                }
            }
        }
        nlinks[slot[&dir]] += subdirs.len() as u32;
        stack.extend(subdirs.into_iter().rev());
    }
    (order, parents, nlinks, group_starts)
}

/// The most frequent (mtime, nsec): compact inodes carry no mtime of their own.
fn most_common_mtime(tree: &Tree<FileChunks>, order: &[NodeId]) -> (i64, u32) {
    let mut counts: HashMap<(i64, u32), usize> = HashMap::new();
    for &n in order {
        let m = &tree.nodes[n].meta;
        if m.mtime >= 0 {
            *counts.entry((m.mtime, m.mtime_nsec)).or_default() += 1;
        }
    }
    counts
        .into_iter()
        .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
        .map(|(t, _)| t)
        .unwrap_or((0, 0))
}

fn file_type<C>(kind: &NodeKind<C>) -> FileType {
    match kind {
        NodeKind::Directory { .. } => FileType::Directory,
        NodeKind::Regular { .. } => FileType::Regular,
        NodeKind::Symlink { .. } => FileType::Symlink,
        NodeKind::CharDevice { .. } => FileType::CharDevice,
        NodeKind::BlockDevice { .. } => FileType::BlockDevice,
        NodeKind::Fifo => FileType::Fifo,
        NodeKind::Socket => FileType::Socket,
    }
}

fn plan_inode(
    tree: &Tree<FileChunks>,
    id: NodeId,
    nlink: u32,
    parent: NodeId,
    build_time: (i64, u32),
    device_count: usize,
    block_bits: u8,
) -> Result<Plan, FormatError> {
    let bs = 1usize << block_bits;
    let node = &tree.nodes[id];
    let xattrs = encode_xattrs(&node.meta.xattrs)?;
    let (size, payload) = match &node.kind {
        NodeKind::Directory { entries } => plan_dir(tree, id, parent, entries, bs)?,
        NodeKind::Symlink { target } => {
            (target.len() as u64, FlatData::Symlink(target.clone())).into_flat()
        }
        NodeKind::Regular { size, content } => {
            plan_chunks(*size, content, device_count, block_bits)?
        }
        NodeKind::CharDevice { major, minor } | NodeKind::BlockDevice { major, minor } => (
            0,
            Payload::None {
                rdev: encode_rdev(*major, *minor)?,
            },
        ),
        NodeKind::Fifo | NodeKind::Socket => (0, Payload::None { rdev: 0 }),
    };
    let meta = &node.meta;
    let extended = meta.uid > 0xFFFF
        || meta.gid > 0xFFFF
        || nlink > 0xFFFF
        || size > u64::from(u32::MAX)
        || (meta.mtime, meta.mtime_nsec) != build_time;
    let mut plan = Plan {
        node: id,
        extended,
        nlink,
        size,
        xattrs,
        payload,
        offset: 0,
        raw_blkaddr: NULL_ADDR,
    };
    // Inline the tail only when it fits in one block with the inode.
    let tail = (size % bs as u64) as usize;
    let fits = tail > 0 && plan.base() + tail <= bs;
    if let Payload::Flat { inline_tail, .. } = &mut plan.payload {
        *inline_tail = fits;
    }
    Ok(plan)
}

/// Directory `id`'s size and payload: its entries, with `.` and `..`
/// (`parent`), checked and sorted by name, packed into blocks.
fn plan_dir(
    tree: &Tree<FileChunks>,
    id: NodeId,
    parent: NodeId,
    entries: &BTreeMap<Vec<u8>, DirEntry>,
    bs: usize,
) -> Result<(u64, Payload), FormatError> {
    let mut list: Vec<(Vec<u8>, NodeId, FileType)> = Vec::with_capacity(entries.len() + 2);
    list.push((b".".to_vec(), id, FileType::Directory));
    list.push((b"..".to_vec(), parent, FileType::Directory));
    for (name, entry) in entries {
        if name.is_empty()
            || name.len() > MAX_NAME_LEN
            || name.contains(&b'/')
            || name.contains(&0)
            || name == b"."
            || name == b".."
        {
            return Err(FormatError::InvalidName(
                String::from_utf8_lossy(name).into_owned(),
            ));
        }
        list.push((
            name.clone(),
            entry.node,
            file_type(&tree.nodes[entry.node].kind),
        ));
    }
    list.sort_by(|a, b| a.0.cmp(&b.0));
    let (blocks, size) = pack_dir_blocks(&list, bs);
    Ok((
        size,
        FlatData::Dir {
            blocks,
            entries: list,
        },
    )
        .into_flat())
}

/// A regular file's size and payload: its chunk indexes, checked against
/// its size and the device table (no payload for an empty file).
fn plan_chunks(
    size: u64,
    content: &FileChunks,
    device_count: usize,
    block_bits: u8,
) -> Result<(u64, Payload), FormatError> {
    if size == 0 {
        return Ok((0, Payload::None { rdev: NULL_ADDR }));
    }
    let bits = content.chunk_bits;
    if !(block_bits..=block_bits + 31).contains(&bits) {
        return Err(FormatError::BadChunk(format!("chunk bits {bits}")));
    }
    let expected = size.div_ceil(1u64 << bits);
    if content.chunks.len() as u64 != expected {
        return Err(FormatError::ChunkCount {
            size,
            got: content.chunks.len(),
            bits,
        });
    }
    let indexes = content
        .chunks
        .iter()
        .map(|c| match *c {
            ChunkAddr::Hole => Ok(ChunkIndex {
                blkaddr: NULL_ADDR.into(),
                ..ChunkIndex::default()
            }),
            ChunkAddr::Data { device, blkaddr } => {
                if device == 0 || usize::from(device) > device_count {
                    return Err(FormatError::BadChunk(format!(
                        "device {device} of {device_count}"
                    )));
                }
                Ok(ChunkIndex {
                    advise: 0.into(),
                    device_id: device.into(),
                    blkaddr: blkaddr.into(),
                })
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let format = u16::from(bits - block_bits) | CHUNK_FORMAT_INDEXES;
    Ok((size, Payload::Chunked { format, indexes }))
}

trait IntoFlat {
    fn into_flat(self) -> (u64, Payload);
}

impl IntoFlat for (u64, FlatData) {
    fn into_flat(self) -> (u64, Payload) {
        (
            self.0,
            Payload::Flat {
                data: self.1,
                inline_tail: false,
            },
        )
    }
}

/// Splits sorted directory entries into blocks; returns each block's entry
/// range and the directory size (full blocks plus the used part of the last).
fn pack_dir_blocks(
    list: &[(Vec<u8>, NodeId, FileType)],
    bs: usize,
) -> (Vec<std::ops::Range<usize>>, u64) {
    let mut blocks = Vec::new();
    let mut start = 0;
    let mut used = 0;
    for (i, (name, _, _)) in list.iter().enumerate() {
        let need = size_of::<Dirent>() + name.len();
        if used + need > bs {
            blocks.push(start..i);
            start = i;
            used = 0;
        }
        used += need;
    }
    blocks.push(start..list.len());
    let size = (blocks.len() as u64 - 1) * bs as u64 + used as u64;
    (blocks, size)
}

fn dir_bytes(
    blocks: &[std::ops::Range<usize>],
    entries: &[(Vec<u8>, NodeId, FileType)],
    nid_of: &HashMap<NodeId, u64>,
    bs: usize,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(blocks.len() * bs);
    for (b, range) in blocks.iter().enumerate() {
        let block_start = b * bs;
        out.resize(block_start, 0);
        let slice = &entries[range.clone()];
        let mut nameoff = slice.len() * size_of::<Dirent>();
        for (name, node, ft) in slice {
            let dirent = Dirent {
                nid: nid_of[node].into(),
                nameoff: (nameoff as u16).into(),
                file_type: *ft as u8,
                reserved: 0,
            };
            out.extend_from_slice(dirent.as_bytes());
            nameoff += name.len();
        }
        for (name, _, _) in slice {
            out.extend_from_slice(name);
        }
    }
    out
}

/// The kernel's `new_encode_dev`: 12-bit major, 20-bit minor.
fn encode_rdev(major: u32, minor: u32) -> Result<u32, FormatError> {
    if major > 0xFFF || minor > 0xF_FFFF {
        return Err(FormatError::DeviceNumber { major, minor });
    }
    Ok((minor & 0xFF) | (major << 8) | ((minor & !0xFF) << 12))
}

/// The inline xattr area: header, then entries padded to 4 bytes.
fn encode_xattrs(
    xattrs: &std::collections::BTreeMap<Vec<u8>, Vec<u8>>,
) -> Result<Vec<u8>, FormatError> {
    if xattrs.is_empty() {
        return Ok(Vec::new());
    }
    let mut out = XattrIbodyHeader::default().as_bytes().to_vec();
    for (name, value) in xattrs {
        let shown = || String::from_utf8_lossy(name).into_owned();
        let (index, suffix) = XATTR_PREFIXES
            .iter()
            .find_map(|(i, p)| name.strip_prefix(*p).map(|s| (*i, s)))
            .ok_or_else(|| FormatError::UnsupportedXattr(shown()))?;
        // The ACL names are whole names; anything longer is not an ACL.
        if (index == 2 || index == 3) && !suffix.is_empty() {
            return Err(FormatError::UnsupportedXattr(shown()));
        }
        let name_len =
            u8::try_from(suffix.len()).map_err(|_| FormatError::XattrTooLong(shown()))?;
        let value_size =
            u16::try_from(value.len()).map_err(|_| FormatError::XattrTooLong(shown()))?;
        let entry = XattrEntry {
            e_name_len: name_len,
            e_name_index: index,
            e_value_size: value_size.into(),
        };
        out.extend_from_slice(entry.as_bytes());
        out.extend_from_slice(suffix);
        out.extend_from_slice(value);
        out.resize(out.len().next_multiple_of(4), 0);
    }
    if (out.len() - 12) / 4 + 1 > usize::from(u16::MAX) {
        return Err(FormatError::TooLarge("inline xattrs"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::erofs::test_tree::add;
    use lamina_tree::{Metadata, Node};

    fn meta(mtime: i64) -> Metadata {
        Metadata {
            mode: 0o755,
            mtime,
            ..Metadata::default()
        }
    }

    #[test]
    fn dir_blocks_split_and_size() {
        let names: Vec<(Vec<u8>, NodeId, FileType)> = (0..1000)
            .map(|i| (format!("name-{i:05}").into_bytes(), 0, FileType::Regular))
            .collect();
        let (blocks, size) = pack_dir_blocks(&names, BLOCK_SIZE);
        // 22 bytes per entry: 186 entries fit in a 4096-byte block.
        assert_eq!(blocks[0], 0..186);
        assert_eq!(blocks.len(), 1000_usize.div_ceil(186));
        assert_eq!(size, 5 * 4096 + (1000 - 5 * 186) as u64 * 22);
    }

    #[test]
    fn rdev_encoding_matches_kernel() {
        assert_eq!(encode_rdev(1, 3).unwrap(), 0x103);
        assert_eq!(
            encode_rdev(259, 70000).unwrap(),
            (70000 & 0xff) | (259 << 8) | ((70000 & !0xff) << 12)
        );
        assert!(encode_rdev(4096, 0).is_err());
    }

    #[test]
    fn image_is_reproducible_and_sized() {
        let mut tree: Tree<FileChunks> = Tree::new();
        let root = tree.root;
        let sub = add(
            &mut tree,
            root,
            b"sub",
            Node {
                meta: meta(5),
                kind: NodeKind::Directory {
                    entries: Default::default(),
                },
            },
        );
        for i in 0..300 {
            add(
                &mut tree,
                sub,
                format!("f{i}").as_bytes(),
                Node {
                    meta: meta(7),
                    kind: NodeKind::Regular {
                        size: 5000,
                        content: FileChunks {
                            chunk_bits: 20,
                            chunks: vec![ChunkAddr::Data {
                                device: 1,
                                blkaddr: i * 2,
                            }],
                        },
                    },
                },
            );
        }
        add(
            &mut tree,
            root,
            b"link",
            Node {
                meta: meta(1),
                kind: NodeKind::Symlink {
                    target: vec![b'x'; 3000],
                },
            },
        );
        let devices = vec![Device {
            tag: "blob".into(),
            blocks: 600,
        }];
        let (a, stats) = write_image(&tree, &devices).unwrap();
        let (b, _) = write_image(&tree, &devices).unwrap();
        assert_eq!(a, b);
        assert_eq!(stats.inodes, 303);
        assert_eq!(a.len(), stats.blocks as usize * BLOCK_SIZE);
        assert_eq!(&a[1024..1028], &EROFS_MAGIC.to_le_bytes());
        // The 300 files share mtime 7, so they are compact.
        assert_eq!(stats.compact_inodes, 300);
    }

    /// Issue 7: an xattr with an empty value is an entry with value size 0,
    /// not left out.
    #[test]
    fn empty_xattr_value_is_encoded() {
        let xattrs = std::collections::BTreeMap::from([
            (b"user.empty".to_vec(), Vec::new()),
            (b"trusted.t".to_vec(), b"v".to_vec()),
        ]);
        let area = encode_xattrs(&xattrs).unwrap();
        // header, then "t"+"v" (4 + 2, padded to 8), then "empty" (4 + 5, padded to 12)
        assert_eq!(area.len(), 12 + 8 + 12);
        assert_eq!(&area[12..20], &[1, 4, 1, 0, b't', b'v', 0, 0]);
        assert_eq!(&area[20..29], &[5, 1, 0, 0, b'e', b'm', b'p', b't', b'y']);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut tree: Tree<FileChunks> = Tree::new();
        let root = tree.root;
        add(
            &mut tree,
            root,
            b"f",
            Node {
                meta: meta(0),
                kind: NodeKind::Regular {
                    size: 3 << 20,
                    content: FileChunks {
                        chunk_bits: 20,
                        chunks: vec![ChunkAddr::Hole],
                    },
                },
            },
        );
        assert!(matches!(
            write_image(&tree, &[]),
            Err(FormatError::ChunkCount { .. })
        ));

        let mut tree: Tree<FileChunks> = Tree::new();
        let mut m = meta(0);
        m.xattrs.insert(b"system.nfs4_acl".to_vec(), b"x".to_vec());
        add(
            &mut tree,
            0,
            b"x",
            Node {
                meta: m,
                kind: NodeKind::Fifo,
            },
        );
        assert!(matches!(
            write_image(&tree, &[]),
            Err(FormatError::UnsupportedXattr(_))
        ));
    }
}
