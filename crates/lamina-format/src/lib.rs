//! lamina's on-disk formats. Pure: byte slices and `Vec<u8>` in and out, no I/O.
//!
//! - [`erofs`]: the kernel-mountable metadata image (our own writer).
//! - [`index`]: the chunk table that maps each stored chunk to its place in a
//!   compressed data blob and in the blob's uncompressed cache file.
//! - [`boot`]: boot pages, the exact pages a recorded start read, packed for
//!   one fetch at mount.
//! - [`fill`]: the fill record, which chunks of a cache file were verified
//!   and made durable, bound to that file's identity.
//! - [`object`]: the object record, a passed-through file's own copy bound
//!   to that copy's identity, size and content digest.
//! - [`locate`]: the chunk locator, where on the node a verified copy of a
//!   chunk lies, by its digest.
//! - [`shard`]: an image split into a metadata view and a shard of
//!   objects named by content, for overlayfs to share across images.
//! - [`tar_index`]: the span table of a tar index, random access into an
//!   unmodified image's compressed layers.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod boot;
pub mod erofs;
pub mod fill;
pub mod index;
pub mod locate;
pub mod lookup;
pub mod object;
pub mod shard;
pub mod tar_index;

/// The most bytes zstd may need for one frame of `n` bytes, as
/// `ZSTD_COMPRESSBOUND` (an incompressible input grows by 1/256 plus a header),
/// saturating. Readers use it to bound a compressed size by the size it
/// claims to decompress to.
pub const fn zstd_bound(n: u64) -> u64 {
    const SMALL: u64 = 128 << 10;
    let margin = if n < SMALL { (SMALL - n) >> 11 } else { 0 };
    n.saturating_add(n >> 8).saturating_add(margin)
}
