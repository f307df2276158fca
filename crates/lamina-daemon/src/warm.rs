//! Warming: boot pages read into the mount's own page cache as they land.
//!
//! A start served from boot pages reads them through the mount one page at
//! a time (readahead is off while they serve it: every page it would read
//! ahead must be in the boot set), and each such read of a cache file is a
//! pre-content event the reader waits on: ~25,000 for the data-science
//! start. Once a frame of boot pages is applied, the worker asks the
//! kernel to read their files' ranges through the mount
//! (`posix_fadvise(WILLNEED)`): a few large reads of its own, answered by
//! the holder at once, and the start then finds its pages in the page
//! cache, with no event and no fault into the cache file.
//!
//! [`WarmMap`] turns a range of a cache file into the file ranges that read
//! it, from the image's EROFS metadata. Only ranges whose every page is
//! ready may be warmed: the holder lets the worker's own reads through
//! unchecked, so a page read ahead of its bytes would be cached as zeros.

use std::ops::Range;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use lamina_format::erofs::{Chunk, Image, Kind, ReadError};

/// Directory entries walked at most (as for predictions).
pub const MAX_ENTRIES: usize = crate::predict::MAX_ENTRIES;

/// Bytes of names kept at most: a hostile image's long names cost the
/// worker no more than this (a large real image's are a few MB).
pub const MAX_NAME_BYTES: usize = 32 << 20;

/// One chunk of a regular file: where it lies in its blob's cache file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    cache_start: u64,
    len: u64,
    file: u32,
    file_offset: u64,
}

/// A directory or a regular file: its parent directory and its name.
#[derive(Debug)]
struct Node {
    parent: u32,
    name: Box<[u8]>,
}

/// Where each byte of the image's cache files is read from, file by file.
#[derive(Debug, Default)]
pub struct WarmMap {
    /// Per blob, the pieces in cache order.
    blobs: Vec<Vec<Piece>>,
    /// The longest piece, to find those overlapping a range.
    longest: u64,
    /// Directories (index 0: the root) and then files, by parent.
    nodes: Vec<Node>,
    /// Per file (`Piece::file`), its node.
    files: Vec<u32>,
    /// Bytes of all names in `nodes`.
    name_bytes: usize,
}

/// A range of one file to read ahead, by its path under the mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileRange {
    /// Path relative to the mount's root.
    pub path: PathBuf,
    /// Byte range of the file.
    pub range: Range<u64>,
}

impl WarmMap {
    /// The map of `image` over `blobs` data blobs (device `d` is blob
    /// `d - 1`). Fails on an image of another block size than a page's
    /// (file pages and cache pages would not match), or with more than
    /// [`MAX_ENTRIES`] entries.
    pub fn build(image: &Image<'_>, blobs: usize) -> Result<WarmMap, ReadError> {
        if image.block_bits() != 12 {
            return Err(ReadError::Unsupported(format!(
                "block size {}",
                1u64 << image.block_bits()
            )));
        }
        let mut map = WarmMap {
            blobs: vec![Vec::new(); blobs],
            ..WarmMap::default()
        };
        map.nodes.push(Node {
            parent: 0,
            name: Box::default(),
        });
        let mut seen_dirs = std::collections::HashSet::from([image.root_nid()]);
        let mut dirs = vec![(image.root_nid(), 0u32)];
        let mut walked = 0usize;
        while let Some((nid, node)) = dirs.pop() {
            let dir = image.inode(nid)?;
            for entry in image.entries(&dir)? {
                if entry.name == b"." || entry.name == b".." || entry.name.contains(&b'/') {
                    continue;
                }
                walked += 1;
                if walked > MAX_ENTRIES {
                    return Err(ReadError::Unsupported(format!(
                        "more than {MAX_ENTRIES} entries"
                    )));
                }
                if map.name_bytes > MAX_NAME_BYTES {
                    return Err(ReadError::Unsupported(format!(
                        "more than {MAX_NAME_BYTES} bytes of names"
                    )));
                }
                match entry.kind() {
                    Some(Kind::Directory) if seen_dirs.insert(entry.nid) => {
                        dirs.push((entry.nid, map.node(node, entry.name)));
                    }
                    Some(Kind::Regular) => {
                        let inode = image.inode(entry.nid)?;
                        if inode.size > 0 {
                            let at = map.node(node, entry.name);
                            map.add_file(image, &inode, at)?;
                        }
                    }
                    _ => {}
                }
            }
        }
        for pieces in &mut map.blobs {
            pieces.sort_by_key(|p| p.cache_start);
        }
        Ok(map)
    }

    fn node(&mut self, parent: u32, name: &[u8]) -> u32 {
        self.name_bytes += name.len();
        self.nodes.push(Node {
            parent,
            name: name.into(),
        });
        (self.nodes.len() - 1) as u32
    }

    fn add_file(
        &mut self,
        image: &Image<'_>,
        inode: &lamina_format::erofs::Inode<'_>,
        node: u32,
    ) -> Result<(), ReadError> {
        let chunks = image.chunks(inode)?;
        let chunk_size = 1u64 << chunks.chunk_bits;
        let file = self.files.len() as u32;
        self.files.push(node);
        for i in 0..chunks.len() {
            let Some(Chunk::Data { device, offset }) = chunks.get(i) else {
                continue;
            };
            let file_offset = i as u64 * chunk_size;
            let len = chunk_size.min(inode.size.saturating_sub(file_offset));
            let Some(pieces) = usize::from(device)
                .checked_sub(1)
                .and_then(|b| self.blobs.get_mut(b))
            else {
                continue;
            };
            if len > 0 {
                pieces.push(Piece {
                    cache_start: offset,
                    len,
                    file,
                    file_offset,
                });
                self.longest = self.longest.max(len);
            }
        }
        Ok(())
    }

    /// The file ranges that read `range` of blob `blob`'s cache file and
    /// nothing outside it (pages: `range` is page-aligned but for a file's
    /// end), one per file and run of its chunks.
    pub fn ranges(&self, blob: u32, range: Range<u64>) -> Vec<FileRange> {
        let Some(pieces) = self.blobs.get(blob as usize) else {
            return Vec::new();
        };
        let from = range.start.saturating_sub(self.longest);
        let first = pieces.partition_point(|p| p.cache_start < from);
        let mut out: Vec<(u32, Range<u64>)> = Vec::new();
        for p in pieces[first..]
            .iter()
            .take_while(|p| p.cache_start < range.end)
        {
            let (start, end) = (p.cache_start, p.cache_start + p.len);
            if end <= range.start {
                continue;
            }
            let (a, b) = (start.max(range.start), end.min(range.end));
            let file_range = p.file_offset + (a - start)..p.file_offset + (b - start);
            match out.last_mut() {
                Some((f, r)) if *f == p.file && r.end == file_range.start => r.end = file_range.end,
                _ => out.push((p.file, file_range)),
            }
        }
        out.into_iter()
            .map(|(file, range)| FileRange {
                path: self.path(file),
                range,
            })
            .collect()
    }

    fn path(&self, file: u32) -> PathBuf {
        let mut names = Vec::new();
        let mut node = self.files[file as usize];
        while node != 0 {
            let n = &self.nodes[node as usize];
            names.push(&n.name[..]);
            node = n.parent;
        }
        let mut path = PathBuf::new();
        for name in names.iter().rev() {
            path.push(std::ffi::OsStr::from_bytes(name));
        }
        path
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lamina_format::erofs::{write_image, ChunkAddr, Device, FileChunks};
    use lamina_tree::{DirEntry, Metadata, Node as TreeNode, NodeId, NodeKind, Tree};

    /// A regular file of `size` bytes in `dir`, its 4 KiB chunks at blocks
    /// `blocks` of device 1 (`None`: a hole).
    fn file(
        tree: &mut Tree<FileChunks>,
        dir: NodeId,
        name: &str,
        size: u64,
        blocks: &[Option<u32>],
    ) {
        let node = tree.add_node(TreeNode {
            meta: Metadata::default(),
            kind: NodeKind::Regular {
                size,
                content: FileChunks {
                    chunk_bits: 12,
                    chunks: blocks
                        .iter()
                        .map(|b| match b {
                            Some(blkaddr) => ChunkAddr::Data {
                                device: 1,
                                blkaddr: *blkaddr,
                            },
                            None => ChunkAddr::Hole,
                        })
                        .collect(),
                },
            },
        });
        if let NodeKind::Directory { entries } = &mut tree.nodes[dir].kind {
            entries.insert(name.into(), DirEntry { node, layer: 0 });
        }
    }

    fn dir(tree: &mut Tree<FileChunks>, parent: NodeId, name: &str) -> NodeId {
        let node = tree.add_node(TreeNode {
            meta: Metadata {
                mode: 0o755,
                ..Metadata::default()
            },
            kind: NodeKind::Directory {
                entries: Default::default(),
            },
        });
        if let NodeKind::Directory { entries } = &mut tree.nodes[parent].kind {
            entries.insert(name.into(), DirEntry { node, layer: 0 });
        }
        node
    }

    #[test]
    fn a_cache_range_maps_to_the_file_ranges_that_read_it() {
        const P: u64 = 4096;
        let mut tree: Tree<FileChunks> = Tree::new();
        let root = tree.root;
        let lib = dir(&mut tree, root, "lib");
        // lib/a.so: 3 pages at blocks 0-2 and a last, short page at 5.
        file(
            &mut tree,
            lib,
            "a.so",
            3 * P + 100,
            &[Some(0), Some(1), Some(2), Some(5)],
        );
        // b.py: 2 pages at 3-4, then a hole.
        file(&mut tree, root, "b.py", 3 * P, &[Some(3), Some(4), None]);
        let device = Device {
            tag: "0".repeat(64),
            blocks: 6,
        };
        let (bytes, _) = write_image(&tree, &[device]).unwrap();
        let map = WarmMap::build(&Image::new(&bytes).unwrap(), 1).unwrap();
        let r = |path: &str, range: Range<u64>| FileRange {
            path: path.into(),
            range,
        };
        assert_eq!(map.ranges(0, P..2 * P), [r("lib/a.so", P..2 * P)]);
        assert_eq!(
            map.ranges(0, P..6 * P),
            [
                r("lib/a.so", P..3 * P),
                r("b.py", 0..2 * P),
                r("lib/a.so", 3 * P..3 * P + 100),
            ]
        );
        assert!(map.ranges(0, 6 * P..8 * P).is_empty(), "past every file");
        assert!(map.ranges(1, 0..P).is_empty(), "no such blob");
    }
}
