//! The chunk cache and kernel mounts.
//!
//! Cache layout under the cache dir (default `/var/lib/lamina`):
//! ```text
//! meta/<layer-hex>.{erofs,index,boot}  metadata, chunk index, boot pages (uncompressed;
//!                                      re-hashed against their digest before every use)
//! blobs/<blob-hex>.cache               one uncompressed, block-addressed file per data blob
//! blobs/<blob-hex>.state               its fill record (lazy mounts)
//! mounts/<id>/                         each live mount's config, status and logs
//! ```
//! A cache file exists under its final name only once every chunk in it has
//! been verified against the chunk index and the whole blob against its
//! digest; partial files carry a `.partial-<pid>` suffix and are never mounted.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod cache;
mod gc;
mod kernel;
mod lazy;

pub use cache::{materialize_blob, store_metadata, CacheError};
pub use gc::{gc, EagerRecord, GcReport};
pub use kernel::{mount_image, unmount, MountError, MountInfo, MountOptions};
pub use lazy::{finish_unmount, mount_lazy, run_dir, LazyOptions, Prefetch};
