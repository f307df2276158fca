//! Tree types: an arena of nodes; directories map names to node ids, so a
//! hardlink is simply two entries naming the same node.

use std::collections::BTreeMap;

/// Index of a node in [`Tree::nodes`].
pub type NodeId = usize;

/// Inode metadata carried from the tar header (and its PAX records).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Metadata {
    /// Permission bits including setuid, setgid and sticky (`0o7777`).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
    /// Nanoseconds part of the modification time.
    pub mtime_nsec: u32,
    /// Extended attributes, full names (`user.foo`) to values.
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

/// A directory entry: the node it names and the layer that put it there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirEntry {
    /// The node.
    pub node: NodeId,
    /// Index of the layer that created this entry (whiteouts only hide entries
    /// of lower layers).
    pub layer: u32,
}

/// What a node is. `C` is the caller's handle for regular file content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeKind<C> {
    /// A directory; names are single path components, never `.` or `..`.
    Directory {
        /// Children by name.
        entries: BTreeMap<Vec<u8>, DirEntry>,
    },
    /// A regular file.
    Regular {
        /// Size in bytes.
        size: u64,
        /// Where the content went.
        content: C,
    },
    /// A symbolic link.
    Symlink {
        /// Link target, as stored.
        target: Vec<u8>,
    },
    /// A character device.
    CharDevice {
        /// Major number.
        major: u32,
        /// Minor number.
        minor: u32,
    },
    /// A block device.
    BlockDevice {
        /// Major number.
        major: u32,
        /// Minor number.
        minor: u32,
    },
    /// A named pipe.
    Fifo,
    /// A unix socket (tar cannot carry one, but trees built by hand can).
    Socket,
}

/// A node: metadata plus kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node<C> {
    /// Owner, mode, times, xattrs.
    pub meta: Metadata,
    /// Kind and kind-specific data.
    pub kind: NodeKind<C>,
}

impl<C> Node<C> {
    /// The `S_IFMT` bits for this node's kind.
    pub fn file_type_bits(&self) -> u32 {
        match self.kind {
            NodeKind::Directory { .. } => 0o040000,
            NodeKind::Regular { .. } => 0o100000,
            NodeKind::Symlink { .. } => 0o120000,
            NodeKind::CharDevice { .. } => 0o020000,
            NodeKind::BlockDevice { .. } => 0o060000,
            NodeKind::Fifo => 0o010000,
            NodeKind::Socket => 0o140000,
        }
    }

    /// Whether this node is a directory.
    pub fn is_dir(&self) -> bool {
        matches!(self.kind, NodeKind::Directory { .. })
    }
}

/// The merged tree. Nodes that are no longer reachable from the root stay in
/// the arena; writers walk from [`Tree::root`] and never see them.
#[derive(Debug, Clone)]
pub struct Tree<C> {
    /// All nodes ever created.
    pub nodes: Vec<Node<C>>,
    /// The root directory.
    pub root: NodeId,
}

impl<C> Default for Tree<C> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C> Tree<C> {
    /// An empty tree: a root directory owned by root, mode 0755, mtime 0.
    pub fn new() -> Self {
        let root = Node {
            meta: Metadata {
                mode: 0o755,
                ..Metadata::default()
            },
            kind: NodeKind::Directory {
                entries: BTreeMap::new(),
            },
        };
        Tree {
            nodes: vec![root],
            root: 0,
        }
    }

    /// Adds a node to the arena (not yet linked into any directory).
    pub fn add_node(&mut self, node: Node<C>) -> NodeId {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// The entries of a directory node, or `None` if it is not a directory.
    pub fn entries(&self, dir: NodeId) -> Option<&BTreeMap<Vec<u8>, DirEntry>> {
        match &self.nodes[dir].kind {
            NodeKind::Directory { entries } => Some(entries),
            _ => None,
        }
    }

    pub(crate) fn entries_mut(&mut self, dir: NodeId) -> Option<&mut BTreeMap<Vec<u8>, DirEntry>> {
        match &mut self.nodes[dir].kind {
            NodeKind::Directory { entries } => Some(entries),
            _ => None,
        }
    }

    /// Looks up a `/`-separated relative path without following symlinks.
    pub fn lookup(&self, path: &[u8]) -> Option<NodeId> {
        let mut cur = self.root;
        for comp in path.split(|&b| b == b'/').filter(|c| !c.is_empty()) {
            cur = self.entries(cur)?.get(comp)?.node;
        }
        Some(cur)
    }

    /// Visits every reachable entry depth-first, children in name order, with
    /// its full path (`""` for the root). Iterative, so deep trees are fine.
    pub fn walk(&self, mut visit: impl FnMut(&[u8], NodeId)) {
        let mut stack: Vec<(Vec<u8>, NodeId)> = vec![(Vec::new(), self.root)];
        while let Some((path, id)) = stack.pop() {
            visit(&path, id);
            if let Some(entries) = self.entries(id) {
                for (name, entry) in entries.iter().rev() {
                    let mut child = path.clone();
                    if !child.is_empty() {
                        child.push(b'/');
                    }
                    child.extend_from_slice(name);
                    stack.push((child, entry.node));
                }
            }
        }
    }
}
