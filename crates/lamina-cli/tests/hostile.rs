//! Hostile input: every image of `mkimage.py hostile` is either refused (exit
//! 3, a message naming the problem, nothing published) or confined (converts,
//! mounts, the would-be escape lands inside the image), as hostile.json says;
//! nothing escapes onto the host. And a corrupted data blob of a converted
//! image is refused at mount time without leaving anything in the cache.

mod common;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use common::*;
use serde_json::Value;

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_string))
        .collect()
}

/// Words of which at least one must appear in the error message of a refused
/// image (case-insensitive).
fn problem_words(tag: &str) -> &'static [&'static str] {
    match tag {
        "traversal" => &["..", "traversal"],
        "hardlink-escape" => &["passwd-link", "shadow-link"],
        "hardlink-dir" => &["directory"],
        "hardlink-missing" => &["does-not-exist"],
        "truncated-gzip" => &["gzip", "deflate", "eof", "truncat"],
        "garbage" => &["gzip"],
        "digest-mismatch" => &["digest mismatch"],
        "diffid-mismatch" => &["diff_id", "diffid", "diff id"],
        "size-mismatch" => &["size"],
        _ => &[""],
    }
}

/// `MNT` + an absolute image path.
fn inside(mnt: &Path, p: &str) -> PathBuf {
    mnt.join(p.trim_start_matches('/'))
}

/// What identifies a host file: type, size, mode, owner, inode, mtime, hash.
fn fingerprint(p: &Path) -> Option<String> {
    let m = fs::symlink_metadata(p).ok()?;
    let hash = if m.is_file() {
        sha256_file(p)
    } else {
        String::new()
    };
    Some(format!(
        "mode {:o} uid {} gid {} size {} ino {} mtime {}.{} ctime {}.{} {hash}",
        m.mode(),
        m.uid(),
        m.gid(),
        m.len(),
        m.ino(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec()
    ))
}

fn staging_leftovers(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.') || n.contains("staging") || n.contains("tmp"))
        .collect()
}

/// Checks the `confined` description of hostile.json against a mount.
fn check_confined(f: &mut Failures, tag: &str, mnt: &Path, confined: &Value) {
    for p in strings(&confined["files"]) {
        let full = inside(mnt, &p);
        let is_file = fs::symlink_metadata(&full).is_ok_and(|m| m.is_file());
        f.check(is_file, || {
            format!("{tag}: {p} is not a regular file inside the mount")
        });
        if is_file && (p.contains("lamina-escape") || p.contains("escape-traversal")) {
            let data = fs::read(&full).unwrap_or_default();
            f.check(data == b"escaped\n", || {
                format!(
                    "{tag}: {p} has content {:?}, expected \"escaped\\n\"",
                    String::from_utf8_lossy(&data)
                )
            });
        }
    }
    for p in strings(&confined["implicit_dirs"]) {
        f.check(inside(mnt, &p).is_dir(), || {
            format!("{tag}: {p} is not a directory inside the mount")
        });
    }
    if let Some(links) = confined["symlinks"].as_object() {
        for (p, target) in links {
            let got = fs::read_link(inside(mnt, p)).ok();
            f.check(got.as_deref() == target.as_str().map(Path::new), || {
                format!("{tag}: symlink {p}: expected target {target}, got {got:?}")
            });
        }
    }
    for group in confined["hardlink_groups"].as_array().into_iter().flatten() {
        let paths = strings(group);
        let metas: Vec<_> = paths
            .iter()
            .map(|p| fs::symlink_metadata(inside(mnt, p)).ok())
            .collect();
        let inodes: Vec<_> = metas
            .iter()
            .map(|m| m.as_ref().map(|m| (m.ino(), m.nlink())))
            .collect();
        let ok = metas
            .iter()
            .all(|m| m.as_ref().is_some_and(|m| m.is_file()))
            && inodes.windows(2).all(|w| w[0] == w[1])
            && inodes[0].is_some_and(|(_, n)| n == paths.len() as u64);
        f.check(ok, || {
            format!("{tag}: hard link group {paths:?} should share one inode with nlink {}, got (ino, nlink) {inodes:?}", paths.len())
        });
    }
}

// Over 100 lines: a table of hostile images, each with the outcome it must get.
#[test]
fn hostile_images_are_refused_or_confined() {
    if !require(&["zstd"]) {
        return;
    }
    let layout = fixtures().join("hostile");
    let descs = hostile_descriptions();
    assert!(
        descs.len() >= 10,
        "hostile.json lists only {} images",
        descs.len()
    );
    let t = TestDir::new("hostile");
    let dst = t.join("dst");
    let work = t.mkdir("work");
    let cache = t.join("cache");
    let mut f = Failures::default();
    let (mut refused, mut confined) = (Vec::new(), Vec::new());

    for d in &descs {
        let tag = d["tag"].as_str().expect("tag");
        let expect = d["expect"].as_str().expect("expect");
        let acceptable = strings(&d["acceptable"]);
        let mnt = t.join(&format!("mnt-{tag}"));
        fs::create_dir_all(&mnt).unwrap();

        let must_not_exist: Vec<PathBuf> = strings(&d["host_must_not_exist"])
            .iter()
            .map(PathBuf::from)
            .collect();
        for p in &must_not_exist {
            assert!(
                fs::symlink_metadata(p).is_err(),
                "{tag}: host path {} exists before the test (left by an earlier escape?); inspect and remove it",
                p.display()
            );
        }
        let unchanged: BTreeMap<PathBuf, Option<String>> = strings(&d["host_must_not_change"])
            .iter()
            .map(|p| (PathBuf::from(p), fingerprint(Path::new(p))))
            .collect();
        let escapes = strings(&d["escape_relative_to_root"]);
        let bases = [
            mnt.clone(),
            dst.clone(),
            dst.join("blobs/sha256"),
            work.clone(),
            cache.clone(),
        ];
        let escape_paths: Vec<PathBuf> = bases
            .iter()
            .flat_map(|b| escapes.iter().map(move |e| b.join(e)))
            .collect();
        for p in &escape_paths {
            assert!(
                fs::symlink_metadata(p).is_err(),
                "{tag}: {} exists before the test",
                p.display()
            );
        }

        let before = snapshot(&dst);
        let tags_before = layout_tags(&dst);
        let out = lamina([
            "convert",
            "--work-dir",
            work.to_str().unwrap(),
            &oci_ref(&layout, tag),
            &oci_ref(&dst, tag),
        ]);
        let leftovers: Vec<_> = fs::read_dir(&work)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .collect();
        f.check(leftovers.is_empty(), || {
            format!("{tag}: --work-dir not cleaned up: {leftovers:?}")
        });

        if !out.status.success() {
            refused.push(tag.to_string());
            f.check(expect == "refuse", || {
                format!("{tag}: refused, but hostile.json expects it to be confined ({}); acceptable: {acceptable:?}\n{}", d["why"], out.describe())
            });
            f.check(out.code() == Some(3), || {
                format!(
                    "{tag}: refused with exit code {:?}, expected 3 (image content refused)\n{}",
                    out.code(),
                    out.describe()
                )
            });
            let msg = out.stderr.to_lowercase();
            let words = problem_words(tag);
            f.check(
                !msg.trim().is_empty() && words.iter().any(|w| msg.contains(w)),
                || {
                    format!(
                        "{tag}: the error message names none of {words:?}\n{}",
                        out.describe()
                    )
                },
            );
            let diff = snapshot_diff(&before, &snapshot(&dst));
            f.check(diff.is_empty(), || {
                format!(
                    "{tag}: a refused conversion changed the destination layout:\n  {}",
                    diff.join("\n  ")
                )
            });
            f.check(layout_tags(&dst) == tags_before, || {
                format!("{tag}: index.json tags changed")
            });

            // Into a destination that does not exist yet: nothing may remain.
            let fresh = t.join(&format!("fresh-{tag}"));
            let out2 = lamina(["convert", &oci_ref(&layout, tag), &oci_ref(&fresh, tag)]);
            f.check(!out2.status.success(), || {
                format!("{tag}: second conversion succeeded:\n{}", out2.describe())
            });
            if fresh.exists() {
                let tags = layout_tags(&fresh);
                let blobs: Vec<_> = fs::read_dir(fresh.join("blobs/sha256"))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path())
                    .collect();
                let staging = staging_leftovers(&fresh);
                f.check(tags.is_empty() && blobs.is_empty() && staging.is_empty(), || {
                    format!("{tag}: refused conversion into a new layout left tags {tags:?}, blobs {blobs:?}, staging {staging:?}")
                });
            }
        } else {
            confined.push(tag.to_string());
            f.check(
                expect == "confine" || acceptable.iter().any(|a| a == "confine"),
                || {
                    format!(
                        "{tag}: converted, but hostile.json says it must be refused ({})\n{}",
                        d["why"],
                        out.describe()
                    )
                },
            );
            let tags = layout_tags(&dst);
            f.check(tags.contains_key(tag), || {
                format!(
                    "{tag}: converted but not tagged in {}: {tags:?}",
                    dst.display()
                )
            });
            f.check(staging_leftovers(&dst).is_empty(), || {
                format!(
                    "{tag}: leftovers in the layout: {:?}",
                    staging_leftovers(&dst)
                )
            });
            if expect == "confine" || acceptable.iter().any(|a| a == "confine") {
                let m = Mount::new(&oci_ref(&dst, tag), &mnt, &cache);
                if let Some(spec) = d.get("confined").filter(|v| !v.is_null()) {
                    check_confined(&mut f, tag, &m.path, spec);
                } else {
                    f.check(false, || {
                        format!("{tag}: converted but hostile.json has no `confined` description")
                    });
                }
                m.unmount();
            }
        }

        for p in &must_not_exist {
            f.check(fs::symlink_metadata(p).is_err(), || {
                format!("{tag}: ESCAPE: host path {} now exists", p.display())
            });
        }
        for (p, fp) in &unchanged {
            let now = fingerprint(p);
            f.check(&now == fp, || {
                format!(
                    "{tag}: ESCAPE: host path {} changed: {fp:?} -> {now:?}",
                    p.display()
                )
            });
        }
        for p in &escape_paths {
            f.check(fs::symlink_metadata(p).is_err(), || {
                format!("{tag}: ESCAPE: {} exists", p.display())
            });
        }
    }
    eprintln!("refused: {refused:?}\nconfined: {confined:?}");
    f.check(!confined.is_empty() && !refused.is_empty(), || {
        format!("expected both outcomes among the hostile images; refused {refused:?}, confined {confined:?}")
    });
    f.finish("hostile images");
}

/// Flip one byte in the middle of the largest data blob of a converted
/// image: `lamina mount` must refuse it with exit 3, mount nothing and leave
/// no cache file (complete or `.partial-*`) for that blob. After the byte is
/// restored, the same cache dir mounts fine.
// Over 100 lines: a corrupt blob refused, then restored and mounted, on one cache dir.
#[test]
fn corrupt_data_blob_is_refused_at_mount() {
    if !require(&["zstd"]) {
        return;
    }
    let t = TestDir::new("corrupt");
    let out = t.join("out");
    let image = oci_ref(&out, "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &image]).ok();
    let manifest = read_manifest(&out, "edge");
    let blob = manifest["layers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| {
            l["mediaType"]
                .as_str()
                .is_some_and(|m| m.contains("lamina.blob"))
        })
        .max_by_key(|l| l["size"].as_u64().unwrap_or(0))
        .unwrap_or_else(|| panic!("no data blob in {manifest}"));
    let digest = blob["digest"].as_str().unwrap().to_string();
    let hex = digest.trim_start_matches("sha256:").to_string();
    let path = blob_path(&out, &digest);
    let original = fs::read(&path).unwrap();
    assert!(
        original.len() > 1 << 20,
        "largest data blob is only {} bytes",
        original.len()
    );
    let mut bad = original.clone();
    let pos = bad.len() / 2;
    bad[pos] ^= 0x5a;
    fs::write(&path, &bad).unwrap();

    let mnt = t.mkdir("mnt");
    let cache = t.join("cache");
    let mut f = Failures::default();
    for attempt in 1..=2 {
        let _unmount_if_mounted = MountWatch(mnt.clone(), cache.clone());
        let o = lamina([
            "mount",
            &image,
            mnt.to_str().unwrap(),
            "--cache-dir",
            cache.to_str().unwrap(),
        ]);
        let mounted = is_mountpoint(&mnt);
        let cached: Vec<String> = cache_files_in(&cache, "blobs")
            .into_iter()
            .filter_map(|p| Some(p.file_name()?.to_string_lossy().into_owned()))
            .filter(|n| n.contains(&hex) || n.contains(".partial"))
            .collect();
        f.check(!o.status.success() && !mounted, || {
            format!(
                "attempt {attempt}: mounted despite the corrupt blob\n{}",
                o.describe()
            )
        });
        f.check(o.code() == Some(3), || {
            format!(
                "attempt {attempt}: expected exit 3 (content refused), got {:?}\n{}",
                o.code(),
                o.describe()
            )
        });
        f.check(o.stderr.contains(&hex) || o.stderr.to_lowercase().contains("digest"), || {
            format!("attempt {attempt}: the message does not name the blob or the digest problem\n{}", o.describe())
        });
        f.check(cached.is_empty(), || {
            format!("attempt {attempt}: cache files left for the corrupt blob: {cached:?}")
        });
    }

    // Restored: the same cache dir must now give the right tree.
    fs::write(&path, &original).unwrap();
    {
        let _unmount_if_mounted = MountWatch(mnt.clone(), cache.clone());
        let o = lamina([
            "mount",
            &image,
            mnt.to_str().unwrap(),
            "--cache-dir",
            cache.to_str().unwrap(),
        ]);
        f.check(o.status.success() && is_mountpoint(&mnt), || {
            format!("mount after restoring the blob failed\n{}", o.describe())
        });
        if is_mountpoint(&mnt) {
            treecmp(&[], &ociunpack(&edge_layout(), "edge"), &mnt);
            lamina([
                "umount",
                mnt.to_str().unwrap(),
                "--cache-dir",
                cache.to_str().unwrap(),
            ])
            .ok();
        }
    }
    f.finish("corrupt data blob");
}

/// The lazy path: with the same corrupted blob, `lamina mount --lazy`
/// succeeds (metadata and index are intact), but no read may ever return
/// wrong bytes: every file reads back equal to the reference or fails with
/// EIO, at least one fails, and the daemon counts bad chunks. After the blob
/// is restored, the same cache dir serves every file correctly (nothing bad
/// was kept).
#[test]
fn corrupt_data_blob_gives_eio_on_lazy_mount() {
    if !require(&["zstd"]) {
        return;
    }
    let t = TestDir::new("corrupt-lazy");
    let out = t.join("out");
    let image = oci_ref(&out, "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &image]).ok();
    let manifest = read_manifest(&out, "edge");
    let blob = manifest["layers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| {
            l["mediaType"]
                .as_str()
                .is_some_and(|m| m.contains("lamina.blob"))
        })
        .max_by_key(|l| l["size"].as_u64().unwrap_or(0))
        .unwrap_or_else(|| panic!("no data blob in {manifest}"));
    let path = blob_path(&out, blob["digest"].as_str().unwrap());
    let original = fs::read(&path).unwrap();
    let mut bad = original.clone();
    let pos = bad.len() / 2;
    bad[pos] ^= 0x5a;
    fs::write(&path, &bad).unwrap();

    let reference = ociunpack(&edge_layout(), "edge");
    let files = regular_files(&reference);
    assert!(files.len() > 5000, "edge has {} regular files", files.len());
    let cache = t.join("cache");
    let mnt = t.join("mnt");
    let lazy = ["--lazy", "--timeout", "20"];

    let m = Mount::with_args(&image, &mnt, &cache, &lazy);
    let mut f = Failures::default();
    let mut eio = 0;
    for rel in &files {
        let want = fs::read(reference.join(rel)).unwrap();
        match fs::read(mnt.join(rel)) {
            Ok(got) => f.check(got == want, || {
                format!(
                    "{}: read {} bytes of WRONG content",
                    rel.display(),
                    got.len()
                )
            }),
            Err(e) if e.raw_os_error() == Some(5) => eio += 1,
            Err(e) => f.check(false, || {
                format!("{}: expected the content or EIO, got {e}", rel.display())
            }),
        }
    }
    f.check(eio > 0, || {
        "no read failed although a data blob is corrupt".into()
    });
    let status = m.status();
    f.check(
        status
            .as_ref()
            .is_some_and(|s| s["status"]["bad_chunks"].as_u64().unwrap_or(0) > 0),
        || format!("lamina status does not count bad chunks: {status:?}"),
    );
    m.unmount();
    f.finish("lazy mount of a corrupt blob");

    fs::write(&path, &original).unwrap();
    let m = Mount::with_args(&image, &mnt, &cache, &lazy);
    treecmp(&[], &reference, &m.path);
    m.unmount();
}

/// Tags `new_tag` in the layout `dir`: the manifest of `tag` plus a boot-pages
/// layer holding `blob` (zstd-compressed boot pages), whose uncompressed
/// size annotation says `claimed`.
fn add_boot_layer(dir: &Path, tag: &str, new_tag: &str, raw: &[u8], blob: &[u8], claimed: u64) {
    let mut manifest = read_manifest(dir, tag);
    let layer_digest = put_blob(dir, blob);
    // A lamina config lists every layer's digest as its diff_id.
    let config_digest = manifest["config"]["digest"].as_str().unwrap().to_string();
    let mut config: Value =
        serde_json::from_slice(&fs::read(blob_path(dir, &config_digest)).unwrap()).unwrap();
    config["rootfs"]["diff_ids"]
        .as_array_mut()
        .unwrap()
        .push(layer_digest.clone().into());
    let config = serde_json::to_vec(&config).unwrap();
    manifest["config"]["digest"] = put_blob(dir, &config).into();
    manifest["config"]["size"] = config.len().into();
    let layer = serde_json::json!({
        "mediaType": "application/vnd.oci.image.layer.lamina.boot.v1+zstd",
        "digest": layer_digest,
        "size": blob.len(),
        "annotations": {
            "dev.lamina.uncompressed.digest": format!("sha256:{}", sha256_hex(raw)),
            "dev.lamina.uncompressed.size": claimed.to_string(),
        },
    });
    manifest["layers"].as_array_mut().unwrap().push(layer);
    tag_manifest(dir, tag, new_tag, &manifest);
}

/// Issue 7: a boot-pages layer whose size annotation says 1 TiB made every
/// worker start preallocate it and abort, so every read got EIO. Now the
/// mount refuses it (exit 3, naming the boot pages) before any holder
/// starts; and a size that lies within the bounds only costs the boot
/// pages: the worker logs it and serves every read from chunks.
#[test]
fn hostile_boot_pages_sizes() {
    if !require(&["zstd"]) {
        return;
    }
    let t = TestDir::new("boot-size");
    let out = t.join("out");
    lamina([
        "convert",
        &oci_ref(&fixtures().join("misc"), "minimal"),
        &oci_ref(&out, "minimal"),
    ])
    .ok();
    // Boot pages with no extents: the 16-byte header alone.
    let raw = b"LAMBOOT\x01\0\0\0\0\0\0\0\0".to_vec();
    let raw_path = t.join("boot.raw");
    fs::write(&raw_path, &raw).unwrap();
    let z_path = t.join("boot.zst");
    run(
        &mut command(
            "zstd",
            [
                OsStr::new("-q"),
                raw_path.as_os_str(),
                OsStr::new("-o"),
                z_path.as_os_str(),
            ],
        ),
        TIMEOUT,
    )
    .ok();
    let blob = fs::read(&z_path).unwrap();
    add_boot_layer(&out, "minimal", "boot-1tib", &raw, &blob, 1 << 40);
    // minimal's cache file has 2 pages: boot pages can be 2 * (4096 + 16) + 16.
    add_boot_layer(&out, "minimal", "boot-lies", &raw, &blob, 8192);

    let cache = t.join("cache");
    let mnt = t.mkdir("mnt");
    let o = lamina([
        "mount",
        "--lazy",
        &oci_ref(&out, "boot-1tib"),
        mnt.to_str().unwrap(),
        "--cache-dir",
        cache.to_str().unwrap(),
    ]);
    let _unmount_if_mounted = MountWatch(mnt.clone(), cache.clone());
    assert!(!is_mountpoint(&mnt), "mounted:\n{}", o.describe());
    assert_eq!(o.code(), Some(3), "{}", o.describe());
    assert!(o.stderr.contains("boot pages"), "{}", o.describe());

    let m = Mount::with_args(
        &oci_ref(&out, "boot-lies"),
        &t.join("mnt2"),
        &cache,
        &["--lazy"],
    );
    treecmp(
        &[],
        &ociunpack(&fixtures().join("misc"), "minimal"),
        &m.path,
    );
    let status = m.status();
    let applied = status
        .as_ref()
        .and_then(|s| s["status"]["boot_page_bytes"].as_u64());
    assert_eq!(applied, Some(0), "status: {status:?}");
    let last = m.unmount();
    assert_eq!(last["last_status"]["failed_misses"], 0, "{last}");
}
