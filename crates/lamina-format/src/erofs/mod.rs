//! The EROFS metadata image: on-disk structures and the writer.

pub mod format;
mod writer;

pub use writer::{write_image, ChunkAddr, Device, FileChunks, FormatError, ImageStats};
