//! lamina's on-disk formats. Pure: byte slices and `Vec<u8>` in and out, no I/O.
//!
//! - [`erofs`]: the kernel-mountable metadata image (our own writer).
//! - [`index`]: the chunk table that maps each stored chunk to its place in a
//!   compressed data blob and in the blob's uncompressed cache file.
//! - [`boot`]: boot pages, the exact pages a recorded start read, packed for
//!   one fetch at mount.
//! - [`fill`]: the fill record, which chunks of a cache file were verified
//!   and made durable, bound to that file's identity.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod boot;
pub mod erofs;
pub mod fill;
pub mod index;
