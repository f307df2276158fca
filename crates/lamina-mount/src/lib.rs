//! The chunk cache and kernel mounts.
//!
//! Cache layout under the cache dir (default `/var/lib/lamina`):
//! ```text
//! meta/<metadata-layer-hex>.erofs   EROFS metadata images (verified, renamed into place)
//! blobs/<blob-hex>.cache            one uncompressed, block-addressed file per data blob
//! mounts/<id>.json                  what each live mount uses
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
pub use lazy::{finish_unmount, mount_lazy, run_dir, LazyOptions};
