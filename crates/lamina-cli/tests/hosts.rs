//! Registry host configuration (`--hosts-dir`, containerd's `hosts.toml`;
//! issue 8, item 2) end to end: lazy mounts of the edge fixture through
//! mirrors that refuse connections, a real pull-through cache (a second
//! `docker-registry` in proxy mode) and a mirror that corrupts every range
//! answer; plus HTTP proxies from the environment. Every mounted tree is
//! compared with an unpack of the source, and every claim that a mirror was
//! used is read from the mirror's own log or counters.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const TOOLS: &[&str] = &["docker-registry", "curl", "python3", "zstd"];

/// Repository and tag of the converted image in every test registry.
const IMAGE: &str = "lam:edge";

/// A registry serving the converted edge fixture, and the test's directory.
fn registry_with_edge(label: &str) -> (Registry, TestDir) {
    let reg = Registry::start();
    let t = TestDir::new(label);
    lamina([
        "convert",
        &oci_ref(&edge_layout(), "edge"),
        &reg.reference(IMAGE),
    ])
    .ok();
    (reg, t)
}

/// Writes `text` as `DIR/NAMESPACE/hosts.toml`; returns DIR.
fn hosts_dir(t: &TestDir, namespace: &str, text: &str) -> PathBuf {
    let dir = t.join("certs.d");
    let ns = dir.join(namespace);
    fs::create_dir_all(&ns).expect("mkdir hosts dir");
    fs::write(ns.join("hosts.toml"), text).expect("write hosts.toml");
    dir
}

/// A hosts.toml with the registry at `server` (a port on 127.0.0.1) and
/// one mirror before it that may pull, `bulk_only` or not.
fn mirror_first(server: u16, mirror: u16, bulk_only: bool) -> String {
    let bulk = if bulk_only {
        "  bulk_only = true\n"
    } else {
        ""
    };
    format!(
        "server = \"http://127.0.0.1:{server}\"\n\n[host.\"http://127.0.0.1:{mirror}\"]\n  \
         capabilities = [\"pull\"]\n{bulk}"
    )
}

/// `127.0.0.1:PORT` written as containerd names its directory.
fn ns_dir(port: u16) -> String {
    format!("127.0.0.1_{port}_")
}

/// Mounts `image` lazily with `--hosts-dir DIR`, checks that the whole tree
/// equals the source, unmounts, and returns the last status.
#[track_caller]
fn mount_and_compare(t: &TestDir, label: &str, image: &str, dir: &Path) -> Value {
    let m = Mount::with_args(
        image,
        &t.join(&format!("mnt-{label}")),
        &t.join(&format!("cache-{label}")),
        &["--hosts-dir", dir.to_str().expect("utf-8 path")],
    );
    treecmp(&[], &ociunpack(&edge_layout(), "edge"), &m.path);
    m.unmount()["last_status"].clone()
}

/// The blob digests of the converted image (data blobs).
fn data_blobs(reg: &Registry) -> Vec<String> {
    let inspect = lamina(["inspect", "--json", &reg.reference(IMAGE)])
        .ok()
        .json();
    inspect["blobs"]
        .as_array()
        .unwrap_or_else(|| panic!("inspect lists no blobs: {inspect}"))
        .iter()
        .map(|b| b["digest"].as_str().expect("digest").to_string())
        .collect()
}

/// (a) The first mirror refuses connections (a closed port): every request
/// falls back to the next host. The registry named in the reference is
/// closed too, so the mount works only through that second host. The
/// `_default` directory serves a registry no directory names.
#[test]
fn refused_mirror_falls_back_to_the_next_host() {
    if !require(TOOLS) {
        return;
    }
    let (reg, t) = registry_with_edge("hosts-refused");
    let (closed, gone) = (free_port(), free_port());
    let toml = format!(
        "[host.\"http://127.0.0.1:{closed}\"]\n  capabilities = [\"pull\", \"resolve\"]\n\
         [host.\"http://127.0.0.1:{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
        reg.port
    );
    let dir = hosts_dir(&t, &ns_dir(gone), &toml);
    let image = format!("docker://127.0.0.1:{gone}/{IMAGE}");
    let last = mount_and_compare(&t, "port-dir", &image, &dir);
    assert_eq!(last["failed_misses"], 0, "umount report: {last}");

    // Without the configuration the same reference cannot be reached.
    let out = lamina([
        "inspect",
        &image,
        "--hosts-dir",
        t.join("none").to_str().unwrap(),
    ]);
    assert_eq!(out.code(), Some(5), "{}", out.describe());

    // _default: for any registry without a directory of its own (inspect
    // reads the manifest and the index blob through it).
    let other = free_port();
    let default_dir = t.join("certs.d-default");
    fs::create_dir_all(default_dir.join("_default")).expect("mkdir");
    fs::write(default_dir.join("_default/hosts.toml"), &toml).expect("write");
    let image = format!("docker://127.0.0.1:{other}/{IMAGE}");
    let dir_arg = default_dir.to_str().expect("utf-8 path");
    let inspect = lamina(["inspect", "--json", &image, "--hosts-dir", dir_arg])
        .ok()
        .json();
    assert_eq!(inspect["lamina"], true, "{inspect}");
}

/// Access log lines of `reg` for blob GETs of `digest` carrying `ns`, with
/// the status they were answered with.
fn blob_gets(reg: &Registry, digest: &str, ns: &str) -> Vec<u16> {
    let log = fs::read_to_string(reg.dir().join("registry.log")).unwrap_or_default();
    let wanted = format!("GET /v2/lam/blobs/{digest}?ns={ns} ");
    log.lines()
        .filter(|l| l.contains(&wanted))
        .filter_map(|l| {
            let after = l.split("\" ").nth(1)?;
            after.split(' ').next()?.parse().ok()
        })
        .collect()
}

/// Whether a pull-through cache has stored `digest` (it stores a blob in
/// the background after its first miss).
fn mirror_stored(mirror: &Registry, digest: &str) -> bool {
    let hex = digest.trim_start_matches("sha256:");
    mirror
        .dir()
        .join("data/docker/registry/v2/blobs/sha256")
        .join(&hex[..2])
        .join(hex)
        .join("data")
        .is_file()
}

/// (b) A second docker-registry as a pull-through cache of the first is the
/// mirror. On a miss it answers range requests with the whole blob (200),
/// once it holds the blob with 206; both serve a lazy mount byte for byte.
/// Its access log shows that data blobs came from it, with `?ns=`.
#[test]
fn pull_through_cache_mirror_serves_lazy_mounts() {
    if !require(TOOLS) {
        return;
    }
    let (reg, t) = registry_with_edge("hosts-pull-through");
    let mirror = Registry::start_pull_through(&reg);
    let toml = format!(
        "server = \"http://127.0.0.1:{}\"\n\n[host.\"http://127.0.0.1:{}\"]\n  \
         capabilities = [\"pull\", \"resolve\"]\n",
        reg.port, mirror.port
    );
    let dir = hosts_dir(&t, &ns_dir(reg.port), &toml);
    let blobs = data_blobs(&reg);
    let ns = format!("127.0.0.1%3A{}", reg.port);

    let last = mount_and_compare(&t, "miss", &reg.reference(IMAGE), &dir);
    assert_eq!(last["failed_misses"], 0, "umount report: {last}");
    assert_eq!(last["bad_chunks"], 0, "umount report: {last}");
    // Every blob's first request is a miss, answered 200. A request the
    // loaded machine lets time out goes on to the registry instead, so one
    // such answer is the claim, not one per blob.
    let answers: Vec<(&String, Vec<u16>)> = blobs
        .iter()
        .map(|b| (b, blob_gets(&mirror, b, &ns)))
        .collect();
    assert!(
        answers.iter().any(|(_, statuses)| statuses.contains(&200)),
        "the mirror's log shows no GET of a data blob answered 200 (whole blob): {answers:?}"
    );

    // The cache stores a blob in the background after its first miss;
    // once it holds the blobs it was asked for it answers ranges with 206.
    let asked: Vec<&String> = answers
        .iter()
        .filter(|(_, statuses)| !statuses.is_empty())
        .map(|(b, _)| *b)
        .collect();
    let start = Instant::now();
    while !asked.iter().all(|b| mirror_stored(&mirror, b)) {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the pull-through cache never stored the data blobs {asked:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let last = mount_and_compare(&t, "hit", &reg.reference(IMAGE), &dir);
    assert_eq!(last["failed_misses"], 0, "umount report: {last}");
    let answers: Vec<(&String, Vec<u16>)> = blobs
        .iter()
        .map(|b| (b, blob_gets(&mirror, b, &ns)))
        .collect();
    assert!(
        answers.iter().any(|(_, statuses)| statuses.contains(&206)),
        "no range answer (206) from the mirror in its log: {answers:?}"
    );
}

/// (c) A mirror that flips every byte of every range answer: verification
/// catches each bad chunk, the host is tried last from then on, and the
/// reads come from the registry; every file equals the source.
#[test]
fn corrupting_mirror_is_caught_and_skipped() {
    if !require(TOOLS) {
        return;
    }
    let (reg, t) = registry_with_edge("hosts-corrupt");
    let proxy = FaultProxy::start(t.path(), "mirror", 0, reg.port, "flipall", &[]);
    let toml = mirror_first(reg.port, proxy.port, false);
    let dir = hosts_dir(&t, &ns_dir(reg.port), &toml);
    let last = mount_and_compare(&t, "corrupt", &reg.reference(IMAGE), &dir);
    let stats = proxy.stats();
    assert!(
        stats["faults"]["flipall"].as_u64().unwrap_or(0) > 0,
        "the mirror was never asked for a range: {stats}"
    );
    assert!(
        last["bad_chunks"].as_u64().unwrap_or(0) > 0,
        "no bad chunk counted although the mirror corrupted answers: {last}"
    );
    assert_eq!(last["failed_misses"], 0, "umount report: {last}");
}

/// HTTP proxies from the environment: a loopback registry is reached
/// directly even when every proxy variable names a dead port; a mirror
/// with a name that is not loopback goes through `HTTP_PROXY`, as the
/// proxy's counters show (the proxy forwards to the registry, so the name
/// never needs resolving).
#[test]
fn proxy_environment_is_honoured_except_for_loopback() {
    if !require(TOOLS) {
        return;
    }
    let (reg, t) = registry_with_edge("hosts-proxy-env");
    let dead = format!("http://127.0.0.1:{}", free_port());
    let proxy_vars = [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ];
    let mut c = lamina_cmd(["inspect", "--json", &reg.reference(IMAGE)]);
    c.args(["--hosts-dir", t.join("none").to_str().unwrap()]);
    for v in proxy_vars {
        c.env(v, &dead);
    }
    c.env_remove("NO_PROXY").env_remove("no_proxy");
    run(&mut c, TIMEOUT).ok();

    let forward = FaultProxy::start(t.path(), "forward", 0, reg.port, "none", &[]);
    let toml = format!(
        "server = \"http://127.0.0.1:{}\"\n\n[host.\"http://mirror.example:{}\"]\n  \
         capabilities = [\"pull\", \"resolve\"]\n",
        reg.port, reg.port
    );
    let dir = hosts_dir(&t, &ns_dir(reg.port), &toml);
    let mut c = lamina_cmd(["inspect", "--json", &reg.reference(IMAGE)]);
    c.args(["--hosts-dir", dir.to_str().unwrap()]);
    for v in proxy_vars {
        c.env_remove(v);
    }
    c.env("HTTP_PROXY", format!("http://127.0.0.1:{}", forward.port));
    c.env_remove("NO_PROXY").env_remove("no_proxy");
    run(&mut c, TIMEOUT).ok();
    let stats = forward.stats();
    assert!(
        stats["requests"].as_u64().unwrap_or(0) > 0,
        "the mirror mirror.example was not reached through HTTP_PROXY: {stats}"
    );
}

/// A malformed hosts.toml stops the command with a message naming the file
/// and the key (exit 2); unknown keys are ignored; a missing directory is no
/// configuration.
#[test]
fn bad_hosts_toml_names_file_and_key() {
    if !require(TOOLS) {
        return;
    }
    let (reg, t) = registry_with_edge("hosts-bad");
    let dir = hosts_dir(
        &t,
        &ns_dir(reg.port),
        "[host.\"http://127.0.0.1:1\"]\n  capabilities = [\"pull\", \"teleport\"]\n",
    );
    let out = lamina([
        "inspect",
        &reg.reference(IMAGE),
        "--hosts-dir",
        dir.to_str().unwrap(),
    ]);
    let file = dir.join(ns_dir(reg.port)).join("hosts.toml");
    assert_eq!(out.code(), Some(2), "{}", out.describe());
    assert!(
        out.stderr.contains(&file.display().to_string())
            && out
                .stderr
                .contains("host.\"http://127.0.0.1:1\".capabilities"),
        "the message names neither the file nor the key:\n{}",
        out.describe()
    );

    fs::write(
        &file,
        format!(
            "future_key = 1\n[host.\"http://127.0.0.1:{}\"]\n  also_new = \"x\"\n",
            reg.port
        ),
    )
    .expect("write");
    lamina([
        "inspect",
        &reg.reference(IMAGE),
        "--hosts-dir",
        dir.to_str().unwrap(),
    ])
    .ok();
    lamina([
        "inspect",
        &reg.reference(IMAGE),
        "--hosts-dir",
        t.join("missing").to_str().unwrap(),
    ])
    .ok();
}

/// A mirror marked `bulk_only` (a P2P daemon, docs/dragonfly.md) is never
/// asked for a whole blob of 64 KiB or less (the config, the chunk index,
/// a small metadata layer): a P2P task costs more than the registry sending
/// them. (Ranges of data blobs read ahead are bulk reads and may go to it.)
/// Every file equals the source. Fails if the config goes to the mirror.
#[test]
fn small_blobs_go_around_a_bulk_only_mirror() {
    if !require(TOOLS) {
        return;
    }
    let (reg, t) = registry_with_edge("hosts-bulk-small");
    let proxy = FaultProxy::start(t.path(), "p2p", 0, reg.port, "none", &[]);
    let toml = mirror_first(reg.port, proxy.port, true);
    let dir = hosts_dir(&t, &ns_dir(reg.port), &toml);
    mount_and_compare(&t, "bulk-small", &reg.reference(IMAGE), &dir);
    let url = format!("http://127.0.0.1:{}/v2/lam/manifests/edge", reg.port);
    let accept = "Accept: application/vnd.oci.image.manifest.v1+json";
    let manifest: Value = run(&mut command("curl", ["-sf", "-H", accept, &url]), SHORT)
        .ok()
        .json();
    let layers = manifest["layers"].as_array().expect("layers").iter();
    let small: Vec<String> = std::iter::once(&manifest["config"])
        .chain(layers)
        .filter(|d| d["size"].as_u64().unwrap_or(u64::MAX) <= 64 << 10)
        .map(|d| d["digest"].as_str().expect("digest").to_string())
        .collect();
    assert!(!small.is_empty(), "no small blob in {manifest}");
    let stats = proxy.stats();
    let asked: Vec<&str> = stats["log"]
        .as_array()
        .map(|l| l.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let wrong: Vec<&&str> = asked
        .iter()
        .filter(|line| !line.contains(" bytes=") && small.iter().any(|d| line.contains(d.as_str())))
        .collect();
    assert!(
        wrong.is_empty(),
        "the bulk_only mirror was asked for small blobs: {wrong:?}"
    );
}

/// A mirror that fails one request (a node's dfdaemon whose P2P task
/// failed answers 500) stays the first host: that request goes on to the
/// registry, the next ones go to the mirror again. Only a host that cannot
/// be reached, or fails several requests in a row, is tried last for a
/// while. Here the mirror fails every third range read: the registry is
/// asked directly only for those, and every file equals the source. Fails
/// if one 500 sends the rest of the image around the mirror.
#[test]
fn one_failed_request_does_not_send_the_rest_around_a_mirror() {
    if !require(TOOLS) {
        return;
    }
    let (reg, t) = registry_with_edge("hosts-one-500");
    let proxy = FaultProxy::start(t.path(), "p2p", 0, reg.port, "500,ok,ok", &[]);
    // The registry behind a plain proxy of its own, to count what it is asked.
    let direct = FaultProxy::start(t.path(), "direct", 0, reg.port, "none", &[]);
    let toml = mirror_first(direct.port, proxy.port, false);
    let dir = hosts_dir(&t, &ns_dir(reg.port), &toml);
    mount_and_compare(&t, "one-500", &reg.reference(IMAGE), &dir);
    let ranges = |p: &FaultProxy| p.stats()["eligible"].as_u64().unwrap_or(0);
    let faulted = proxy.stats()["faulted"].as_u64().unwrap_or(0);
    let (mirrored, direct) = (ranges(&proxy), ranges(&direct));
    eprintln!("the mirror: {mirrored} range reads, {faulted} answered 500; the registry: {direct} range reads");
    assert!(faulted >= 1, "the mirror failed no request");
    assert!(
        mirrored > faulted * 2,
        "after a 500 the mirror was asked for {mirrored} ranges in all ({faulted} failed): lamina went around it"
    );
    assert!(
        direct <= faulted,
        "the registry was asked directly for {direct} ranges, the mirror failed {faulted}"
    );
}

/// `--prefetch all` through a bulk_only mirror (a P2P daemon) asks it for
/// each data blob whole, in one request, filling chunks as they stream by:
/// dfdaemon schedules a task per request, and a task first asked for in
/// ranges has its seed fetch those ranges only. When a stream is cut short
/// every time (the mirror sends half the answer for a data blob and
/// closes), it is asked for once more, then the rest of that blob is
/// fetched in ranges: the prefetch completes and every file equals the
/// source. Fails if the prefetch goes in ranges only, if a stream cut short
/// loses what it had not delivered, or if it is asked for without end.
#[test]
fn a_whole_blob_prefetch_cut_short_is_finished_in_ranges() {
    let Some(run) = StreamFault::prefetch("hosts-stream-cut", "truncate", &[], true) else {
        return;
    };
    let (asked, stats, worker) = (run.asked(), &run.stats, &run.worker);
    for blob in &run.blobs {
        let whole = whole_gets(&asked, blob);
        let want = if *blob == run.blob { 2 } else { 1 };
        assert_eq!(
            whole, want,
            "{blob} asked for whole {whole} times: {asked:#?}"
        );
    }
    assert!(
        stats["faults"]["truncate"].as_u64() >= Some(2),
        "the stream was not cut twice: {stats}"
    );
    assert!(
        worker.contains("asking for it again") && worker.contains("; the rest in ranges"),
        "the cut stream, asked for again and then finished in ranges, is not in the worker's log:\n{worker}"
    );
}

/// A `--prefetch all` mount of the edge image through a P2P mirror
/// (`bulk_only`, a faultproxy) whose whole GETs of the first data blob get
/// `mode` (`extra`: more faultproxy arguments), once every file was
/// compared with umoci's unpack (after the prefetch is complete, with
/// `complete`) and the mount is gone.
struct StreamFault {
    /// The image's data blobs.
    blobs: Vec<String>,
    /// The faulted blob.
    blob: String,
    /// The proxy's stats.
    stats: Value,
    /// The mount's worker log.
    worker: String,
}

impl StreamFault {
    fn prefetch(label: &str, mode: &str, extra: &[&str], complete: bool) -> Option<StreamFault> {
        if !require(TOOLS) {
            return None;
        }
        let (reg, t) = registry_with_edge(label);
        let blobs = data_blobs(&reg);
        let blob = blobs[0].clone();
        let mut args = vec!["--blob", blob.as_str(), "--whole"];
        args.extend(extra);
        let proxy = FaultProxy::start(t.path(), "p2p", 0, reg.port, mode, &args);
        let toml = mirror_first(reg.port, proxy.port, true);
        let dir = hosts_dir(&t, &ns_dir(reg.port), &toml);
        let args = ["--hosts-dir", dir.to_str().unwrap(), "--prefetch", "all"];
        let m = Mount::with_args(
            &reg.reference(IMAGE),
            &t.join("mnt"),
            &t.join("cache"),
            &args,
        );
        if complete {
            m.wait_complete(Duration::from_secs(120));
        }
        treecmp(&[], &ociunpack(&edge_layout(), "edge"), &m.path);
        let worker = fs::read_to_string(run_dir(&m).join("worker.log")).unwrap_or_default();
        m.unmount();
        let stats = proxy.stats();
        Some(StreamFault {
            blobs,
            blob,
            stats,
            worker,
        })
    }

    /// The requests the proxy saw, in order.
    fn asked(&self) -> Vec<&str> {
        self.stats["log"]
            .as_array()
            .map(|l| l.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default()
    }
}

/// How many times the proxy's log `asked` has a whole GET of `blob`.
fn whole_gets(asked: &[&str], blob: &str) -> usize {
    asked
        .iter()
        .filter(|l| l.starts_with("GET ") && l.ends_with(blob))
        .count()
}

/// A whole-blob stream through a P2P mirror cut short once (dfdaemon breaks
/// its answer when its scheduler sends it to the registry mid-way, then
/// serves the next request from what it fetches) is asked for again and
/// finishes there: the blob asked for whole twice, nothing of it in ranges.
/// Fails without the second request: the rest of the blob then goes to the
/// registry in ranges, from every node whose stream broke
/// (docs/dragonfly.md).
#[test]
fn a_whole_blob_stream_cut_once_is_asked_for_again() {
    let Some(run) = StreamFault::prefetch("hosts-stream-again", "truncate,ok", &[], true) else {
        return;
    };
    let (asked, worker) = (run.asked(), &run.worker);
    assert_eq!(
        run.stats["faults"]["truncate"].as_u64(),
        Some(1),
        "{}",
        run.stats
    );
    let whole = whole_gets(&asked, &run.blob);
    assert_eq!(whole, 2, "{} asked for whole: {asked:#?}", run.blob);
    assert!(
        worker.contains("asking for it again"),
        "the second request is not in the worker's log:\n{worker}"
    );
    assert!(
        !worker.contains("; the rest in ranges"),
        "the blob's rest went in ranges after the second request:\n{worker}"
    );
}

/// A whole-blob stream through a P2P mirror that stops mid-way (half the
/// blob, then nothing for 30 s: a piece waiting for a parent): readers of
/// the chunks it claimed and has not sent fetch them in ranges once it has
/// sent nothing for 2 s, instead of waiting for it, and every file equals
/// the source. Fails without it: the readers wait out the stall (their own
/// deadline is the stream's read timeout), and nothing of the blob goes in
/// ranges.
#[test]
fn readers_do_not_wait_for_a_stalled_blob_stream() {
    let extra = ["--stall", "30"];
    let Some(run) = StreamFault::prefetch("hosts-stream-stalled", "stallmid", &extra, false) else {
        return;
    };
    let (stats, worker) = (&run.stats, &run.worker);
    // The stalled stream times out and is asked for again: at least once.
    assert!(
        stats["faults"]["stallmid"].as_u64() >= Some(1),
        "{stats}\n{worker}"
    );
    assert!(
        worker.contains("the blob's stream stalled: a miss's chunks in ranges"),
        "no reader fetched past the stalled stream:\n{worker}"
    );
}

/// The Debian image in a registry, with what a test of one of its blobs
/// streamed through a P2P mirror needs.
struct DebianFixture {
    reg: Registry,
    /// The largest data blob, as `lamina inspect --json` lists it.
    blob: Value,
    t: TestDir,
    /// umoci's unpack of the source.
    rootfs: PathBuf,
}

impl DebianFixture {
    fn new(label: &str) -> DebianFixture {
        let layout = debian_source();
        let reg = Registry::start();
        let t = TestDir::new(label);
        let (src, image) = (oci_ref(&layout, "bookworm"), reg.reference("lam:deb"));
        lamina_timeout(["convert", &src, &image], Duration::from_secs(1200)).ok();
        let inspect = lamina(["inspect", "--json", &image]).ok().json();
        let blob = inspect["blobs"]
            .as_array()
            .and_then(|b| b.iter().max_by_key(|b| b["compressed_bytes"].as_u64()))
            .filter(|b| b["digest"].is_string())
            .unwrap_or_else(|| panic!("inspect lists no blobs: {inspect}"))
            .clone();
        let rootfs = umoci_unpack(&format!("{}:bookworm", layout.display()), &t.join("bundle"));
        DebianFixture {
            reg,
            blob,
            t,
            rootfs,
        }
    }

    fn digest(&self) -> &str {
        self.blob["digest"].as_str().unwrap_or_default()
    }

    /// Mounts `lam:deb` lazily through a bulk_only mirror that holds back
    /// its answers to whole-blob GETs of the blob for `stall` seconds, the
    /// registry behind a plain proxy of its own; compares every file with
    /// the unpack. Returns how many times the blob was streamed, and how
    /// many range reads of it the registry got and their bytes (of the
    /// first 1,000 requests).
    fn read_all_with_stream_held(&self, stall: &str) -> (u64, u64, u64) {
        let (reg, t, blob) = (&self.reg, &self.t, self.digest());
        let only = ["--blob", blob];
        let direct = FaultProxy::start(t.path(), "direct", 0, reg.port, "none", &only);
        let held = [&only[..], &["--whole", "--stall", stall]].concat();
        let p2p = FaultProxy::start(t.path(), "p2p", 0, reg.port, "stall", &held);
        let toml = mirror_first(direct.port, p2p.port, true);
        let dir = hosts_dir(t, &ns_dir(reg.port), &toml);
        let m = Mount::with_args(
            &reg.reference("lam:deb"),
            &t.join("mnt"),
            &t.join("cache"),
            &["--hosts-dir", dir.to_str().expect("utf-8 path")],
        );
        let n = treecmp(&[], &self.rootfs, &m.path);
        assert!(n > 5000, "compared only {n} entries");
        m.unmount();
        let streamed = p2p.stats()["faults"]["stall"].as_u64().unwrap_or(0);
        let stats = direct.stats();
        let ranges = stats["eligible"].as_u64().unwrap_or(0);
        let bytes: u64 = stats["log"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .filter(|l| l.contains(blob))
            .filter_map(|l| l.rsplit_once(" bytes=")?.1.split_once('-'))
            .filter_map(|(a, b)| Some(b.parse::<u64>().ok()? + 1 - a.parse::<u64>().ok()?))
            .sum();
        eprintln!(
            "{blob}: streamed {streamed} time(s); {ranges} range reads, {bytes} bytes, from the registry"
        );
        (streamed, ranges, bytes)
    }
}

/// A reader reading the Debian image's largest blob in order through a
/// bulk_only mirror (a P2P daemon) gets that blob streamed whole. The
/// mirror holds the stream's answer back 3 s, as a Dragonfly task waits for
/// its seed when a fleet starts at once: the reader's misses on that blob
/// wait for the stream instead of fetching its chunks in ranges from the
/// registry meanwhile (on a fleet, every node would). Every file equals
/// umoci's unpack. Fails if misses go around an opening stream.
#[test]
fn misses_wait_for_a_blob_stream_that_is_opening() {
    if !require(&["docker-registry", "python3", "zstd", "umoci", "debootstrap"]) {
        return;
    }
    let fixture = DebianFixture::new("hosts-stream-open");
    let (streamed, ranges, _) = fixture.read_all_with_stream_held("3");
    assert_eq!(streamed, 1, "the largest blob was not streamed once");
    assert!(
        ranges <= RANGES_BEFORE_A_STREAM,
        "{ranges} range reads of the streamed blob went to the registry"
    );
}

/// The same with the stream's answer held 40 s, past the 10 s a request
/// may wait for its answer (each try of the stream gives up; the last
/// after about 40 s): the blob's misses wait for the stream at most 5 s
/// after it was asked for, then the blob is read as without a stream, in
/// ranges with windows ahead of the reader. Every file is equal; the
/// registry sends most of the blob in ranges, in a few dozen reads. Fails
/// if the reader goes on chunk by chunk (a read per chunk: about a
/// thousand for this blob) once its stream is given up.
#[test]
fn a_stream_that_does_not_answer_leaves_its_blob_to_windows_in_ranges() {
    if !require(&["docker-registry", "python3", "zstd", "umoci", "debootstrap"]) {
        return;
    }
    let fixture = DebianFixture::new("hosts-stream-hung");
    let blob = &fixture.blob;
    let (size, chunks) = (blob["compressed_bytes"].as_u64(), blob["chunks"].as_u64());
    let (Some(size), Some(chunks)) = (size, chunks) else {
        panic!("no size or chunk count in {blob}");
    };
    let (_, ranges, bytes) = fixture.read_all_with_stream_held("40");
    assert!(
        bytes > size / 2,
        "{bytes} bytes of the {size}-byte blob came in ranges"
    );
    assert!(
        ranges < chunks / 4,
        "{ranges} range reads for a blob of {chunks} chunks: no windows ahead of the reader"
    );
}

/// Range reads of a blob a reader may send before its stream is decided
/// (the reads that show it reads in order, and their predictions).
const RANGES_BEFORE_A_STREAM: u64 = 12;
