//! A private containerd (1.6 or 2.x, with or without CRI) with lamina as
//! its proxy snapshotter, and their configs.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::fixture::images;
use crate::{Version, CONTAINERD2_DIR, PAUSE_IMAGE};
use serde_json::Value;

/// A private containerd with lamina as a proxy snapshotter.
pub(crate) struct Node {
    pub(crate) version: Version,
    pub(crate) t: TestDir,
    pub(crate) reg: Registry,
    pub(crate) snapshotter: Background,
    /// Where the snapshotter serves its Prometheus metrics.
    pub(crate) metrics: String,
    pub(crate) containerd: Background,
    /// A front that asks for Basic credentials, where the registry has one
    /// ([`start_keychain`](Self::start_keychain)): images are named by its
    /// host.
    pub(crate) front: Option<FaultProxy>,
    /// The snapshotter's cache dirs: its own, then its tenants'.
    pub(crate) cache_dirs: Vec<PathBuf>,
}

impl Node {
    pub(crate) fn start(version: Version) -> Option<Node> {
        Node::start_with(version, false, &[])
    }

    /// With `cri`, containerd's CRI plugin is on (lamina as its snapshotter,
    /// the registry over plain HTTP through a hosts.toml, PAUSE_IMAGE as
    /// the pod sandbox image). `snapshotter_args` go to `lamina snapshotter`,
    /// `{registry}` in them replaced by the registry's `HOST:PORT`.
    pub(crate) fn start_with(
        version: Version,
        cri: bool,
        snapshotter_args: &[&str],
    ) -> Option<Node> {
        Node::start_inner(version, cri, snapshotter_args, None)
    }

    /// A CRI node whose registry answers only requests that carry Basic
    /// `credentials` (`USER:PASSWORD`, checked by a front), and whose
    /// snapshotter has no credentials of its own but serves CRI's image
    /// service in front of containerd (`--cri-keychain`): pods bring them.
    pub(crate) fn start_keychain(
        version: Version,
        credentials: &str,
        snapshotter_args: &[&str],
    ) -> Option<Node> {
        Node::start_inner(version, true, snapshotter_args, Some(credentials))
    }

    fn start_inner(
        version: Version,
        cri: bool,
        snapshotter_args: &[&str],
        basic_auth: Option<&str>,
    ) -> Option<Node> {
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
        let front = basic_auth.map(|creds| {
            let extra = ["--basic-auth", creds];
            FaultProxy::start(t.path(), "front", 0, reg.port, "none", &extra)
        });
        let front_host = front.as_ref().map(|f| format!("127.0.0.1:{}", f.port));
        let given: Vec<String> = snapshotter_args
            .iter()
            .map(|a| a.replace("{registry}", &reg.host()))
            .map(|a| a.replace("{front}", front_host.as_deref().unwrap_or("")))
            .collect();
        args.extend(given.iter().map(OsStr::new));
        let mut cache_dirs = vec![t.join("snapshotter").join("cache")];
        // `--tenant-cache SELECTOR=DIR`, DIR absolute.
        let tenants = given.windows(2).filter(|w| w[0] == "--tenant-cache");
        cache_dirs
            .extend(tenants.filter_map(|w| Some(PathBuf::from(&w[1][w[1].find("=/")? + 1..]))));
        let containerd_sock = t.join("containerd.sock");
        if front.is_some() {
            args.extend([OsStr::new("--cri-keychain"), containerd_sock.as_os_str()]);
        }
        let snapshotter = start_snapshotter_with(&t, &args);
        let host = match &front {
            Some(f) => format!("127.0.0.1:{}", f.port),
            None => reg.host(),
        };
        let registry = cri.then_some(host);
        let containerd = start_containerd(version, &t, registry.as_deref());
        let node = Node {
            version,
            t,
            reg,
            snapshotter,
            metrics,
            containerd,
            front,
            cache_dirs,
        };
        node.wait_containerd();
        Some(node)
    }

    pub(crate) fn sock(&self) -> PathBuf {
        self.t.join("containerd.sock")
    }

    pub(crate) fn snap_root(&self) -> PathBuf {
        self.t.join("snapshotter")
    }

    pub(crate) fn ctr_bin(&self) -> PathBuf {
        match self.version {
            Version::V16 => tool("ctr"),
            Version::V2 => Path::new(CONTAINERD2_DIR).join("ctr"),
        }
    }

    /// `ctr -a SOCK ARGS...`
    pub(crate) fn ctr<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&self, args: I) -> Command {
        let mut c = command(self.ctr_bin(), ["-a".as_ref(), self.sock().as_os_str()]);
        c.env("CONTAINERD_NAMESPACE", self.namespace()).args(args);
        c
    }

    /// A namespace of this node's own (`-n` on a command line wins): runc
    /// keeps container state under /run/containerd/runc/NAMESPACE whatever
    /// containerd's state dir, so two nodes running a container of the same
    /// name in one namespace collide ("container with given ID already
    /// exists").
    pub(crate) fn namespace(&self) -> String {
        let dir = self.t.path().file_name().unwrap_or_default();
        dir.to_string_lossy()
            .replace(|c: char| !c.is_ascii_alphanumeric(), "-")
    }

    pub(crate) fn wait_containerd(&self) {
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

    /// `repo_tag` in the node's registry, through its front if it has one.
    pub(crate) fn image(&self, repo_tag: &str) -> String {
        match &self.front {
            Some(f) => format!("127.0.0.1:{}/{repo_tag}", f.port),
            None => format!("{}/{repo_tag}", self.reg.host()),
        }
    }

    /// Pulls `repo_tag` for the lamina snapshotter the way each version
    /// passes remote-snapshot labels.
    pub(crate) fn pull(&self, repo_tag: &str) -> Output {
        run(&mut self.pull_command(&self.image(repo_tag)), TIMEOUT)
    }

    /// The command [`pull`](Self::pull) runs, for `image` (`HOST/REPO:TAG`).
    pub(crate) fn pull_command(&self, image: &str) -> Command {
        match self.version {
            Version::V16 => {
                let mut c = command(tool("ctr-remote"), ["-a".as_ref(), self.sock().as_os_str()]);
                c.env("CONTAINERD_NAMESPACE", self.namespace());
                c.args([
                    "image",
                    "rpull",
                    "--plain-http",
                    "--snapshotter",
                    "lamina",
                    image,
                ]);
                c
            }
            Version::V2 => self.ctr([
                "image",
                "pull",
                "--plain-http",
                "--snapshotter",
                "lamina",
                image,
            ]),
        }
    }

    /// `ctr run --rm` of `repo_tag` with `cmd`.
    pub(crate) fn run_rm(&self, repo_tag: &str, id: &str, cmd: &[&str]) -> Output {
        let image = self.image(repo_tag);
        let mut args = vec!["run", "--rm", "--snapshotter", "lamina", &image, id];
        args.extend(cmd);
        run(&mut self.ctr(args), TIMEOUT)
    }

    /// Runs `cmd` from `repo_tag` (`ctr run --rm --net-host`, plus
    /// `ctr_args`) until a client on 127.0.0.1:`port` sending `request`
    /// reads an answer starting with `answer`; then kills it.
    pub(crate) fn serve(
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
    pub(crate) fn content(&self) -> Vec<String> {
        let out = run(&mut self.ctr(["content", "ls", "-q"]), SHORT).ok();
        out.stdout.lines().map(|l| l.trim().to_string()).collect()
    }

    /// `ctr snapshots --snapshotter lamina ls`: (key, parent, kind).
    pub(crate) fn snapshots(&self) -> Vec<(String, String, String)> {
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
    pub(crate) fn status(&self) -> Vec<Value> {
        self.cache_dirs.iter().flat_map(|d| status_of(d)).collect()
    }

    /// Live lamina mounts under the snapshotter.
    pub(crate) fn lamina_mounts(&self) -> usize {
        self.status().iter().filter(|m| m["alive"] == true).count()
    }

    /// Bytes lamina fetched for the mounts under the snapshotter's cache.
    pub(crate) fn fetched_bytes(&self) -> u64 {
        self.status_sum("fetched_bytes")
    }

    /// The status field `key` summed over the mounts under the
    /// snapshotter's cache; a status without it is a failure.
    pub(crate) fn status_sum(&self, key: &str) -> u64 {
        self.status()
            .iter()
            .map(|m| match &m["status"] {
                // The worker has not written its first status yet.
                Value::Null => 0,
                s => s[key].as_u64().unwrap_or_else(|| panic!("no {key} in {m}")),
            })
            .sum()
    }

    pub(crate) fn logs(&self) -> String {
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

pub(crate) fn start_snapshotter(t: &TestDir) -> Background {
    start_snapshotter_with(t, &[])
}

/// `lamina snapshotter` under `t` with `extra` arguments.
pub(crate) fn start_snapshotter_with(t: &TestDir, extra: &[&OsStr]) -> Background {
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

/// A loopback port nothing listens on now.
pub(crate) fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

/// Sends `request` to 127.0.0.1:`port`; the first bytes of the answer.
pub(crate) fn ask(port: u16, request: &[u8]) -> Option<Vec<u8>> {
    use std::io::{Read, Write};
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(request).ok()?;
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).ok()?;
    Some(buf[..n].to_vec())
}

/// `lamina status --json` of the cache dir `dir`: its mounts.
pub(crate) fn status_of(dir: &Path) -> Vec<Value> {
    let out = lamina([
        OsStr::new("status"),
        OsStr::new("--json"),
        OsStr::new("--cache-dir"),
        dir.as_os_str(),
    ])
    .ok();
    out.json()
        .as_array()
        .unwrap_or_else(|| panic!("status --json is not an array:\n{}", out.describe()))
        .clone()
}
