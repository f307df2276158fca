//! Rootless FUSE (issue 9): user nobody mounts through fusermount3, and
//! rootless podman runs python3 from a lamina mount.

use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::*;
use crate::fuse_daemons;

/// The unprivileged user the rootless test runs as.
const NOBODY: u32 = 65534;

/// `lamina ARGS` as user nobody, with `home` as its home and cache root.
fn lamina_as_nobody(home: &Path, args: &[&OsStr]) -> Output {
    let mut c = command(
        tool("setpriv"),
        [
            OsStr::new(&format!("--reuid={NOBODY}")),
            OsStr::new(&format!("--regid={NOBODY}")),
            OsStr::new("--clear-groups"),
            OsStr::new(LAMINA),
        ],
    );
    c.args(args)
        .env_remove("LAMINA_CACHE_DIR")
        .env("HOME", home)
        .env("XDG_CACHE_HOME", home.join("cache"));
    run(&mut c, TIMEOUT)
}

/// Puts /dev/fuse's mode back when dropped.
struct DevFuseMode(u32);

/// The rootless tests open /dev/fuse to everyone for their run: one at a
/// time, or the first to end puts the mode back under the other (seen: the
/// podman test's mount failed with EACCES).
static DEV_FUSE: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Drop for DevFuseMode {
    fn drop(&mut self) {
        let _ = fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(self.0));
    }
}

/// Rootless (issue 9): user nobody mounts the edge image lazily through
/// fusermount3 with no --cache-dir: auto mode says FUSE because it is not
/// root, the cache lands in `$XDG_CACHE_HOME/lamina` (0700), and the mount
/// belongs to nobody. Through it, and through a user namespace nobody
/// makes (as a rootless runtime does), every file nobody may read has the
/// reference bytes. nobody's `lamina umount` unmounts it (fusermount3 -u)
/// and the daemon exits.
///
/// A normal host's /dev/fuse is 0666 (fusermount3 opens it as the user);
/// where it is not (this CI's is 0600) the test opens it up and restores it.
// Over 100 lines: the unprivileged set-up and every check that needs it, in order.
#[test]
fn rootless_lazy_fuse_mount_through_fusermount3() {
    if !require(&["setpriv", "fusermount3", "unshare"]) {
        return;
    }
    let _one_at_a_time = DEV_FUSE.lock().unwrap_or_else(|e| e.into_inner());
    let mode = fs::metadata("/dev/fuse").unwrap().permissions().mode() & 0o7777;
    let _restore = DevFuseMode(mode);
    fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(0o666)).unwrap();
    let t = TestDir::new("fuse-rootless");
    fs::set_permissions(t.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let image = oci_ref(&t.join("img"), "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &image]).ok();
    let (home, mnt) = (t.mkdir("home"), t.mkdir("mnt"));
    let chown = |p: &Path| {
        let mut c = command(
            "chown",
            [OsStr::new("-R"), OsStr::new("65534:65534"), p.as_os_str()],
        );
        run(&mut c, SHORT).ok();
    };
    for p in [&t.join("img"), &home, &mnt] {
        chown(p);
    }
    let _watch = MountWatch(mnt.clone(), home.join("cache/lamina"));

    let out = lamina_as_nobody(
        &home,
        &["mount", "--json", "--lazy", &image, mnt.to_str().unwrap()].map(OsStr::new),
    )
    .ok();
    let info = out.json();
    assert_eq!(info["mode"], "fuse", "{info}");
    assert!(
        info["mode_reason"]
            .as_str()
            .unwrap_or("")
            .contains("not root"),
        "{info}"
    );
    let cache = home.join("cache/lamina");
    let meta = fs::metadata(&cache).expect("the default rootless cache dir");
    assert_eq!(meta.permissions().mode() & 0o777, 0o700, "cache dir mode");
    assert_eq!(meta.uid(), NOBODY, "cache dir owner");
    let line = fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
        .find(|l| l.split(' ').nth(1) == Some(mnt.to_str().unwrap()))
        .map(str::to_string)
        .expect("the mount in /proc/self/mounts");
    assert!(
        line.contains("fuse.lamina") && line.contains(&format!("user_id={NOBODY}")),
        "not nobody's FUSE mount: {line}"
    );

    // nobody reads every file it may read, directly and from inside a user
    // namespace of its own; root, not the mount's owner, is kept out.
    let reference = ociunpack(&edge_layout(), "edge");
    let script = "import hashlib,os,sys\n\
        for d,_,fs in os.walk(sys.argv[1]):\n\
        \x20 for f in fs:\n\
        \x20   p=os.path.join(d,f)\n\
        \x20   if os.path.isfile(p) and not os.path.islink(p) and os.access(p,os.R_OK):\n\
        \x20     print(hashlib.sha256(open(p,'rb').read()).hexdigest(), os.path.relpath(p,sys.argv[1]))\n";
    // The system python: a per-user one (pyenv under /root) is not for nobody.
    let (python, unshare) = (Path::new("/usr/bin/python3"), tool("unshare"));
    for userns in [false, true] {
        let mut args: Vec<&OsStr> = vec![
            OsStr::new("--reuid=65534"),
            OsStr::new("--regid=65534"),
            OsStr::new("--clear-groups"),
        ];
        if userns {
            args.extend([
                unshare.as_os_str(),
                OsStr::new("--user"),
                OsStr::new("--map-root-user"),
            ]);
        }
        args.extend([
            python.as_os_str(),
            OsStr::new("-c"),
            OsStr::new(script),
            mnt.as_os_str(),
        ]);
        let out = run(&mut command(tool("setpriv"), args), TIMEOUT).ok();
        let mut compared = 0;
        for line in out.stdout.lines() {
            let (hash, path) = line.split_once(' ').expect("hash path");
            assert_eq!(
                hash,
                sha256_file(&reference.join(path)),
                "{path} read by nobody (user namespace: {userns})"
            );
            compared += 1;
        }
        assert!(
            compared >= 1000,
            "only {compared} files readable by nobody (userns {userns})"
        );
    }
    assert!(
        fs::read_dir(&mnt).is_err(),
        "root could list nobody's mount made without allow_other"
    );

    let status = lamina_as_nobody(&home, &["status", "--json"].map(OsStr::new)).ok();
    assert!(status.stdout.contains("misses"), "{}", status.describe());
    let daemons = fuse_daemons(&cache);
    assert_eq!(daemons.len(), 1, "one FUSE daemon serves the mount");
    lamina_as_nobody(&home, &[OsStr::new("umount"), mnt.as_os_str()]).ok();
    assert!(!is_mountpoint(&mnt), "still mounted after nobody's umount");
    assert!(
        process_exits(daemons[0], Duration::from_secs(10)),
        "the FUSE daemon outlived its mount"
    );
}

/// User nobody's podman: `home` holds its storage, config and cache, and
/// `run` is its runtime dir, under a short name of its own: with an
/// XDG_RUNTIME_DIR of 40 characters or more, podman 4.3's exit command
/// refuses the runroot and `podman run` waits 20 s (docs/fuse.md).
///
/// Dropping it ends nobody's podman user namespace and any lamina daemon
/// serving from the cache under its home: a mount left in that namespace
/// would otherwise keep its daemon, and the daemon the namespace, alive.
struct NobodyPodman {
    home: PathBuf,
    run: tempfile::TempDir,
}

impl NobodyPodman {
    /// Makes `home` and a runtime dir, both nobody's.
    fn new(home: PathBuf) -> NobodyPodman {
        let run_dir = tempfile::Builder::new()
            .prefix("lamina-run-")
            .tempdir()
            .expect("a runtime dir");
        fs::set_permissions(run_dir.path(), fs::Permissions::from_mode(0o700)).unwrap();
        for p in [&home, run_dir.path()] {
            let mut c = command(
                "chown",
                [OsStr::new("-R"), OsStr::new("65534:65534"), p.as_os_str()],
            );
            run(&mut c, SHORT).ok();
        }
        NobodyPodman { home, run: run_dir }
    }

    /// `podman ARGS` as nobody.
    fn podman(&self, args: &[&str]) -> Output {
        let mut c = command(
            tool("setpriv"),
            [
                OsStr::new(&format!("--reuid={NOBODY}")),
                OsStr::new(&format!("--regid={NOBODY}")),
                OsStr::new("--clear-groups"),
                tool("podman").as_os_str(),
            ],
        );
        c.args(args)
            .env_remove("LAMINA_CACHE_DIR")
            .env("HOME", &self.home)
            .env("XDG_RUNTIME_DIR", self.run.path())
            .env("XDG_CONFIG_HOME", self.home.join("config"))
            .env("XDG_DATA_HOME", self.home.join("data"))
            .env("XDG_CACHE_HOME", self.home.join("cache"));
        run(&mut c, TIMEOUT)
    }
}

impl Drop for NobodyPodman {
    fn drop(&mut self) {
        let _ = self.podman(&["system", "migrate"]);
        let mut kill = command("pkill", [OsStr::new("-f"), self.home.as_os_str()]);
        let _ = try_run(&mut kill, SHORT);
    }
}

/// Hashes every file under /usr/lib/python3.11 in order: one digest.
const HASH_PYTHON_LIB: &str = "cd usr/lib/python3.11 && find . -type f | LC_ALL=C sort | \
                               xargs -d '\\n' sha256sum | sha256sum";

/// Rootless podman (issue 9): user nobody, with subordinate ids
/// (scripts/setup.sh gives it 200000-265535), mounts the Debian image lazily
/// inside podman's own user namespace (`podman unshare lamina mount`, so
/// the image's files belong to the container's users there), and `podman
/// run --rootfs MNT:O` runs python3 from it without root. The container's
/// write lands in podman's overlay, not in the image; the files of
/// /usr/lib/python3.11 read in the container hash as ociunpack.py's tree
/// has them; `podman unshare lamina umount` unmounts it.
#[test]
fn rootless_podman_runs_python3_from_a_lamina_mount() {
    if !require(&["setpriv", "podman", "newuidmap"]) {
        return;
    }
    let subuid = fs::read_to_string("/etc/subuid").unwrap_or_default();
    assert!(
        subuid.lines().any(|l| l.starts_with("nobody:")),
        "nobody has no subordinate uids: scripts/setup.sh adds them"
    );
    let _one_at_a_time = DEV_FUSE.lock().unwrap_or_else(|e| e.into_inner());
    let mode = fs::metadata("/dev/fuse").unwrap().permissions().mode() & 0o7777;
    let _restore = DevFuseMode(mode);
    fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(0o666)).unwrap();
    let t = TestDir::new("podman-rootless");
    fs::set_permissions(t.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let image = oci_ref(&t.join("img"), "deb");
    lamina(["convert", &oci_ref(&debian_source(), "bookworm"), &image]).ok();
    let mnt = t.mkdir("mnt");
    for p in [&t.join("img"), &mnt] {
        let mut c = command(
            "chown",
            [OsStr::new("-R"), OsStr::new("65534:65534"), p.as_os_str()],
        );
        run(&mut c, SHORT).ok();
    }
    let nobody = NobodyPodman::new(t.mkdir("home"));
    let podman = |args: &[&str]| nobody.podman(args);
    let mnt_arg = mnt.to_str().unwrap();

    let out = podman(&[
        "unshare", LAMINA, "mount", "--json", "--lazy", &image, mnt_arg,
    ])
    .ok();
    let info = out.json();
    assert_eq!(info["mode"], "fuse", "{info}");
    assert!(
        info["mode_reason"]
            .as_str()
            .unwrap_or("")
            .contains("not root"),
        "root of a user namespace is not root of the host: {info}"
    );
    let script = format!(
        "python3 -c 'print(\"hello from rootless podman\")' && \
         echo written > /etc/lamina-test && cat /etc/lamina-test && cd / && {HASH_PYTHON_LIB}"
    );
    // --ulimit host: podman raises the open-files limit past nobody's
    // hard limit otherwise. cgroupfs: no systemd user session here.
    let rootfs = format!("{mnt_arg}:O");
    let out = podman(&[
        "--cgroup-manager=cgroupfs",
        "run",
        "--rm",
        "--network",
        "none",
        "--ulimit",
        "host",
        "--rootfs",
        &rootfs,
        "sh",
        "-c",
        &script,
    ])
    .ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        lines.get(..2),
        Some(&["hello from rootless podman", "written"][..]),
        "{}",
        out.describe()
    );
    let reference = ociunpack(&debian_source(), "bookworm");
    let script = HASH_PYTHON_LIB.replace("cd usr", &format!("cd {}/usr", reference.display()));
    let want = run(&mut command("bash", ["-c", &script]), TIMEOUT)
        .ok()
        .stdout;
    assert_eq!(
        lines.get(2).copied(),
        Some(want.trim()),
        "{}",
        out.describe()
    );

    // The write went to podman's overlay, not into the image.
    let listed = podman(&["unshare", "ls", "-a", &format!("{mnt_arg}/etc")]).ok();
    assert!(
        listed.stdout.contains("os-release") && !listed.stdout.contains("lamina-test"),
        "{}",
        listed.describe()
    );
    podman(&["unshare", LAMINA, "umount", mnt_arg]).ok();
    let listed = podman(&["unshare", "ls", "-A", mnt_arg]).ok();
    assert_eq!(listed.stdout, "", "still mounted:\n{}", listed.describe());
}
