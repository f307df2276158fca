//! The holder: owns the fanotify group for the whole life of the mount.
//!
//! It creates the group, watches the incomplete cache files, mounts the
//! image, and then only pumps events: each miss goes (with the event's fd) to
//! the worker, each answer from the worker goes back to the kernel. It never
//! fetches, so it has little reason to fail. When the worker dies the holder
//! keeps every pending event, starts a new worker and hands them over again:
//! readers wait (up to the timeout, then EIO) and never see the zeros a
//! closed group would let through. It ignores SIGTERM/SIGINT/SIGHUP and exits
//! on its own once the filesystem is unmounted.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;

use lamina_sys::{FanotifyGroup, Response};
use rustix::event::{poll, PollFd, PollFlags};

use crate::bdi::BdiReadahead;
use crate::config::{write_atomic, DaemonConfig, Privileges};
use crate::protocol::{self, Message};
use crate::ready::ReadyRanges;
use crate::relay::{Miss, News, Relay, Reply, Worker};

/// Written to `<run_dir>/ready` once the mount is usable (or failed).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Ready {
    /// Holder pid.
    pub pid: u32,
    /// `None` when mounted; otherwise why not.
    pub error: Option<String>,
}

/// A fanotify event waiting for the worker: answered through the group,
/// by the event's fd, which is closed after the answer.
struct EventReply {
    group: Rc<FanotifyGroup>,
    file: OwnedFd,
    response_fd: i32,
}

impl Reply for EventReply {
    fn attachment(&self) -> (Option<BorrowedFd<'_>>, i32) {
        (Some(self.file.as_fd()), self.response_fd)
    }

    fn answer(self, errno: i32) {
        let response = match errno {
            0 => Response::Allow,
            e => Response::DenyErrno(e),
        };
        answer(&self.group, self.response_fd, response);
    }
}

/// The EROFS mount data naming each cache file as a `device=`, in device
/// order. Fails with the first path the kernel's option parser could not take
/// (a comma splits options; a NUL ends the string).
pub fn device_options<'a>(
    paths: impl IntoIterator<Item = &'a Path>,
) -> Result<std::ffi::CString, PathBuf> {
    let mut data = String::new();
    for path in paths {
        let p = path.to_string_lossy();
        if p.contains(',') || p.contains('\0') {
            return Err(path.to_path_buf());
        }
        if !data.is_empty() {
            data.push(',');
        }
        data.push_str("device=");
        data.push_str(&p);
    }
    std::ffi::CString::new(data).map_err(|_| PathBuf::new())
}

/// The longest string fsconfig(2) takes as a value (it copies 256 bytes at
/// most, the NUL included).
const FSCONFIG_VALUE_MAX: usize = 255;

/// Mounts the EROFS metadata image `metadata` (a regular file: file-backed
/// mode) read-only at `mountpoint`, with `devices`, the cache files in device
/// order, as its extra devices.
///
/// Through fsopen(2), one fsconfig(2) `device` parameter per cache file, and
/// fsmount(2): mount(2) copies at most one page of options, so its
/// `device=` list is cut short past ~35 cache paths and the kernel refuses an
/// image of more data blobs ("extra devices don't match"). mount(2) remains
/// the way where fsopen(2) is missing or a path is longer than fsconfig(2)
/// takes; its options must then fit the page. The caller has checked the
/// paths with [`device_options`].
///
/// Without `acl` (an image whose manifest says no inode has an xattr, so
/// none has an ACL), the mount is `noacl`: the kernel answers ACL requests
/// EOPNOTSUPP without a look at the inode, and `ls -l`, told so once per
/// filesystem, stops asking (one syscall less per file and two per
/// directory; a warm `ls -lR` of a million files took 3.4 s instead of
/// 4.5-5.0 s on the machine of docs/bench-scale.md).
///
/// With `direct`, EROFS reads the cache files with direct I/O (its
/// `directio` option; kernels without it mount without): each page is
/// read once from disk into EROFS's own page cache, not first into the
/// cache file's and then copied. For a cache file that is complete before
/// the mount (an eager mount), not for a lazy one: the worker writes its
/// fills through the page cache, and a direct read of a range just
/// filled would first wait for it to be written back.
pub fn mount_erofs(spec: &ErofsMount<'_>) -> Result<(), rustix::io::Errno> {
    match mount_erofs_once(spec, spec.direct) {
        Err(rustix::io::Errno::INVAL) if spec.direct => mount_erofs_once(spec, false),
        result => result,
    }
}

/// What [`mount_erofs`] mounts, and how.
#[derive(Debug, Clone, Copy)]
pub struct ErofsMount<'a> {
    /// The metadata image (a regular file).
    pub metadata: &'a Path,
    /// Where to mount it.
    pub mountpoint: &'a Path,
    /// The cache files, in device order.
    pub devices: &'a [&'a Path],
    /// Whether an inode may have an ACL (else `noacl`).
    pub acl: bool,
    /// `suid` and `dev`, when asked.
    pub privileges: Privileges,
    /// Direct I/O on the cache files (`directio`).
    pub direct: bool,
}

fn mount_erofs_once(spec: &ErofsMount<'_>, direct: bool) -> Result<(), rustix::io::Errno> {
    let ErofsMount {
        metadata,
        mountpoint,
        devices,
        acl,
        privileges,
        ..
    } = *spec;
    use rustix::mount::{
        fsconfig_create, fsconfig_set_flag, fsconfig_set_string, fsmount, fsopen, move_mount,
        FsMountFlags, FsOpenFlags, MountAttrFlags, MoveMountFlags,
    };
    let short = |p: &Path| p.as_os_str().len() <= FSCONFIG_VALUE_MAX;
    if short(metadata) && devices.iter().all(|d| short(d)) {
        match fsopen("erofs", FsOpenFlags::FSOPEN_CLOEXEC) {
            Ok(fs) => {
                fsconfig_set_string(&fs, "source", metadata)?;
                for d in devices {
                    fsconfig_set_string(&fs, "device", *d)?;
                }
                fsconfig_set_flag(&fs, "ro")?;
                if !acl {
                    fsconfig_set_flag(&fs, "noacl")?;
                }
                if direct {
                    fsconfig_set_flag(&fs, "directio")?;
                }
                fsconfig_create(&fs)?;
                let mut attrs = MountAttrFlags::MOUNT_ATTR_RDONLY;
                if !privileges.suid {
                    attrs |= MountAttrFlags::MOUNT_ATTR_NOSUID;
                }
                if !privileges.dev {
                    attrs |= MountAttrFlags::MOUNT_ATTR_NODEV;
                }
                let mnt = fsmount(&fs, FsMountFlags::FSMOUNT_CLOEXEC, attrs)?;
                return move_mount(
                    &mnt,
                    "",
                    rustix::fs::CWD,
                    mountpoint,
                    MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
                );
            }
            Err(rustix::io::Errno::NOSYS) => {}
            Err(e) => return Err(e),
        }
    }
    let devices = device_options(devices.iter().copied()).map_err(|_| rustix::io::Errno::INVAL)?;
    let flags = [(!acl, "noacl,"), (direct, "directio,")];
    let prefix: String = flags.iter().filter(|f| f.0).map(|f| f.1).collect();
    let data = std::ffi::CString::new(format!("{prefix}{}", devices.to_string_lossy()))
        .map_err(|_| rustix::io::Errno::INVAL)?;
    // The kernel reads one page of options and drops the rest unseen.
    if data.as_bytes().len() >= 4096 {
        return Err(rustix::io::Errno::TOOBIG);
    }
    let mut flags = rustix::mount::MountFlags::RDONLY;
    if !privileges.suid {
        flags |= rustix::mount::MountFlags::NOSUID;
    }
    if !privileges.dev {
        flags |= rustix::mount::MountFlags::NODEV;
    }
    rustix::mount::mount(metadata, mountpoint, "erofs", flags, Some(data.as_c_str()))
}

fn mount_options(config: &DaemonConfig) -> io::Result<std::ffi::CString> {
    device_options(config.blobs.iter().map(|b| b.cache_path.as_path()))
        .map_err(|p| io::Error::other(format!("cache path {} contains a comma", p.display())))
}

fn write_ready(config: &DaemonConfig, error: Option<String>) -> io::Result<()> {
    let ready = Ready {
        pid: std::process::id(),
        error,
    };
    write_atomic(
        &config.run_dir.join("ready"),
        &serde_json::to_vec(&ready).map_err(io::Error::other)?,
    )
}

/// Runs the holder for the mount described by `config_path`. Returns when
/// the filesystem has been unmounted, or with an error (also written to the
/// ready file) if the mount could not be set up.
pub fn run_holder(config_path: &Path) -> io::Result<()> {
    let _ = rustix::process::setsid();
    lamina_sys::ignore_termination_signals()?;
    // The OOM killer must never pick the process whose death lets readers
    // see holes as zeros.
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", "-1000") {
        tracing::warn!("oom_score_adj: {e}");
    }
    let config = DaemonConfig::load(config_path)?;
    match setup(&config, config_path) {
        Ok((group, worker, watched, root, files)) => {
            let readahead = if watched.is_empty() {
                None
            } else {
                config.readahead_kb.and_then(|kb| {
                    BdiReadahead::lower(&config.mountpoint, kb)
                        .map_err(|e| tracing::warn!("read_ahead_kb left as is: {e}"))
                        .ok()
                })
            };
            // Mounted: from here on the holder never leaves while the
            // filesystem lives, whatever fails.
            tracing::info!(
                image = %config.image,
                mountpoint = %config.mountpoint.display(),
                watched = watched.len(),
                "mounted; serving"
            );
            if let Err(e) = write_ready(&config, None) {
                tracing::warn!("writing the ready file: {e}; serving anyway");
            }
            // Off the mount's path (making and joining cgroups measured
            // 15 to 20 ms of a cold start's mount); workers restarted
            // later are born in the holder's cgroup.
            let (run_dir, worker_pid) = (config.run_dir.clone(), worker.pid());
            std::thread::spawn(move || {
                crate::bounds::enter_mount_cgroup(&run_dir, &[worker_pid]);
            });
            serve(
                &config,
                config_path,
                (group, worker, watched, root, files),
                readahead,
            )
        }
        Err(e) => {
            let msg = e.to_string();
            write_ready(&config, Some(msg.clone()))?;
            Err(io::Error::other(msg))
        }
    }
}

/// The group, the worker, the watched cache files (by device and inode:
/// blob), the mount's root, and the mount's cache files.
type Setup = (
    FanotifyGroup,
    Worker,
    HashMap<(u64, u64), u32>,
    Root,
    Vec<std::fs::File>,
);

fn setup(config: &DaemonConfig, config_path: &Path) -> io::Result<Setup> {
    let group = FanotifyGroup::new().map_err(|e| {
        io::Error::other(format!(
            "fanotify pre-content group: {e} (lazy mounts need root and Linux 6.14+ with CONFIG_FANOTIFY_ACCESS_PERMISSIONS)"
        ))
    })?;
    // The holder acts on the cache files the mount made, never on a name
    // looked up again: each is opened and checked once, then marked and
    // mounted through its fd (`/proc/self/fd/N`).
    let files = config
        .blobs
        .iter()
        .map(|b| b.open_checked())
        .collect::<io::Result<Vec<_>>>()?;
    let fd_paths: Vec<PathBuf> = files.iter().map(lamina_sys::fd_path).collect();
    let mut watched = HashMap::new();
    for (i, b) in config.blobs.iter().enumerate() {
        if b.complete {
            continue;
        }
        group.watch(&fd_paths[i]).map_err(|e| {
            io::Error::other(format!(
                "watching {}: {e} (the cache directory's filesystem does not support fanotify pre-content events; ext4 does, tmpfs does not: choose another --cache-dir)",
                b.cache_path.display()
            ))
        })?;
        let m = files[i].metadata()?;
        watched.insert((m.dev(), m.ino()), i as u32);
    }
    let mut files = files;
    let mut fd_paths = fd_paths;
    for borrowed in &config.borrowed {
        let file = borrowed.open_checked()?;
        fd_paths.push(lamina_sys::fd_path(&file));
        files.push(file);
    }
    let worker = Worker::spawn(config_path, &config.run_dir.join("worker.log"))?;
    mount_options(config)?;
    let devices: Vec<&Path> = fd_paths.iter().map(PathBuf::as_path).collect();
    let mounted = mount_erofs(&ErofsMount {
        metadata: config
            .mount_metadata
            .as_deref()
            .unwrap_or(&config.metadata_path),
        mountpoint: &config.mountpoint,
        devices: &devices,
        acl: config.xattrs,
        privileges: config.privileges,
        direct: false, // a lazy mount's cache files are written while read
    });
    if let Err(e) = mounted {
        worker.kill();
        return Err(io::Error::other(format!(
            "mount {}: {e}",
            config.mountpoint.display()
        )));
    }
    let root = watch_superblock(&config.mountpoint)
        .and_then(|watch| {
            let dev = rustix::fs::stat(&config.mountpoint)?.st_dev;
            Ok(Root { watch, dev })
        })
        .inspect_err(|_| {
            let _ = rustix::mount::unmount(
                config.mountpoint.as_path(),
                rustix::mount::UnmountFlags::DETACH,
            );
        })?;
    // The worker gets the group before the mount is reported ready, not
    // only when it says hello: a holder killed in between would leave
    // nobody to answer the group, and reads would see the cache files'
    // holes as zeros. It gets them again at hello (that copy is dropped).
    hand_over(worker.sock(), &group, &root);
    Ok((group, worker, watched, root, files))
}

/// The root of the mount just made: a watch on it, and its device.
pub(crate) struct Root {
    watch: OwnedFd,
    dev: u64,
}

/// An inotify watch on the root of the mount just made. It reports
/// `IN_UNMOUNT` when the superblock dies: not at `umount -l` while a file is
/// open, not when something is mounted over the mountpoint, not while an
/// overlay uses the tree, but when nobody can read it any more.
fn watch_superblock(mountpoint: &Path) -> io::Result<OwnedFd> {
    use rustix::fs::inotify;
    let fd = inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)?;
    // A read-only root never changes: the watch only waits for the unmount.
    inotify::add_watch(&fd, mountpoint, inotify::WatchFlags::DELETE_SELF)?;
    Ok(fd)
}

/// Whether the superblock watched by `fd` is gone (drains its events).
pub(crate) fn superblock_gone(fd: &OwnedFd) -> bool {
    use rustix::fs::inotify::{ReadFlags, Reader};
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 1024];
    let mut reader = Reader::new(fd, &mut buf);
    let mut gone = false;
    while let Ok(event) = reader.next() {
        gone |= event
            .events()
            .intersects(ReadFlags::UNMOUNT | ReadFlags::IGNORED);
    }
    gone
}

fn serve(
    config: &DaemonConfig,
    config_path: &Path,
    (group, worker, mut watched, root, files): Setup,
    mut readahead: Option<BdiReadahead>,
) -> io::Result<()> {
    let group = Rc::new(group);
    let log = config.run_dir.join("worker.log");
    let timeout = Duration::from_secs(config.timeout_secs);
    let mut relay = Relay::new(worker, config_path, &log, timeout);
    let mut buf = Vec::new();
    // Unwatched through the files the mount was made with.
    let paths: Vec<PathBuf> = files.iter().map(lamina_sys::fd_path).collect();
    let mut ready = ReadyRanges::default();
    let mut reported = ((0, 0), std::time::Instant::now());

    loop {
        let wait = relay.poll_wait(Duration::from_millis(200));
        let group_fd = group.as_fd();
        let worker_fd = relay.worker_sock();
        let mut fds = [
            PollFd::new(&group_fd, PollFlags::IN),
            PollFd::new(&worker_fd, PollFlags::IN),
            PollFd::new(&root.watch, PollFlags::IN),
        ];
        let ts = rustix::event::Timespec {
            tv_sec: wait.as_secs() as i64,
            tv_nsec: i64::from(wait.subsec_nanos()),
        };
        match poll(&mut fds, Some(&ts)) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                // Never leave: exiting would close the group and let readers
                // see zeros. Log, breathe, and go on.
                tracing::warn!("poll: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let group_ready = fds[0].revents().contains(PollFlags::IN);
        let worker_ready = !fds[1].revents().is_empty();
        let unmounted = !fds[2].revents().is_empty() && superblock_gone(&root.watch);

        if group_ready {
            take_events(&group, &mut buf, (&watched, &mut ready), &mut relay);
        }
        if worker_ready {
            relay.on_worker(
                |sock| hand_over(sock, &group, &root),
                |news| match news {
                    News::Ready { blob, range } => ready.add(blob, range),
                    News::Complete(blob) => {
                        ready.forget(blob);
                        let Some(path) = paths.get(blob as usize) else {
                            return;
                        };
                        match group.unwatch(path) {
                            Ok(()) => watched.retain(|_, b| *b != blob),
                            Err(e) => tracing::warn!("unwatch {}: {e}", path.display()),
                        }
                        if watched.is_empty() {
                            if let Some(r) = readahead.take() {
                                r.restore();
                            }
                        }
                    }
                },
            );
        }
        relay.expire();
        let counts = (ready.answered, ready.worker_events);
        if counts != reported.0 && (unmounted || reported.1.elapsed() >= Duration::from_millis(100))
        {
            report_answered(&relay, counts);
            reported = (counts, std::time::Instant::now());
        }

        if unmounted {
            tracing::info!("the filesystem is gone; exiting");
            relay.shutdown();
            // The run dir describes a live mount; there is none now.
            let _ = std::fs::remove_dir_all(&config.run_dir);
            return Ok(());
        }
    }
}

/// Tells the worker how many events the holder answered itself (its
/// status reports them); a lost report is made good by the next.
fn report_answered(relay: &Relay<EventReply>, (readers, worker): (u64, u64)) {
    let answered = Message::Answered { readers, worker };
    if let Err(e) = protocol::send(relay.worker_sock(), answered, None) {
        tracing::debug!("reporting answered events: {e}");
    }
}

/// Reads the group's events: reads of watched cache files become misses,
/// unless their range is known ready; everything else (the worker's own
/// fills, other files) is allowed.
fn take_events(
    group: &Rc<FanotifyGroup>,
    buf: &mut Vec<u8>,
    (watched, ready): (&HashMap<(u64, u64), u32>, &mut ReadyRanges),
    relay: &mut Relay<EventReply>,
) {
    let worker_pid = relay.worker_pid();
    let events = group.read_events(buf).unwrap_or_else(|e| {
        tracing::warn!("reading events: {e}");
        std::thread::sleep(Duration::from_millis(10));
        Vec::new()
    });
    for ev in events {
        let Some(file) = ev.file else {
            tracing::error!("fanotify queue overflow");
            continue;
        };
        // The worker's own prefetch writes are verified data: let them through.
        if ev.pid == worker_pid {
            ready.worker_events += 1;
            answer(group, ev.response_fd, Response::Allow);
            continue;
        }
        let stat = match rustix::fs::fstat(&file) {
            Ok(stat) => stat,
            Err(e) => {
                tracing::error!("fstat of an event file: {e}; reader gets EIO");
                answer(group, ev.response_fd, Response::DenyErrno(libc::EIO));
                continue;
            }
        };
        let Some(&blob) = watched.get(&(stat.st_dev, stat.st_ino)) else {
            answer(group, ev.response_fd, Response::Allow);
            continue;
        };
        let (offset, count) = ev.range.unwrap_or((0, stat.st_size as u64));
        if ready.covers(blob, offset, count) {
            ready.answered += 1;
            answer(group, ev.response_fd, Response::Allow);
            continue;
        }
        relay.submit(Miss {
            blob,
            offset,
            count,
            pid: ev.pid,
            reply: EventReply {
                group: group.clone(),
                file,
                response_fd: ev.response_fd,
            },
        });
    }
}

/// Gives the worker copies of the group and of the superblock watch: if the
/// holder is killed, the group stays open in the worker, which finishes the
/// misses in hand and fails later reads with EIO, instead of the kernel
/// letting reads see zeros. And the mount's device, by which the worker
/// knows the mount it warms boot pages through (`crate::warm`).
fn hand_over(sock: BorrowedFd<'_>, group: &FanotifyGroup, root: &Root) {
    let sent = protocol::send(sock, Message::GroupFd, Some(group.as_fd()))
        .and_then(|()| protocol::send(sock, Message::SuperblockFd, Some(root.watch.as_fd())))
        .and_then(|()| protocol::send(sock, Message::RootDev { dev: root.dev }, None));
    if let Err(e) = sent {
        tracing::warn!("handing the group to the worker: {e}");
    }
}

/// Answers an event; a failed answer is logged, never fatal (the holder
/// must outlive every error while the mount exists).
fn answer(group: &FanotifyGroup, fd: i32, response: Response) {
    if let Err(e) = group.respond(fd, response) {
        tracing::error!("answering event fd {fd}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lamina_format::erofs::{write_image, write_image_with, ChunkAddr, Device, FileChunks};
    use lamina_tree::{DirEntry, Metadata, Node, NodeId, NodeKind, Tree};

    /// Unmounts on drop, so a failed assertion leaves nothing mounted.
    struct Unmount(PathBuf);

    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH);
        }
    }

    /// 120 cache files under a long directory name: as `device=` options
    /// they take ~20 KB, five times the page mount(2) reads, and the kernel
    /// saw only the first ~25 ("extra devices don't match"). Every device
    /// reaches it, and each file reads its own device's bytes (issue 10).
    /// Whether this test may mount: root, or told to skip (and says so).
    fn may_mount() -> bool {
        if rustix::process::geteuid().is_root() {
            return true;
        }
        if std::env::var("LAMINA_SKIP_PRIVILEGED").as_deref() == Ok("1") {
            println!("skipped: mounting EROFS needs root");
            return false;
        }
        panic!("this test mounts EROFS: run it as root, or set LAMINA_SKIP_PRIVILEGED=1");
    }

    fn add(tree: &mut Tree<FileChunks>, dir: NodeId, name: &[u8], node: Node<FileChunks>) {
        let id = tree.add_node(node);
        if let NodeKind::Directory { entries } = &mut tree.nodes[dir].kind {
            entries.insert(name.to_vec(), DirEntry { node: id, layer: 0 });
        }
    }

    fn regular(size: u64, chunk_bits: u8, blocks: &[u32]) -> Node<FileChunks> {
        let chunks = blocks
            .iter()
            .map(|&blkaddr| ChunkAddr::Data { device: 1, blkaddr })
            .collect();
        Node {
            meta: Metadata {
                mode: 0o644,
                ..Metadata::default()
            },
            kind: NodeKind::Regular {
                size,
                content: FileChunks { chunk_bits, chunks },
            },
        }
    }

    /// An image of 512-byte blocks (how a tar index points into a layer's
    /// tar, docs/format.md) mounts file-backed, and its files read the
    /// bytes at their 512-byte-aligned places in the device; a directory
    /// over several blocks and a symlink longer than a block read back.
    #[test]
    fn mount_erofs_takes_512_byte_blocks() {
        if !may_mount() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let blob: Vec<u8> = (0..65536usize).map(|i| (i * 7 + i / 512) as u8).collect();
        let cache = tmp.path().join("layer.tar");
        std::fs::write(&cache, &blob).unwrap();
        let mut tree: Tree<FileChunks> = Tree::new();
        let root = tree.root;
        add(&mut tree, root, b"a", regular(1000, 9, &[3, 4]));
        add(&mut tree, root, b"b", regular(5000, 12, &[20, 28]));
        let names: Vec<String> = (0..200).map(|i| format!("entry-{i:04}")).collect();
        let dir = tree.add_node(Node {
            meta: Metadata {
                mode: 0o755,
                ..Metadata::default()
            },
            kind: NodeKind::Directory {
                entries: Default::default(),
            },
        });
        if let NodeKind::Directory { entries } = &mut tree.nodes[root].kind {
            entries.insert(
                b"dir".to_vec(),
                DirEntry {
                    node: dir,
                    layer: 0,
                },
            );
        }
        for name in &names {
            add(&mut tree, dir, name.as_bytes(), regular(0, 9, &[]));
        }
        let target = vec![b'z'; 700];
        let link = Node {
            meta: Metadata::default(),
            kind: NodeKind::Symlink {
                target: target.clone(),
            },
        };
        add(&mut tree, root, b"link", link);
        let devices = [Device {
            tag: "layer".into(),
            blocks: 128,
        }];
        let (image, _) = write_image_with(&tree, &devices, 9).unwrap();
        let meta = tmp.path().join("meta.erofs");
        std::fs::write(&meta, image).unwrap();
        let mnt = tmp.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let spec = ErofsMount {
            metadata: &meta,
            mountpoint: &mnt,
            devices: &[cache.as_path()],
            acl: true,
            privileges: Privileges::default(),
            direct: false,
        };
        mount_erofs(&spec).unwrap();
        let _guard = Unmount(mnt.clone());
        // a: two 512-byte chunks from block 3; b: a 4 KiB chunk from block
        // 20 (blocks 20 to 27) and 904 bytes from block 28.
        let a = std::fs::read(mnt.join("a")).unwrap();
        assert!(a == blob[1536..2536], "a reads other bytes");
        let mut b = blob[20 * 512..28 * 512].to_vec();
        b.extend_from_slice(&blob[28 * 512..28 * 512 + 904]);
        let got = std::fs::read(mnt.join("b")).unwrap();
        assert!(got == b, "b reads other bytes");
        let mut listed: Vec<String> = std::fs::read_dir(mnt.join("dir"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        listed.sort();
        assert_eq!(listed, names);
        let read_link = std::fs::read_link(mnt.join("link")).unwrap();
        let read_link = std::os::unix::ffi::OsStrExt::as_bytes(read_link.as_os_str());
        assert_eq!(read_link, target.as_slice());
        rustix::mount::unmount(&mnt, rustix::mount::UnmountFlags::empty()).unwrap();
    }

    #[test]
    fn mount_erofs_takes_more_devices_than_a_page_of_options() {
        if !may_mount() {
            return;
        }
        const N: u16 = 120;
        let tmp = tempfile::tempdir().unwrap();
        let blobs = tmp.path().join("b".repeat(140));
        std::fs::create_dir(&blobs).unwrap();
        let mut tree: Tree<FileChunks> = Tree::new();
        let mut devices = Vec::new();
        let mut paths = Vec::new();
        for i in 0..N {
            let path = blobs.join(format!("{i:03}.cache"));
            std::fs::write(&path, vec![i as u8 + 1; 4096]).unwrap();
            paths.push(path);
            devices.push(Device {
                tag: format!("{i:064}"),
                blocks: 1,
            });
            let node = tree.add_node(Node {
                meta: Metadata {
                    mode: 0o644,
                    ..Metadata::default()
                },
                kind: NodeKind::Regular {
                    size: 4096,
                    content: FileChunks {
                        chunk_bits: 12,
                        chunks: vec![ChunkAddr::Data {
                            device: i + 1,
                            blkaddr: 0,
                        }],
                    },
                },
            });
            let root = tree.root;
            if let NodeKind::Directory { entries } = &mut tree.nodes[root].kind {
                entries.insert(format!("f{i:03}").into_bytes(), DirEntry { node, layer: 0 });
            }
        }
        let (image, _) = write_image(&tree, &devices).unwrap();
        let meta = tmp.path().join("meta.erofs");
        std::fs::write(&meta, image).unwrap();
        let mnt = tmp.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let devices: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
        let options = device_options(devices.iter().copied()).unwrap();
        assert!(
            options.as_bytes().len() > 4 * 4096,
            "{} bytes",
            options.as_bytes().len()
        );

        let spec = ErofsMount {
            metadata: &meta,
            mountpoint: &mnt,
            devices: &devices,
            acl: true,
            privileges: Privileges::default(),
            direct: false,
        };
        mount_erofs(&spec).unwrap();
        let _guard = Unmount(mnt.clone());
        for i in 0..N {
            let got = std::fs::read(mnt.join(format!("f{i:03}"))).unwrap();
            assert_eq!(got, vec![i as u8 + 1; 4096], "f{i:03}");
        }
        rustix::mount::unmount(&mnt, rustix::mount::UnmountFlags::empty()).unwrap();
    }
}
