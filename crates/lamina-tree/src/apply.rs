//! Applying one layer tar to the tree, with OCI whiteout semantics.

use std::collections::BTreeMap;
use std::io::{self, Read};

use base64::Engine as _;

use crate::tree::{DirEntry, Metadata, Node, NodeId, NodeKind, Tree};

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";
/// Symlinks followed while resolving one path, as the kernel's MAXSYMLINKS.
const MAX_SYMLINK_FOLLOWS: u32 = 40;

/// Why a layer could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The tar stream itself could not be read (corrupt, truncated, or the
    /// digest check of the underlying reader failed).
    #[error("layer {layer}: reading the tar stream failed: {source}")]
    Read {
        /// Layer index.
        layer: u32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// An entry made no sense in the tree built so far.
    #[error("layer {layer}: entry {path:?}: {reason}")]
    Entry {
        /// Layer index.
        layer: u32,
        /// Entry path as in the tar.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The content callback failed.
    #[error("layer {layer}: entry {path:?}: storing content failed: {source}")]
    Content {
        /// Layer index.
        layer: u32,
        /// Entry path as in the tar.
        path: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
}

/// What happened while applying a layer.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LayerStats {
    /// Tar entries read.
    pub entries: u64,
    /// Whiteouts and opaque markers applied.
    pub whiteouts: u64,
    /// Entries whose path had to be confined (`..` above the root, absolute
    /// paths, symlinks pointing out of the tree).
    pub confined: u64,
    /// Entry types lamina ignores (e.g. PAX global headers).
    pub skipped: u64,
    /// Bytes of regular file content.
    pub content_bytes: u64,
}

/// A reader the tar crate may "seek" forward in: it reads the bytes and
/// drops them. Else the crate skips the padding after each entry's data by
/// reading it into a 32 KiB buffer it zeroes first, every time: 32 GB of
/// memset, over a second of a million-file convert.
struct ForwardSeek<R> {
    inner: R,
    /// Bytes read or skipped.
    pos: u64,
}

impl<R: Read> Read for ForwardSeek<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl<R: Read> io::Seek for ForwardSeek<R> {
    fn seek(&mut self, to: io::SeekFrom) -> io::Result<u64> {
        let skip = match to {
            io::SeekFrom::Current(n) if n >= 0 => n as u64,
            io::SeekFrom::Start(n) if n >= self.pos => n - self.pos,
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "a layer stream seeks only forward",
                ))
            }
        };
        let skipped = io::copy(&mut (&mut self.inner).take(skip), &mut io::sink())?;
        self.pos += skipped;
        if skipped < skip {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "unexpected EOF during skip",
            ));
        }
        Ok(self.pos)
    }
}

/// Applies one layer tar to `tree`.
///
/// `content` is called for each regular file with the entry's path, a reader
/// of exactly its bytes, its size and where its bytes start in the tar
/// stream (a multiple of 512: what a tar index points at), and returns the
/// handle stored in the tree. The reader `tar` is drained to EOF so that a digest-checking reader
/// underneath sees every byte.
pub fn apply_layer<C, R, F>(
    tree: &mut Tree<C>,
    layer: u32,
    tar: R,
    mut content: F,
) -> Result<LayerStats, ApplyError>
where
    R: Read,
    F: FnMut(&[u8], &mut dyn Read, u64, u64) -> io::Result<C>,
{
    let read_err = |source| ApplyError::Read { layer, source };
    let mut archive = tar::Archive::new(ForwardSeek { inner: tar, pos: 0 });
    let mut stats = LayerStats::default();
    {
        // Raw entries: PAX and GNU long-name records are handled here, because
        // the tar crate splits PAX records at newlines and so misreads binary
        // xattr values (a capability set can contain 0x0a).
        let entries = archive.entries_with_seek().map_err(read_err)?;
        let entries = entries.raw(true);
        let mut pending = Pending::default();
        for entry in entries {
            let mut entry = entry.map_err(read_err)?;
            match entry.header().entry_type() {
                tar::EntryType::XHeader => {
                    let data = read_small(&mut entry).map_err(read_err)?;
                    pending.pax = parse_pax(&data).map_err(read_err)?;
                    continue;
                }
                tar::EntryType::XGlobalHeader => {
                    stats.skipped += 1;
                    continue;
                }
                tar::EntryType::GNULongName => {
                    pending.long_name = Some(trim_nul(read_small(&mut entry).map_err(read_err)?));
                    continue;
                }
                tar::EntryType::GNULongLink => {
                    pending.long_link = Some(trim_nul(read_small(&mut entry).map_err(read_err)?));
                    continue;
                }
                _ => {}
            }
            stats.entries += 1;
            let pending = std::mem::take(&mut pending);
            apply_entry(tree, layer, &mut entry, pending, &mut stats, &mut content)?;
        }
    }
    // Trailing zero blocks and padding must reach the digest check too.
    io::copy(&mut archive.into_inner(), &mut io::sink()).map_err(read_err)?;
    Ok(stats)
}

/// PAX and GNU records that apply to the next real entry.
#[derive(Debug, Default)]
struct Pending {
    pax: Vec<(Vec<u8>, Vec<u8>)>,
    long_name: Option<Vec<u8>>,
    long_link: Option<Vec<u8>>,
}

impl Pending {
    fn pax(&self, key: &[u8]) -> Option<&[u8]> {
        self.pax
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_slice())
    }
}

/// Reads a metadata record (PAX or long name), refusing absurd sizes.
fn read_small<R: Read>(entry: &mut tar::Entry<'_, R>) -> io::Result<Vec<u8>> {
    const MAX: u64 = 16 << 20;
    if entry.size() > MAX {
        return Err(invalid(format!(
            "tar metadata record of {} bytes",
            entry.size()
        )));
    }
    let mut data = Vec::with_capacity(entry.size() as usize);
    entry.read_to_end(&mut data)?;
    Ok(data)
}

fn trim_nul(mut v: Vec<u8>) -> Vec<u8> {
    while v.last() == Some(&0) {
        v.pop();
    }
    v
}

/// Parses PAX records (`LEN KEY=VALUE\n`, LEN counting the whole record), by
/// length, so values may hold any bytes.
///
/// POSIX: a keyword with an empty value is deleted, so the header field
/// applies again (`uid=` means the header's uid). Xattr records are exempt:
/// there an empty value is the xattr's value (`user.x` set to ""), as
/// containerd keeps it.
fn parse_pax(mut data: &[u8]) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut out = Vec::new();
    while !data.is_empty() {
        if data.iter().all(|&b| b == 0) {
            break; // padding some writers leave
        }
        let bad = || invalid("malformed PAX record".into());
        let space = data.iter().position(|&b| b == b' ').ok_or_else(bad)?;
        let len: usize = std::str::from_utf8(&data[..space])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(bad)?;
        if len <= space + 1 || len > data.len() || data[len - 1] != b'\n' {
            return Err(bad());
        }
        let record = &data[space + 1..len - 1];
        let eq = record.iter().position(|&b| b == b'=').ok_or_else(bad)?;
        let (key, value) = (&record[..eq], &record[eq + 1..]);
        if value.is_empty() && !is_xattr_record(key) {
            out.retain(|(k, _)| k != key);
        } else {
            out.push((key.to_vec(), value.to_vec()));
        }
        data = &data[len..];
    }
    Ok(out)
}

const SCHILY_XATTR: &[u8] = b"SCHILY.xattr.";
const LIBARCHIVE_XATTR: &[u8] = b"LIBARCHIVE.xattr.";

fn is_xattr_record(key: &[u8]) -> bool {
    key.starts_with(SCHILY_XATTR) || key.starts_with(LIBARCHIVE_XATTR)
}

/// One parsed tar entry, reduced to what the tree needs.
enum Incoming {
    Dir,
    File,
    Symlink(Vec<u8>),
    Hardlink(Vec<u8>),
    Char(u32, u32),
    Block(u32, u32),
    Fifo,
}

fn apply_entry<C, R: Read, F>(
    tree: &mut Tree<C>,
    layer: u32,
    entry: &mut tar::Entry<'_, R>,
    pending: Pending,
    stats: &mut LayerStats,
    content: &mut F,
) -> Result<(), ApplyError>
where
    F: FnMut(&[u8], &mut dyn Read, u64, u64) -> io::Result<C>,
{
    let raw_path = match (pending.pax(b"path"), &pending.long_name) {
        (Some(p), _) => p.to_vec(),
        (None, Some(p)) => p.clone(),
        (None, None) => entry.header().path_bytes().into_owned(),
    };
    let shown = String::from_utf8_lossy(&raw_path).into_owned();
    let fail = |reason: String| ApplyError::Entry {
        layer,
        path: shown.clone(),
        reason,
    };
    let read_err = |source| ApplyError::Read { layer, source };

    let Some(incoming) = classify_entry(entry, &pending, layer, stats, &fail)? else {
        return Ok(());
    };
    let meta = read_metadata(entry, &pending).map_err(read_err)?;

    let (parent_comps, name, confined) = split_path(&raw_path);
    if confined {
        stats.confined += 1;
    }

    // Whiteouts: applied only to what lower layers left.
    if let Some(name) = &name {
        if name.starts_with(WHITEOUT_PREFIX) {
            return apply_whiteout(tree, &parent_comps, name, layer, stats, &fail);
        }
    }

    let parent = resolve_dir(tree, &parent_comps, layer, true, stats)
        .map_err(|r| fail(r.to_string()))?
        .ok_or_else(|| fail("parent directory could not be created".into()))?;

    let Some(name) = name else {
        // The entry names the directory itself ("./", "..", "/").
        return match incoming {
            Incoming::Dir => {
                tree.nodes[parent].meta = meta;
                Ok(())
            }
            _ => Err(fail("only a directory can name the root".into())),
        };
    };

    let kind = match incoming {
        Incoming::Dir => {
            let existing = tree.entries(parent).and_then(|e| e.get(&name)).copied();
            if let Some(existing) = existing {
                if tree.nodes[existing.node].is_dir() {
                    // Same directory, new metadata: children stay.
                    tree.nodes[existing.node].meta = meta;
                    if let Some(e) = tree.entries_mut(parent).and_then(|e| e.get_mut(&name)) {
                        e.layer = layer;
                    }
                    return Ok(());
                }
            }
            NodeKind::Directory {
                entries: BTreeMap::new(),
            }
        }
        Incoming::File => store_content(entry, &raw_path, &shown, layer, stats, content)?,
        Incoming::Symlink(target) => NodeKind::Symlink { target },
        Incoming::Char(major, minor) => NodeKind::CharDevice { major, minor },
        Incoming::Block(major, minor) => NodeKind::BlockDevice { major, minor },
        Incoming::Fifo => NodeKind::Fifo,
        Incoming::Hardlink(target) => {
            return add_hardlink(tree, parent, name, &target, layer, stats, &fail);
        }
    };
    let node = tree.add_node(Node { meta, kind });
    let entries = tree
        .entries_mut(parent)
        .ok_or_else(|| fail("parent is not a directory".into()))?;
    entries.insert(name, DirEntry { node, layer });
    Ok(())
}

/// Checks that `entry` is one lamina can apply (no PAX size other than the
/// header's, not sparse) and reduces it to what the tree needs; `None` for
/// an entry type lamina skips (counted in `stats`).
fn classify_entry<R: Read>(
    entry: &tar::Entry<'_, R>,
    pending: &Pending,
    layer: u32,
    stats: &mut LayerStats,
    fail: &impl Fn(String) -> ApplyError,
) -> Result<Option<Incoming>, ApplyError> {
    let read_err = |source| ApplyError::Read { layer, source };
    let header = entry.header();
    let device = |h: &tar::Header| -> Result<(u32, u32), ApplyError> {
        let major = h.device_major().map_err(read_err)?.unwrap_or(0);
        let minor = h.device_minor().map_err(read_err)?.unwrap_or(0);
        Ok((major, minor))
    };
    let link_target = |e: &tar::Entry<'_, R>| -> Result<Vec<u8>, ApplyError> {
        match (pending.pax(b"linkpath"), &pending.long_link) {
            (Some(l), _) => Ok(l.to_vec()),
            (None, Some(l)) => Ok(l.clone()),
            (None, None) => e
                .header()
                .link_name_bytes()
                .map(|l| l.into_owned())
                .ok_or_else(|| fail("link entry without a link name".into())),
        }
    };
    if let Some(size) = pending.pax(b"size") {
        // Raw iteration reads the header's size; a different PAX size would
        // desynchronise the stream, so refuse it rather than guess.
        if std::str::from_utf8(size)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            != Some(entry.size())
        {
            return Err(fail(
                "PAX size record differs from the header size (files over 8 GiB are not supported)"
                    .into(),
            ));
        }
    }
    // Sparse files (GNU type 'S', or PAX `GNU.sparse.*` records, as GNU tar
    // --sparse writes them): raw iteration reads their packed data, sparse
    // map or extension headers as the file's bytes, which would make a file
    // of the wrong size and content. Refused, never converted wrong.
    if header.entry_type() == tar::EntryType::GNUSparse
        || pending
            .pax
            .iter()
            .any(|(k, _)| k.starts_with(b"GNU.sparse."))
    {
        return Err(fail(
            "sparse files (GNU or PAX sparse tar entries) are not supported".into(),
        ));
    }
    let incoming = match header.entry_type() {
        tar::EntryType::Directory => Incoming::Dir,
        tar::EntryType::Regular | tar::EntryType::Continuous => Incoming::File,
        tar::EntryType::Symlink => Incoming::Symlink(link_target(entry)?),
        tar::EntryType::Link => Incoming::Hardlink(link_target(entry)?),
        tar::EntryType::Char => {
            let (a, b) = device(header)?;
            Incoming::Char(a, b)
        }
        tar::EntryType::Block => {
            let (a, b) = device(header)?;
            Incoming::Block(a, b)
        }
        tar::EntryType::Fifo => Incoming::Fifo,
        _ => {
            stats.skipped += 1;
            return Ok(None);
        }
    };
    Ok(Some(incoming))
}

/// Applies the whiteout or opaque marker `name` in the directory
/// `parent_comps` names, hiding only what lower layers left.
fn apply_whiteout<C>(
    tree: &mut Tree<C>,
    parent_comps: &[Vec<u8>],
    name: &[u8],
    layer: u32,
    stats: &mut LayerStats,
    fail: &impl Fn(String) -> ApplyError,
) -> Result<(), ApplyError> {
    stats.whiteouts += 1;
    let Some(parent) =
        resolve_dir(tree, parent_comps, layer, false, stats).map_err(|r| fail(r.to_string()))?
    else {
        return Ok(()); // nothing below to hide
    };
    let entries = tree
        .entries_mut(parent)
        .ok_or_else(|| fail("whiteout parent is not a directory".into()))?;
    if name == OPAQUE_MARKER {
        entries.retain(|_, e| e.layer >= layer);
    } else {
        let victim = &name[WHITEOUT_PREFIX.len()..];
        if entries.get(victim).is_some_and(|e| e.layer < layer) {
            entries.remove(victim);
        }
    }
    Ok(())
}

/// Passes a regular file's bytes to `content` and returns its node kind;
/// whatever the callback left unread is read and dropped.
fn store_content<C, R: Read, F>(
    entry: &mut tar::Entry<'_, R>,
    raw_path: &[u8],
    shown: &str,
    layer: u32,
    stats: &mut LayerStats,
    content: &mut F,
) -> Result<NodeKind<C>, ApplyError>
where
    F: FnMut(&[u8], &mut dyn Read, u64, u64) -> io::Result<C>,
{
    let read_err = |source| ApplyError::Read { layer, source };
    let size = entry.size();
    let offset = entry.raw_file_position();
    let mut reader = (&mut *entry).take(size);
    let handle =
        content(raw_path, &mut reader, size, offset).map_err(|source| ApplyError::Content {
            layer,
            path: shown.to_owned(),
            source,
        })?;
    // A callback that stopped early must not desynchronise the tar.
    io::copy(&mut reader, &mut io::sink()).map_err(read_err)?;
    stats.content_bytes += size;
    Ok(NodeKind::Regular {
        size,
        content: handle,
    })
}

/// Adds `name` in `parent` as a hard link to `target`, which must exist in
/// the tree and not be a directory.
fn add_hardlink<C>(
    tree: &mut Tree<C>,
    parent: NodeId,
    name: Vec<u8>,
    target: &[u8],
    layer: u32,
    stats: &mut LayerStats,
    fail: &impl Fn(String) -> ApplyError,
) -> Result<(), ApplyError> {
    let (t_parent, t_name, t_confined) = split_path(target);
    if t_confined {
        stats.confined += 1;
    }
    let t_name = t_name.ok_or_else(|| fail("hardlink to a directory".into()))?;
    let t_dir =
        resolve_dir(tree, &t_parent, layer, false, stats).map_err(|r| fail(r.to_string()))?;
    let target_node = t_dir
        .and_then(|d| tree.entries(d))
        .and_then(|e| e.get(&t_name))
        .map(|e| e.node)
        .ok_or_else(|| {
            fail(format!(
                "hardlink target {:?} does not exist in the image",
                String::from_utf8_lossy(target)
            ))
        })?;
    if tree.nodes[target_node].is_dir() {
        return Err(fail("hardlink to a directory".into()));
    }
    let entries = tree
        .entries_mut(parent)
        .ok_or_else(|| fail("parent is not a directory".into()))?;
    entries.insert(
        name,
        DirEntry {
            node: target_node,
            layer,
        },
    );
    Ok(())
}

/// Splits a tar path into parent components and final name, dropping empty
/// and `.` components. A final `..` (or an empty path) yields no name: the
/// entry names a directory reached through the parent components. Returns
/// whether the path was absolute or used `..` (so it may be confined).
fn split_path(path: &[u8]) -> (Vec<Vec<u8>>, Option<Vec<u8>>, bool) {
    let confined = path.first() == Some(&b'/');
    let mut comps: Vec<Vec<u8>> = path
        .split(|&b| b == b'/')
        .filter(|c| !c.is_empty() && *c != b".")
        .map(<[u8]>::to_vec)
        .collect();
    let has_dotdot = comps.iter().any(|c| c == b"..");
    match comps.last() {
        Some(last) if last != b".." => {
            let name = comps.pop();
            (comps, name, confined || has_dotdot)
        }
        _ => (comps, None, confined || has_dotdot),
    }
}

/// Why a path could not be resolved to a directory.
#[derive(Debug)]
enum ResolveError {
    NotADirectory(Vec<u8>),
    SymlinkLoop,
}

impl std::fmt::Display for ResolveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResolveError::NotADirectory(c) => write!(
                f,
                "path component {:?} is not a directory",
                String::from_utf8_lossy(c)
            ),
            ResolveError::SymlinkLoop => write!(f, "too many levels of symbolic links"),
        }
    }
}

/// Walks `comps` from the root, following symlinks inside the tree and
/// stopping `..` at the root. Missing directories are created (with default
/// metadata) when `create` is set; otherwise `Ok(None)` is returned.
fn resolve_dir<C>(
    tree: &mut Tree<C>,
    comps: &[Vec<u8>],
    layer: u32,
    create: bool,
    stats: &mut LayerStats,
) -> Result<Option<NodeId>, ResolveError> {
    let mut stack = vec![tree.root];
    let mut follows = 0;
    if walk(tree, &mut stack, comps, layer, create, &mut follows, stats)? {
        Ok(stack.last().copied())
    } else {
        Ok(None)
    }
}

fn walk<C>(
    tree: &mut Tree<C>,
    stack: &mut Vec<NodeId>,
    comps: &[Vec<u8>],
    layer: u32,
    create: bool,
    follows: &mut u32,
    stats: &mut LayerStats,
) -> Result<bool, ResolveError> {
    let mut at = 0;
    while at < comps.len() {
        let comp = &comps[at];
        at += 1;
        if comp == b".." {
            if stack.len() > 1 {
                stack.pop();
            }
            continue;
        }
        let cur = *stack.last().unwrap_or(&tree.root);
        let existing = tree.entries(cur).and_then(|e| e.get(comp)).map(|e| e.node);
        let child = match existing {
            // `missing/..` names the current directory: create nothing.
            None if comps.get(at).is_some_and(|c| c == b"..") => {
                at += 1;
                continue;
            }
            Some(child) => child,
            None if create => {
                let node = tree.add_node(Node {
                    meta: Metadata {
                        mode: 0o755,
                        ..Metadata::default()
                    },
                    kind: NodeKind::Directory {
                        entries: BTreeMap::new(),
                    },
                });
                if let Some(e) = tree.entries_mut(cur) {
                    e.insert(comp.clone(), DirEntry { node, layer });
                }
                node
            }
            None => return Ok(false),
        };
        match &tree.nodes[child].kind {
            NodeKind::Directory { .. } => stack.push(child),
            NodeKind::Symlink { target } => {
                *follows += 1;
                if *follows > MAX_SYMLINK_FOLLOWS {
                    return Err(ResolveError::SymlinkLoop);
                }
                let target = target.clone();
                if target.first() == Some(&b'/') {
                    stack.truncate(1);
                }
                let target_comps: Vec<Vec<u8>> = target
                    .split(|&b| b == b'/')
                    .filter(|c| !c.is_empty() && *c != b".")
                    .map(<[u8]>::to_vec)
                    .collect();
                if target.first() == Some(&b'/') || target_comps.iter().any(|c| c == b"..") {
                    stats.confined += 1;
                }
                if !walk(tree, stack, &target_comps, layer, create, follows, stats)? {
                    return Ok(false);
                }
            }
            _ => return Err(ResolveError::NotADirectory(comp.clone())),
        }
    }
    Ok(true)
}

/// Reads owner, mode, mtime and xattrs, with PAX records overriding the
/// fixed header fields (uids above 2^21, fractional mtimes).
fn read_metadata<R: Read>(entry: &tar::Entry<'_, R>, pending: &Pending) -> io::Result<Metadata> {
    let header = entry.header();
    let mut meta = Metadata {
        mode: header.mode()? & 0o7777,
        uid: u32::try_from(header.uid()?).unwrap_or(u32::MAX),
        gid: u32::try_from(header.gid()?).unwrap_or(u32::MAX),
        mtime: i64::try_from(header.mtime()?).unwrap_or(i64::MAX),
        mtime_nsec: 0,
        xattrs: BTreeMap::new(),
    };
    {
        for (key, value) in &pending.pax {
            let (key, value) = (key.as_slice(), value.as_slice());
            let parse_u32 = |v: &[u8]| {
                std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.trim().parse::<u32>().ok())
                    .ok_or_else(|| {
                        invalid(format!("bad PAX number {:?}", String::from_utf8_lossy(v)))
                    })
            };
            match key {
                b"uid" => meta.uid = parse_u32(value)?,
                b"gid" => meta.gid = parse_u32(value)?,
                b"mtime" => (meta.mtime, meta.mtime_nsec) = parse_pax_time(value)?,
                _ => {
                    if let Some(name) = key.strip_prefix(SCHILY_XATTR) {
                        meta.xattrs.insert(name.to_vec(), value.to_vec());
                    } else if let Some(name) = key.strip_prefix(LIBARCHIVE_XATTR) {
                        let name = percent_decode(name);
                        let value = base64::engine::general_purpose::STANDARD_NO_PAD
                            .decode(value.strip_suffix(b"=").unwrap_or(value))
                            .or_else(|_| base64::engine::general_purpose::STANDARD.decode(value))
                            .map_err(|e| invalid(format!("bad LIBARCHIVE.xattr value: {e}")))?;
                        meta.xattrs.insert(name, value);
                    }
                }
            }
        }
    }
    Ok(meta)
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Parses a PAX time (`1234567890.123456789`, possibly negative).
fn parse_pax_time(v: &[u8]) -> io::Result<(i64, u32)> {
    let s = std::str::from_utf8(v)
        .map_err(|_| invalid("PAX mtime is not UTF-8".into()))?
        .trim();
    let bad = || invalid(format!("bad PAX mtime {s:?}"));
    let (secs, frac) = s.split_once('.').unwrap_or((s, ""));
    let secs: i64 = secs.parse().map_err(|_| bad())?;
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let mut digits: String = frac.chars().take(9).collect();
    while digits.len() < 9 {
        digits.push('0');
    }
    let nsec: u32 = digits.parse().map_err(|_| bad())?;
    if s.starts_with('-') && nsec > 0 {
        // -1.25 means 1.25 s before the epoch: -2 s + 0.75 s.
        return Ok((secs - 1, 1_000_000_000 - nsec));
    }
    Ok((secs, nsec))
}

fn percent_decode(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'%' && i + 2 < s.len() {
            if let (Some(h), Some(l)) = (
                s.get(i + 1).and_then(|c| (*c as char).to_digit(16)),
                s.get(i + 2).and_then(|c| (*c as char).to_digit(16)),
            ) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(s[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    /// The tar crate's forward seeks read and drop; nothing seeks back.
    #[test]
    fn layer_streams_seek_only_forward() {
        use std::io::{Seek, SeekFrom};
        let bytes: Vec<u8> = (0..100).collect();
        let mut r = ForwardSeek {
            inner: &bytes[..],
            pos: 0,
        };
        let mut two = [0; 2];
        r.read_exact(&mut two).unwrap();
        assert_eq!(r.seek(SeekFrom::Current(10)).unwrap(), 12);
        r.read_exact(&mut two).unwrap();
        assert_eq!(two, [12, 13]);
        assert_eq!(r.seek(SeekFrom::Start(20)).unwrap(), 20);
        assert_eq!(r.stream_position().unwrap(), 20);
        assert!(r.seek(SeekFrom::Start(3)).is_err(), "backwards");
        assert!(r.seek(SeekFrom::Current(-1)).is_err(), "backwards");
        assert!(r.seek(SeekFrom::End(0)).is_err());
        let e = r.seek(SeekFrom::Current(81)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    use super::*;

    struct LayerBuilder(tar::Builder<Vec<u8>>);

    impl LayerBuilder {
        fn new() -> Self {
            LayerBuilder(tar::Builder::new(Vec::new()))
        }
        fn add(&mut self, path: &str, ty: tar::EntryType, data: &[u8], link: Option<&str>) {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(ty);
            h.set_mode(if ty == tar::EntryType::Directory {
                0o755
            } else {
                0o644
            });
            h.set_size(data.len() as u64);
            h.set_mtime(1000);
            h.set_uid(0);
            h.set_gid(0);
            if let Some(link) = link {
                self.0.append_link(&mut h, path, link).unwrap();
            } else {
                self.0.append_data(&mut h, path, data).unwrap();
            }
        }
        fn dir(&mut self, p: &str) -> &mut Self {
            self.add(p, tar::EntryType::Directory, b"", None);
            self
        }
        fn file(&mut self, p: &str, d: &[u8]) -> &mut Self {
            self.add(p, tar::EntryType::Regular, d, None);
            self
        }
        fn symlink(&mut self, p: &str, t: &str) -> &mut Self {
            self.add(p, tar::EntryType::Symlink, b"", Some(t));
            self
        }
        fn hardlink(&mut self, p: &str, t: &str) -> &mut Self {
            self.add(p, tar::EntryType::Link, b"", Some(t));
            self
        }
        /// A PAX extended header with `records`, for the next entry.
        fn pax(&mut self, records: &[(&str, &[u8])]) -> &mut Self {
            let mut data = Vec::new();
            for (key, value) in records {
                let body = [b" ", key.as_bytes(), b"=", value, b"\n"].concat();
                let mut len = body.len() + 1;
                while len.to_string().len() + body.len() != len {
                    len = len.to_string().len() + body.len();
                }
                data.extend_from_slice(len.to_string().as_bytes());
                data.extend_from_slice(&body);
            }
            let mut h = tar::Header::new_ustar();
            h.set_entry_type(tar::EntryType::XHeader);
            h.set_path("PaxHeader").unwrap();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            self.0.append(&h, &data[..]).unwrap();
            self
        }
        fn bytes(self) -> Vec<u8> {
            self.0.into_inner().unwrap()
        }
    }

    type T = Tree<Vec<u8>>;

    /// Each file's data offset points at its bytes in the tar stream, past
    /// PAX records and GNU long names before its header.
    #[test]
    fn data_offsets_point_at_the_files_bytes_in_the_tar() {
        let long = format!("d/{}", "n".repeat(150));
        let mut b = LayerBuilder::new();
        b.dir("d").file("d/a", b"first").file("d/empty", b"");
        b.pax(&[("user.k", b"v")]).file("d/b", &[7u8; 1000]);
        b.file(&long, b"behind a long name");
        let tar = b.bytes();
        let mut t: Tree<(u64, u64)> = Tree::new();
        apply_layer(&mut t, 0, &tar[..], |_, _, size, offset| Ok((offset, size))).unwrap();
        let mut checked = 0;
        t.walk(|path, id| {
            if let NodeKind::Regular { content, .. } = &t.nodes[id].kind {
                let (offset, size) = *content;
                assert_eq!(offset % 512, 0, "{path:?}");
                let want: &[u8] = match path.rsplit(|&c| c == b'/').next().unwrap() {
                    b"a" => b"first",
                    b"empty" => b"",
                    b"b" => &[7u8; 1000],
                    _ => b"behind a long name",
                };
                let at = offset as usize;
                assert_eq!(&tar[at..at + size as usize], want, "{path:?}");
                checked += 1;
            }
        });
        assert_eq!(checked, 4);
    }

    fn apply(tree: &mut T, layer: u32, tar: Vec<u8>) -> Result<LayerStats, ApplyError> {
        apply_layer(tree, layer, &tar[..], |_, r, _, _| {
            let mut v = Vec::new();
            r.read_to_end(&mut v)?;
            Ok(v)
        })
    }

    fn content(tree: &T, path: &str) -> Option<Vec<u8>> {
        match &tree.nodes[tree.lookup(path.as_bytes())?].kind {
            NodeKind::Regular { content, .. } => Some(content.clone()),
            _ => None,
        }
    }

    fn paths(tree: &T) -> Vec<String> {
        let mut out = Vec::new();
        tree.walk(|p, _| out.push(String::from_utf8_lossy(p).into_owned()));
        out
    }

    #[test]
    fn whiteouts_and_opaque_dirs() {
        let mut t = T::new();
        let mut l0 = LayerBuilder::new();
        l0.dir("a")
            .file("a/x", b"1")
            .file("a/y", b"2")
            .dir("b")
            .file("b/z", b"3");
        apply(&mut t, 0, l0.bytes()).unwrap();
        let mut l1 = LayerBuilder::new();
        l1.dir("a")
            .file("a/.wh..wh..opq", b"")
            .file("a/new", b"n")
            .file("b/.wh.z", b"")
            .file(".wh.missing", b"");
        apply(&mut t, 1, l1.bytes()).unwrap();
        assert_eq!(paths(&t), vec!["", "a", "a/new", "b"]);
    }

    #[test]
    fn whiteout_does_not_hide_same_layer_entry() {
        let mut t = T::new();
        let mut l0 = LayerBuilder::new();
        l0.file("f", b"old");
        apply(&mut t, 0, l0.bytes()).unwrap();
        let mut l1 = LayerBuilder::new();
        l1.file(".wh.f", b"").file("f", b"new");
        apply(&mut t, 1, l1.bytes()).unwrap();
        assert_eq!(content(&t, "f").unwrap(), b"new");
        let mut l2 = LayerBuilder::new();
        l2.file("g", b"g").file(".wh.g", b"");
        apply(&mut t, 2, l2.bytes()).unwrap();
        assert_eq!(content(&t, "g").unwrap(), b"g");
    }

    #[test]
    fn hardlink_survives_whiteout_of_other_name() {
        let mut t = T::new();
        let mut l0 = LayerBuilder::new();
        l0.file("orig", b"shared").hardlink("link", "orig");
        apply(&mut t, 0, l0.bytes()).unwrap();
        let mut l1 = LayerBuilder::new();
        l1.file(".wh.orig", b"").hardlink("link2", "link");
        apply(&mut t, 1, l1.bytes()).unwrap();
        assert!(t.lookup(b"orig").is_none());
        assert_eq!(content(&t, "link").unwrap(), b"shared");
        assert_eq!(t.lookup(b"link"), t.lookup(b"link2"));
    }

    #[test]
    fn file_replaced_by_dir_and_back() {
        let mut t = T::new();
        let mut l0 = LayerBuilder::new();
        l0.file("p", b"file");
        apply(&mut t, 0, l0.bytes()).unwrap();
        let mut l1 = LayerBuilder::new();
        l1.dir("p").file("p/child", b"c");
        apply(&mut t, 1, l1.bytes()).unwrap();
        assert_eq!(content(&t, "p/child").unwrap(), b"c");
        let mut l2 = LayerBuilder::new();
        l2.file("p", b"file again");
        apply(&mut t, 2, l2.bytes()).unwrap();
        assert_eq!(content(&t, "p").unwrap(), b"file again");
        assert!(t.lookup(b"p/child").is_none());
    }

    #[test]
    fn hostile_paths_are_confined() {
        let mut t = T::new();
        let mut l0 = LayerBuilder::new();
        l0.dir("tmp")
            .symlink("evil", "/tmp")
            .symlink("up", "../../..");
        let mut raw = l0.bytes();
        // tar::Builder refuses "..", so splice hostile names in by hand.
        raw.truncate(raw.len() - 1024);
        let mut b = tar::Builder::new(raw);
        for (p, d) in [
            ("../../escape", &b"t"[..]),
            ("/abs", b"a"),
            ("evil/through", b"e"),
            ("up/via-dotdot", b"u"),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(d.len() as u64);
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            h.as_gnu_mut().unwrap().name[..p.len()].copy_from_slice(p.as_bytes());
            h.set_cksum();
            b.append(&h, d).unwrap();
        }
        let stats = apply(&mut t, 0, b.into_inner().unwrap()).unwrap();
        assert_eq!(content(&t, "escape").unwrap(), b"t");
        assert_eq!(content(&t, "abs").unwrap(), b"a");
        assert_eq!(content(&t, "tmp/through").unwrap(), b"e");
        assert_eq!(content(&t, "via-dotdot").unwrap(), b"u");
        assert_eq!(paths(&t).len(), 8, "{:?}", paths(&t));
        assert!(stats.confined >= 4, "{stats:?}");
    }

    #[test]
    fn hardlink_to_missing_or_outside_target_is_refused() {
        let mut t = T::new();
        let mut l0 = LayerBuilder::new();
        l0.hardlink("pw", "../../etc/passwd");
        let err = apply(&mut t, 0, l0.bytes()).unwrap_err();
        assert!(err.to_string().contains("does not exist"), "{err}");
    }

    /// A GNU sparse entry ('S') and a PAX 1.0 sparse file: refused, not
    /// converted into a file of their packed bytes (the file of the GNU
    /// entry below would have been 10 bytes instead of 3 MiB).
    #[test]
    fn sparse_entries_are_refused() {
        let mut b = LayerBuilder::new();
        b.add("sparse.bin", tar::EntryType::GNUSparse, b"HELLO-DATA", None);
        let err = apply(&mut T::new(), 0, b.bytes()).unwrap_err();
        assert!(err.to_string().contains("sparse"), "{err}");

        let mut b = LayerBuilder::new();
        b.pax(&[
            ("GNU.sparse.major", b"1"),
            ("GNU.sparse.minor", b"0"),
            ("GNU.sparse.name", b"big"),
            ("GNU.sparse.realsize", b"3145728"),
        ])
        .file("GNUSparseFile.0/big", b"1\n1048576\n10\n");
        let err = apply(&mut T::new(), 0, b.bytes()).unwrap_err();
        assert!(err.to_string().contains("sparse"), "{err}");

        // A plain file is still taken.
        let mut b = LayerBuilder::new();
        b.file("plain", b"x");
        apply(&mut T::new(), 0, b.bytes()).unwrap();
    }

    #[test]
    fn symlink_loop_is_refused() {
        let mut t = T::new();
        let mut l0 = LayerBuilder::new();
        l0.symlink("a", "b").symlink("b", "a").file("a/x", b"");
        let err = apply(&mut t, 0, l0.bytes()).unwrap_err();
        assert!(err.to_string().contains("symbolic links"), "{err}");
    }

    #[test]
    fn truncated_tar_is_an_error() {
        let mut l0 = LayerBuilder::new();
        l0.file("big", &[7u8; 5000]);
        let mut raw = l0.bytes();
        raw.truncate(2048);
        let err = apply(&mut T::new(), 0, raw).unwrap_err();
        assert!(
            matches!(err, ApplyError::Read { .. } | ApplyError::Content { .. }),
            "{err}"
        );
    }

    #[test]
    fn pax_records_with_binary_values() {
        let value = b"a\nb=c\x00";
        let mut rec = b" SCHILY.xattr.security.capability=".to_vec();
        rec.extend_from_slice(value);
        rec.push(b'\n');
        let mut len = rec.len() + 1;
        while len.to_string().len() + rec.len() != len {
            len = len.to_string().len() + rec.len();
        }
        let mut data = format!("{len}").into_bytes();
        data.extend_from_slice(&rec);
        data.extend_from_slice(b"11 path=ab\n");
        let got = parse_pax(&data).unwrap();
        assert_eq!(got[0].1, value);
        assert_eq!(got[1], (b"path".to_vec(), b"ab".to_vec()));
        assert!(parse_pax(b"99 path=x\n").is_err());
        assert!(parse_pax(b"5 a=b\n").is_err());
    }

    fn meta_of<'a>(tree: &'a T, path: &str) -> &'a Metadata {
        &tree.nodes[tree.lookup(path.as_bytes()).unwrap()].meta
    }

    /// Issue 7: an xattr whose value is empty is an xattr, not a deleted
    /// PAX keyword (Go's archive/tar, and so umoci, drops it).
    #[test]
    fn empty_xattr_values_are_kept() {
        let mut l0 = LayerBuilder::new();
        l0.pax(&[
            ("SCHILY.xattr.user.empty", b""),
            ("SCHILY.xattr.user.set", b"v"),
            ("LIBARCHIVE.xattr.user.lib", b""),
        ])
        .file("f", b"data")
        .pax(&[("SCHILY.xattr.trusted.empty", b"")])
        .dir("d");
        let mut t = T::new();
        apply(&mut t, 0, l0.bytes()).unwrap();
        let xattrs = |p| {
            meta_of(&t, p)
                .xattrs
                .iter()
                .map(|(k, v)| (String::from_utf8_lossy(k).into_owned(), v.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            xattrs("f"),
            [
                ("user.empty".to_string(), vec![]),
                ("user.lib".to_string(), vec![]),
                ("user.set".to_string(), b"v".to_vec()),
            ]
        );
        assert_eq!(xattrs("d"), [("trusted.empty".to_string(), vec![])]);
    }

    /// POSIX: an empty value deletes a keyword, so the header field applies.
    #[test]
    fn empty_pax_values_fall_back_to_the_header() {
        let mut l0 = LayerBuilder::new();
        l0.pax(&[
            ("uid", b"70000"),
            ("uid", b""),
            ("gid", b""),
            ("mtime", b""),
            ("path", b""),
        ])
        .file("f", b"data");
        let mut t = T::new();
        apply(&mut t, 0, l0.bytes()).unwrap();
        let m = meta_of(&t, "f");
        assert_eq!((m.uid, m.gid, m.mtime), (0, 0, 1000));
        assert_eq!(content(&t, "f").unwrap(), b"data");
        assert_eq!(
            parse_pax(b"11 path=ab\n8 path=\n").unwrap(),
            Vec::<(Vec<u8>, Vec<u8>)>::new()
        );
        assert_eq!(
            parse_pax(b"24 SCHILY.xattr.user.e=\n").unwrap(),
            [(b"SCHILY.xattr.user.e".to_vec(), vec![])]
        );
    }

    #[test]
    fn pax_times() {
        assert_eq!(parse_pax_time(b"12.5").unwrap(), (12, 500_000_000));
        assert_eq!(parse_pax_time(b"-1.25").unwrap(), (-2, 750_000_000));
        assert_eq!(parse_pax_time(b"7").unwrap(), (7, 0));
        assert!(parse_pax_time(b"x").is_err());
    }
}
