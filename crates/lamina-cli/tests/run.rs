//! `lamina run` end to end with the real runc: the reference Debian image
//! with a config of our own (User, WorkingDir, Env, Cmd), converted once
//! per test binary and served by a registry per test on 127.0.0.1.
//!
//! Every test also checks that nothing is left behind: no mount below its
//! temp dir, no runc state, no run dir, no lazy-mount holder.

mod common;

use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

const TOOLS: &[&str] = &["umoci", "debootstrap", "jq", "docker-registry", "runc"];

/// Repository and tag of the converted image in every test registry.
const IMAGE: &str = "run:1";

/// The config the test image carries (the Debian image's layers).
fn image_config() -> Value {
    json!({
        "User": "www-data:redis",
        "WorkingDir": "/usr/share",
        "Env": [
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "IMG_ONLY=image",
            "OVERRIDE=image",
        ],
        "Cmd": ["sh", "-c", "echo image-cmd"],
    })
}

/// Storage of a registry holding the test image as [`IMAGE`].
fn registry_data() -> &'static Path {
    static D: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = D.get_or_init(|| {
        std::panic::catch_unwind(build_image).map_err(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .unwrap_or_else(|| "panic".into())
        })
    });
    match built {
        Ok(p) => p,
        Err(e) => panic!("the test image could not be built: {e}"),
    }
}

fn build_image() -> PathBuf {
    let source = debian_source();
    let dir = fixtures().join("debian-run");
    if dir.exists() {
        fs::remove_dir_all(&dir).unwrap_or_else(|e| panic!("rm {}: {e}", dir.display()));
    }
    let layout = dir.join("layout");
    derive_layout(&source, "bookworm", &layout, "run");
    let reg = Registry::start();
    lamina_timeout(
        ["convert", &oci_ref(&layout, "run"), &reg.reference(IMAGE)],
        Duration::from_secs(1800),
    )
    .ok();
    reg.stop();
    let data = dir.join("registry-data");
    let mut c = command(
        "cp",
        [
            OsStr::new("-a"),
            reg.dir().join("data").as_os_str(),
            data.as_os_str(),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    data
}

fn blob(layout: &Path, digest: &str) -> PathBuf {
    layout
        .join("blobs/sha256")
        .join(digest.trim_start_matches("sha256:"))
}

fn put_blob(layout: &Path, bytes: &[u8]) -> Value {
    let digest = format!("sha256:{}", hex(&Sha256::digest(bytes)));
    fs::write(blob(layout, &digest), bytes).unwrap();
    json!({"digest": digest, "size": bytes.len()})
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A copy of the `tag` image of `src` (layers hard-linked) whose config's
/// runtime part is [`image_config`], tagged `new_tag` in `dst`.
fn derive_layout(src: &Path, tag: &str, dst: &Path, new_tag: &str) {
    fs::create_dir_all(dst.join("blobs/sha256")).unwrap();
    let index: Value = serde_json::from_slice(&fs::read(src.join("index.json")).unwrap()).unwrap();
    let desc = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag)
        .unwrap_or_else(|| panic!("no tag {tag} in {}", src.display()))
        .clone();
    let digest = desc["digest"].as_str().unwrap();
    let mut manifest: Value =
        serde_json::from_slice(&fs::read(blob(src, digest)).unwrap()).unwrap();
    for layer in manifest["layers"].as_array().unwrap() {
        let d = layer["digest"].as_str().unwrap();
        if fs::hard_link(blob(src, d), blob(dst, d)).is_err() {
            fs::copy(blob(src, d), blob(dst, d)).unwrap();
        }
    }
    let config_digest = manifest["config"]["digest"].as_str().unwrap().to_string();
    let mut config: Value =
        serde_json::from_slice(&fs::read(blob(src, &config_digest)).unwrap()).unwrap();
    config["config"] = image_config();
    let c = put_blob(dst, &serde_json::to_vec(&config).unwrap());
    manifest["config"]["digest"] = c["digest"].clone();
    manifest["config"]["size"] = c["size"].clone();
    let m = put_blob(dst, &serde_json::to_vec(&manifest).unwrap());
    let index = json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": m["digest"], "size": m["size"],
        "annotations": {"org.opencontainers.image.ref.name": new_tag},
    }]});
    fs::write(dst.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    fs::write(dst.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
}

/// One test's registry, cache dir and state dir.
struct Env {
    t: TestDir,
    reg: Registry,
}

impl Env {
    #[track_caller]
    fn new(label: &str) -> Env {
        let reg = Registry::start_with_data(registry_data());
        Env {
            t: TestDir::new(label),
            reg,
        }
    }

    fn image(&self) -> String {
        self.reg.reference(IMAGE)
    }

    fn cache(&self) -> PathBuf {
        self.t.join("cache")
    }

    fn state(&self) -> PathBuf {
        self.t.join("state")
    }

    /// `lamina run --cache-dir C --state-dir S FLAGS IMAGE -- CMD`.
    fn command(&self, flags: &[&str], cmd: &[&str]) -> Command {
        let mut c = lamina_cmd(["run", "--cache-dir"]);
        c.arg(self.cache()).arg("--state-dir").arg(self.state());
        c.args(flags).arg(self.image()).arg("--").args(cmd);
        c
    }

    #[track_caller]
    fn run(&self, flags: &[&str], cmd: &[&str]) -> Output {
        run(&mut self.command(flags, cmd), TIMEOUT)
    }

    /// Nothing of any container is left: mounts, run dirs, runc state,
    /// lazy-mount holders.
    #[track_caller]
    fn assert_clean(&self) {
        let mounts = mounts_under(self.t.path());
        assert!(mounts.is_empty(), "still mounted: {mounts:?}");
        for dir in [
            self.state().join("containers"),
            self.state().join("userns"),
            self.state().join("runc"),
            self.cache().join("mounts"),
        ] {
            let left: Vec<_> = fs::read_dir(&dir)
                .map(|d| d.flatten().map(|e| e.path()).collect())
                .unwrap_or_default();
            assert!(left.is_empty(), "left in {}: {left:?}", dir.display());
        }
        let mut list = command(
            tool("runc"),
            [
                OsStr::new("--root"),
                self.state().join("runc").as_os_str(),
                OsStr::new("list"),
                OsStr::new("-q"),
            ],
        );
        let out = run(&mut list, SHORT);
        assert_eq!(
            out.stdout.trim(),
            "",
            "runc still lists containers:\n{}",
            out.describe()
        );
    }
}

#[track_caller]
fn lines(o: &Output) -> Vec<&str> {
    o.stdout.lines().collect()
}

#[test]
fn output_and_exit_code_come_through() {
    if !require(TOOLS) {
        return;
    }
    let e = Env::new("run-exit");
    let o = e
        .run(&["--rm"], &["sh", "-c", "echo out; echo err >&2; exit 3"])
        .code_is(3);
    assert_eq!(o.stdout, "out\n", "{}", o.describe());
    assert!(o.stderr.contains("err"), "{}", o.describe());
    // No command: the image's Cmd.
    let mut c = lamina_cmd(["run", "--rm", "--cache-dir"]);
    c.arg(e.cache())
        .arg("--state-dir")
        .arg(e.state())
        .arg(e.image());
    let o = run(&mut c, TIMEOUT).ok();
    assert_eq!(o.stdout, "image-cmd\n", "{}", o.describe());
    // docker's codes when the command cannot run.
    e.run(&["--rm"], &["no-such-command"]).code_is(127);
    e.run(&["--rm"], &["/etc/passwd"]).code_is(126);
    e.assert_clean();
}

#[test]
fn image_config_env_workdir_and_user_apply() {
    if !require(TOOLS) {
        return;
    }
    let e = Env::new("run-config");
    let script = "id -un; id -gn; pwd; echo \"$IMG_ONLY $OVERRIDE $FROM_HOST $HOME\"";
    let mut c = e.command(
        &["--rm", "-e", "OVERRIDE=flag", "-e", "FROM_HOST"],
        &["sh", "-c", script],
    );
    c.env("FROM_HOST", "host-value");
    let o = run(&mut c, TIMEOUT).ok();
    // User "www-data:redis" by name, from the image's /etc/passwd and
    // /etc/group; WorkingDir; Env merged with -e (later wins); HOME from
    // the passwd entry.
    assert_eq!(
        lines(&o),
        [
            "www-data",
            "redis",
            "/usr/share",
            "image flag host-value /var/www"
        ],
        "{}",
        o.describe()
    );
    let o = e
        .run(
            &["--rm", "-u", "0", "-w", "/tmp"],
            &["sh", "-c", "id -u; id -g; pwd; env"],
        )
        .ok();
    let out = lines(&o);
    assert_eq!(out[..3], ["0", "0", "/tmp"], "{}", o.describe());
    assert!(out.contains(&"IMG_ONLY=image"), "{}", o.describe());
    assert!(out.contains(&"HOME=/root"), "{}", o.describe());
    e.assert_clean();
}

#[test]
fn bad_input_exits_125_and_leaves_nothing() {
    if !require(TOOLS) {
        return;
    }
    let e = Env::new("run-bad");
    for (flags, what) in [
        (&["-v", "/tmp"][..], "bad volume"),
        (&["-v", "relative:/data"][..], "bad volume"),
        (&["-v", "/no/such/source/dir:/data"][..], "does not exist"),
        (&["-u", "ghost"][..], "unable to find user ghost"),
        (
            &["-u", "www-data:ghosts"][..],
            "unable to find group ghosts",
        ),
        (&["--net", "bridge"][..], "bad network"),
        (&["--name", "a/b"][..], "bad container name"),
        (&["--no-such-flag"][..], "--no-such-flag"),
    ] {
        let o = e.run(flags, &["true"]).code_is(125);
        assert!(
            o.stderr.contains(what),
            "{flags:?}: expected {what:?}:\n{}",
            o.describe()
        );
    }
    let left: Vec<_> = fs::read_dir(e.cache().join("containers"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "upper dirs left: {left:?}");
    e.assert_clean();
}

#[test]
fn writes_land_in_the_upper_dir_and_vanish_with_rm() {
    if !require(TOOLS) {
        return;
    }
    let e = Env::new("run-upper");
    let keep = e.cache().join("containers/kept");
    e.run(
        &["--name", "kept", "-u", "0"],
        &["sh", "-c", "echo data > /root/written"],
    )
    .ok();
    let upper = keep.join("upper");
    assert_eq!(
        fs::read_to_string(upper.join("root/written")).unwrap(),
        "data\n"
    );
    // Private: the container's directory and the cache dir are 0700; the
    // upper dir itself has the image root's mode (it is the container's /).
    for dir in [&keep, &e.cache(), &e.state(), &e.state().join("containers")] {
        let mode = fs::metadata(dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{}", dir.display());
    }
    assert_eq!(
        fs::metadata(&upper).unwrap().permissions().mode() & 0o777,
        0o755
    );
    // The image itself is unchanged: a new container does not see the file.
    e.run(&["--rm", "-u", "0"], &["test", "!", "-e", "/root/written"])
        .ok();
    // The name stays taken until `lamina rm`.
    let o = e.run(&["--name", "kept"], &["true"]).code_is(125);
    assert!(o.stderr.contains("in use"), "{}", o.describe());
    let mut rm = lamina_cmd(["rm", "--cache-dir"]);
    rm.arg(e.cache())
        .arg("--state-dir")
        .arg(e.state())
        .arg("kept");
    run(&mut rm, SHORT).ok();
    assert!(!keep.exists());

    e.run(
        &["--rm", "--name", "gone", "-u", "0"],
        &["sh", "-c", "echo x > /root/written"],
    )
    .ok();
    assert!(!e.cache().join("containers/gone").exists());
    e.assert_clean();
}

/// Issue 43: `lamina run --share-files`. The container's root is its
/// overlay with an upper dir over the image's shared-files view (metadata
/// view over content-addressed shards): programs run with their libraries
/// mapped from a shard, a write to an image file copies it up whole (the
/// view's file holds no data, only where it is), the next container sees
/// the image's bytes, and nothing (view, shard, mount) is left after `--rm`.
#[test]
fn share_files_runs_the_container_over_the_shared_view() {
    if !require(TOOLS) {
        return;
    }
    let e = Env::new("run-share");
    let flags = [
        "--rm",
        "-u",
        "0",
        "--eager",
        "--mode",
        "kernel",
        "--share-files",
    ];
    let script = "head -c 5 /etc/passwd; echo; echo extra >> /etc/passwd; tail -n 1 /etc/passwd; \
                  perl -e 'print 6 * 7, qq(\\n)'";
    let o = e.run(&flags, &["sh", "-c", script]).ok();
    assert_eq!(lines(&o), ["root:", "extra", "42"], "{}", o.describe());
    let o = e.run(&flags, &["tail", "-n", "1", "/etc/passwd"]).ok();
    assert_ne!(o.stdout.trim(), "extra", "{}", o.describe());
    let shards: Vec<_> = fs::read_dir(e.cache().join("shards"))
        .unwrap()
        .flatten()
        .flat_map(|d| fs::read_dir(d.path()).unwrap().flatten())
        .filter(|s| !s.file_name().to_string_lossy().starts_with('.'))
        .map(|s| s.path())
        .collect();
    assert!(shards.is_empty(), "shards left: {shards:?}");
    e.assert_clean();
}

/// Issue 28 point 8: an untrusted image runs with no network but its own
/// loopback, no raw sockets, no new privileges and docker's seccomp rules
/// (no user namespace, no keyring) unless asked; asked, it gets them.
#[test]
fn containers_are_confined_unless_asked() {
    if !require(TOOLS) {
        return;
    }
    let e = Env::new("run-confined");
    // Through a pipe: the profile lets ordinary programs be.
    let status = "grep -E '^(NoNewPrivs|Seccomp|CapBnd):' /proc/self/status | cat";
    let field = |o: &Output, name: &str| -> String {
        let line = o.stdout.lines().find(|l| l.starts_with(name));
        let line = line.unwrap_or_else(|| panic!("no {name} in {}", o.describe()));
        line.split_whitespace().nth(1).unwrap().to_string()
    };
    const NET_RAW: u64 = 1 << 13;
    let cap_bnd = |o: &Output| u64::from_str_radix(&field(o, "CapBnd:"), 16).unwrap();
    let o = e.run(&["--rm"], &["sh", "-c", status]).ok();
    assert_eq!(field(&o, "NoNewPrivs:"), "1", "{}", o.describe());
    assert_eq!(field(&o, "Seccomp:"), "2", "{}", o.describe());
    assert_eq!(cap_bnd(&o) & NET_RAW, 0, "{}", o.describe());
    let o = e.run(&["--rm"], &["ls", "/sys/class/net"]).ok();
    assert_eq!(lines(&o), ["lo"], "{}", o.describe());
    // No user namespace (unshare(CLONE_NEWUSER)), no keyring: EPERM.
    let o = e.run(&["--rm"], &["unshare", "-U", "true"]);
    assert_ne!(o.status.code(), Some(0), "{}", o.describe());
    assert!(o.stderr.contains("not permitted"), "{}", o.describe());
    let keyctl = "import ctypes, os; l = ctypes.CDLL(None, use_errno=True); \
                  r = l.syscall(250, 0, -3, 0, 0, 0); print(r, os.strerror(ctypes.get_errno()))";
    let o = e.run(&["--rm"], &["python3", "-c", keyctl]).ok();
    assert_eq!(
        o.stdout.trim(),
        "-1 Operation not permitted",
        "{}",
        o.describe()
    );
    // docker 29's defaults (issue 42, point 8): /proc without setuid,
    // devices or exec; /proc/interrupts masked; io_uring refused; and
    // podman's pids limit, which --pids-limit -1 lifts.
    let pids = "cat /sys/fs/cgroup/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids/pids.max";
    let look = format!("grep ' /proc ' /proc/mounts; wc -c < /proc/interrupts; {pids}");
    let o = e.run(&["--rm"], &["sh", "-c", &look]).ok();
    let got = lines(&o);
    let proc_options: Vec<&str> = got[0]
        .split_whitespace()
        .nth(3)
        .unwrap()
        .split(',')
        .collect();
    for option in ["nosuid", "nodev", "noexec"] {
        assert!(
            proc_options.contains(&option),
            "/proc without {option}: {}",
            o.describe()
        );
    }
    assert_eq!(got[1..], ["0", "2048"], "{}", o.describe());
    let io_uring = "import ctypes, os; l = ctypes.CDLL(None, use_errno=True); \
                    r = l.syscall(425, 1, 0); print(r, os.strerror(ctypes.get_errno()))";
    let o = e.run(&["--rm"], &["python3", "-c", io_uring]).ok();
    assert_eq!(
        o.stdout.trim(),
        "-1 Operation not permitted",
        "{}",
        o.describe()
    );
    let o = e
        .run(&["--rm", "--pids-limit", "-1"], &["sh", "-c", pids])
        .ok();
    assert_eq!(o.stdout.trim(), "max", "{}", o.describe());
    let asked = [
        "--rm",
        "--cap-add",
        "NET_RAW",
        "--security-opt",
        "no-new-privileges=false",
        "--security-opt",
        "seccomp=unconfined",
    ];
    let o = e.run(&asked, &["sh", "-c", status]).ok();
    assert_eq!(field(&o, "NoNewPrivs:"), "0", "{}", o.describe());
    assert_eq!(field(&o, "Seccomp:"), "0", "{}", o.describe());
    assert_eq!(cap_bnd(&o) & NET_RAW, NET_RAW, "{}", o.describe());
    e.run(&["--rm", "--cap-add", "NET_MAGIC"], &["true"])
        .code_is(125);
    e.assert_clean();
}

/// Issue 42, `--userns`: the container's root is host uid 200000. Inside,
/// root owns the image's files as it does without a user namespace (an
/// idmapped mount of the image: no byte of it changes); on the host, what
/// the container writes belongs to the range, and a host file only root may
/// read stays shut to the container's root. Asked for the host's network, a
/// FUSE mount or an empty range, it refuses before setting anything up.
#[test]
fn userns_root_is_no_root_on_the_host() {
    if !require(TOOLS) {
        return;
    }
    let e = Env::new("run-userns");
    let secret = e.t.join("host-secret");
    fs::write(&secret, "host only\n").unwrap();
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o600)).unwrap();
    let vol = format!("{}:/mnt/secret:ro", secret.display());
    let script = "id -u; cat /proc/self/uid_map; stat -c '%u:%g %n' /etc/passwd /var/mail; \
                  echo data > /root/written; cat /mnt/secret 2>/dev/null || echo denied";
    let flags = [
        "--name",
        "ns",
        "-u",
        "0",
        "--mode",
        "kernel",
        "--userns",
        "200000:65536",
        "-v",
        &vol,
    ];
    let o = e.run(&flags, &["sh", "-c", script]).ok();
    let out: Vec<String> = o.stdout.split_whitespace().map(String::from).collect();
    let expected = [
        "0",
        "0",
        "200000",
        "65536",
        "0:0",
        "/etc/passwd",
        "0:8",
        "/var/mail",
        "denied",
    ];
    assert_eq!(out, expected, "{}", o.describe());
    let written = e.cache().join("containers/ns/upper/root/written");
    let meta = fs::metadata(&written).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        (meta.uid(), meta.gid()),
        (200_000, 200_000),
        "{}",
        written.display()
    );
    for (bad, why) in [
        (vec!["--userns", "200000", "--net", "host"], "own network"),
        (
            vec!["--userns", "200000", "--mode", "fuse"],
            "--mode kernel",
        ),
        (vec!["--userns", "0:10"], "above root"),
    ] {
        let o = e.run(&bad, &["true"]).code_is(125);
        assert!(o.stderr.contains(why), "{bad:?}: {}", o.describe());
    }
    // A state dir below a dir others may not pass through: refused up
    // front, naming it (runc's init would fail with EACCES).
    let closed = e.t.join("closed");
    fs::create_dir(&closed).unwrap();
    fs::set_permissions(&closed, fs::Permissions::from_mode(0o700)).unwrap();
    let mut c = lamina_cmd(["run", "--rm", "--userns", "200000", "--cache-dir"]);
    c.arg(e.cache())
        .arg("--state-dir")
        .arg(closed.join("state"));
    c.arg(e.image()).args(["--", "true"]);
    let o = run(&mut c, TIMEOUT).code_is(125);
    assert!(
        o.stderr.contains("cannot be passed through"),
        "{}",
        o.describe()
    );
    assert!(
        o.stderr.contains(closed.to_str().unwrap()),
        "{}",
        o.describe()
    );
    e.assert_clean();
}

#[test]
fn net_none_has_only_loopback() {
    if !require(TOOLS) {
        return;
    }
    let e = Env::new("run-net");
    let o = e
        .run(&["--rm", "--net", "none"], &["ls", "/sys/class/net"])
        .ok();
    assert_eq!(lines(&o), ["lo"], "{}", o.describe());
    // The host's network shows the host's interfaces.
    let mut host: Vec<String> = fs::read_dir("/sys/class/net")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    host.sort();
    assert!(
        host.len() > 1,
        "the host has only {host:?}: the test cannot tell"
    );
    let o = e
        .run(&["--rm", "--net", "host"], &["ls", "/sys/class/net"])
        .ok();
    assert_eq!(lines(&o), host, "{}", o.describe());
    e.assert_clean();
}

#[test]
fn volumes_are_bound() {
    if !require(TOOLS) {
        return;
    }
    let e = Env::new("run-vol");
    let src = e.t.mkdir("vol");
    fs::write(src.join("from-host"), "host data\n").unwrap();
    let bind = format!("{}:/data", src.display());
    let o = e
        .run(
            &["--rm", "-u", "0", "-v", &bind],
            &[
                "sh",
                "-c",
                "cat /data/from-host; echo back > /data/from-container",
            ],
        )
        .ok();
    assert_eq!(o.stdout, "host data\n", "{}", o.describe());
    assert_eq!(
        fs::read_to_string(src.join("from-container")).unwrap(),
        "back\n"
    );
    let ro = format!("{bind}:ro");
    let o = e
        .run(&["--rm", "-u", "0", "-v", &ro], &["touch", "/data/x"])
        .failed();
    assert!(o.stderr.contains("Read-only"), "{}", o.describe());
    assert!(!src.join("x").exists());
    e.assert_clean();
}

/// Processes whose command line is exactly `argv`.
fn processes(argv: &[&str]) -> Vec<u32> {
    let want: Vec<u8> = argv.iter().flat_map(|a| a.bytes().chain([0])).collect();
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == want))
        .collect()
}

/// Starts `lamina run` in the background and waits until `ready` says the
/// container's process is up (bounded: a hang fails the test).
fn start_background(
    e: &Env,
    name: &str,
    cmd: &[&str],
    ready: impl Fn(&Background) -> bool,
) -> Background {
    let mut c = e.command(
        &["--json", "--rm", "--name", name, "--stop-timeout", "1"],
        cmd,
    );
    let mut bg = Background::spawn(name, &mut c, e.t.path());
    let started = Instant::now();
    while !ready(&bg) {
        assert!(bg.running(), "lamina run exited early:\n{}", bg.describe());
        assert!(
            started.elapsed() < TIMEOUT,
            "the container never got ready:\n{}",
            bg.describe()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    bg
}

fn terminate(bg: &mut Background) -> i32 {
    let pid = rustix::process::Pid::from_raw(bg.pid() as i32).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let status = bg
        .wait_timeout(TIMEOUT)
        .unwrap_or_else(|| panic!("lamina run did not exit after SIGTERM:\n{}", bg.describe()));
    status
        .code()
        .unwrap_or_else(|| panic!("killed by a signal: {status}\n{}", bg.describe()))
}

/// `lamina run --mode fuse`: while the container runs, its image is a FUSE
/// mount (and no EROFS one); it reads the image and writes to its upper
/// dir; stopped, it leaves nothing behind, FUSE daemon included.
#[test]
fn mode_fuse_runs_the_container_on_a_fuse_mount() {
    if !require(TOOLS) {
        return;
    }
    let e = Env::new("run-fuse");
    let flags = ["--json", "--rm", "--name", "fz", "--stop-timeout", "1"];
    let flags = [&flags[..], &["--mode", "fuse", "-u", "0"]].concat();
    let script =
        "echo w > /root/w && cat /root/w /etc/os-release | head -2 && echo ready; sleep 1000";
    let mut c = e.command(&flags, &["sh", "-c", script]);
    let mut bg = Background::spawn("fz", &mut c, e.t.path());
    let started = Instant::now();
    while !fs::read_to_string(&bg.stdout_path).is_ok_and(|o| o.contains("ready")) {
        assert!(bg.running(), "lamina run exited early:\n{}", bg.describe());
        assert!(
            started.elapsed() < TIMEOUT,
            "never ready:\n{}",
            bg.describe()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = fs::read_to_string(&bg.stdout_path).unwrap();
    assert!(out.starts_with("w\n"), "{}", bg.describe());
    let types: Vec<String> = fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
        .filter(|l| {
            l.split(' ')
                .nth(1)
                .is_some_and(|m| m.starts_with(&*e.t.path().to_string_lossy()))
        })
        .filter_map(|l| l.split(' ').nth(2).map(String::from))
        .collect();
    assert!(
        types.iter().any(|t| t.starts_with("fuse")) && !types.iter().any(|t| t == "erofs"),
        "mounts of the container: {types:?}"
    );
    assert_eq!(terminate(&mut bg), 137, "{}", bg.describe());
    e.assert_clean();
}

#[test]
fn sigterm_stops_the_container_and_cleans_up() {
    if !require(TOOLS) {
        return;
    }
    let e = Env::new("run-term");
    // PID 1 ignores SIGTERM without a handler: the KILL after the stop
    // timeout ends it (128 + 9).
    let sleep = ["sleep", "1000"];
    let mut bg = start_background(&e, "sleeper", &sleep, |_| !processes(&sleep).is_empty());
    assert_eq!(terminate(&mut bg), 137, "{}", bg.describe());
    let report: Value = fs::read_to_string(&bg.stderr_path)
        .unwrap()
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no --json report:\n{}", bg.describe()));
    assert_eq!(report["stopped_by_signal"], 15, "{report}");
    assert!(processes(&sleep).is_empty(), "sleep 1000 survived");
    e.assert_clean();
    assert!(!e.cache().join("containers/sleeper").exists());

    // A process that handles SIGTERM gets it: the signal is forwarded.
    let trap = [
        "sh",
        "-c",
        "trap 'exit 7' TERM; echo ready; while :; do sleep 0.1; done",
    ];
    let mut bg = start_background(&e, "trapper", &trap, |bg| {
        fs::read_to_string(&bg.stdout_path).is_ok_and(|o| o.contains("ready"))
    });
    assert_eq!(terminate(&mut bg), 7, "{}", bg.describe());
    e.assert_clean();
}
