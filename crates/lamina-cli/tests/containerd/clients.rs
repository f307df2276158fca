//! Clients of the private containerd: Docker Engine with lamina as its
//! storage driver, and a CRI client running a pod (Kubernetes' path).

use std::ffi::OsStr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::fixture::images;
use crate::node::{ask, Node};
use crate::{Version, CONTAINERD2_DIR, DOCKER_DIR, LAMINA_IMAGE, ORIG_IMAGE, PAUSE_IMAGE};

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
    let mut f = Failures::default();
    run_lamina_pod(&node, &[], &mut f);
    if !f.0.is_empty() {
        f.0.push(node.logs());
    }
    f.finish(&format!("CRI on containerd {version:?}"));
}

/// Runs a pod of the lamina image through cri-run (`cri_args` before the
/// others) and checks it the way the kubelet would see it, and that the
/// image was mounted lazily.
fn run_lamina_pod(node: &Node, cri_args: &[String], f: &mut Failures) {
    let imgs = images();
    let mut c = command(cri_run_bin(), cri_args);
    c.args([
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
    ]);
    let out = run(&mut c, TIMEOUT);
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
}

/// Issue 42, point 11: a pod brings its own pull secret. The registry
/// opens only to it (a front that asks for Basic credentials), and the
/// snapshotter has none of its own but serves CRI's image service in front
/// of containerd (`--cri-keychain`), as the kubelet's
/// `--image-service-endpoint`. The pod runs from the lamina image mounted
/// lazily, and the mount's range reads carried the pod's secret. Before,
/// the snapshotter's socket served no image service.
fn cri_pod_brings_its_pull_secret(version: Version) {
    let creds = "tenant-a:s3cret-a";
    // The secret's user is a tenant with a cache dir of its own.
    let tenant = TestDir::new("secret-tenant");
    let arg = format!("secret:tenant-a@{{front}}={}", tenant.join("a").display());
    let Some(node) = Node::start_keychain(version, creds, &["--tenant-cache", &arg]) else {
        return;
    };
    let front = node.front.as_ref().expect("a keychain node has a front");
    let mut f = Failures::default();
    // The front really shuts out a request without the secret.
    let anonymous = ask(front.port, b"GET /v2/ HTTP/1.1\r\nHost: x\r\n\r\n");
    f.check(
        anonymous
            .as_deref()
            .is_some_and(|a| a.starts_with(b"HTTP/1.1 401")),
        || format!("the front answered {anonymous:?} without credentials"),
    );
    let snapshotter_sock = node.t.join("snapshotter.sock");
    let args = [
        "-image-endpoint".to_string(),
        snapshotter_sock.display().to_string(),
        "-creds".into(),
        creds.into(),
    ];
    run_lamina_pod(&node, &args, &mut f);
    let stats = front.stats();
    f.check(stats["authorized_ranges"].as_u64() > Some(0), || {
        format!("no range read came with the pod's secret: {stats}")
    });
    // Kept for the mounts alone: private, and named by its digest.
    let kept: Vec<_> = std::fs::read_dir(node.t.join("credentials"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    let secrets: Vec<_> = kept
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    f.check(secrets.len() == 1, || {
        format!("the snapshotter keeps {kept:?} for one pull secret")
    });
    for secret in secrets {
        let mode = std::fs::metadata(secret).map(|m| m.mode() & 0o777);
        f.check(matches!(mode, Ok(0o600)), || {
            format!("{} has mode {mode:?}", secret.display())
        });
    }
    let own = cache_files_in(&tenant.join("a"), "blobs");
    let shared = cache_files_in(&node.snap_root().join("cache"), "blobs");
    f.check(!own.is_empty() && shared.is_empty(), || {
        format!("cache files: the secret's tenant's {own:?}, shared {shared:?}")
    });
    if !f.0.is_empty() {
        f.0.push(front.bg.describe());
        f.0.push(node.logs());
    }
    f.finish(&format!("a pod's pull secret on containerd {version:?}"));
}

#[test]
fn cri_on_containerd_16_runs_a_lamina_pod() {
    cri_pod_runs_a_lamina_image(Version::V16);
}

#[test]
fn cri_on_containerd_2_runs_a_lamina_pod() {
    cri_pod_runs_a_lamina_image(Version::V2);
}

#[test]
fn cri_on_containerd_16_takes_a_pods_pull_secret() {
    cri_pod_brings_its_pull_secret(Version::V16);
}

#[test]
fn cri_on_containerd_2_takes_a_pods_pull_secret() {
    cri_pod_brings_its_pull_secret(Version::V2);
}
