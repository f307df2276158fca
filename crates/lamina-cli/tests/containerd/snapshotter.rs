//! The snapshotter itself: its FUSE mode, a restart while a container
//! reads, rests with `--fetch-rests`, and registry mirrors from its hosts.toml.

use std::ffi::OsStr;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::fixture::images;
use crate::node::{free_port, start_snapshotter, start_snapshotter_with, status_of, Node};
use crate::pulls::debian_version;
use crate::{Version, LAMINA_IMAGE};

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

/// Issue 42: a tenant's cache dir. The snapshotter's `--tenant-cache`
/// names the lamina image's repository as a tenant with a dir of its own
/// (which an operator bounds with a filesystem or project quota). python3
/// runs from it; the mount's cache files, metadata and run dir are in the
/// tenant's dir and none in the shared cache; a snapshotter killed and
/// started again finds the live mount there and serves a new container
/// without mounting it again; and removing the image's snapshots unmounts
/// it and empties the tenant's run dirs. Before, there were no tenant dirs.
#[test]
fn containerd_2_keeps_a_tenants_cache_in_its_own_dir() {
    let tenant = TestDir::new("tenant-cache");
    let arg = format!("{{registry}}/deb={}", tenant.join("deb").display());
    // Each mount's cache files reserved too (`--reserve-space`).
    let args = ["--tenant-cache", arg.as_str(), "--reserve-space"];
    let Some(mut node) = Node::start_with(Version::V2, false, &args) else {
        return;
    };
    let mut f = Failures::default();
    let pulled = node.pull(LAMINA_IMAGE);
    assert!(pulled.status.success(), "pull:\n{}", pulled.describe());
    let out = node.run_rm(LAMINA_IMAGE, "py", &["python3", "-c", "print('tenant')"]);
    f.check(out.stdout.contains("tenant"), || {
        format!("python3 from the tenant's mount:\n{}", out.describe())
    });
    let (own, shared) = (tenant.join("deb"), node.snap_root().join("cache"));
    let own_files = cache_files_in(&own, "blobs");
    let shared_files = cache_files_in(&shared, "blobs");
    f.check(!own_files.is_empty() && shared_files.is_empty(), || {
        format!("cache files: tenant's {own_files:?}, shared {shared_files:?}")
    });
    let cache_files: Vec<_> = own_files
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "cache"))
        .collect();
    f.check(!cache_files.is_empty(), || {
        format!("no .cache file among the tenant's {own_files:?}")
    });
    for file in cache_files {
        let whole = allocated_whole(file);
        f.check(whole.is_ok(), || whole.unwrap_err());
    }
    let live = |dir: &Path| status_of(dir).iter().filter(|m| m["alive"] == true).count();
    f.check(live(&own) == 1 && live(&shared) == 0, || {
        format!(
            "live mounts: tenant's {}, shared {}",
            live(&own),
            live(&shared)
        )
    });
    node.snapshotter.stop(); // SIGKILL
    node.snapshotter = start_snapshotter_with(
        &node.t,
        &[
            OsStr::new("--tenant-cache"),
            OsStr::new(&arg.replace("{registry}", &node.reg.host())),
            OsStr::new("--reserve-space"),
        ],
    );
    // containerd's connection to the proxy plugin backs off after the
    // kill: wait until it reaches the new snapshotter.
    let started = Instant::now();
    let ls = || node.ctr(["snapshots", "--snapshotter", "lamina", "ls"]);
    while !try_run(&mut ls(), SHORT).is_ok_and(|o| o.status.success()) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "containerd did not reach the restarted snapshotter"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let again = node.run_rm(LAMINA_IMAGE, "again", &["python3", "-c", "print('again')"]);
    f.check(again.stdout.contains("again"), || {
        format!("a container after the restart:\n{}", again.describe())
    });
    let restarted = fs::read_to_string(&node.snapshotter.stderr_path).unwrap_or_default();
    f.check(!restarted.contains("mounted it again"), || {
        format!("the restart remounted a live image:\n{restarted}")
    });
    let removed = run(
        &mut node.ctr(["image", "rm", "--sync", &node.image(LAMINA_IMAGE)]),
        TIMEOUT,
    );
    f.check(removed.status.success(), || {
        format!("image rm:\n{}", removed.describe())
    });
    let started = Instant::now();
    while live(&own) > 0 && started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(200));
    }
    f.check(live(&own) == 0, || {
        "the tenant's mount outlived its snapshots".to_string()
    });
    if !f.0.is_empty() {
        f.0.push(node.logs());
    }
    f.finish("a tenant's cache dir");
}

/// `lamina snapshotter --fetch-rests`: a container that reads 3,000 small
/// files of /usr in a shuffled order (a start that waits on misses all
/// over the image, no boot set; one that reads in order is served by
/// reads ahead instead) gets the rest of a blob beside its misses; /usr
/// then reads back as the image has it, no miss failed, and the mount
/// fetched no more than the image's blobs (no chunk twice). Without the
/// flag the snapshotter's mounts fetch no rest (the other tests' small
/// starts stay under 10% of the image).
#[test]
fn containerd_2_fetches_the_rest_of_a_blob_with_fetch_rests() {
    let Some(node) = Node::start_with(Version::V2, false, &["--fetch-rests"]) else {
        return;
    };
    let imgs = images();
    let mut f = Failures::default();
    let pulled = node.pull(LAMINA_IMAGE);
    assert!(pulled.status.success(), "pull:\n{}", pulled.describe());
    let out = node.run_rm(LAMINA_IMAGE, "spread", &["bash", "-c", SPREAD_READ]);
    f.check(out.stdout.contains("rc=0 0 0"), || {
        format!("the shuffled reads:\n{}", out.describe())
    });
    let sum = |key: &str| node.status_sum(key);
    // Rests run on beside the reads; wait for them before weighing bytes.
    let started = Instant::now();
    while sum("rests_running") > 0 && started.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(200));
    }
    f.check(sum("rests_running") == 0, || {
        "rests still running after 120 s".to_string()
    });
    let out = node.run_rm(LAMINA_IMAGE, "reader", &["bash", "-c", HASH_USR]);
    let reference = reference_usr_hash(&imgs.source);
    f.check(out.stdout.trim() == reference.trim(), || {
        format!(
            "/usr after the rests:\ncontainer: {}\nreference: {reference}",
            out.describe()
        )
    });
    let (rests, rest_bytes) = (sum("rests"), sum("rest_fetched_bytes"));
    f.check(rests >= 1 && rest_bytes > 0, || {
        format!("no rest fetched: {rests} rests, {rest_bytes} bytes")
    });
    f.check(sum("failed_misses") == 0, || {
        format!("failed misses: {}", sum("failed_misses"))
    });
    let fetched = node.fetched_bytes();
    f.check(fetched <= imgs.blob_bytes, || {
        format!(
            "fetched {fetched} bytes, more than the image's {}",
            imgs.blob_bytes
        )
    });
    eprintln!(
        "figures: 3,000 files read with --fetch-rests: {rests} rests, {rest_bytes} bytes of them, \
         {fetched} fetched of {}",
        imgs.blob_bytes
    );
    if !f.0.is_empty() {
        f.0.push(node.logs());
    }
    f.finish("snapshotter --fetch-rests");
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

/// Reads 3,000 files of /usr under 64 KiB in an order shuffled from the
/// bytes of /usr/bin/find (the same in every run), and prints the
/// pipeline's exit codes.
const SPREAD_READ: &str = "set -o pipefail; cd / && find usr -type f -size -64k | \
                           shuf -n 3000 --random-source=/usr/bin/find | \
                           xargs -d '\\n' cat > /dev/null; echo \"rc=${PIPESTATUS[*]}\"";

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
