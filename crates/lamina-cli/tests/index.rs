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
    put_as(reg, path, body, "application/vnd.oci.image.index.v1+json");
}

/// `PUT /v2/<path>` of a manifest or index of `media_type`.
fn put_as(reg: &Registry, path: &str, body: &[u8], media_type: &str) {
    let url = format!("http://{}/v2/{path}", reg.host());
    let body = String::from_utf8(body.to_vec()).unwrap();
    let kind = format!("Content-Type: {media_type}");
    let mut c = command(
        "curl",
        [
            "-sf",
            "-X",
            "PUT",
            "-H",
            &kind,
            "--data-binary",
            &body,
            &url,
        ],
    );
    run(&mut c, TIMEOUT).ok();
}

fn tags(reg: &Registry, repo: &str) -> Vec<String> {
    let list: Value = serde_json::from_slice(&get(reg, &format!("{repo}/tags/list"))).unwrap();
    serde_json::from_value(list["tags"].clone()).unwrap()
}

/// Indexes `reference`; checks the artifact is a referrer of the image's
/// manifest (under the fallback tag), and that the tag now names an image
/// index that lists that manifest, unchanged, and binds the artifact to it;
/// returns `lamina index`'s report.
fn index_and_check(reg: &Registry, repo: &str, tag: &str) -> Value {
    index_with_and_check(reg, repo, tag, &[])
}

/// [`index_and_check`], `lamina index` given `args` too.
fn index_with_and_check(reg: &Registry, repo: &str, tag: &str, args: &[&str]) -> Value {
    let before = sha256_hex(&get(reg, &format!("{repo}/manifests/{tag}")));
    let image = reg.reference(&format!("{repo}:{tag}"));
    let reports = lamina(
        ["index", "--json"]
            .iter()
            .chain(args)
            .chain([&image.as_str()]),
    )
    .ok()
    .json();
    assert_eq!(reports.as_array().map(Vec::len), Some(1), "{reports}");
    let report = reports[0].clone();
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
    check_bound(reg, repo, tag, &report);
    report
}

/// The tag names an image index that lists the indexed manifest (with its
/// platform) and binds the artifact of `report` to it, as `bound_in` says.
fn check_bound(reg: &Registry, repo: &str, tag: &str, report: &Value) {
    let top = get(reg, &format!("{repo}/manifests/{tag}"));
    let bound_in = report["bound_in"].as_str().unwrap_or_default();
    assert!(
        bound_in.ends_with(&format!("@sha256:{}", sha256_hex(&top))),
        "{tag} is not the image index the report names: {report}"
    );
    let top: Value = serde_json::from_slice(&top).unwrap();
    let entries = top["manifests"].as_array().unwrap();
    let image = entries.iter().find(|e| e["digest"] == report["subject"]);
    assert!(
        image.is_some_and(|e| e["platform"]["os"] == "linux"),
        "{top}"
    );
    let bound = entries
        .iter()
        .find(|e| e["digest"] == report["manifest_digest"])
        .unwrap_or_else(|| panic!("the index is not in {top}"));
    assert_eq!(bound["platform"]["os"], "unknown", "{bound}");
    assert_eq!(
        bound["annotations"]["vnd.docker.reference.digest"],
        report["subject"]
    );
    assert_eq!(
        bound["annotations"]["vnd.docker.reference.type"],
        "dev.lamina.tar-index"
    );
}

/// The Debian image through its index, kernel and FUSE, equals umoci's
/// unpack (every span decoded with its narrowed window); the whole index,
/// windows included, is at most 3% of the image's layers (issue 44).
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
        report["artifact_bytes"].as_u64().unwrap(),
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

/// A lazy FUSE mount through an index fetches, before it returns, the span
/// table and the metadata's first frame, by range; the daemon fetches the
/// metadata's other frames by range as requests need them (an answer
/// corrupted on the way fetched again, never used), and the worker the
/// lookup table after the mount. The tree equals ociunpack.py's.
#[test]
fn a_lazy_fuse_mount_through_an_index_fetches_its_metadata_as_read() {
    if !require(TOOLS) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("index-frames");
    let layout = t.join("src");
    let files = ["small-files", "--files", "4000", "--out"];
    let args = files.iter().map(std::ffi::OsStr::new);
    let tag = ["--tag", "src"].map(std::ffi::OsStr::new);
    python(
        "bench/harness/synthetic.py",
        args.chain([layout.as_os_str()]).chain(tag),
        TIMEOUT,
    )
    .ok();
    reg.push(&layout, "src", "many:orig");
    let report = index_with_and_check(&reg, "many", "orig", &["--metadata-frame-size", "16K"]);
    let path = format!(
        "many/manifests/{}",
        report["manifest_digest"].as_str().unwrap()
    );
    let artifact: Value = serde_json::from_slice(&get(&reg, &path)).unwrap();
    let layer = |media_type: &str| {
        let layers = artifact["layers"].as_array().unwrap();
        let found = layers.iter().find(|l| l["mediaType"] == media_type);
        found.unwrap_or_else(|| panic!("no {media_type} layer: {artifact}"))["digest"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (metadata, lookup) = (
        layer(lamina_image::artifact::MEDIA_TYPE_METADATA),
        layer(lamina_image::artifact::MEDIA_TYPE_LOOKUP),
    );
    let listed = artifact["layers"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|l| l["annotations"][lamina_image::artifact::ANNOTATION_METADATA_FRAMES].as_str())
        .unwrap_or_else(|| panic!("no frames listed: {artifact}"));
    let frames: Vec<(u64, u64, String)> = serde_json::from_str(listed).unwrap();
    assert!(frames.len() > 3, "the metadata is in few frames: {listed}");

    // The metadata's range reads: the mount's untouched, the daemon's
    // first one corrupted.
    let only = ["--blob", metadata.as_str()];
    let proxy = FaultProxy::start(t.path(), "proxy", 0, reg.port, "ok,flip", &only);
    let image = format!("docker://127.0.0.1:{}/many:orig", proxy.port);
    let cache = t.join("cache");
    let args = ["--mode", "fuse", "--lazy", "--prefetch", "none"];
    let m = Mount::with_args(&image, &t.join("mnt"), &cache, &args);
    let requests = |blob: &str| -> Vec<String> {
        let stats = proxy.stats();
        let log = stats["log"].as_array().unwrap();
        let lines = log.iter().filter_map(|l| l.as_str());
        lines
            .filter(|l| l.contains(blob))
            .map(str::to_string)
            .collect()
    };
    let first_frame = format!("bytes=0-{}", frames[0].0 - 1);
    let at_mount = requests(&metadata);
    assert!(
        matches!(&at_mount[..], [one] if one.ends_with(&first_frame)),
        "the metadata read before the mount returned, not its first frame ({first_frame}): \
         {at_mount:?}"
    );
    // Fetched at the mount, the daemon would start with it.
    let log = wait_for_log(
        &cache,
        &m.path,
        "lookups through the lookup table from now on",
    );
    let at_start =
        |l: &&str| l.contains("lookups through the lookup table") && !l.contains("from now on");
    assert!(
        !log.lines().any(|l| at_start(&l)),
        "lookup table fetched at mount:\n{log}"
    );

    treecmp(&[], &ociunpack(&layout, "src"), &m.path);
    let written = metadata_frames_written(&cache, &m.path);
    let bad_answers = log_field(&written, "bad_answers");
    assert!(bad_answers.is_some_and(|n| n > 0), "{written}");
    let fetched = requests(&metadata);
    assert!(
        fetched.len() > frames.len() && fetched.iter().all(|r| r.contains(" bytes=")),
        "the metadata read otherwise than frame by frame: {fetched:?}"
    );
    assert!(
        !requests(&lookup).is_empty(),
        "the lookup table came from nowhere"
    );
    m.unmount();
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
    // Nothing vouches for a referrer: refused before it is opened.
    let out = mount("b").failed();
    assert!(out.stderr.contains("vouches"), "{}", out.describe());
    // Pinned by the operator, it is opened, and its subject is not b's.
    let pinned = a["manifest_digest"].as_str().unwrap();
    let out = lamina([
        "mount".as_ref(),
        reg.reference("x:b").as_ref(),
        mnt.as_os_str(),
        "--cache-dir".as_ref(),
        cache.as_os_str(),
        "--trust-index".as_ref(),
        pinned.as_ref(),
    ])
    .failed();
    assert!(out.stderr.contains("subject"), "{}", out.describe());
    assert!(!is_mountpoint(&mnt));
}

/// An index stored elsewhere (an OCI layout) is used when named with
/// `--index`, for the registry image (kernel and FUSE) and for the same
/// image in a layout; an index named for another image is refused.
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
    // Through FUSE, with a cache of its own: the metadata's frames and the
    // lookup table come from the index's layout, not the image's registry.
    let fuse = ["--index", &idx, "--mode", "fuse"];
    let m = Mount::with_args(&gz, &t.join("fuse"), &t.join("cache-fuse"), &fuse);
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
/// and the boot set's spans follow once the start is over. (`--index` of a
/// registry names the index by digest: a tag is refused.)
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
    let report = lamina([
        "index",
        "--json",
        "--prefetch",
        trace.to_str().unwrap(),
        &image,
        &reg.reference("deb:orig-boot"),
    ])
    .ok()
    .json();
    let boot_index = reg.reference(&format!(
        "deb@{}",
        report[0]["manifest_digest"].as_str().unwrap()
    ));
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
    // A tag anyone who may push can move names no index.
    let out = lamina([
        "mount".as_ref(),
        image.as_ref(),
        t.mkdir("by-tag").as_os_str(),
        "--cache-dir".as_ref(),
        t.join("cache").as_os_str(),
        "--index".as_ref(),
        reg.reference("deb:orig-boot").as_ref(),
    ])
    .failed();
    assert!(out.stderr.contains("by digest"), "{}", out.describe());
    python3_prints_ok(&m.path, START);
    let s = settled_status(&m);
    assert!(s["boot_page_bytes"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(s["miss_fetched_bytes"], 0, "a miss fetched a span: {s}");
    assert_eq!(s["failed_misses"], 0, "{s}");
    m.unmount();
}

/// Boot pages known from the image (`lamina index --boot-exec python3`,
/// issue 44): the walk reads the image's files back from its gzip layers
/// as spans; a mount through that index applies the pages, keeps its
/// readahead, reads the loader and a start-up module without a miss, and
/// starts python3. A program the image does not have is an error naming it.
#[test]
fn boot_pages_known_from_the_image_serve_the_loader() {
    if !require(&["umoci", "skopeo", "docker-registry", "curl", "chroot"]) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("index-static-boot");
    reg.push(&debian_source(), "bookworm", "deb:orig");
    let image = reg.reference("deb:orig");
    let out = lamina([
        "index",
        "--boot-exec",
        "pyhton3",
        &image,
        &reg.reference("deb:typo"),
    ])
    .failed();
    assert!(
        out.stderr
            .contains("--boot-exec pyhton3: no such program in the image"),
        "{}",
        out.describe()
    );
    assert!(!tags(&reg, "deb").contains(&"typo".to_string()));
    let report = lamina([
        "index",
        "--json",
        "--boot-exec",
        "python3",
        &image,
        &reg.reference("deb:orig-static"),
    ])
    .ok()
    .json();
    let segments = report[0]["boot_pages"]["segments"].as_u64().unwrap_or(0);
    assert!(
        segments > 0 && report[0]["boot_set"].as_u64().unwrap() > 0,
        "{report}"
    );
    let index = reg.reference(&format!(
        "deb@{}",
        report[0]["manifest_digest"].as_str().unwrap()
    ));
    let m = Mount::with_args(
        &image,
        &t.join("mnt"),
        &t.join("cache"),
        &["--mode", "kernel", "--index", &index, "--prefetch", "pages"],
    );
    let config: Value =
        serde_json::from_slice(&std::fs::read(run_dir(&m).join("config.json")).unwrap()).unwrap();
    assert_eq!(config["boot_pages"][0]["from_image"], true, "{config}");
    assert!(config["readahead_kb"].is_null(), "{config}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let applied = loop {
        let s = settled_status(&m);
        if s["boot_frames_done"].as_u64() == Some(segments) {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "frames not applied: {s}"
        );
    };
    for path in [
        "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
        "usr/lib/python3.11/encodings/__pycache__/__init__.cpython-311.pyc",
    ] {
        let bytes = std::fs::read(m.path.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(!bytes.is_empty(), "{path} is empty");
    }
    let read = settled_status(&m);
    assert_eq!(
        read["miss_requests"], applied["miss_requests"],
        "reading the loader and a start-up module fetched a span"
    );
    python3_prints_ok(&m.path, START);
    let s = settled_status(&m);
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

/// `lamina mount IMAGE MNT --cache-dir CACHE EXTRA...`, its output.
fn try_mount(
    image: &str,
    mnt: &std::path::Path,
    cache: &std::path::Path,
    extra: &[&str],
) -> Output {
    let mut c = lamina_cmd(["mount", image]);
    c.arg(mnt).arg("--cache-dir").arg(cache).args(extra);
    run(&mut c, TIMEOUT)
}

/// Issue 42, point 1: a referrer pushed by anyone who may push to the
/// repository chooses the whole tree (audit mode shows the forged one
/// would be served: python3.11 setuid). Nothing vouches for it, so
/// `lamina mount` (kernel and FUSE) and `lamina run` refuse it. Once the
/// publisher binds the true index into the tag's image index, the tag
/// mounts the true tree whatever the referrers list; the manifest's own
/// digest, which the binding does not cover, is refused unless the
/// operator pins an index.
#[test]
fn a_referrer_nothing_vouches_for_is_refused_and_a_bound_index_serves() {
    if !require(&["umoci", "skopeo", "docker-registry", "curl", "runc"]) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("index-hostile");
    reg.push(&debian_source(), "bookworm", "deb:orig");
    let manifest = format!("sha256:{}", sha256_hex(&get(&reg, "deb/manifests/orig")));
    push_setuid_index(&reg, &format!("deb@{manifest}"), PYTHON);
    let image = reg.reference("deb:orig");
    let (mnt, cache) = (t.mkdir("mnt"), t.join("cache"));
    for mode in ["kernel", "fuse"] {
        let out = try_mount(&image, &mnt, &cache, &["--mode", mode]).code_is(3);
        assert!(out.stderr.contains("vouches"), "{}", out.describe());
        assert!(!is_mountpoint(&mnt), "{mode}: mounted");
    }
    let mut c = lamina_cmd(["run", "--rm", "--cache-dir"]);
    c.arg(&cache)
        .arg("--state-dir")
        .arg(t.join("state"))
        .arg(&image)
        .args(["--", "python3", "-c", "print('hostile')"]);
    let out = run(&mut c, TIMEOUT).code_is(125);
    assert!(out.stderr.contains("vouches"), "{}", out.describe());
    assert!(!out.stdout.contains("hostile"), "{}", out.describe());

    audit_serves_the_forgery(&image, &t);

    let report = index_and_check(&reg, "deb", "orig");
    for mode in ["kernel", "fuse"] {
        let m = Mount::with_args(&image, &t.join(mode), &cache, &["--mode", mode]);
        assert_eq!(mode_bits(&m.path.join(PYTHON)), 0o755, "{mode}");
        m.unmount();
    }
    let by_manifest = reg.reference(&format!("deb@{manifest}"));
    let out = try_mount(&by_manifest, &mnt, &cache, &[]).code_is(3);
    assert!(out.stderr.contains("vouches"), "{}", out.describe());
    let pinned = report["manifest_digest"].as_str().unwrap();
    let m = Mount::with_args(
        &by_manifest,
        &t.join("pinned"),
        &cache,
        &["--trust-index", pinned],
    );
    assert_eq!(mode_bits(&m.path.join(PYTHON)), 0o755);
    m.unmount();
}

/// cosign, built once per machine by `scripts/setup.sh`.
const COSIGN: &str = "/var/cache/lamina-test/go/cosign-v2.6.5/cosign";

/// Waits for cosign's first build if it is running (scripts/setup.sh
/// starts it in the background); panics if it failed or never ran.
fn wait_for_cosign() {
    let bin = std::path::Path::new(COSIGN);
    let dir = bin.parent().unwrap().display().to_string();
    let (building, log) = (format!("{dir}.building"), format!("{dir}.log"));
    let started = std::time::Instant::now();
    while !bin.exists() && std::path::Path::new(&building).exists() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30 * 60),
            "cosign's build (log {log}) still runs after 30 min"
        );
        std::thread::sleep(std::time::Duration::from_secs(2));
    }
    assert!(
        bin.exists(),
        "{COSIGN} is missing: scripts/setup.sh builds it (log {log}: {})",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}

/// `cosign ARGS` in `dir`, with an empty key password and no
/// transparency log (the node checks signatures offline).
fn cosign(dir: &std::path::Path, args: &[&str]) -> Output {
    wait_for_cosign();
    let mut c = command(COSIGN, args);
    c.current_dir(dir)
        .env("COSIGN_PASSWORD", "")
        .env("COSIGN_EXPERIMENTAL", "1");
    run(&mut c, TIMEOUT).ok()
}

/// A cosign key pair in `dir` (`cosign.key`, `cosign.pub`); the public
/// key's path.
fn cosign_keys(dir: &std::path::Path) -> String {
    std::fs::create_dir_all(dir).unwrap();
    cosign(dir, &["generate-key-pair"]);
    dir.join("cosign.pub").display().to_string()
}

/// Signs `image` (`HOST/REPO@DIGEST`) with `dir`'s key, as a publisher would:
/// stored under cosign's `.sig` tag, or as an OCI 1.1 referrer.
fn cosign_sign(dir: &std::path::Path, image: &str, as_referrer: bool) {
    let mode = if as_referrer { "oci-1-1" } else { "legacy" };
    cosign(
        dir,
        &[
            "sign",
            "--key",
            "cosign.key",
            "--tlog-upload=false",
            "--yes",
            "--allow-insecure-registry",
            "--allow-http-registry",
            &format!("--registry-referrers-mode={mode}"),
            image,
        ],
    );
}

/// Issue 42, must work (b): an index signed with a key the node trusts is
/// used, whatever else the referrers list holds. The publisher signs the
/// true index with real cosign (by cosign's `.sig` tag with key A, as an
/// OCI 1.1 referrer with key C); a forged index (python3.11 setuid) is
/// pushed after it, so it is listed last, and gets a copy of the true
/// index's signature manifest under its own `.sig` tag (a true signature,
/// of another digest); and a signature whose payload is gone is listed
/// newest beside the true index's good ones. A mount of the manifest's digest with key A or key
/// C trusted serves the true tree (kernel and FUSE; the forged candidate,
/// checked first, is refused); with key B, or none, it is refused; and in
/// audit mode without keys the forged one would have been served.
#[test]
fn an_index_signed_with_a_trusted_key_serves_and_nothing_else_does() {
    if !require(&["umoci", "skopeo", "docker-registry", "curl"]) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("index-signed");
    reg.push(&debian_source(), "bookworm", "deb:orig");
    let manifest = format!("sha256:{}", sha256_hex(&get(&reg, "deb/manifests/orig")));
    let report = index_and_check(&reg, "deb", "orig");
    let true_index = report["manifest_digest"].as_str().unwrap().to_string();
    let (key_a, key_b, key_c) = (
        cosign_keys(&t.join("a")),
        cosign_keys(&t.join("b")),
        cosign_keys(&t.join("c")),
    );
    let signed = format!("{}/deb@{true_index}", reg.host());
    cosign_sign(&t.join("a"), &signed, false);
    cosign_sign(&t.join("c"), &signed, true);
    let forged = push_setuid_index(&reg, &format!("deb@{manifest}"), PYTHON);
    let sig_tag = |d: &str| format!("deb/manifests/sha256-{}.sig", &d["sha256:".len()..]);
    let true_sig = get(&reg, &sig_tag(&true_index));
    assert!(!true_sig.is_empty(), "cosign stored no .sig tag");
    put_as(
        &reg,
        &sig_tag(&forged),
        &true_sig,
        "application/vnd.oci.image.manifest.v1+json",
    );
    push_unreadable_signature(&reg, &true_index);

    let by_manifest = reg.reference(&format!("deb@{manifest}"));
    let (mnt, cache) = (t.mkdir("mnt"), t.join("cache"));
    for (key, modes) in [(&key_a, &["kernel", "fuse"][..]), (&key_c, &["kernel"][..])] {
        for mode in modes {
            let args = ["--mode", mode, "--trust-index-key", key.as_str()];
            let m = Mount::with_args(&by_manifest, &t.join(&format!("m-{mode}")), &cache, &args);
            assert_eq!(mode_bits(&m.path.join(PYTHON)), 0o755, "{key} {mode}");
            m.unmount();
        }
    }
    for extra in [&["--trust-index-key", key_b.as_str()][..], &[][..]] {
        let out = try_mount(&by_manifest, &mnt, &cache, extra).code_is(3);
        assert!(out.stderr.contains("vouches"), "{}", out.describe());
        assert!(!is_mountpoint(&mnt));
    }
    audit_serves_the_forgery(&by_manifest, &t);
}

/// Lists, newest, a signature of `index` whose payload blob is gone from
/// the registry (pushed, then deleted), as anyone who may push a referrer
/// could: it must be skipped, not keep the good signatures beside it from
/// being found (before, the failed read refused the mount).
fn push_unreadable_signature(reg: &Registry, index: &str) {
    use lamina_oci::registry::BlobBody;
    use lamina_oci::{cosign, media_types, Descriptor, Digest, RegistryClient, SourceOptions};
    let client = RegistryClient::new(&reg.host(), &SourceOptions::default()).unwrap();
    let payload = b"{\"gone\": true}";
    let blob = Descriptor::new(
        cosign::SIMPLE_SIGNING,
        Digest::of_bytes(payload),
        payload.len() as u64,
    );
    client
        .put_blob("deb", &blob, BlobBody::Bytes(payload))
        .unwrap();
    let subject = get(reg, &format!("deb/manifests/{index}"));
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": media_types::OCI_MANIFEST,
        "artifactType": cosign::SIGNATURE_ARTIFACT_TYPE,
        "config": {"mediaType": media_types::OCI_EMPTY, "size": 2,
                   "digest": Digest::of_bytes(b"{}").to_string()},
        "layers": [{"mediaType": cosign::SIMPLE_SIGNING, "size": payload.len(),
                    "digest": blob.digest.to_string(),
                    "annotations": {cosign::SIGNATURE_ANNOTATION: "MEUCIQ=="}}],
        "subject": {"mediaType": media_types::OCI_MANIFEST, "size": subject.len(),
                    "digest": index},
    });
    client
        .push_referrer("deb", &serde_json::to_vec(&manifest).unwrap())
        .unwrap();
    let url = format!("http://{}/v2/deb/blobs/{}", reg.host(), blob.digest);
    run(&mut command("curl", ["-sf", "-X", "DELETE", &url]), TIMEOUT).ok();
    assert!(
        client.get_blob("deb", &blob.digest).is_err(),
        "the payload is still served"
    );
}

/// In audit mode the forged index (python3.11 setuid) is what a mount of
/// `image` serves: the refusals a test checks are the policy's, not an
/// accident of the forgery.
fn audit_serves_the_forgery(image: &str, t: &TestDir) {
    let audit = Mount::with_args(
        image,
        &t.join("audit"),
        &t.join("cache-audit"),
        &["--index-policy", "audit"],
    );
    assert_eq!(
        mode_bits(&audit.path.join(PYTHON)),
        0o4755,
        "the forgery is not what audit mode serves"
    );
    audit.unmount();
}

/// Issue 42, point 1 (d): a mirror may carry referrers but decides no
/// trust. A hosts.toml mirror that may resolve answers the referrers
/// call with a forged index: a mount of the image's manifest digest
/// refuses it; a mount of the bound image index's digest (what a user
/// pins) serves the true tree, the mirror's referrers notwithstanding.
#[test]
fn a_mirror_answering_the_referrers_call_decides_nothing() {
    if !require(TOOLS) {
        return;
    }
    let (reg, mirror) = (Registry::start(), Registry::start());
    let t = TestDir::new("index-mirror");
    reg.push(&debian_source(), "bookworm", "deb:orig");
    mirror.push(&debian_source(), "bookworm", "deb:orig");
    let manifest = format!("sha256:{}", sha256_hex(&get(&reg, "deb/manifests/orig")));
    let report = index_and_check(&reg, "deb", "orig");
    push_setuid_index(&mirror, &format!("deb@{manifest}"), PYTHON);
    let hosts = t.join("certs.d");
    let ns = hosts.join(format!("127.0.0.1_{}_", reg.port));
    std::fs::create_dir_all(&ns).unwrap();
    let toml = format!(
        "server = \"http://127.0.0.1:{}\"\n\n[host.\"http://127.0.0.1:{}\"]\n  \
         capabilities = [\"pull\", \"resolve\"]\n",
        reg.port, mirror.port
    );
    std::fs::write(ns.join("hosts.toml"), toml).unwrap();
    let hosts_arg = ["--hosts-dir", hosts.to_str().unwrap()];
    let (mnt, cache) = (t.mkdir("mnt"), t.join("cache"));
    let by_manifest = reg.reference(&format!("deb@{manifest}"));
    let out = try_mount(&by_manifest, &mnt, &cache, &hosts_arg).code_is(3);
    assert!(out.stderr.contains("vouches"), "{}", out.describe());
    let bound_in = report["bound_in"].as_str().unwrap();
    let pinned = reg.reference(&format!("deb@{}", bound_in.rsplit_once('@').unwrap().1));
    let m = Mount::with_args(&pinned, &t.join("bound"), &cache, &hosts_arg);
    assert_eq!(mode_bits(&m.path.join(PYTHON)), 0o755);
    m.unmount();
}

/// Issue 42, point 9: a kernel mount hands the metadata to the kernel's
/// EROFS parser, as root, only after lamina's bounded reader (the one FUSE
/// mounts serve through) has read every directory and inode of it. An
/// index vouched for (pinned by digest) whose `/usr/bin` is the root again
/// (a directory loop) is refused, by name, exit 3, and nothing is
/// mounted; before, it mounted and `usr/bin/usr/bin/usr` was there. The
/// true index, pinned the same way, mounts.
#[test]
fn metadata_the_reader_refuses_never_reaches_the_kernel() {
    if !require(&["umoci", "skopeo", "docker-registry", "curl"]) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("index-kernel-parser");
    reg.push(&debian_source(), "bookworm", "deb:orig");
    let manifest = format!("sha256:{}", sha256_hex(&get(&reg, "deb/manifests/orig")));
    let subject = format!("deb@{manifest}");
    let forged = push_forged_index(&reg, &subject, &|m| loop_to_root(m, "usr/bin"));
    let image = reg.reference(&subject);
    let (mnt, cache) = (t.mkdir("mnt"), t.join("cache"));
    for lazy in [&["--lazy"][..], &["--eager"][..]] {
        let mut args = vec!["--mode", "kernel", "--trust-index", &forged];
        args.extend_from_slice(lazy);
        let out = try_mount(&image, &mnt, &cache, &args).code_is(3);
        assert!(
            out.stderr.contains("refused before the kernel mount")
                && out.stderr.contains("reached twice"),
            "{lazy:?}: {}",
            out.describe()
        );
        assert!(!is_mountpoint(&mnt), "{lazy:?}: mounted");
    }
    let truth = push_forged_index(&reg, &subject, &|_| {});
    let m = Mount::with_args(
        &image,
        &t.join("true"),
        &cache,
        &["--mode", "kernel", "--trust-index", &truth],
    );
    assert_eq!(mode_bits(&m.path.join(PYTHON)), 0o755);
    assert!(!m.path.join("usr/bin/usr").exists());
    m.unmount();
}
