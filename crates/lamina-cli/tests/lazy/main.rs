//! The lazy-loading path end to end: the reference Debian image (python3,
//! nginx-light, redis-server), converted once per test binary, is served by
//! a registry per test and mounted lazily (`docker://` default), then read
//! by real programs and by hashing readers, also while the worker is killed,
//! the registry restarts, or a proxy (`tests/tools/faultproxy.py`) corrupts,
//! truncates, resets, refuses and stalls range requests.
//!
//! Every byte read is compared with `umoci unpack` of the same source: whole
//! trees with treecmp, files by sha256. Every wait is bounded; every reader
//! runs in a child process with a deadline, so a hung read fails the test
//! instead of hanging it.

#[path = "../common/mod.rs"]
mod common;

mod daemon;
mod fixture;
mod readers;

mod boot;
mod faults;
mod gc;
mod holder;
mod shared_cache;
mod stalls;
mod stress;
mod warm;
mod workload;

use std::time::Instant;

/// Tools the tests need (debootstrap and jq only when the Debian image is
/// not cached yet, but the check is static).
const TOOLS: &[&str] = &[
    "umoci",
    "debootstrap",
    "jq",
    "chroot",
    "docker-registry",
    "curl",
    "mount",
    "umount",
    "cp",
];

/// Repository and tag of the converted image in every test registry.
const IMAGE: &str = "deb:bookworm";

/// Tag of the source image in its OCI layout.
const SRC_TAG: &str = "bookworm";

/// Prints the test's wall time when dropped (also when it fails).
#[derive(Debug)]
struct Timer(&'static str, Instant);

impl Drop for Timer {
    fn drop(&mut self) {
        eprintln!("time: {} {:.1} s", self.0, self.1.elapsed().as_secs_f64());
    }
}
