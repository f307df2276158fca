//! The merged tree: OCI layer tars applied in order, with whiteouts, opaque
//! directories and hardlinks, into an in-memory tree that never touches disk.
//!
//! Nothing here writes to the host filesystem, so a hostile tar cannot escape
//! anything: paths are resolved inside the tree, `..` stops at the root and
//! symlinks met on the way are followed *inside the tree* (as `umoci` and
//! containerd do with a confined join).  What cannot be made sense of is refused
//! with an [`ApplyError`].
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod apply;
mod tree;

pub use apply::{apply_layer, ApplyError, LayerStats};
pub use tree::{DirEntry, Metadata, Node, NodeId, NodeKind, Tree};
