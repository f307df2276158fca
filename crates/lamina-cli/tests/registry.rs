//! Registry round trip: skopeo pushes the edge fixture to a throw-away local
//! registry, lamina converts registry -> registry and mounts straight from
//! the registry; the mounted tree must equal umoci's unpack.

mod common;

use common::*;

#[test]
fn registry_round_trip_matches_umoci() {
    if !require(&["umoci", "skopeo", "docker-registry", "curl", "fsck.erofs"]) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("registry");
    let src = reg.reference("src:edge");
    let dst = reg.reference("lam:edge");
    reg.push(&edge_layout(), "edge-gz", "src:edge");

    let report = lamina(["convert", "--json", &src, &dst]).ok().json();
    let inspect = lamina(["inspect", "--json", &dst]).ok().json();
    assert_eq!(inspect["lamina"], true, "{inspect}");
    assert_eq!(
        inspect["manifest_digest"], report["manifest_digest"],
        "the pushed manifest is not the one convert reported"
    );
    // The source is edge-gz exactly (skopeo --preserve-digests).
    let edge_gz = layout_tags(&edge_layout())["edge-gz"].clone();
    assert_eq!(report["source_manifest_digest"], edge_gz.as_str());

    let blobs: u64 = report["blobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["size"].as_u64().unwrap())
        .sum();

    // Default for docker:// is a lazy mount: data comes on first read.
    let m = Mount::new(&dst, &t.join("mnt"), &t.join("cache"));
    assert_eq!(m.info["manifest_digest"], report["manifest_digest"]);
    let status = m.status();
    let holder = status
        .as_ref()
        .and_then(|s| s["holder_pid"].as_u64())
        .unwrap_or_else(|| panic!("lamina status does not list the lazy mount: {status:?}"));
    treecmp(UMOCI_IGNORES, umoci_edge_rootfs(), &m.path);
    treecmp(&[], &ociunpack(&edge_layout(), "edge"), &m.path);
    fsck_erofs(&m);
    let mnt = m.path.clone();
    let cache = m.cache.clone();
    let last = m.unmount();
    let last = &last["last_status"];
    assert_eq!(last["failed_misses"], 0, "umount report: {last}");
    assert_eq!(last["bad_chunks"], 0, "umount report: {last}");
    assert!(
        last["fetched_bytes"]
            .as_u64()
            .is_some_and(|b| b > 0 && b <= blobs),
        "fetched_bytes should be within (0, {blobs}]: {last}"
    );
    assert!(
        process_exits(holder as u32, std::time::Duration::from_secs(15)),
        "the holder (pid {holder}) still runs 15 s after the unmount"
    );
    let after = lamina(["status", "--json", "--cache-dir", cache.to_str().unwrap()])
        .ok()
        .json();
    assert!(
        after
            .as_array()
            .is_some_and(|a| a.iter().all(|e| e["mountpoint"].as_str() != mnt.to_str())),
        "status still lists {} after umount: {after}",
        mnt.display()
    );

    // --eager from the registry into a fresh cache fetches every data blob.
    let m = Mount::with_args(&dst, &t.join("mnt2"), &t.join("cache2"), &["--eager"]);
    assert_eq!(
        m.info["fetched_bytes"], blobs,
        "an eager first mount fetches every data blob"
    );
    treecmp(&[], &ociunpack(&edge_layout(), "edge"), &m.path);
    m.unmount();
}

/// A malformed reference exits 2; a tag or repository the registry does not
/// have exits 4, for convert, mount and inspect alike.
#[test]
fn registry_bad_reference_and_missing_tag() {
    if !require(&["docker-registry", "curl", "skopeo"]) {
        return;
    }
    let reg = Registry::start();
    let t = TestDir::new("registry-errors");
    // Something in the registry, so "missing" really means the tag.
    let mut c = command(
        tool("skopeo"),
        [
            "copy".to_string(),
            "--quiet".to_string(),
            "--dest-tls-verify=false".to_string(),
            "--preserve-digests".to_string(),
            oci_ref(&fixtures().join("misc"), "minimal"),
            reg.reference("there:minimal"),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    let mnt = t.mkdir("mnt");
    let cache = t.join("cache");
    let out = t.join("out");
    let mut f = Failures::default();

    let mut expect = |code: i32, args: Vec<String>| {
        let o = lamina(&args);
        f.check(
            o.code() == Some(code) && !o.stderr.trim().is_empty(),
            || format!("expected exit {code} with a message:\n{}", o.describe()),
        );
        f.check(!is_mountpoint(&mnt), || {
            format!("{} got mounted", mnt.display())
        });
        let _ = force_unmount(&mnt, Some(&cache));
    };
    let s = |v: &str| v.to_string();
    let dst = oci_ref(&out, "x");
    let (mnt_s, cache_s) = (
        mnt.to_str().unwrap().to_string(),
        cache.to_str().unwrap().to_string(),
    );
    for bad in [
        format!("docker://{}/Upper/Case:tag", reg.host()),
        format!("docker://{}/repo:bad:tag", reg.host()),
        format!("docker://{}/repo:", reg.host()),
        format!("docker://{}/", reg.host()),
        format!("docker://{}/repo@sha256:abc", reg.host()),
        s("nosuchtransport:foo"),
    ] {
        expect(2, vec![s("inspect"), bad.clone()]);
        expect(2, vec![s("convert"), bad.clone(), dst.clone()]);
        expect(
            2,
            vec![
                s("mount"),
                bad.clone(),
                mnt_s.clone(),
                s("--cache-dir"),
                cache_s.clone(),
            ],
        );
    }
    // A bad destination with a good source.
    expect(
        2,
        vec![
            s("convert"),
            reg.reference("there:minimal"),
            format!("docker://{}/Bad:x", reg.host()),
        ],
    );
    for missing in [reg.reference("there:nope"), reg.reference("nothere:latest")] {
        expect(4, vec![s("inspect"), missing.clone()]);
        expect(4, vec![s("convert"), missing.clone(), dst.clone()]);
        expect(
            4,
            vec![
                s("mount"),
                missing.clone(),
                mnt_s.clone(),
                s("--cache-dir"),
                cache_s.clone(),
            ],
        );
    }
    // Nothing was published for the failed conversions.
    f.check(layout_tags(&out).is_empty(), || {
        format!("tags in {}: {:?}", out.display(), layout_tags(&out))
    });
    f.finish("registry error exit codes");
}
