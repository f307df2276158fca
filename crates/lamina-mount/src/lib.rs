//! Owns mounting: the choice of kernel or FUSE (`--mode auto`), eager fills
//! of the cache, lazy mounts' daemons, tar-index mounts, gc and mount
//! metrics; [`mount`] is the entry point of the CLI, `lamina run` and the
//! snapshotter. Kernel mounts are eager or lazy, FUSE mounts (`lamina_fuse`)
//! too.
//!
//! Cache layout under the cache dir (default `/var/lib/lamina`):
//! ```text
//! meta/<domain>/<layer-hex>.{erofs,index,lookup}
//!                                      metadata, chunk index, lookup table (uncompressed;
//!                                      FUSE mounts only fetch the lookup table); <domain>: 16 hex
//!                                      digits naming the trust domain (`common::domain_id`)
//! meta/<domain>/<layer-hex>.<ext>.fill its fill record: verified whole, bound to the file
//!                                      (without one, a copy is hashed before use)
//! meta/<domain>/<layer-hex>.boot       boot pages (checked by the worker)
//! meta/<domain>/<layer-hex>.tarindex   a tar index's span table (`lamina index`)
//! blobs/<domain>/<blob-hex>.<entry>.cache
//!                                      one uncompressed, block-addressed file per cache entry:
//!                                      a blob as one chunk table describes it (through a tar
//!                                      index: the layer's tar); <entry> is 32 hex digits of
//!                                      its id (`lamina_fetch::store::EntryKey::stem`)
//! blobs/<domain>/<blob-hex>.<entry>.fill   its fill record (`lamina_format::fill`)
//! blobs/<domain>/<blob-hex>.<entry>.table  a paged blob's chunk table
//! blobs/<domain>/chunks.locate         the domain's chunk locator (`lamina_format::locate`)
//! objects/content/<domain>/<sha256>   a FUSE-passthrough file's own copy (root only), made
//!                                      from complete blobs, one per content and trust domain
//! objects/content/<domain>/<sha256>.record
//!                                      its record (`lamina_format::object`): identity, size,
//!                                      content sha256; checked once per daemon before use
//! objects/<layer-hex>.<entries>/<nid>  an image's hard link to it
//! shards/<domain>/<id>/                a shard of objects named by content (`--share-files`,
//!                                      `shared.rs`): shard.erofs, objects, blobs.json, mnt/
//! mounts/<id>/                         each live mount's config, status and logs
//!                                      (a FUSE daemon's counters: fuse-status.json; a
//!                                      `--share-files` view: view.erofs, view/, view.json)
//! ```
//! Directories are 0700 and files 0600. Which chunks of a cache file may be
//! read is decided by its fill record alone, for eager and lazy mounts alike
//! (see `lamina_fetch::store`); an eager mount's fresh file appears under its
//! final name only once every chunk and the whole blob verified.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod borrow;
mod cache;
mod common;
mod daemons;
mod fuse;
mod gc;
mod kernel;
mod layers;
mod lazy;
pub mod metrics;
mod mode;
mod shared;
mod tar_index;

pub use cache::{materialize_blob, store_metadata, CacheError};
pub use common::{cache_dir_of, run_dir, MountError, MountInfo, MountOptions};
pub use daemons::reap_daemons;
pub use fuse::{mount_fuse, FUSE_STATUS, FUSE_THREADS};
pub use gc::{gc, EagerRecord, GcReport};
pub use kernel::{mount_image, unmount};
pub use lamina_daemon::config::Privileges;
pub use lazy::{
    finish_unmount, is_served, last_status, mount, mount_lazy_from, LazyOptions, Prefetch,
    Unmounted,
};
pub use mode::{choose as choose_mode, host_facts, HostFacts, Mode};
pub use tar_index::{find as find_tar_index, FoundIndex, IndexTrust, Vouch};
