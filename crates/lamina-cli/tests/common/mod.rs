//! Helpers shared by lamina's end-to-end tests.
//!
//! Everything here runs real commands (the `lamina` binary, umoci, skopeo,
//! docker-registry, fsck.erofs, the Python tools under `tests/`) and real
//! kernel mounts, so the tests need root. A test calls [`require`] first: when
//! root or a tool is missing the test FAILS, unless `LAMINA_SKIP_PRIVILEGED=1`
//! is set, in which case it prints `skipped: ...` and returns.
//!
//! Every command runs with a deadline ([`run`]); stdout and stderr go to
//! anonymous temp files (no pipe can fill up) and are shown in full context
//! when an assertion on them fails.
#![allow(dead_code)]

mod commands;
mod forge;
mod images;
mod mounts;
mod registry;
mod trees;

// Each test target uses some of the helpers, none uses all of them.
#[allow(unused_imports)]
pub use commands::*;
#[allow(unused_imports)]
pub use forge::*;
#[allow(unused_imports)]
pub use images::*;
#[allow(unused_imports)]
pub use mounts::*;
#[allow(unused_imports)]
pub use registry::*;
#[allow(unused_imports)]
pub use trees::*;

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The binary under test.
pub const LAMINA: &str = env!("CARGO_BIN_EXE_lamina");

/// Default deadline for one command.
pub const TIMEOUT: Duration = Duration::from_secs(300);

/// Deadline for quick commands (umount, registry stop, ...).
pub const SHORT: Duration = Duration::from_secs(60);

/// The repository root (`/work/main`).
pub fn repo_root() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    p.canonicalize()
        .unwrap_or_else(|e| panic!("cannot resolve the repository root {}: {e}", p.display()))
}

/// A file of the repository, e.g. `tests/tools/treecmp.py`.
pub fn repo_file(rel: &str) -> PathBuf {
    repo_root().join(rel)
}
