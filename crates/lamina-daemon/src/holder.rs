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
use crate::config::{write_atomic, DaemonConfig};
use crate::protocol::{self, Message};
use crate::relay::{Miss, Relay, Reply, Worker};

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
        Ok((group, worker, watched, superblock)) => {
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
            serve(
                &config,
                config_path,
                group,
                worker,
                watched,
                superblock,
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

type Setup = (FanotifyGroup, Worker, HashMap<(u64, u64), u32>, OwnedFd);

fn setup(config: &DaemonConfig, config_path: &Path) -> io::Result<Setup> {
    let group = FanotifyGroup::new().map_err(|e| {
        io::Error::other(format!(
            "fanotify pre-content group: {e} (lazy mounts need root and Linux 6.14+ with CONFIG_FANOTIFY_ACCESS_PERMISSIONS)"
        ))
    })?;
    let mut watched = HashMap::new();
    for (i, b) in config.blobs.iter().enumerate() {
        if b.complete {
            continue;
        }
        group.watch(&b.cache_path).map_err(|e| {
            io::Error::other(format!(
                "watching {}: {e} (the cache directory's filesystem does not support fanotify pre-content events; ext4 does, tmpfs does not: choose another --cache-dir)",
                b.cache_path.display()
            ))
        })?;
        let m = std::fs::metadata(&b.cache_path)?;
        watched.insert((m.dev(), m.ino()), i as u32);
    }
    let exe = std::env::current_exe()?;
    let worker = Worker::spawn(&exe, config_path, &config.run_dir.join("worker.log"))?;
    let data = mount_options(config)?;
    let mounted = rustix::mount::mount(
        config.metadata_path.as_path(),
        config.mountpoint.as_path(),
        "erofs",
        rustix::mount::MountFlags::RDONLY,
        Some(data.as_c_str()),
    );
    if let Err(e) = mounted {
        worker.kill();
        return Err(io::Error::other(format!(
            "mount {}: {e}",
            config.mountpoint.display()
        )));
    }
    let superblock = watch_superblock(&config.mountpoint).inspect_err(|_| {
        let _ = rustix::mount::unmount(
            config.mountpoint.as_path(),
            rustix::mount::UnmountFlags::DETACH,
        );
    })?;
    Ok((group, worker, watched, superblock))
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
    group: FanotifyGroup,
    worker: Worker,
    mut watched: HashMap<(u64, u64), u32>,
    superblock: OwnedFd,
    mut readahead: Option<BdiReadahead>,
) -> io::Result<()> {
    let group = Rc::new(group);
    let log = config.run_dir.join("worker.log");
    let timeout = Duration::from_secs(config.timeout_secs);
    let mut relay = Relay::new(worker, config_path, &log, timeout);
    let mut buf = Vec::new();
    let paths: Vec<PathBuf> = config.blobs.iter().map(|b| b.cache_path.clone()).collect();

    loop {
        let wait = relay.poll_wait(Duration::from_millis(200));
        let group_fd = group.as_fd();
        let worker_fd = relay.worker_sock();
        let mut fds = [
            PollFd::new(&group_fd, PollFlags::IN),
            PollFd::new(&worker_fd, PollFlags::IN),
            PollFd::new(&superblock, PollFlags::IN),
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
        let unmounted = !fds[2].revents().is_empty() && superblock_gone(&superblock);

        if group_ready {
            take_events(&group, &mut buf, &watched, &mut relay);
        }
        if worker_ready {
            relay.on_worker(
                |sock| hand_over(sock, &group, &superblock),
                |blob| {
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
                },
            );
        }
        relay.expire();

        if unmounted {
            tracing::info!("the filesystem is gone; exiting");
            relay.shutdown();
            // The run dir describes a live mount; there is none now.
            let _ = std::fs::remove_dir_all(&config.run_dir);
            return Ok(());
        }
    }
}

/// Reads the group's events: reads of watched cache files become misses;
/// everything else (the worker's own fills, other files) is allowed.
fn take_events(
    group: &Rc<FanotifyGroup>,
    buf: &mut Vec<u8>,
    watched: &HashMap<(u64, u64), u32>,
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
/// letting reads see zeros.
fn hand_over(sock: BorrowedFd<'_>, group: &FanotifyGroup, superblock: &OwnedFd) {
    let sent = protocol::send(sock, Message::GroupFd, Some(group.as_fd()))
        .and_then(|()| protocol::send(sock, Message::SuperblockFd, Some(superblock.as_fd())));
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
