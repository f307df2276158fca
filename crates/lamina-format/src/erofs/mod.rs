//! The EROFS metadata image: on-disk structures, the writer, and the reader
//! the FUSE path serves from.

pub mod format;
mod reader;
mod writer;

pub use reader::{Chunk, Chunks, DeviceInfo, Entry, Image, Inode, Kind, ReadError, Xattr};
pub use writer::{write_image, ChunkAddr, Device, FileChunks, FormatError, ImageStats};
