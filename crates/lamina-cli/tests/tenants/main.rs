//! Issue 28: images of different tenants share one cache dir, and none of
//! them may change what another reads.
//!
//! * Point 1: a hostile image names another image's data blob (its digest
//!   and size) with a chunk table of its own, and its registry serves its
//!   own bytes under that digest. Every chunk it fetches verifies against
//!   its own table, so a cache keyed by blob digest alone let it write its
//!   bytes where the honest image reads (or let the honest image trust its
//!   fill record). The honest image must read its own bytes whichever
//!   mounted first, on the kernel path and through FUSE, and the cache must
//!   hold two entries for the blob.
//! * Point 2: an eager mount of an image that shares a blob with a live
//!   lazy mount must not put a new cache file in place of the one the lazy
//!   mount's kernel mount, holder and worker hold.
//!
//! The images are small generated trees (`MKIMAGE` below, built with
//! `tests/fixtures/mkimage.py`'s writers): one uncompressed tar layer of
//! incompressible files from 100 bytes (packed) to 600,000 (three chunks),
//! so each converts to a single data blob. Every byte read is compared
//! with `umoci unpack` of the source; every read runs in a child process
//! with a deadline.

#[path = "../common/mod.rs"]
mod common;

mod images;
mod reading;

mod domains;
mod hostile_blob;
mod live_cache;
mod objects;
mod shared;
mod updates;

use std::time::{Duration, Instant};

/// Tools the tests need besides root and python3.
const TOOLS: &[&str] = &["umoci", "docker-registry", "curl", "zstd"];

/// A reader's deadline: the images are a few MB, read on loopback.
const READ_DEADLINE: Duration = Duration::from_secs(120);

/// Seconds a lazy mount's reader waits for data before EIO: short, so a
/// read of the hostile image that cannot be served fails well within
/// [`READ_DEADLINE`].
const MISS_TIMEOUT: &str = "15";

/// Files of the honest image, `data/NAME.bin` of SIZE bytes: four packed
/// (at most the 16 KiB pack limit) in one pack, the others one chunk each
/// or, past the 256 KiB chunk size, two and three.
const FILES: &[(&str, u64)] = &[
    ("s00", 100),
    ("s01", 3000),
    ("s02", 5000),
    ("s03", 12000),
    ("f00", 17000),
    ("f01", 20000),
    ("f02", 40000),
    ("f03", 70000),
    ("f04", 262_144),
    ("f05", 300_000),
    ("f06", 600_000),
];

/// Files whose content the hostile image changes (sizes kept): one in the
/// pack, one single-chunk file, one of two chunks.
const CHANGED: &[&str] = &["s01", "f02", "f05"];

/// Prints the test's wall time when dropped (also when it fails).
#[derive(Debug)]
struct Timer(&'static str, Instant);

impl Drop for Timer {
    fn drop(&mut self) {
        eprintln!("time: {} {:.1} s", self.0, self.1.elapsed().as_secs_f64());
    }
}
