//! Tar indexes (issue 30): `lamina index` of unmodified images in a local
//! docker-registry 2.8 (no referrers API: the tag-schema fallback), and
//! mounts of the images' own references through them, compared with
//! umoci's unpack. The image's tag and manifest stay as they were.

mod common;

use common::*;
use serde_json::Value;

/// The python3 start the index tests record and measure.
const START: &str = "import json, os, re; print('ok')";

const TOOLS: &[&str] = &["umoci", "skopeo", "docker-registry", "curl"];

/// `GET /v2/<path>` from the registry, with an OCI Accept header.
fn get(reg: &Registry, path: &str) -> Vec<u8> {
    let url = format!("http://{}/v2/{path}", reg.host());
    let accept = "Accept: application/vnd.oci.image.manifest.v1+json, \
                  application/vnd.oci.image.index.v1+json";
    let mut c = command("curl", ["-sf", "-H", accept, &url]);
    run(&mut c, TIMEOUT).ok().stdout.into_bytes()
}

/// `PUT /v2/<path>` of an OCI image index.
fn put_index(reg: &Registry, path: &str, body: &[u8]) {
    let url = format!("http://{}/v2/{path}", reg.host());
    let body = String::from_utf8(body.to_vec()).unwrap();
    let kind = "Content-Type: application/vnd.oci.image.index.v1+json";
    let mut c = command(
        "curl",
        ["-sf", "-X", "PUT", "-H", kind, "--data-binary", &body, &url],
    );
    run(&mut c, TIMEOUT).ok();
}

fn tags(reg: &Registry, repo: &str) -> Vec<String> {
    let list: Value = serde_json::from_slice(&get(reg, &format!("{repo}/tags/list"))).unwrap();
    serde_json::from_value(list["tags"].clone()).unwrap()
}

/// Indexes `reference`; checks the artifact is a referrer of the untouched
/// image under the fallback tag and small; returns `lamina index`'s report.
fn index_and_check(reg: &Registry, repo: &str, tag: &str) -> Value {
    let before = sha256_hex(&get(reg, &format!("{repo}/manifests/{tag}")));
    let reports = lamina(["index", "--json", &reg.reference(&format!("{repo}:{tag}"))])
        .ok()
        .json();
    assert_eq!(reports.as_array().map(Vec::len), Some(1), "{reports}");
    let report = reports[0].clone();
    let after = sha256_hex(&get(reg, &format!("{repo}/manifests/{tag}")));
    assert_eq!(before, after, "indexing changed the image's manifest");
    assert_eq!(report["subject"], format!("sha256:{before}"), "{report}");
    let fallback = format!("sha256-{before}");
    assert!(
        tags(reg, repo).contains(&fallback),
        "no referrers tag {fallback}: {:?}",
        tags(reg, repo)
    );
    let list: Value =
        serde_json::from_slice(&get(reg, &format!("{repo}/manifests/{fallback}"))).unwrap();
    let listed: Vec<&Value> = list["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["digest"] == report["manifest_digest"])
        .collect();
    assert_eq!(listed.len(), 1, "{list}");
    assert_eq!(
        listed[0]["artifactType"],
        "application/vnd.lamina.tar-index.v1"
    );
    let artifact: Value = serde_json::from_slice(&get(
        reg,
        &format!(
            "{repo}/manifests/{}",
            report["manifest_digest"].as_str().unwrap()
        ),
    ))
    .unwrap();
    assert_eq!(artifact["subject"]["digest"], format!("sha256:{before}"));
    report
}

/// The Debian image through its index, kernel and FUSE, equals umoci's
/// unpack; what a mount fetches of the index before its first read (all
/// but the windows, which come with their spans) is under 3% of the
/// image's layers.
#[test]
fn index_of_debian_mounts_like_umoci_kernel_and_fuse() {
    if !require(TOOLS) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("index-debian");
    reg.push(&debian_source(), "bookworm", "deb:orig");
    let report = index_and_check(&reg, "deb", "orig");
    let (artifact, layers) = (
        report["artifact_bytes"].as_u64().unwrap() - report["window_bytes"].as_u64().unwrap(),
        report["image_layer_bytes"].as_u64().unwrap(),
    );
    assert!(
        artifact * 100 <= 3 * layers,
        "the index is {artifact} bytes for {layers} bytes of layers"
    );
    let rootfs = umoci_unpack(
        &format!("{}:bookworm", debian_source().display()),
        &t.join("umoci"),
    );
    let image = reg.reference("deb:orig");
    for mode in ["kernel", "fuse"] {
        let m = Mount::with_args(
            &image,
            &t.join(&format!("mnt-{mode}")),
            &t.join("cache"),
            &["--mode", mode],
        );
        treecmp(&[], &rootfs, &m.path);
        m.unmount();
    }
}

/// The torture image (hostile paths, hardlinks, xattrs, devices, gzip)
/// through its index equals umoci's unpack.
#[test]
fn index_of_the_torture_image_mounts_like_umoci() {
    if !require(TOOLS) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("index-edge");
    reg.push(&edge_layout(), "edge-gz", "edge:gz");
    reg.push(&edge_layout(), "edge", "edge:zstd");
    index_and_check(&reg, "edge", "gz");
    index_and_check(&reg, "edge", "zstd");
    let m = Mount::new(&reg.reference("edge:gz"), &t.join("gz"), &t.join("cache"));
    treecmp(UMOCI_IGNORES, umoci_edge_rootfs(), &m.path);
    m.unmount();
    // umoci cannot read zstd layers; ociunpack keeps empty xattrs too.
    let m = Mount::new(
        &reg.reference("edge:zstd"),
        &t.join("zstd"),
        &t.join("cache"),
    );
    treecmp(&[], &ociunpack(&edge_layout(), "edge"), &m.path);
    m.unmount();
}

/// Without an index, a plain image is refused with a hint; an index
/// listed for another image (a hostile referrers tag) is refused.
#[test]
fn plain_images_need_their_own_index() {
    if !require(TOOLS) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("index-refused");
    reg.push(&edge_layout(), "edge-gz", "x:a");
    reg.push(&debian_source(), "bookworm", "x:b");
    let mnt = t.mkdir("mnt");
    let cache = t.join("cache");
    let mount = |tag: &str| {
        lamina([
            "mount".as_ref(),
            reg.reference(&format!("x:{tag}")).as_ref(),
            mnt.as_os_str(),
            "--cache-dir".as_ref(),
            cache.as_os_str(),
        ])
    };
    let out = mount("a").failed();
    assert!(out.stderr.contains("lamina index"), "{}", out.describe());
    // Index a, then list a's index under b's referrers tag.
    let a = index_and_check(&reg, "x", "a");
    let b = sha256_hex(&get(&reg, "x/manifests/b"));
    let a_digest = a["subject"].as_str().unwrap().trim_start_matches("sha256:");
    let list = get(&reg, &format!("x/manifests/sha256-{a_digest}"));
    put_index(&reg, &format!("x/manifests/sha256-{b}"), &list);
    let out = mount("b").failed();
    assert!(out.stderr.contains("subject"), "{}", out.describe());
    assert!(!is_mountpoint(&mnt));
}

/// An index stored elsewhere (an OCI layout) is used when named with
/// `--index`, for the registry image and for the same image in a layout;
/// an index named for another image is refused.
#[test]
fn an_index_named_with_dash_dash_index() {
    if !require(TOOLS) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("index-named");
    reg.push(&edge_layout(), "edge-gz", "e:gz");
    let gz = reg.reference("e:gz");
    let idx = oci_ref(&t.join("idx"), "edge-gz");
    let report = lamina(["index", "--json", &gz, &idx]).ok().json();
    assert_eq!(
        tags(&reg, "e"),
        ["gz"],
        "the registry got a referrers tag: {report}"
    );
    let cache = t.join("cache");
    let mnt = t.mkdir("plain");
    let out = lamina([
        "mount".as_ref(),
        gz.as_ref(),
        mnt.as_os_str(),
        "--cache-dir".as_ref(),
        cache.as_os_str(),
    ])
    .failed();
    assert!(out.stderr.contains("--index"), "{}", out.describe());
    let m = Mount::with_args(&gz, &t.join("reg"), &cache, &["--index", &idx]);
    treecmp(UMOCI_IGNORES, umoci_edge_rootfs(), &m.path);
    m.unmount();
    let local = oci_ref(&edge_layout(), "edge-gz");
    let m = Mount::with_args(&local, &t.join("local"), &cache, &["--index", &idx]);
    treecmp(UMOCI_IGNORES, umoci_edge_rootfs(), &m.path);
    m.unmount();
    // The index of edge-gz named for edge (zstd layers: another manifest).
    let other = oci_ref(&edge_layout(), "edge");
    let out = lamina([
        "mount".as_ref(),
        other.as_ref(),
        mnt.as_os_str(),
        "--cache-dir".as_ref(),
        cache.as_os_str(),
        "--index".as_ref(),
        idx.as_ref(),
    ])
    .failed();
    assert!(out.stderr.contains("subject"), "{}", out.describe());
    assert!(!is_mountpoint(&mnt));
}

/// A multi-platform image gets one index per platform, each a referrer of
/// its platform's manifest; a mount picks this host's platform and its
/// index.
#[test]
fn a_multi_platform_image_gets_an_index_per_platform() {
    if !require(TOOLS) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("index-platforms");
    let layout = t.join("multi");
    let mut c = command(
        "cp",
        ["-a".as_ref(), edge_layout().as_os_str(), layout.as_os_str()],
    );
    run(&mut c, TIMEOUT).ok();
    let tags = layout_tags(&layout);
    let entry = |tag: &str, arch: &str| {
        let digest = &tags[tag];
        let size = std::fs::metadata(blob_path(&layout, digest)).unwrap().len();
        serde_json::json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest, "size": size,
            "platform": {"os": "linux", "architecture": arch},
        })
    };
    let host = if cfg!(target_arch = "aarch64") {
        "arm64"
    } else {
        "amd64"
    };
    let other = if host == "amd64" { "arm64" } else { "amd64" };
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [entry("edge-gz", host), entry("edge", other)],
    });
    let bytes = serde_json::to_vec(&index).unwrap();
    let digest = put_blob(&layout, &bytes);
    let mut top: Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    top["manifests"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "digest": digest, "size": bytes.len(),
            "annotations": {"org.opencontainers.image.ref.name": "multi"},
        }));
    std::fs::write(layout.join("index.json"), serde_json::to_vec(&top).unwrap()).unwrap();
    let mut c = command(
        tool("skopeo"),
        [
            "copy".to_string(),
            "--quiet".to_string(),
            "--all".to_string(),
            "--dest-tls-verify=false".to_string(),
            "--preserve-digests".to_string(),
            oci_ref(&layout, "multi"),
            reg.reference("m:multi"),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    let reports = lamina(["index", "--json", &reg.reference("m:multi")])
        .ok()
        .json();
    let reports = reports.as_array().unwrap();
    assert_eq!(reports.len(), 2, "{reports:?}");
    for (report, (tag, arch)) in reports.iter().zip([("edge-gz", host), ("edge", other)]) {
        assert_eq!(report["platform"], format!("linux/{arch}"), "{report}");
        assert_eq!(report["subject"], tags[tag].as_str(), "{report}");
        let fallback = tags[tag].replace("sha256:", "sha256-");
        assert!(self::tags(&reg, "m").contains(&fallback), "no {fallback}");
    }
    let m = Mount::new(&reg.reference("m:multi"), &t.join("mnt"), &t.join("cache"));
    treecmp(UMOCI_IGNORES, umoci_edge_rootfs(), &m.path);
    m.unmount();
}

/// The mount's settled figures from `lamina status --json`.
#[track_caller]
fn settled_status(m: &Mount) -> Value {
    // status.json is rewritten within 25 ms of a change.
    std::thread::sleep(std::time::Duration::from_millis(700));
    m.status().expect("a lazy mount has a status")["status"].clone()
}

/// The figure: a lazy mount of the Debian image's own tag through
/// its index (default span size) moves under 10% of the image's layers for
/// a python3 start: the span table and metadata at mount, then the spans
/// the start reads and their windows (tar-index mounts do not predict).
#[test]
fn a_python3_start_through_the_index_moves_under_a_tenth() {
    if !require(&["umoci", "skopeo", "docker-registry", "curl", "chroot"]) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("index-python3");
    reg.push(&debian_source(), "bookworm", "deb:orig");
    let report = index_and_check(&reg, "deb", "orig");
    let m = Mount::with_args(
        &reg.reference("deb:orig"),
        &t.join("mnt"),
        &t.join("cache"),
        &["--mode", "kernel"],
    );
    python3_prints_ok(&m.path, START);
    let s = settled_status(&m);
    // At mount: the span table and the metadata, compressed, as the
    // artifact gives them (the kernel path reads no lookup table).
    let artifact: Value = serde_json::from_slice(&get(
        &reg,
        &format!(
            "deb/manifests/{}",
            report["manifest_digest"].as_str().unwrap()
        ),
    ))
    .unwrap();
    let at_mount: u64 = artifact["layers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| {
            let kind = l["mediaType"].as_str().unwrap();
            kind.contains("tar-index.v1") || kind.contains("erofs")
        })
        .map(|l| l["size"].as_u64().unwrap())
        .sum();
    let fetched = s["fetched_bytes"].as_u64().unwrap();
    let layers = report["image_layer_bytes"].as_u64().unwrap();
    let moved = fetched + at_mount;
    eprintln!(
        "python3 start: {fetched} bytes of spans and windows in {} requests, {at_mount} bytes of \
         span table and metadata, {:.1}% of {layers}",
        s["requests"],
        moved as f64 * 100.0 / layers as f64
    );
    assert_eq!(s["failed_misses"], 0, "{s}");
    assert!(
        moved * 10 < layers,
        "moved {moved} bytes for {layers} bytes of layers: {s}"
    );
    m.unmount();
}

/// Through a proxy that flips bytes in every second range answer, an index
/// mount still reads every file right (bad spans and windows are fetched
/// again); through one that flips every answer, reads fail with EIO and
/// never return wrong bytes.
#[test]
fn flipped_bytes_under_an_index_mount_cost_refetches_or_eio() {
    if !require(TOOLS) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("index-flip");
    reg.push(&edge_layout(), "edge-gz", "e:gz");
    index_and_check(&reg, "e", "gz");
    let proxy = FaultProxy::start(t.path(), "flip", 0, reg.port, "flip", &["--every", "2"]);
    let image = format!("docker://127.0.0.1:{}/e:gz", proxy.port);
    let m = Mount::with_args(
        &image,
        &t.join("mnt"),
        &t.join("cache"),
        &["--timeout", "30"],
    );
    treecmp(UMOCI_IGNORES, umoci_edge_rootfs(), &m.path);
    let s = settled_status(&m);
    assert!(
        s["bad_chunks"].as_u64().unwrap() > 0,
        "no bad span counted: {s}"
    );
    assert_eq!(s["failed_misses"], 0, "{s}");
    m.unmount();

    let all = FaultProxy::start(t.path(), "flipall", 0, reg.port, "flipall", &[]);
    let image = format!("docker://127.0.0.1:{}/e:gz", all.port);
    let m = Mount::with_args(
        &image,
        &t.join("mnt2"),
        &t.join("cache2"),
        &["--timeout", "5"],
    );
    let mut read = 0;
    for rel in regular_files(umoci_edge_rootfs()) {
        let want = std::fs::read(umoci_edge_rootfs().join(&rel)).unwrap();
        if want.iter().all(|b| *b == 0) {
            continue; // holes read without a fetch
        }
        match std::fs::read(m.path.join(&rel)) {
            Ok(got) => panic!(
                "{}: read {} bytes ({}) through a proxy corrupting every range answer",
                rel.display(),
                got.len(),
                if got == want { "right" } else { "WRONG" }
            ),
            Err(e) => assert_eq!(e.raw_os_error(), Some(5), "{}: {e}", rel.display()),
        }
        read += 1;
        if read == 4 {
            break;
        }
    }
    assert!(read > 0, "no file with data in the torture image");
    let s = settled_status(&m);
    assert!(s["failed_misses"].as_u64().unwrap() > 0, "{s}");
    m.unmount();
}

/// Boot pages from a trace (`lamina index --prefetch TRACE`): a start
/// recorded through the index's mount, indexed again with the trace (into
/// another tag of the image's repository, named with --index), then a fresh
/// mount starts python3 from the boot pages alone: no miss fetches a span,
/// and the boot set's spans follow once the start is over.
#[test]
fn boot_pages_from_a_trace_serve_the_start() {
    if !require(&["umoci", "skopeo", "docker-registry", "curl", "chroot"]) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("index-boot");
    reg.push(&debian_source(), "bookworm", "deb:orig");
    index_and_check(&reg, "deb", "orig");
    let image = reg.reference("deb:orig");
    let trace = t.join("trace.txt");
    let m = Mount::with_args(
        &image,
        &t.join("rec"),
        &t.join("cache-rec"),
        &["--record-trace", trace.to_str().unwrap()],
    );
    python3_prints_ok(&m.path, START);
    m.unmount();
    let boot_index = reg.reference("deb:orig-boot");
    let report = lamina([
        "index",
        "--json",
        "--prefetch",
        trace.to_str().unwrap(),
        &image,
        &boot_index,
    ])
    .ok()
    .json();
    assert!(
        report[0]["boot_pages"]["bytes"].as_u64().unwrap() > 0
            && report[0]["boot_set"].as_u64().unwrap() > 0,
        "{report}"
    );
    let m = Mount::with_args(
        &image,
        &t.join("boot"),
        &t.join("cache"),
        &["--mode", "kernel", "--index", &boot_index],
    );
    python3_prints_ok(&m.path, START);
    let s = settled_status(&m);
    assert!(s["boot_page_bytes"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(s["miss_fetched_bytes"], 0, "a miss fetched a span: {s}");
    assert_eq!(s["failed_misses"], 0, "{s}");
    m.unmount();
}

/// `lamina run` of the original tag finds its index too, and runs the
/// container from a lazy mount of it.
#[test]
fn lamina_run_starts_the_original_tag() {
    if !require(&["umoci", "skopeo", "docker-registry", "curl", "runc"]) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("index-run");
    reg.push(&debian_source(), "bookworm", "deb:orig");
    index_and_check(&reg, "deb", "orig");
    let mut c = lamina_cmd(["run", "--rm", "--cache-dir"]);
    c.arg(t.join("cache"))
        .arg("--state-dir")
        .arg(t.join("state"))
        .arg(reg.reference("deb:orig"))
        .args(["--", "python3", "-c", "print('ok from the index')"]);
    let o = run(&mut c, TIMEOUT).ok();
    assert_eq!(o.stdout, "ok from the index\n", "{}", o.describe());
    let mounts = mounts_under(t.path());
    assert!(mounts.is_empty(), "still mounted: {mounts:?}");
}
