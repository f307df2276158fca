//! What one mount's daemons may take from the node (issue 42, point 10):
//! a cgroup of their own ([`lamina_sys::cgroup`]) with the limits below,
//! so that one tenant's storm of misses takes CPU, memory and threads from
//! its own share only. Prefetches run at idle I/O priority
//! (`lamina_sys::do_io_when_idle`), and each mount's miss threads are
//! bounded ([`crate::pool::MAX_MISS_THREADS`]).

use std::path::Path;

use lamina_sys::cgroup::Limits;

/// The limits of one mount's daemons together (the holder or FUSE daemon
/// and its worker): memory for their heaps and the page cache their fills
/// dirty (reclaimed, not refused, at the limit), threads for the miss
/// pools with room to spare, and the default CPU weight, so that every
/// mount weighs as much as any other within `lamina/`
/// ([`lamina_sys::cgroup::PARENT_CPU_WEIGHT`]).
pub const MOUNT_LIMITS: Limits = Limits {
    memory_max: 1 << 30,
    pids_max: 1024,
    cpu_weight: 100,
};

/// Moves this daemon, the processes `others` (its worker) and those it
/// starts after into the cgroup of the mount whose run dir is `run_dir`;
/// where that cannot be done (rootless, no controllers), says why in the
/// log and goes on.
pub fn enter_mount_cgroup(run_dir: &Path, others: &[u32]) {
    let Some(name) = run_dir.file_name().and_then(|n| n.to_str()) else {
        return;
    };
    let joined =
        lamina_sys::cgroup::enter_own(&format!("mount-{name}"), &MOUNT_LIMITS).and_then(|dirs| {
            for &pid in others {
                lamina_sys::cgroup::join(&dirs, pid)?;
            }
            Ok(dirs)
        });
    match joined {
        Ok(dirs) => tracing::info!(?dirs, "the mount's daemons have a cgroup of their own"),
        Err(e) => tracing::warn!("the mount's daemons share their parent's cgroup: {e}"),
    }
}
