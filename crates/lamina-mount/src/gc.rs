//! Evicting cache files no live mount uses, least recently used first.

use std::collections::HashSet;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// A record of an eager mount, so gc knows its files are in use.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct EagerRecord {
    /// Mountpoint.
    pub mountpoint: PathBuf,
    /// `st_dev` of the mountpoint while mounted.
    pub dev: u64,
    /// Files the mount uses.
    pub files: Vec<PathBuf>,
}

/// What gc did.
#[derive(Debug, Default, serde::Serialize)]
pub struct GcReport {
    /// Files removed.
    pub evicted: Vec<PathBuf>,
    /// Bytes (allocated) freed.
    pub freed_bytes: u64,
    /// Bytes (allocated) left in the cache.
    pub kept_bytes: u64,
    /// Files kept because a live mount uses them.
    pub in_use: usize,
}

/// The lock that keeps gc from a starting mount's files: `gc.lock` in the
/// cache dir.
const GC_LOCK: &str = "gc.lock";

/// Taken (shared) by a mount from before it creates its cache files until
/// its daemons are ready or its eager record is written: until then no
/// `ready` file names it, and gc would count its files unused. gc holds
/// the lock exclusively while it looks and evicts, so it waits for mounts
/// that are starting, and they for it. Released when dropped.
pub(crate) fn starting_mount(cache_dir: &Path) -> Result<fs::File, crate::MountError> {
    let path = cache_dir.join(GC_LOCK);
    let file = lock(cache_dir, rustix::fs::FlockOperation::LockShared)
        .map_err(|e| crate::MountError::Io(path.clone(), e))?;
    // Fill records are bound to their cache file by inode and birth time
    // (what tells a file put in its place apart): a filesystem that keeps
    // no birth time could not tell, so it is refused, not trusted.
    match lamina_fetch::store::identity(&file) {
        Ok(Some(_)) => Ok(file),
        Ok(None) => Err(crate::MountError::Io(
            cache_dir.to_path_buf(),
            std::io::Error::other(
                "the cache dir's filesystem keeps no birth time (ext4 with 128-byte inodes, \
                 say), so a cache file replaced under a mount could not be told from the one \
                 that was verified: choose a cache dir on ext4 with 256-byte inodes, xfs, \
                 btrfs or tmpfs",
            ),
        )),
        Err(e) => Err(crate::MountError::Io(path, e)),
    }
}

fn lock(cache_dir: &Path, how: rustix::fs::FlockOperation) -> std::io::Result<fs::File> {
    lamina_fetch::private::private_dir(cache_dir)?;
    let path = cache_dir.join(GC_LOCK);
    let file = match lamina_fetch::private::create_new(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            lamina_fetch::private::open_existing(&path)?
        }
        Err(e) => return Err(e),
    };
    rustix::fs::flock(&file, how)?;
    Ok(file)
}

/// Whether a daemon of the lazy mount whose run dir is `run` still serves
/// it: its holder or FUSE daemon (`ready`), or its worker (`status.json`),
/// which serves in the holder's place once the holder died.
fn served(run: &Path) -> bool {
    let ready: Option<lamina_daemon::holder::Ready> = fs::read(run.join("ready"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let worker = fs::read(run.join("status.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|s| s["pid"].as_u64())
        .and_then(|pid| u32::try_from(pid).ok());
    [ready.map(|r| r.pid), worker]
        .into_iter()
        .flatten()
        .any(crate::daemons::is_lamina_daemon)
}

/// Files used by live mounts (lazy: a daemon of it alive; eager: still
/// mounted).
fn files_in_use(cache_dir: &Path) -> HashSet<PathBuf> {
    // Shards (`--share-files`) read their image's cache files while
    // mounted, whichever views stack them.
    let mut used: HashSet<PathBuf> = crate::shared::shard_files(cache_dir).into_iter().collect();
    let Ok(dir) = fs::read_dir(cache_dir.join("mounts")) else {
        return used;
    };
    for entry in dir.flatten() {
        let run = entry.path();
        if let Ok(bytes) = fs::read(run.join("eager.json")) {
            if let Ok(rec) = serde_json::from_slice::<EagerRecord>(&bytes) {
                if fs::metadata(&rec.mountpoint).is_ok_and(|m| m.dev() == rec.dev) {
                    used.extend(rec.files);
                }
            }
            continue;
        }
        if !served(&run) {
            continue;
        }
        // A lazy FUSE mount's daemon reads the lookup table too.
        if let Ok(config) = lamina_fuse::load_config(&run.join("fuse.json")) {
            used.extend(config.lookup_path);
            used.extend(config.lookup_later.map(|l| l.path));
        }
        if let Ok(config) = lamina_daemon::config::DaemonConfig::load(&run.join("config.json")) {
            used.insert(config.metadata_path);
            used.insert(config.index_path);
            for boot in &config.boot_pages {
                used.extend((0..boot.frames().len()).map(|k| boot.frame_path(k)));
            }
            used.extend(config.later_layers.into_iter().map(|l| l.path));
            for b in config.blobs {
                used.insert(b.cache_path.with_extension("fill"));
                used.insert(b.cache_path.with_extension("table"));
                used.insert(b.cache_path);
            }
        }
    }
    used
}

/// The files of `blobs/` and `meta/`, in their trust domains' dirs
/// (`common::domain_id`) or, from before those, right there.
fn cache_files(cache_dir: &Path) -> Vec<(PathBuf, fs::Metadata)> {
    let mut files = Vec::new();
    for sub in ["blobs", "meta"] {
        for (path, meta) in entries(&cache_dir.join(sub)) {
            match meta.is_dir() {
                true => files.extend(entries(&path).filter(|(_, m)| m.is_file())),
                false => files.push((path, meta)),
            }
        }
    }
    files
}

/// The entries of `dir` (none if it cannot be read), not followed.
fn entries(dir: &Path) -> impl Iterator<Item = (PathBuf, fs::Metadata)> {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.path(), fs::symlink_metadata(e.path()).ok()?)))
}

/// The objects dirs (`objects/<layer-hex>.<entries>`): path, mtime and allocated
/// bytes of each, its files included but for links of content objects
/// (counted with those, see [`content_objects`]).
fn object_dirs(cache_dir: &Path) -> Vec<(PathBuf, i64, u64)> {
    let Ok(dir) = fs::read_dir(cache_dir.join("objects")) else {
        return Vec::new();
    };
    let mut dirs = Vec::new();
    for entry in dir.flatten() {
        let Ok(meta) = fs::symlink_metadata(entry.path()) else {
            continue;
        };
        if !meta.is_dir() || entry.file_name() == lamina_fuse::CONTENT_DIR {
            continue;
        }
        let files = fs::read_dir(entry.path()).into_iter().flatten().flatten();
        let bytes = files
            .filter_map(|f| f.metadata().ok())
            .filter(|m| m.nlink() == 1)
            .map(|m| m.blocks() * 512)
            .sum::<u64>();
        dirs.push((entry.path(), meta.mtime(), meta.blocks() * 512 + bytes));
    }
    dirs
}

/// A content object (`objects/content/<domain>/<sha256>`, see `lamina_fuse`).
struct ContentObject {
    /// The object and its record, removed together.
    paths: Vec<PathBuf>,
    mtime: i64,
    bytes: u64,
    /// No image's objects dir links it.
    unused: bool,
}

/// The content objects of the cache, in every trust domain's dir
/// (`objects/content/<domain>`).
fn content_objects(cache_dir: &Path) -> Vec<ContentObject> {
    let content = cache_dir.join("objects").join(lamina_fuse::CONTENT_DIR);
    let files = entries(&content)
        .filter(|(_, m)| m.is_dir())
        .flat_map(|(dir, _)| entries(&dir));
    let mut objects = Vec::new();
    for (path, meta) in files {
        if !meta.is_file() || path.extension().is_some_and(|e| e == "record") {
            continue;
        }
        let record = path.with_extension("record");
        let record_bytes = fs::metadata(&record).map_or(0, |m| m.blocks() * 512);
        objects.push(ContentObject {
            paths: vec![path, record],
            mtime: meta.mtime(),
            bytes: meta.blocks() * 512 + record_bytes,
            unused: meta.nlink() == 1,
        });
    }
    objects
}

/// Whether the objects of `objects/<layer-hex>.<entries>` are in use:
/// exactly while a `<layer-hex>.erofs` of `meta/` (in any trust domain's
/// dir) is.
fn objects_in_use(cache_dir: &Path, objects: &Path, used: &HashSet<PathBuf>) -> bool {
    // `objects/<layer-hex>.<entries>` (see `fuse::objects_dir`).
    let name = objects.file_name().unwrap_or_default().to_string_lossy();
    let layer = name.split('.').next().unwrap_or_default();
    let metadata = format!("{layer}.erofs");
    let meta = cache_dir.join("meta");
    used.iter()
        .any(|p| p.starts_with(&meta) && p.file_name().is_some_and(|n| *n == *metadata))
}

/// Removes unused cache files (and objects dirs), oldest first, until the cache's allocated
/// size is at most `max_size` bytes.
pub fn gc(cache_dir: &Path, max_size: u64) -> std::io::Result<GcReport> {
    let _no_mount_starts = lock(cache_dir, rustix::fs::FlockOperation::LockExclusive)?;
    let used = files_in_use(cache_dir);
    let mut report = GcReport::default();
    // (mtime, allocated bytes, paths removed together)
    let mut candidates: Vec<(i64, u64, Vec<PathBuf>)> = Vec::new();
    let mut total = 0u64;
    {
        for (path, meta) in cache_files(cache_dir) {
            let size = meta.blocks() * 512;
            total += size;
            if path.ends_with(lamina_fetch::locator::LOCATOR_FILE) {
                continue; // bounded, and shared by every entry
            }
            if path.extension().is_some_and(|e| {
                ["fill", "table", "skipped", "named"]
                    .iter()
                    .any(|x| e == *x)
            }) {
                continue; // goes with its cache file
            }
            if used.contains(&path) {
                report.in_use += 1;
                continue;
            }
            let mut group = vec![path.clone()];
            let mut bytes = size;
            // A blob's fill record is `<hex>.fill`, a whole file's
            // `<name>.fill`: each goes with its file.
            let state = if path.extension().is_some_and(|e| e == "cache") {
                path.with_extension("fill")
            } else {
                lamina_fetch::store::whole_record_path(&path)
            };
            // A blob's chunk table (paged index) and ranges lists go with
            // it too.
            let cache = path.extension().is_some_and(|e| e == "cache");
            let more = ["table", "skipped", "named"].map(|e| path.with_extension(e));
            let more = more.into_iter().filter(|_| cache);
            for extra in std::iter::once(state).chain(more) {
                if let Ok(m) = fs::metadata(&extra) {
                    bytes += m.blocks() * 512;
                    group.push(extra);
                }
            }
            candidates.push((meta.mtime(), bytes, group));
        }
    }
    for (dir, mtime, bytes) in object_dirs(cache_dir) {
        total += bytes;
        if objects_in_use(cache_dir, &dir, &used) {
            report.in_use += 1;
        } else {
            candidates.push((mtime, bytes, vec![dir]));
        }
    }
    for object in content_objects(cache_dir) {
        total += object.bytes;
        if object.unused {
            candidates.push((object.mtime, object.bytes, object.paths));
        }
    }
    evict(candidates, &mut total, max_size, &mut report);
    // The objects dirs removed leave content objects no image links.
    let freed: Vec<_> = content_objects(cache_dir)
        .into_iter()
        .filter(|o| o.unused)
        .map(|o| (o.mtime, o.bytes, o.paths))
        .collect();
    evict(freed, &mut total, max_size, &mut report);
    report.kept_bytes = total;
    Ok(report)
}

/// Removes `candidates` (mtime, allocated bytes, paths removed together),
/// oldest first, until `total` is at most `max_size`.
fn evict(
    mut candidates: Vec<(i64, u64, Vec<PathBuf>)>,
    total: &mut u64,
    max_size: u64,
    report: &mut GcReport,
) {
    candidates.sort_by_key(|c| c.0);
    for (_, bytes, group) in candidates {
        if *total <= max_size {
            break;
        }
        for p in group {
            let removed = if p.is_dir() {
                fs::remove_dir_all(&p)
            } else {
                fs::remove_file(&p)
            };
            if removed.is_ok() {
                report.evicted.push(p);
            }
        }
        *total = total.saturating_sub(bytes);
        report.freed_bytes += bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_oldest_unused_first() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = dir.path().join("blobs");
        fs::create_dir_all(&blobs).unwrap();
        for (i, name) in ["a", "b", "c"].iter().enumerate() {
            let p = blobs.join(format!("{name}.cache"));
            fs::write(&p, vec![1u8; 8192]).unwrap();
            fs::write(p.with_extension("fill"), b"s").unwrap();
            fs::write(p.with_extension("skipped"), b"r").unwrap();
            fs::write(p.with_extension("named"), b"n").unwrap();
            let t =
                std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 + i as u64);
            fs::File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(t)
                .unwrap();
        }
        let report = gc(dir.path(), 45_000).unwrap();
        // a is oldest: it and its state go first; then the cache fits.
        assert!(report.evicted.contains(&blobs.join("a.cache")));
        assert!(report.evicted.contains(&blobs.join("a.fill")));
        assert!(report.evicted.contains(&blobs.join("a.skipped")));
        assert!(report.evicted.contains(&blobs.join("a.named")));
        assert!(blobs.join("c.cache").exists() && blobs.join("c.skipped").exists());
        assert!(report.kept_bytes <= 45_000, "{report:?}");
        assert!(blobs.join("b.named").exists(), "{report:?}");
        let report = gc(dir.path(), 0).unwrap();
        assert_eq!(report.kept_bytes, 0);
    }

    /// Point 9 of the many-tenants issue: while a mount is starting (its
    /// cache files made, no `ready` file yet), gc waits; then it evicts.
    #[test]
    fn gc_waits_for_a_starting_mount() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = dir.path().join("blobs");
        fs::create_dir_all(&blobs).unwrap();
        let file = blobs.join("x.cache");
        fs::write(&file, vec![1u8; 8192]).unwrap();
        let starting = starting_mount(dir.path()).unwrap();
        let cache = dir.path().to_path_buf();
        let (tx, rx) = std::sync::mpsc::channel();
        let gc_thread = std::thread::spawn(move || {
            let report = gc(&cache, 0);
            let _ = tx.send(());
            report
        });
        // A gc that did not wait would be done long before this.
        let waited = rx.recv_timeout(std::time::Duration::from_millis(500));
        assert!(waited.is_err(), "gc ran while a mount was starting");
        assert!(file.exists());
        drop(starting);
        let report = gc_thread.join().unwrap().unwrap();
        assert!(report.evicted.contains(&file), "{report:?}");
    }

    /// Issue 42, point 4: a mount whose holder died but whose worker
    /// serves in its place counts as served (its files are kept); once no
    /// daemon of it is left, it does not.
    #[test]
    fn a_mount_served_by_its_worker_alone_counts_as_served() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("mounts/m");
        fs::create_dir_all(&run).unwrap();
        // A dead holder; a live daemon (named as the worker is) in status.json.
        fs::write(run.join("ready"), br#"{"pid": 4194304, "error": null}"#).unwrap();
        assert!(!served(&run));
        let mut worker = std::process::Command::new("sh")
            .args(["-c", "sleep 30", "internal-worker"])
            .spawn()
            .unwrap();
        let status = format!(r#"{{"pid": {}}}"#, worker.id());
        fs::write(run.join("status.json"), status).unwrap();
        // Until the child has exec'd, its cmdline is this test's.
        let started = std::time::Instant::now();
        while !crate::daemons::is_lamina_daemon(worker.id()) && started.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(served(&run), "a mount its worker serves counts as dead");
        worker.kill().unwrap();
        worker.wait().unwrap();
        assert!(!served(&run));
    }

    /// Cache files live in their trust domain's dir (`blobs/<domain>`,
    /// `meta/<domain>`): gc finds and evicts them there, records with them.
    #[test]
    fn files_in_trust_domain_dirs_are_evicted() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = dir.path().join("blobs").join("0123456789abcdef");
        let meta = dir.path().join("meta").join("0123456789abcdef");
        fs::create_dir_all(&blobs).unwrap();
        fs::create_dir_all(&meta).unwrap();
        let (cache, fill, erofs) = (
            blobs.join("a.cache"),
            blobs.join("a.fill"),
            meta.join("m.erofs"),
        );
        for p in [&cache, &fill, &erofs] {
            fs::write(p, vec![1u8; 8192]).unwrap();
        }
        let report = gc(dir.path(), 0).unwrap();
        for p in [&cache, &fill, &erofs] {
            assert!(report.evicted.contains(p), "{p:?} in {report:?}");
        }
        assert_eq!(report.kept_bytes, 0);
    }

    #[test]
    fn a_whole_files_record_goes_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let meta = dir.path().join("meta");
        fs::create_dir_all(&meta).unwrap();
        let file = meta.join("abc.erofs");
        fs::write(&file, vec![1u8; 8192]).unwrap();
        let record = lamina_fetch::store::whole_record_path(&file);
        fs::write(&record, b"r").unwrap();
        let report = gc(dir.path(), 0).unwrap();
        assert!(report.evicted.contains(&file), "{report:?}");
        assert!(report.evicted.contains(&record), "{report:?}");
        assert!(!record.exists());
        assert_eq!(report.kept_bytes, 0);
    }

    /// A live eager mount of `cache` (its mountpoint is the cache dir
    /// itself) that uses the cache file `file`.
    fn live_eager_mount(cache: &Path, file: &str) {
        let run = cache.join("mounts/m");
        fs::create_dir_all(&run).unwrap();
        let record = EagerRecord {
            mountpoint: cache.to_path_buf(),
            dev: fs::metadata(cache).unwrap().dev(),
            files: vec![cache.join(file)],
        };
        fs::write(run.join("eager.json"), serde_json::to_vec(&record).unwrap()).unwrap();
    }

    /// objects/<hex> goes with meta/<hex>.erofs: kept while a live mount
    /// uses that metadata, evicted (whole) when none does.
    #[test]
    fn objects_dirs_are_kept_exactly_while_their_metadata_is_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path();
        for hex in ["used", "unused"] {
            let objects = cache.join("objects").join(hex);
            fs::create_dir_all(&objects).unwrap();
            fs::write(objects.join("12"), vec![1u8; 8192]).unwrap();
            fs::write(objects.join("12.record"), b"r").unwrap();
        }
        live_eager_mount(cache, "meta/used.erofs");

        let report = gc(cache, 0).unwrap();
        assert_eq!(report.evicted, vec![cache.join("objects/unused")]);
        assert!(!cache.join("objects/unused").exists());
        assert!(cache.join("objects/used/12").exists());
        assert_eq!(report.in_use, 1, "{report:?}");
        assert!(report.kept_bytes >= 8192, "{report:?}");
    }

    /// Issue 43: a content object stays while an image's objects dir links
    /// it, and goes once none does, with the dirs gc removed in the same
    /// run; linked objects are counted once.
    #[test]
    fn content_objects_go_once_no_image_links_them() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path();
        let content = cache.join("objects/content/domain");
        fs::create_dir_all(&content).unwrap();
        for (name, linked_from) in [
            ("kept", Some("used")),
            ("freed", Some("unused")),
            ("lone", None),
        ] {
            fs::write(content.join(name), vec![1u8; 8192]).unwrap();
            fs::write(content.join(format!("{name}.record")), b"r").unwrap();
            if let Some(hex) = linked_from {
                let objects = cache.join("objects").join(hex);
                fs::create_dir_all(&objects).unwrap();
                fs::hard_link(content.join(name), objects.join("12")).unwrap();
                fs::write(objects.join("12.record"), b"r").unwrap();
            }
        }
        live_eager_mount(cache, "meta/used.erofs");

        // Every name counted, the two links of objects too, less those.
        let allocated = |p: &Path| fs::symlink_metadata(p).unwrap().blocks() * 512;
        let names: u64 = ["used", "unused"]
            .iter()
            .map(|hex| cache.join("objects").join(hex))
            .flat_map(|d| {
                [
                    allocated(&d),
                    allocated(&d.join("12")),
                    allocated(&d.join("12.record")),
                ]
            })
            .chain(entries(&content).map(|(p, _)| allocated(&p)))
            .sum();
        let report = gc(cache, u64::MAX).unwrap();
        assert!(report.evicted.is_empty());
        let links = allocated(&content.join("kept")) + allocated(&content.join("freed"));
        assert_eq!(report.kept_bytes, names - links, "each object counted once");

        let report = gc(cache, 0).unwrap();
        assert!(report.evicted.contains(&cache.join("objects/unused")));
        for gone in ["lone", "lone.record", "freed", "freed.record"] {
            assert!(
                report.evicted.contains(&content.join(gone)),
                "{gone}: {report:?}"
            );
            assert!(!content.join(gone).exists(), "{gone}");
        }
        assert!(content.join("kept").exists() && content.join("kept.record").exists());
        assert!(cache.join("objects/used/12").exists());
    }
}
