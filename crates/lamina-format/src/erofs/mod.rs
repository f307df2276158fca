//! The EROFS metadata image: on-disk structures, the writer, and the reader
//! the FUSE path serves from.

pub mod format;
mod reader;
mod writer;

pub use format::{BLOCK_BITS, TAR_BLOCK_BITS};
pub use reader::{Chunk, Chunks, DeviceInfo, Entry, Gate, Image, Inode, Kind, ReadError, Xattr};
pub use writer::{
    write_image, write_image_with, ChunkAddr, Device, FileChunks, FormatError, ImageStats,
};

/// Building trees in the writer's and the reader's tests.
#[cfg(test)]
pub(crate) mod test_tree {
    use super::FileChunks;
    use lamina_tree::{DirEntry, Node, NodeId, NodeKind, Tree};

    /// Adds `node` to `tree` as `name` in directory `dir`.
    pub(crate) fn add(
        tree: &mut Tree<FileChunks>,
        dir: NodeId,
        name: &[u8],
        node: Node<FileChunks>,
    ) -> NodeId {
        let id = tree.add_node(node);
        if let NodeKind::Directory { entries } = &mut tree.nodes[dir].kind {
            entries.insert(name.to_vec(), DirEntry { node: id, layer: 0 });
        }
        id
    }

    /// A fixed xorshift sequence: the corruption tests' byte positions and
    /// values, the same on every run.
    pub(crate) fn xorshift() -> impl FnMut() -> u64 {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        }
    }
}
