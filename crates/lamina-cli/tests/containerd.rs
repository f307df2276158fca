//! `lamina snapshotter` under real containerd: Debian's 1.6 (images pulled
//! with `ctr-remote image rpull`, which passes stargz's remote-snapshot
//! labels) and 2.x built from its Go module by scripts/setup.sh (images
//! pulled with `ctr image pull` through the transfer service, which passes
//! the CRI labels when the proxy plugin exports
//! `enable_remote_snapshot_annotations`). Each test runs a private
//! containerd (its own root, state and sockets), a private snapshotter, the
//! local registry and runc.

mod common;

use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const LAMINA_IMAGE: &str = "deb:lamina";
const PLAIN_IMAGE: &str = "deb:plain";
/// The source image as it is (digests preserved), with a tar index beside
/// it (`lamina index`), in a repository of its own.
const ORIG_IMAGE: &str = "orig:bookworm";
const SRC_TAG: &str = "bookworm";
/// A plain image whose command sleeps: the pod sandbox ("pause") image.
const PAUSE_IMAGE: &str = "pause:1";

/// Where scripts/setup.sh installs containerd 2.x (containerd, ctr and the
/// runc shim, built from containerd's Go module).
const CONTAINERD2_DIR: &str = "/var/cache/lamina-test/go/containerd-v2.4.2";

/// Where scripts/setup.sh installs dockerd and the docker client (built from
/// moby's and docker/cli's Go modules).
const DOCKER_DIR: &str = "/var/cache/lamina-test/go/dockerd-v28.5.2";

#[derive(Debug, Clone, Copy, PartialEq)]
enum Version {
    /// Debian's containerd 1.6.
    V16,
    /// containerd 2.x from its Go module.
    V2,
}

/// The Debian image as a lamina image and as a plain one, in a registry's
/// storage (copied by every test), plus facts about it.
#[derive(Debug)]
struct Images {
    registry_data: PathBuf,
    /// The source layout (for the plain image's reference content).
    source: PathBuf,
    /// Digests of the lamina image's data blobs.
    blob_digests: Vec<String>,
    /// Their compressed bytes in all.
    blob_bytes: u64,
    /// The original image's layer digests and their bytes in all.
    orig_layers: Vec<String>,
    orig_bytes: u64,
}

fn images() -> &'static Images {
    static I: OnceLock<Images> = OnceLock::new();
    I.get_or_init(build_images)
}

fn build_images() -> Images {
    let source = debian_source();
    let reg = Registry::start();
    lamina_timeout(
        [
            "convert",
            &oci_ref(&source, SRC_TAG),
            &reg.reference(LAMINA_IMAGE),
        ],
        Duration::from_secs(1200),
    )
    .ok();
    let mut c = command(
        tool("skopeo"),
        [
            "copy".to_string(),
            "--dest-tls-verify=false".into(),
            oci_ref(&source, SRC_TAG),
            reg.reference(PLAIN_IMAGE),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    // The pod sandbox image: the plain image, made to sleep.
    let pause = fixtures().join("containerd-pause-oci");
    let _ = fs::remove_dir_all(&pause);
    run(
        &mut command(
            "cp",
            [OsStr::new("-a"), source.as_os_str(), pause.as_os_str()],
        ),
        TIMEOUT,
    )
    .ok();
    let mut c = command(
        tool("umoci"),
        [
            "config".to_string(),
            "--image".into(),
            format!("{}:{SRC_TAG}", pause.display()),
            "--tag".into(),
            "pause".into(),
            "--config.cmd".into(),
            "sleep".into(),
            "--config.cmd".into(),
            "infinity".into(),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    let mut c = command(
        tool("skopeo"),
        [
            "copy".to_string(),
            "--dest-tls-verify=false".into(),
            oci_ref(&pause, "pause"),
            reg.reference(PAUSE_IMAGE),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    reg.push(&source, SRC_TAG, ORIG_IMAGE);
    let index = lamina(["index", "--json", &reg.reference(ORIG_IMAGE)])
        .ok()
        .json();
    let orig_bytes = index[0]["image_layer_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("no image_layer_bytes in {index}"));
    let orig_layers = source_layer_digests(&source);
    let inspect = lamina(["inspect", "--json", &reg.reference(LAMINA_IMAGE)])
        .ok()
        .json();
    let blobs = inspect["blobs"]
        .as_array()
        .unwrap_or_else(|| panic!("no blobs in {inspect}"));
    let blob_digests = blobs
        .iter()
        .map(|b| b["digest"].as_str().expect("blob digest").to_string())
        .collect();
    let blob_bytes = blobs
        .iter()
        .map(|b| {
            b["compressed_bytes"]
                .as_u64()
                .expect("blob compressed_bytes")
        })
        .sum();
    reg.stop();
    let registry_data = fixtures().join("containerd-registry-data");
    let _ = fs::remove_dir_all(&registry_data);
    let mut c = command(
        "cp",
        [
            OsStr::new("-a"),
            reg.dir().join("data").as_os_str(),
            registry_data.as_os_str(),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    Images {
        registry_data,
        source,
        blob_digests,
        blob_bytes,
        orig_layers,
        orig_bytes,
    }
}

/// The layer digests of the source layout's image, from its manifest.
fn source_layer_digests(layout: &Path) -> Vec<String> {
    let blob = |digest: &str| -> Value {
        let path = layout
            .join("blobs/sha256")
            .join(digest.trim_start_matches("sha256:"));
        serde_json::from_slice(&fs::read(&path).unwrap()).unwrap()
    };
    let index: Value =
        serde_json::from_slice(&fs::read(layout.join("index.json")).unwrap()).unwrap();
    let top = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == SRC_TAG)
        .unwrap_or_else(|| panic!("no {SRC_TAG} in {index}"));
    let manifest = blob(top["digest"].as_str().unwrap());
    manifest["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["digest"].as_str().unwrap().to_string())
        .collect()
}

/// A private containerd with lamina as a proxy snapshotter.
struct Node {
    version: Version,
    t: TestDir,
    reg: Registry,
    snapshotter: Background,
    /// Where the snapshotter serves its Prometheus metrics.
    metrics: String,
    containerd: Background,
}

impl Node {
    fn start(version: Version) -> Option<Node> {
        Node::start_with(version, false, &[])
    }

    /// With `cri`, containerd's CRI plugin is on (lamina as its snapshotter,
    /// the registry over plain HTTP through a hosts.toml, PAUSE_IMAGE as
    /// the pod sandbox image). `snapshotter_args` go to `lamina snapshotter`.
    fn start_with(version: Version, cri: bool, snapshotter_args: &[&str]) -> Option<Node> {
        let mut tools = vec!["runc", "skopeo", "docker-registry", "umoci"];
        if version == Version::V16 {
            tools.extend(["containerd", "ctr", "ctr-remote"]);
        }
        if !require(&tools) {
            return None;
        }
        if version == Version::V2 {
            let ctd = Path::new(CONTAINERD2_DIR).join("containerd");
            assert!(
                ctd.exists(),
                "{} is missing: scripts/setup.sh installs containerd 2.x there",
                ctd.display()
            );
        }
        let imgs = images();
        let reg = Registry::start_with_data(&imgs.registry_data);
        let t = TestDir::new("containerd");
        let metrics = format!("127.0.0.1:{}", free_port());
        let mut args = vec![OsStr::new("--metrics-address"), OsStr::new(&metrics)];
        args.extend(snapshotter_args.iter().map(OsStr::new));
        let snapshotter = start_snapshotter_with(&t, &args);
        let registry = cri.then(|| reg.host());
        let containerd = start_containerd(version, &t, registry.as_deref());
        let node = Node {
            version,
            t,
            reg,
            snapshotter,
            metrics,
            containerd,
        };
        node.wait_containerd();
        Some(node)
    }

    fn sock(&self) -> PathBuf {
        self.t.join("containerd.sock")
    }

    fn snap_root(&self) -> PathBuf {
        self.t.join("snapshotter")
    }

    fn ctr_bin(&self) -> PathBuf {
        match self.version {
            Version::V16 => tool("ctr"),
            Version::V2 => Path::new(CONTAINERD2_DIR).join("ctr"),
        }
    }

    /// `ctr -a SOCK ARGS...`
    fn ctr<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&self, args: I) -> Command {
        let mut c = command(self.ctr_bin(), ["-a".as_ref(), self.sock().as_os_str()]);
        c.env("CONTAINERD_NAMESPACE", self.namespace()).args(args);
        c
    }

    /// A namespace of this node's own (`-n` on a command line wins): runc
    /// keeps container state under /run/containerd/runc/NAMESPACE whatever
    /// containerd's state dir, so two nodes running a container of the same
    /// name in one namespace collide ("container with given ID already
    /// exists").
    fn namespace(&self) -> String {
        let dir = self.t.path().file_name().unwrap_or_default();
        dir.to_string_lossy()
            .replace(|c: char| !c.is_ascii_alphanumeric(), "-")
    }

    fn wait_containerd(&self) {
        let started = Instant::now();
        loop {
            if let Ok(out) = try_run(&mut self.ctr(["version"]), SHORT) {
                if out.status.success() {
                    return;
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "containerd did not answer in 30 s:\n{}",
                self.containerd.describe()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn image(&self, repo_tag: &str) -> String {
        format!("{}/{repo_tag}", self.reg.host())
    }

    /// Pulls `repo_tag` for the lamina snapshotter the way each version
    /// passes remote-snapshot labels.
    fn pull(&self, repo_tag: &str) -> Output {
        let image = self.image(repo_tag);
        let mut c = match self.version {
            Version::V16 => {
                let mut c = command(tool("ctr-remote"), ["-a".as_ref(), self.sock().as_os_str()]);
                c.env("CONTAINERD_NAMESPACE", self.namespace());
                c.args([
                    "image",
                    "rpull",
                    "--plain-http",
                    "--snapshotter",
                    "lamina",
                    &image,
                ]);
                c
            }
            Version::V2 => self.ctr([
                "image",
                "pull",
                "--plain-http",
                "--snapshotter",
                "lamina",
                &image,
            ]),
        };
        run(&mut c, TIMEOUT)
    }

    /// `ctr run --rm` of `repo_tag` with `cmd`.
    fn run_rm(&self, repo_tag: &str, id: &str, cmd: &[&str]) -> Output {
        let image = self.image(repo_tag);
        let mut args = vec!["run", "--rm", "--snapshotter", "lamina", &image, id];
        args.extend(cmd);
        run(&mut self.ctr(args), TIMEOUT)
    }

    /// Runs `cmd` from `repo_tag` (`ctr run --rm --net-host`, plus
    /// `ctr_args`) until a client on 127.0.0.1:`port` sending `request`
    /// reads an answer starting with `answer`; then kills it.
    fn serve(
        &self,
        repo_tag: &str,
        id: &str,
        ctr_args: &[&str],
        cmd: &[&str],
        (port, request, answer): (u16, &[u8], &[u8]),
    ) -> Result<(), String> {
        let image = self.image(repo_tag);
        let mut args = vec!["run", "--rm", "--net-host", "--snapshotter", "lamina"];
        args.extend(ctr_args);
        args.extend([image.as_str(), id]);
        args.extend(cmd);
        let mut server = Background::spawn(id, &mut self.ctr(args), self.t.path());
        let started = Instant::now();
        let result = loop {
            if ask(port, request).is_some_and(|a| a.starts_with(answer)) {
                break Ok(());
            }
            if !server.running() {
                break Err(format!("{id} exited first:\n{}", server.describe()));
            }
            if started.elapsed() > TIMEOUT {
                break Err(format!("{id} did not answer:\n{}", server.describe()));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        run(&mut self.ctr(["tasks", "kill", "-s", "SIGKILL", id]), SHORT);
        if server.wait_timeout(TIMEOUT).is_none() {
            return Err(format!("{id}: ctr run did not end after SIGKILL"));
        }
        result
    }

    /// Digests in containerd's content store.
    fn content(&self) -> Vec<String> {
        let out = run(&mut self.ctr(["content", "ls", "-q"]), SHORT).ok();
        out.stdout.lines().map(|l| l.trim().to_string()).collect()
    }

    /// `ctr snapshots --snapshotter lamina ls`: (key, parent, kind).
    fn snapshots(&self) -> Vec<(String, String, String)> {
        let out = run(
            &mut self.ctr(["snapshots", "--snapshotter", "lamina", "ls"]),
            SHORT,
        )
        .ok();
        out.stdout
            .lines()
            .skip(1)
            .map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                match f.as_slice() {
                    [k, kind] => (k.to_string(), String::new(), kind.to_string()),
                    [k, p, kind] => (k.to_string(), p.to_string(), kind.to_string()),
                    _ => panic!("unexpected `ctr snapshots ls` line {l:?}"),
                }
            })
            .collect()
    }

    /// `lamina status --json` of the snapshotter's cache: one entry a mount.
    fn status(&self) -> Vec<Value> {
        let out = lamina([
            OsStr::new("status"),
            OsStr::new("--json"),
            OsStr::new("--cache-dir"),
            self.snap_root().join("cache").as_os_str(),
        ])
        .ok();
        out.json()
            .as_array()
            .unwrap_or_else(|| panic!("status --json is not an array:\n{}", out.describe()))
            .clone()
    }

    /// Live lamina mounts under the snapshotter.
    fn lamina_mounts(&self) -> usize {
        self.status().iter().filter(|m| m["alive"] == true).count()
    }

    /// Bytes lamina fetched for the mounts under the snapshotter's cache.
    fn fetched_bytes(&self) -> u64 {
        self.status()
            .iter()
            .map(|m| match &m["status"] {
                // The worker has not written its first status yet.
                Value::Null => 0,
                s => s["fetched_bytes"]
                    .as_u64()
                    .unwrap_or_else(|| panic!("no fetched_bytes in {m}")),
            })
            .sum()
    }

    fn logs(&self) -> String {
        format!(
            "{}\n{}",
            self.snapshotter.describe(),
            self.containerd.describe()
        )
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Tasks first (their shims outlive containerd), then containerd,
        // then the snapshotter; TestDir's drop unmounts what is left.
        if let Ok(out) = try_run(&mut self.ctr(["task", "ls", "-q"]), SHORT) {
            for id in out.stdout.lines().map(str::trim).filter(|l| !l.is_empty()) {
                let _ = try_run(&mut self.ctr(["task", "kill", "-s", "KILL", id]), SHORT);
                std::thread::sleep(Duration::from_millis(200));
                let _ = try_run(&mut self.ctr(["task", "delete", "-f", id]), SHORT);
                let _ = try_run(&mut self.ctr(["container", "delete", id]), SHORT);
            }
        }
        self.containerd.stop();
        self.snapshotter.stop();
        for m in mounts_under(self.t.path()) {
            if let Err(e) = force_unmount(&m, Some(&self.snap_root().join("cache"))) {
                eprintln!("warning: {e}");
            }
        }
    }
}

fn start_snapshotter(t: &TestDir) -> Background {
    start_snapshotter_with(t, &[])
}

/// `lamina snapshotter` under `t` with `extra` arguments.
fn start_snapshotter_with(t: &TestDir, extra: &[&OsStr]) -> Background {
    let root = t.join("snapshotter");
    let sock = t.join("snapshotter.sock");
    let mut c = lamina_cmd([
        OsStr::new("snapshotter"),
        OsStr::new("--root"),
        root.as_os_str(),
        OsStr::new("--address"),
        sock.as_os_str(),
    ]);
    c.args(extra);
    let mut bg = Background::spawn("snapshotter", &mut c, t.path());
    let started = Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(
            bg.running() && started.elapsed() < Duration::from_secs(30),
            "lamina snapshotter did not listen on {}:\n{}",
            sock.display(),
            bg.describe()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    bg
}

/// containerd's config: private paths, no CRI (these tests use ctr), lamina
/// as a proxy snapshotter.
fn containerd_config(version: Version, t: &TestDir, cri_registry: Option<&str>) -> String {
    let dir = t.path().display();
    if let Some(host) = cri_registry {
        return cri_config(version, t, host);
    }
    let proxy = format!(
        "[proxy_plugins.lamina]\n  type = \"snapshot\"\n  address = \"{dir}/snapshotter.sock\"\n"
    );
    match version {
        Version::V16 => format!(
            "version = 2\nroot = \"{dir}/ctd-root\"\nstate = \"{dir}/ctd-state\"\n\
             disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
             [grpc]\n  address = \"{dir}/containerd.sock\"\n\
             [ttrpc]\n  address = \"{dir}/containerd.sock.ttrpc\"\n{proxy}"
        ),
        Version::V2 => format!(
            "version = 3\nroot = \"{dir}/ctd-root\"\nstate = \"{dir}/ctd-state\"\n\
             disabled_plugins = [\"io.containerd.grpc.v1.cri\", \"io.containerd.cri.v1.images\", \
             \"io.containerd.cri.v1.runtime\"]\n\
             [grpc]\n  address = \"{dir}/containerd.sock\"\n\
             [ttrpc]\n  address = \"{dir}/containerd.sock.ttrpc\"\n{proxy}\
             [proxy_plugins.lamina.exports]\n  enable_remote_snapshot_annotations = \"true\"\n\
             [plugins.\"io.containerd.transfer.v1.local\"]\n\
             [[plugins.\"io.containerd.transfer.v1.local\".unpack_config]]\n  \
             platform = \"linux/amd64\"\n  snapshotter = \"lamina\"\n"
        ),
    }
}

/// containerd with its CRI plugin: lamina as the snapshotter with the
/// remote-snapshot labels passed, the registry over plain HTTP, host
/// networking only (no CNI on the test machine). `restrict_oom_score_adj`:
/// CRI gives the pod sandbox an oom_score_adj of -998, which needs
/// CAP_SYS_RESOURCE, and the test machines run without it (runc's init
/// then dies with "can't get final child's PID from pipe").
fn cri_config(version: Version, t: &TestDir, host: &str) -> String {
    let dir = t.path().display();
    let hosts = t.join(&format!("certs.d/{host}"));
    fs::create_dir_all(&hosts).unwrap();
    fs::write(
        hosts.join("hosts.toml"),
        format!("server = \"http://{host}\"\n[host.\"http://{host}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"),
    )
    .unwrap();
    let common = format!(
        "root = \"{dir}/ctd-root\"\nstate = \"{dir}/ctd-state\"\n\
         [grpc]\n  address = \"{dir}/containerd.sock\"\n\
         [ttrpc]\n  address = \"{dir}/containerd.sock.ttrpc\"\n\
         [proxy_plugins.lamina]\n  type = \"snapshot\"\n  address = \"{dir}/snapshotter.sock\"\n"
    );
    match version {
        Version::V16 => format!(
            "version = 2\n{common}\
             [plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"{host}/{PAUSE_IMAGE}\"\n  \
             restrict_oom_score_adj = true\n\
             [plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  snapshotter = \"lamina\"\n  \
             disable_snapshot_annotations = false\n\
             [plugins.\"io.containerd.grpc.v1.cri\".registry]\n  config_path = \"{dir}/certs.d\"\n"
        ),
        Version::V2 => format!(
            "version = 3\n{common}\
             [proxy_plugins.lamina.exports]\n  enable_remote_snapshot_annotations = \"true\"\n\
             [plugins.\"io.containerd.cri.v1.images\"]\n  snapshotter = \"lamina\"\n  \
             disable_snapshot_annotations = false\n\
             [plugins.\"io.containerd.cri.v1.images\".pinned_images]\n  sandbox = \"{host}/{PAUSE_IMAGE}\"\n\
             [plugins.\"io.containerd.cri.v1.images\".registry]\n  config_path = \"{dir}/certs.d\"\n\
             [plugins.\"io.containerd.cri.v1.runtime\"]\n  restrict_oom_score_adj = true\n"
        ),
    }
}

fn start_containerd(version: Version, t: &TestDir, cri_registry: Option<&str>) -> Background {
    let config = t.join("containerd.toml");
    fs::write(&config, containerd_config(version, t, cri_registry)).unwrap();
    let bin = match version {
        Version::V16 => tool("containerd"),
        Version::V2 => Path::new(CONTAINERD2_DIR).join("containerd"),
    };
    let mut c = command(&bin, [OsStr::new("--config"), config.as_os_str()]);
    if version == Version::V2 {
        // Its own runc shim before Debian's 1.6 one.
        let path = std::env::var("PATH").unwrap_or_default();
        c.env("PATH", format!("{CONTAINERD2_DIR}:{path}"));
    }
    Background::spawn("containerd", &mut c, t.path())
}

/// Pull, run, writes, content store, bytes moved, a plain image: the checks
/// both containerd versions share.
fn lamina_and_plain_images_run(version: Version) {
    let Some(node) = Node::start(version) else {
        return;
    };
    let imgs = images();
    let mut f = Failures::default();

    let pulled = node.pull(LAMINA_IMAGE);
    f.check(pulled.status.success(), || {
        format!("pulling the lamina image failed:\n{}", pulled.describe())
    });
    let content = node.content();
    let in_store: Vec<_> = imgs
        .blob_digests
        .iter()
        .filter(|d| content.contains(d))
        .collect();
    f.check(in_store.is_empty(), || {
        format!("containerd's content store holds lamina data blobs {in_store:?}")
    });

    let out = node.run_rm(
        LAMINA_IMAGE,
        "py",
        &["python3", "-c", "print('hello from lamina')"],
    );
    f.check(
        out.status.success() && out.stdout.contains("hello from lamina"),
        || format!("python3 in the lamina container:\n{}", out.describe()),
    );
    // Bytes per start: what each one added to the shared cache (the later
    // ones find the libraries the earlier ones read already local).
    let mut starts = vec![("python3", node.fetched_bytes())];
    // Two servers of the same image, each run until it answers.
    let conf = node.t.join("nginx.conf");
    let port = free_port();
    fs::write(&conf, nginx_conf(port)).expect("write nginx.conf");
    let bind = format!(
        "type=bind,src={},dst=/etc/nginx/lamina-test.conf,options=rbind:ro",
        conf.display()
    );
    let served = node.serve(
        LAMINA_IMAGE,
        "nginx",
        &["--mount", &bind],
        &["nginx", "-c", "/etc/nginx/lamina-test.conf"],
        (port, b"GET / HTTP/1.0\r\n\r\n", b"HTTP/1.1 200"),
    );
    f.check(served.is_ok(), || format!("nginx: {served:?}"));
    starts.push(("nginx", node.fetched_bytes()));
    let port = free_port();
    let port_arg = port.to_string();
    let served = node.serve(
        LAMINA_IMAGE,
        "redis",
        &[],
        &[
            "redis-server",
            "--port",
            &port_arg,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        (port, b"PING\r\n", b"+PONG"),
    );
    f.check(served.is_ok(), || format!("redis-server: {served:?}"));
    starts.push(("redis-server", node.fetched_bytes()));

    let mut before = 0;
    for (name, after) in starts {
        let added = after.saturating_sub(before);
        eprintln!(
            "{version:?}: the {name} start fetched {added} of {} compressed bytes",
            imgs.blob_bytes
        );
        f.check(added > 0 && added * 10 < imgs.blob_bytes, || {
            format!(
                "the {name} start fetched {added} bytes, not under 10% of the image's {}",
                imgs.blob_bytes
            )
        });
        before = after;
    }

    // The container's writes go to its own upper dir and vanish with it.
    let before = node.snapshots();
    let out = node.run_rm(
        LAMINA_IMAGE,
        "writer",
        &[
            "sh",
            "-c",
            "echo written > /etc/lamina-test && cat /etc/lamina-test",
        ],
    );
    f.check(
        out.status.success() && out.stdout.contains("written"),
        || format!("a write in the container:\n{}", out.describe()),
    );
    f.check(node.snapshots() == before, || {
        format!(
            "snapshots before {before:?}, after the --rm container {:?}",
            node.snapshots()
        )
    });
    // containerd removes the snapshot from its own records at once and has
    // the snapshotter remove it in its next garbage collection, soon after.
    let started = Instant::now();
    let mut leaked = walk_files_named(&node.snap_root().join("snapshots"), "lamina-test");
    while !leaked.is_empty() && started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(200));
        leaked = walk_files_named(&node.snap_root().join("snapshots"), "lamina-test");
    }
    f.check(leaked.is_empty(), || {
        format!("the container's write outlived it: {leaked:?}")
    });

    // Both containers of the image ran on its one lazy mount: one cache,
    // one set of daemons.
    let mounts = node.lamina_mounts();
    f.check(mounts == 1, || {
        format!("{mounts} lamina mounts for two containers of one image, want 1")
    });
    check_metrics(&node, &mut f);

    let pulled = node.pull(PLAIN_IMAGE);
    f.check(pulled.status.success(), || {
        format!("pulling the plain image failed:\n{}", pulled.describe())
    });
    let out = node.run_rm(PLAIN_IMAGE, "plain", &["cat", "/etc/debian_version"]);
    let want = debian_version(&imgs.source);
    f.check(
        out.status.success() && out.stdout.trim() == want.trim(),
        || {
            format!(
                "the plain image's /etc/debian_version (want {want:?}):\n{}",
                out.describe()
            )
        },
    );
    // Each image resolved is counted by how it is served, the plain one too.
    let text = scrape(&node.metrics);
    for kind in ["lamina", "plain"] {
        let series = format!(r#"lamina_snapshotter_images_total{{kind="{kind}"}}"#);
        f.check(sample(&text, &series).is_some_and(|n| n >= 1.0), || {
            format!("{series} is not counted:\n{text}")
        });
    }
    let kinds: Vec<String> = node.snapshots().into_iter().map(|s| s.2).collect();
    f.check(kinds.iter().all(|k| k == "Committed"), || {
        format!(
            "snapshots left active after the runs: {:?}",
            node.snapshots()
        )
    });
    if !f.0.is_empty() {
        f.0.push(node.logs());
    }
    f.finish(&format!("containerd {version:?}"));
}

/// The snapshotter's metrics while it serves containerd: the one live mount,
/// its fetched bytes as `lamina status` has them, its misses' latencies,
/// and the gRPC calls containerd made.
fn check_metrics(node: &Node, f: &mut Failures) {
    // Both read the worker's status.json, rewritten every 25 ms when it changed.
    let fetched = node.fetched_bytes();
    let text = scrape(&node.metrics);
    let sum = |name: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    };
    f.check(sample(&text, "lamina_mounts_live") == Some(1.0), || {
        format!("lamina_mounts_live is not 1:\n{text}")
    });
    f.check(sum("lamina_fetched_bytes_total") == fetched as f64, || {
        format!("lamina_fetched_bytes_total is not status's {fetched}:\n{text}")
    });
    f.check(sum("lamina_miss_latency_seconds_count") > 0.0, || {
        format!("no miss in lamina_miss_latency_seconds:\n{text}")
    });
    let prepares = r#"lamina_snapshotter_grpc_requests_total{method="prepare"}"#;
    f.check(sample(&text, prepares).is_some_and(|n| n > 0.0), || {
        format!("no Prepare counted:\n{text}")
    });
}

/// A loopback port nothing listens on now.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

/// Sends `request` to 127.0.0.1:`port`; the first bytes of the answer.
fn ask(port: u16, request: &[u8]) -> Option<Vec<u8>> {
    use std::io::{Read, Write};
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(request).ok()?;
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).ok()?;
    Some(buf[..n].to_vec())
}

/// nginx in the foreground on 127.0.0.1:`port`, serving the image's page.
fn nginx_conf(port: u16) -> String {
    format!(
        "daemon off;\nworker_processes 1;\npid /run/nginx-lamina-test.pid;\nerror_log stderr warn;\n\
         events {{ worker_connections 16; }}\n\
         http {{ access_log off; server {{ listen 127.0.0.1:{port}; root /var/www/html; \
         index index.nginx-debian.html; }} }}\n"
    )
}

/// `/etc/debian_version` of the source image, by umoci.
fn debian_version(source: &Path) -> String {
    static V: OnceLock<String> = OnceLock::new();
    V.get_or_init(|| {
        let dir = fixtures().join("containerd-umoci");
        let _ = fs::remove_dir_all(&dir);
        let rootfs = umoci_unpack(&format!("{}:{SRC_TAG}", source.display()), &dir);
        fs::read_to_string(rootfs.join("etc/debian_version")).unwrap()
    })
    .clone()
}

/// Files called `name` under `root`, on `root`'s filesystem only.
fn walk_files_named(root: &Path, name: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    let root_dev = fs::metadata(root).map(|m| m.dev()).ok();
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(meta) = e.path().symlink_metadata() else {
                continue;
            };
            // Stay off the lamina mounts: the image itself is not a leak.
            if Some(meta.dev()) != root_dev {
                continue;
            }
            if e.file_name() == name {
                found.push(e.path());
            }
            if meta.is_dir() {
                stack.push(e.path());
            }
        }
    }
    found
}

#[test]
fn containerd_16_runs_lamina_and_plain_images() {
    lamina_and_plain_images_run(Version::V16);
}

#[test]
fn containerd_2_runs_lamina_and_plain_images() {
    lamina_and_plain_images_run(Version::V2);
}

/// The unmodified image's own tag, pulled through the snapshotter: found to
/// have a tar index, so containerd downloads none of its layers (its
/// content store holds none) and python3 runs from a lazy mount that
/// fetched a fraction of them; the snapshotter says so in its log and
/// metrics.
fn original_tag_runs_through_its_index(version: Version) {
    let Some(node) = Node::start(version) else {
        return;
    };
    let imgs = images();
    let mut f = Failures::default();
    let pulled = node.pull(ORIG_IMAGE);
    f.check(pulled.status.success(), || {
        format!("pulling the original tag failed:\n{}", pulled.describe())
    });
    let content = node.content();
    let in_store: Vec<_> = imgs
        .orig_layers
        .iter()
        .filter(|d| content.contains(d))
        .collect();
    f.check(in_store.is_empty(), || {
        format!("containerd's content store holds the image's layers {in_store:?}")
    });
    let out = node.run_rm(
        ORIG_IMAGE,
        "py",
        &["python3", "-c", "print('hello from the index')"],
    );
    f.check(
        out.status.success() && out.stdout.contains("hello from the index"),
        || format!("python3 from the original tag:\n{}", out.describe()),
    );
    let fetched = node.fetched_bytes();
    eprintln!(
        "{version:?}: python3 from the original tag fetched {fetched} of {} bytes of layers",
        imgs.orig_bytes
    );
    // Lazily: a fraction (predictions on; docs/index.md has the figures).
    f.check(fetched > 0 && fetched * 4 < imgs.orig_bytes, || {
        format!("fetched {fetched} bytes of {}", imgs.orig_bytes)
    });
    let text = scrape(&node.metrics);
    let series = r#"lamina_snapshotter_images_total{kind="tar_index"}"#;
    f.check(sample(&text, series).is_some_and(|n| n >= 1.0), || {
        format!("{series} is not counted:\n{text}")
    });
    let log = node.logs();
    f.check(log.contains("through its tar index"), || {
        "the snapshotter's log does not say it served the image through its tar index".into()
    });
    if !f.0.is_empty() {
        f.0.push(log);
    }
    f.finish(&format!("containerd {version:?}"));
}

#[test]
fn containerd_16_runs_the_original_tag_through_its_index() {
    original_tag_runs_through_its_index(Version::V16);
}

#[test]
fn containerd_2_runs_the_original_tag_through_its_index() {
    original_tag_runs_through_its_index(Version::V2);
}

/// dockerd on `node`'s containerd with the containerd image store and lamina
/// as its storage driver (containerd's snapshotter of that name).
struct Dockerd {
    bg: Background,
    sock: PathBuf,
}

impl Dockerd {
    fn start(node: &Node) -> Dockerd {
        let dir = Path::new(DOCKER_DIR);
        assert!(
            dir.join("dockerd").exists() && dir.join("docker").exists(),
            "{DOCKER_DIR} lacks dockerd or docker: scripts/setup.sh builds them there"
        );
        let t = &node.t;
        let sock = t.join("docker.sock");
        let mut c = command(dir.join("dockerd"), Vec::<&OsStr>::new());
        c.arg("--containerd")
            .arg(node.sock())
            .arg("--data-root")
            .arg(t.join("docker-root"))
            .arg("--exec-root")
            .arg(t.join("docker-exec"))
            .arg("--pidfile")
            .arg(t.join("docker.pid"))
            .arg("-H")
            .arg(format!("unix://{}", sock.display()))
            .args(["--iptables=false", "--ip6tables=false", "--bridge=none"])
            .args(["--userland-proxy=false", "--storage-driver", "lamina"])
            .args(["--feature", "containerd-snapshotter=true"])
            .args(["--insecure-registry", &node.reg.host()]);
        // containerd 2.x's runc shim before Debian's.
        let path = std::env::var("PATH").unwrap_or_default();
        c.env("PATH", format!("{CONTAINERD2_DIR}:{path}"));
        let bg = Background::spawn("dockerd", &mut c, t.path());
        let mut d = Dockerd { bg, sock };
        let started = Instant::now();
        while !run(&mut d.docker(["info"]), SHORT).status.success() {
            assert!(
                d.bg.running() && started.elapsed() < Duration::from_secs(60),
                "dockerd did not answer:\n{}",
                d.bg.describe()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        d
    }

    /// `docker -H SOCK ARGS...`
    fn docker<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&self, args: I) -> Command {
        let mut c = command(Path::new(DOCKER_DIR).join("docker"), Vec::<&OsStr>::new());
        c.arg("-H")
            .arg(format!("unix://{}", self.sock.display()))
            .args(args);
        c
    }
}

/// Docker Engine (dockerd with the containerd image store and `lamina` as
/// its storage driver, on containerd 2.x with lamina snapshotter) pulls the
/// original tag lazily through its index: containerd's content store (in
/// dockerd's namespace) holds none of its layers, and `docker run` starts
/// python3 from the lazy mount.
#[test]
fn docker_pulls_the_original_tag_through_its_index() {
    let Some(node) = Node::start(Version::V2) else {
        return;
    };
    let imgs = images();
    let docker = Dockerd::start(&node);
    let mut f = Failures::default();
    let image = node.image(ORIG_IMAGE);
    let pulled = run(&mut docker.docker(["pull", &image]), TIMEOUT);
    f.check(pulled.status.success(), || {
        format!("docker pull:\n{}", pulled.describe())
    });
    let content = run(
        &mut node.ctr(["-n", "moby", "content", "ls", "-q"]),
        TIMEOUT,
    )
    .ok()
    .stdout;
    let in_store: Vec<_> = imgs
        .orig_layers
        .iter()
        .filter(|d| content.contains(d.as_str()))
        .collect();
    f.check(in_store.is_empty(), || {
        format!("containerd's content store (namespace moby) holds the image's layers {in_store:?}")
    });
    let out = run(
        &mut docker.docker([
            "run",
            "--rm",
            "--network",
            "none",
            &image,
            "python3",
            "-c",
            "print('hello from docker')",
        ]),
        TIMEOUT,
    );
    f.check(
        out.status.success() && out.stdout.contains("hello from docker"),
        || format!("docker run:\n{}", out.describe()),
    );
    let fetched = node.fetched_bytes();
    eprintln!(
        "docker: python3 from the original tag fetched {fetched} of {} bytes",
        imgs.orig_bytes
    );
    f.check(fetched > 0 && fetched * 4 < imgs.orig_bytes, || {
        format!("fetched {fetched} bytes of {}", imgs.orig_bytes)
    });
    if !f.0.is_empty() {
        f.0.push(docker.bg.describe());
        f.0.push(node.logs());
    }
    f.finish("docker on containerd 2");
}

/// `lamina snapshotter --mode fuse`: containerd 2 runs the lamina image from
/// a lazy FUSE mount (no EROFS mount under the snapshotter, one FUSE
/// mount); python3 starts fetching under 10% of the image; a write lands in
/// the container's own upper dir; every file under /usr reads back as the
/// image has it (the umoci unpack's hash).
#[test]
fn containerd_2_runs_a_lamina_image_through_fuse() {
    let Some(node) = Node::start_with(Version::V2, false, &["--mode", "fuse"]) else {
        return;
    };
    let imgs = images();
    let mut f = Failures::default();
    let pulled = node.pull(LAMINA_IMAGE);
    assert!(pulled.status.success(), "pull:\n{}", pulled.describe());
    let out = node.run_rm(LAMINA_IMAGE, "py", &["python3", "-c", "print('via fuse')"]);
    f.check(out.stdout.contains("via fuse"), || {
        format!("python3 through FUSE:\n{}", out.describe())
    });
    let fetched = node.fetched_bytes();
    f.check(fetched > 0 && fetched * 10 < imgs.blob_bytes, || {
        format!("python3 fetched {fetched} of {} bytes", imgs.blob_bytes)
    });
    let types = mount_types_under(&node.snap_root());
    f.check(
        types.iter().any(|t| t.starts_with("fuse")) && !types.iter().any(|t| t == "erofs"),
        || format!("mounts under the snapshotter: {types:?}, want FUSE and no EROFS"),
    );
    let out = node.run_rm(
        LAMINA_IMAGE,
        "writer",
        &[
            "sh",
            "-c",
            "echo written > /etc/lamina-test && cat /etc/lamina-test",
        ],
    );
    f.check(out.stdout.contains("written"), || {
        format!("a write in the container:\n{}", out.describe())
    });
    let out = node.run_rm(LAMINA_IMAGE, "reader", &["bash", "-c", HASH_USR]);
    let reference = reference_usr_hash(&imgs.source);
    f.check(out.stdout.trim() == reference.trim(), || {
        format!(
            "/usr through FUSE:\ncontainer: {}\nreference: {reference}",
            out.describe()
        )
    });
    if !f.0.is_empty() {
        f.0.push(node.logs());
    }
    f.finish("snapshotter --mode fuse");
}

/// Filesystem types of the mounts at or below `root`.
fn mount_types_under(root: &Path) -> Vec<String> {
    let root = fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
    fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.len() > 2 && Path::new(f[1]).starts_with(&root)).then(|| f[2].to_string())
        })
        .collect()
}

/// Hashes every file under /usr, in order, and prints one digest and the
/// pipeline's exit codes: the same script in the container and on the
/// reference tree.
const HASH_USR: &str = "set -o pipefail; cd / && find usr -type f | LC_ALL=C sort | \
                        xargs -d '\\n' sha256sum | sha256sum; echo \"rc=${PIPESTATUS[*]}\"";

#[test]
fn snapshotter_killed_and_restarted_while_a_container_reads() {
    let Some(mut node) = Node::start(Version::V2) else {
        return;
    };
    let imgs = images();
    let pulled = node.pull(LAMINA_IMAGE);
    assert!(pulled.status.success(), "pull:\n{}", pulled.describe());

    let image = node.image(LAMINA_IMAGE);
    let mut reader = node.ctr([
        "run",
        "--rm",
        "--snapshotter",
        "lamina",
        &image,
        "reader",
        "bash",
        "-c",
        HASH_USR,
    ]);
    let mut reader = Background::spawn("reader", &mut reader, node.t.path());
    // Kill the snapshotter once the container is reading.
    let started = Instant::now();
    while node.fetched_bytes() < 8 << 20 {
        assert!(
            reader.running() && started.elapsed() < Duration::from_secs(120),
            "the reader did not get going:\n{}\n{}",
            reader.describe(),
            node.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let killed_at = node.fetched_bytes();
    node.snapshotter.stop(); // SIGKILL
    std::thread::sleep(Duration::from_millis(500));
    node.snapshotter = start_snapshotter(&node.t);

    let status = reader.wait_timeout(TIMEOUT);
    let out = fs::read_to_string(&reader.stdout_path).unwrap_or_default();
    let reference = reference_usr_hash(&imgs.source);
    let mut f = Failures::default();
    f.check(status.is_some_and(|s| s.success()), || {
        format!("the reader did not finish well:\n{}", reader.describe())
    });
    f.check(out.trim() == reference.trim(), || {
        format!(
            "the container read other bytes than the image's (killed after {killed_at} bytes):\n\
             container: {out}\nreference: {reference}\n{}",
            reader.describe()
        )
    });
    // The restarted snapshotter found its mount alive and serves new work.
    let restarted = fs::read_to_string(&node.snapshotter.stderr_path).unwrap_or_default();
    f.check(!restarted.contains("mounted it again"), || {
        format!("the restart remounted a live image:\n{restarted}")
    });
    let again = node.run_rm(
        LAMINA_IMAGE,
        "after",
        &["python3", "-c", "print('still here')"],
    );
    f.check(again.stdout.contains("still here"), || {
        format!("a container after the restart:\n{}", again.describe())
    });
    if !f.0.is_empty() {
        f.0.push(node.logs());
    }
    f.finish("snapshotter kill -9 and restart");
}

/// Registry configuration through containerd: the snapshotter's hosts.toml
/// names a mirror that refuses connections, then a pull-through cache of the
/// registry (a second docker-registry), then the registry as `server`. The
/// container reads /usr exactly as the image has it, the mount reports no
/// failed read, and the cache's access log shows it served the lamina
/// image's blobs (with containerd's `?ns=`) to the snapshotter's mount.
#[test]
fn snapshotter_fetches_through_hosts_toml_mirrors() {
    let Some(mut node) = Node::start(Version::V2) else {
        return;
    };
    let imgs = images();
    let mirror = Registry::start_pull_through(&node.reg);
    let hosts = node.t.mkdir("certs.d");
    // containerd's directory name for 127.0.0.1:PORT
    let ns_dir = hosts.join(format!("127.0.0.1_{}_", node.reg.port));
    fs::create_dir_all(&ns_dir).expect("mkdir hosts dir");
    let toml = format!(
        "server = \"http://{}\"\n\n\
         [host.\"http://127.0.0.1:{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n\n\
         [host.\"http://{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
        node.reg.host(),
        free_port(),
        mirror.host()
    );
    fs::write(ns_dir.join("hosts.toml"), &toml).expect("write hosts.toml");
    node.snapshotter.stop();
    node.snapshotter =
        start_snapshotter_with(&node.t, &[OsStr::new("--hosts-dir"), hosts.as_os_str()]);

    let pulled = node.pull(LAMINA_IMAGE);
    assert!(pulled.status.success(), "pull:\n{}", pulled.describe());
    let out = node.run_rm(LAMINA_IMAGE, "reader", &["bash", "-c", HASH_USR]);
    let reference = reference_usr_hash(&imgs.source);
    let mut f = Failures::default();
    f.check(
        out.status.success() && out.stdout.trim() == reference.trim(),
        || {
            format!(
                "the container read other bytes than the image's:\n{}\nreference: {reference}",
                out.describe()
            )
        },
    );
    let failed: u64 = node
        .status()
        .iter()
        .map(|m| m["status"]["failed_misses"].as_u64().unwrap_or(0))
        .sum();
    f.check(failed == 0, || format!("{failed} failed reads"));
    let log = fs::read_to_string(mirror.dir().join("registry.log")).unwrap_or_default();
    let ns = format!("?ns={}", node.reg.host().replace(':', "%3A"));
    let served: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("GET /v2/deb/blobs/sha256:") && l.contains(&ns))
        .filter(|l| l.contains("\" 200 ") || l.contains("\" 206 "))
        .collect();
    f.check(!served.is_empty(), || {
        format!("the pull-through mirror's log shows no blob it served with {ns}:\n{log}")
    });
    eprintln!(
        "the mirror served {} blob requests of the lamina mount",
        served.len()
    );
    if !f.0.is_empty() {
        f.0.push(node.logs());
    }
    f.finish("hosts.toml mirrors through containerd");
}

/// [`HASH_USR`] over the umoci unpack of the source image.
fn reference_usr_hash(source: &Path) -> String {
    debian_version(source); // unpacks it
    let rootfs = fixtures().join("containerd-umoci/rootfs");
    let script = HASH_USR.replace("cd /", &format!("cd {}", rootfs.display()));
    run(&mut command("bash", ["-c", &script]), TIMEOUT)
        .ok()
        .stdout
}

/// The CRI client of tests/cri-run, built on first use.
fn cri_run_bin() -> PathBuf {
    static B: OnceLock<PathBuf> = OnceLock::new();
    B.get_or_init(|| {
        let dir = repo_file("tests/cri-run");
        let bin = fixtures().join("cri-run");
        let go = std::env::var("GO").unwrap_or_else(|_| "/usr/local/go/bin/go".into());
        let mut c = command(
            go,
            [
                OsStr::new("build"),
                OsStr::new("-o"),
                bin.as_os_str(),
                OsStr::new("."),
            ],
        );
        c.current_dir(dir).env("GOFLAGS", "-mod=mod");
        run(&mut c, TIMEOUT).ok();
        bin
    })
    .clone()
}

/// Kubernetes' path: a CRI client pulls the lamina image and runs a pod
/// with it; the sandbox (pause) image is a plain one through the same
/// snapshotter.
fn cri_pod_runs_a_lamina_image(version: Version) {
    let Some(node) = Node::start_with(version, true, &[]) else {
        return;
    };
    let imgs = images();
    let mut c = command(
        cri_run_bin(),
        [
            "-endpoint".to_string(),
            node.sock().display().to_string(),
            "-sandbox-image".into(),
            node.image(PAUSE_IMAGE),
            "-image".into(),
            node.image(LAMINA_IMAGE),
            "-log-dir".into(),
            node.t.path().display().to_string(),
            "--".into(),
            "python3".into(),
            "-c".into(),
            "print('hello from a lamina pod')".into(),
        ],
    );
    let out = run(&mut c, TIMEOUT);
    let mut f = Failures::default();
    f.check(out.status.success(), || {
        format!("cri-run:\n{}", out.describe())
    });
    if out.status.success() {
        let res = out.json();
        f.check(res["exit_code"] == 0, || {
            format!("the pod's container: {res}")
        });
        f.check(
            res["log"]
                .as_str()
                .is_some_and(|l| l.contains("hello from a lamina pod")),
            || format!("the pod's log: {res}"),
        );
    }
    let content = run(
        &mut node.ctr(["-n", "k8s.io", "content", "ls", "-q"]),
        SHORT,
    )
    .ok();
    let in_store: Vec<_> = imgs
        .blob_digests
        .iter()
        .filter(|d| content.stdout.contains(d.as_str()))
        .collect();
    f.check(in_store.is_empty(), || {
        format!("containerd's content store holds lamina data blobs {in_store:?}")
    });
    let fetched = node.fetched_bytes();
    f.check(fetched > 0 && fetched * 10 < imgs.blob_bytes, || {
        format!(
            "the pod fetched {fetched} bytes of the image's {}",
            imgs.blob_bytes
        )
    });
    if !f.0.is_empty() {
        f.0.push(node.logs());
    }
    f.finish(&format!("CRI on containerd {version:?}"));
}

#[test]
fn cri_on_containerd_16_runs_a_lamina_pod() {
    cri_pod_runs_a_lamina_image(Version::V16);
}

#[test]
fn cri_on_containerd_2_runs_a_lamina_pod() {
    cri_pod_runs_a_lamina_image(Version::V2);
}
