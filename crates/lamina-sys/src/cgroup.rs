//! A cgroup of its own for each mount's daemons, so that one tenant's
//! storm of misses takes CPU, memory and threads from its own share only
//! (the daemons of every mount otherwise share the cgroup of whoever
//! started them: the snapshotter's, containerd's).
//!
//! The cgroup is `lamina/<name>` below the root of each hierarchy: on
//! cgroup v2 (`/sys/fs/cgroup/cgroup.controllers` exists) one directory
//! with the `cpu`, `memory` and `pids` controllers enabled for it; on v1
//! (or a hybrid layout) one directory in each of the `cpu`, `memory` and
//! `pids` hierarchies. A process moves itself in; the processes it starts
//! after that are born there. Empty cgroups of mounts gone are removed
//! when the next one is made (a cgroup cannot remove itself while its
//! process lives).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Where cgroup filesystems are mounted.
const ROOT: &str = "/sys/fs/cgroup";

/// The CPU weight of `lamina/`, all mounts' daemons together, against
/// the cgroups beside it (containers, system services; 100 each by
/// default): containers' reads wait on these daemons, so under contention
/// they must not weigh as one container. Each mount's cgroup then shares
/// it with the others by its own weight.
pub const PARENT_CPU_WEIGHT: u64 = 1000;

/// What a mount's daemons may use together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of memory, page cache they dirty included (`memory.max`,
    /// v1 `memory.limit_in_bytes`).
    pub memory_max: u64,
    /// Processes and threads (`pids.max`).
    pub pids_max: u64,
    /// CPU weight against other cgroups, 1..=10000, 100 the default
    /// (`cpu.weight`; v1 `cpu.shares` = weight * 1024 / 100).
    pub cpu_weight: u64,
}

/// Moves this process into the cgroup `lamina/<name>` (made with
/// `limits`) of every hierarchy that has the controllers; returns the
/// cgroup directories it joined.
pub fn enter_own(name: &str, limits: &Limits) -> io::Result<Vec<PathBuf>> {
    enter_own_in(Path::new(ROOT), name, limits)
}

/// [`enter_own`] with the cgroup filesystems under `root` (tests).
pub fn enter_own_in(root: &Path, name: &str, limits: &Limits) -> io::Result<Vec<PathBuf>> {
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return Err(io::Error::other(format!("cgroup name {name:?}")));
    }
    // Another mount starting beside this one may remove the new cgroup as
    // empty before this process is in it (`make_fresh`): made again.
    let mut tries = 0;
    loop {
        match enter_once(root, name, limits) {
            Err(e) if e.kind() == io::ErrorKind::NotFound && tries < 3 => tries += 1,
            result => return result,
        }
    }
}

fn enter_once(root: &Path, name: &str, limits: &Limits) -> io::Result<Vec<PathBuf>> {
    let pid = std::process::id().to_string();
    if root.join("cgroup.controllers").exists() {
        let parent = root.join("lamina");
        enable_controllers(root, &parent)?;
        write(&parent, "cpu.weight", PARENT_CPU_WEIGHT)?;
        let dir = parent.join(name);
        make_fresh(&dir)?;
        write(&dir, "memory.max", limits.memory_max)?;
        write(&dir, "pids.max", limits.pids_max)?;
        write(&dir, "cpu.weight", limits.cpu_weight.clamp(1, 10_000))?;
        write(&dir, "cgroup.procs", &pid)?;
        return Ok(vec![dir]);
    }
    let shares = |weight: u64| (weight.clamp(1, 10_000) * 1024 / 100).max(2);
    let settings: [(&str, &str, u64); 3] = [
        ("memory", "memory.limit_in_bytes", limits.memory_max),
        ("pids", "pids.max", limits.pids_max),
        ("cpu", "cpu.shares", shares(limits.cpu_weight)),
    ];
    let mut joined = Vec::new();
    for (controller, file, value) in settings {
        let hierarchy = root.join(controller);
        if !hierarchy.join("cgroup.procs").exists() {
            continue; // not mounted here
        }
        let dir = hierarchy.join("lamina").join(name);
        make_fresh(&dir)?;
        if controller == "cpu" {
            write(
                &hierarchy.join("lamina"),
                "cpu.shares",
                shares(PARENT_CPU_WEIGHT),
            )?;
        }
        write(&dir, file, value)?;
        write(&dir, "cgroup.procs", &pid)?;
        joined.push(dir);
    }
    match joined.is_empty() {
        true => Err(io::Error::other(format!(
            "no cgroup hierarchy with the cpu, memory or pids controller under {}",
            root.display()
        ))),
        false => Ok(joined),
    }
}

/// Moves process `pid` into each cgroup of `dirs` (what [`enter_own`]
/// returned).
pub fn join(dirs: &[PathBuf], pid: u32) -> io::Result<()> {
    dirs.iter()
        .try_for_each(|dir| write(dir, "cgroup.procs", pid))
}

/// The cgroup of `pid` in each hierarchy, as `/proc/PID/cgroup` has it
/// (`controllers:path`).
pub fn cgroups_of(pid: u32) -> io::Result<Vec<String>> {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_once(':').map(|(_, rest)| rest.to_string()))
        .collect())
}

/// On v2: `parent` (no processes of its own) hands the controllers to its
/// children, which the root must hand to it first.
fn enable_controllers(root: &Path, parent: &Path) -> io::Result<()> {
    fs::create_dir_all(parent)?;
    for dir in [root, parent] {
        let enabled = fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
        for controller in ["cpu", "memory", "pids"] {
            if !enabled.split_whitespace().any(|c| c == controller) {
                write(dir, "cgroup.subtree_control", format!("+{controller}"))?;
            }
        }
    }
    Ok(())
}

/// Makes `dir` (a cgroup), first removing the empty cgroups beside it:
/// those of mounts gone. One of the same name still in use (a mount at the
/// same mountpoint whose daemons live on) is joined as it is.
fn make_fresh(dir: &Path) -> io::Result<()> {
    if let Some(parent) = dir.parent() {
        fs::create_dir_all(parent)?;
        for entry in fs::read_dir(parent)?.flatten() {
            if entry.path() != dir && entry.path().is_dir() {
                let _ = fs::remove_dir(entry.path()); // refused while in use
            }
        }
    }
    match fs::create_dir(dir) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        other => other,
    }
}

fn write(dir: &Path, file: &str, value: impl ToString) -> io::Result<()> {
    let path = dir.join(file);
    fs::write(&path, value.to_string())
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        memory_max: 256 << 20,
        pids_max: 512,
        cpu_weight: 50,
    };

    /// On a v1 layout (fake files under a temp dir: the kernel's refusal
    /// of a real move is not tested here), each hierarchy gets the mount's
    /// cgroup with its limit, this process's pid in it, and empty cgroups
    /// of mounts gone are removed.
    #[test]
    fn v1_hierarchies_each_get_the_mounts_cgroup() {
        let root = tempfile::tempdir().unwrap();
        for c in ["memory", "pids", "cpu"] {
            fs::create_dir_all(root.path().join(c)).unwrap();
            fs::write(root.path().join(c).join("cgroup.procs"), "").unwrap();
        }
        let gone = root.path().join("pids/lamina/gone");
        fs::create_dir_all(&gone).unwrap();
        let joined = enter_own_in(root.path(), "m1", &LIMITS).unwrap();
        assert_eq!(joined.len(), 3);
        let read = |p: &str| fs::read_to_string(root.path().join(p)).unwrap();
        assert_eq!(read("memory/lamina/m1/memory.limit_in_bytes"), "268435456");
        assert_eq!(read("pids/lamina/m1/pids.max"), "512");
        assert_eq!(read("cpu/lamina/m1/cpu.shares"), "512");
        assert_eq!(read("cpu/lamina/cpu.shares"), "10240");
        assert_eq!(
            read("cpu/lamina/m1/cgroup.procs"),
            std::process::id().to_string()
        );
        assert!(!gone.exists(), "an empty cgroup of a mount gone is removed");
        assert!(enter_own_in(root.path(), "../x", &LIMITS).is_err());
    }

    /// On v2: the controllers are enabled down to `lamina/`, and the
    /// mount's cgroup gets the limits.
    #[test]
    fn v2_gets_one_cgroup_with_the_controllers_enabled() {
        let root = tempfile::tempdir().unwrap();
        fs::write(root.path().join("cgroup.controllers"), "cpu memory pids").unwrap();
        fs::write(root.path().join("cgroup.subtree_control"), "").unwrap();
        let joined = enter_own_in(root.path(), "m2", &LIMITS).unwrap();
        assert_eq!(joined, [root.path().join("lamina/m2")]);
        let read = |p: &str| fs::read_to_string(root.path().join(p)).unwrap();
        assert_eq!(read("lamina/m2/memory.max"), "268435456");
        assert_eq!(read("lamina/m2/pids.max"), "512");
        assert_eq!(read("lamina/m2/cpu.weight"), "50");
        assert_eq!(read("lamina/cpu.weight"), "1000");
        // Each +controller write replaces the fake file: the last one stays.
        assert_eq!(read("lamina/cgroup.subtree_control"), "+pids");
    }
}
