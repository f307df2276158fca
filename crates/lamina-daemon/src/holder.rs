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
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lamina_sys::{FanotifyGroup, Response};
use rustix::event::{poll, PollFd, PollFlags};
use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};

use crate::config::{write_atomic, DaemonConfig};
use crate::protocol::{self, Message};

/// Written to `<run_dir>/ready` once the mount is usable (or failed).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Ready {
    /// Holder pid.
    pub pid: u32,
    /// `None` when mounted; otherwise why not.
    pub error: Option<String>,
}

struct PendingMiss {
    file: OwnedFd,
    response_fd: i32,
    blob: u32,
    offset: u64,
    count: u64,
    /// The reading process.
    pid: i32,
    deadline: Instant,
    sent: bool,
}

struct Worker {
    child: Child,
    sock: OwnedFd,
    ready: bool,
}

fn spawn_worker(exe: &Path, config_path: &Path, log: &Path) -> io::Result<Worker> {
    let (ours, theirs) = socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    // The worker's end must survive exec; the holder is single-threaded, so
    // no other thread can fork in between.
    rustix::io::fcntl_setfd(&theirs, rustix::io::FdFlags::empty())?;
    let log = File::options()
        .create(true)
        .append(true)
        .mode(lamina_fetch::private::FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(log)?;
    let child = Command::new(exe)
        .arg("internal-worker")
        .arg(config_path)
        .arg(rustix::fd::AsRawFd::as_raw_fd(&theirs).to_string())
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?;
    drop(theirs);
    Ok(Worker {
        child,
        sock: ours,
        ready: false,
    })
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
                    Readahead::lower(&config.mountpoint, kb)
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

/// The mount's readahead, lowered while blobs are incomplete and put back
/// when the last one completes (from then on reads never leave the kernel).
#[derive(Debug)]
struct Readahead {
    path: PathBuf,
    original: String,
}

impl Readahead {
    fn lower(mountpoint: &Path, kb: u32) -> io::Result<Readahead> {
        let root = File::open(mountpoint)?;
        let name = lamina_sys::fs_sysfs_path(root.as_fd())?;
        let bdi = name.rsplit('/').next().unwrap_or_default();
        let path = Path::new("/sys/class/bdi").join(bdi).join("read_ahead_kb");
        let original = std::fs::read_to_string(&path)?.trim().to_string();
        std::fs::write(&path, kb.to_string())?;
        tracing::info!(
            "{} {original} -> {kb} until every blob is complete",
            path.display()
        );
        Ok(Readahead { path, original })
    }

    fn restore(self) {
        if let Err(e) = std::fs::write(&self.path, &self.original) {
            tracing::warn!("restoring {}: {e}", self.path.display());
        }
    }
}

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
    let worker = spawn_worker(&exe, config_path, &config.run_dir.join("worker.log"))?;
    let data = mount_options(config)?;
    let mounted = rustix::mount::mount(
        config.metadata_path.as_path(),
        config.mountpoint.as_path(),
        "erofs",
        rustix::mount::MountFlags::RDONLY,
        Some(data.as_c_str()),
    );
    if let Err(e) = mounted {
        let mut w = worker;
        let _ = w.child.kill();
        let _ = w.child.wait();
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
    mut worker: Worker,
    mut watched: HashMap<(u64, u64), u32>,
    superblock: OwnedFd,
    mut readahead: Option<Readahead>,
) -> io::Result<()> {
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
    let log = config.run_dir.join("worker.log");
    let timeout = Duration::from_secs(config.timeout_secs);
    let mut pending: HashMap<u64, PendingMiss> = HashMap::new();
    let mut next_id = 1u64;
    let mut buf = Vec::new();
    let mut last_respawn = Instant::now();
    let mut respawn_delay = Duration::from_millis(250);
    let mut failed: Vec<FailedRange> = Vec::new();
    let paths: Vec<PathBuf> = config.blobs.iter().map(|b| b.cache_path.clone()).collect();

    loop {
        let now = Instant::now();
        let next_deadline = pending.values().map(|p| p.deadline).min();
        let wait = next_deadline
            .map(|d| d.saturating_duration_since(now))
            .unwrap_or(Duration::from_millis(200))
            .min(Duration::from_millis(200));
        let group_fd = group.as_fd();
        let mut fds = [
            PollFd::new(&group_fd, PollFlags::IN),
            PollFd::new(&worker.sock, PollFlags::IN),
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
            let worker_pid = worker.child.id() as i32;
            let events = group.read_events(&mut buf).unwrap_or_else(|e| {
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
                    answer(&group, ev.response_fd, Response::Allow);
                    continue;
                }
                let stat = match rustix::fs::fstat(&file) {
                    Ok(stat) => stat,
                    Err(e) => {
                        tracing::error!("fstat of an event file: {e}; reader gets EIO");
                        answer(&group, ev.response_fd, Response::DenyErrno(libc::EIO));
                        continue;
                    }
                };
                let key = (stat.st_dev, stat.st_ino);
                let Some(&blob) = watched.get(&key) else {
                    answer(&group, ev.response_fd, Response::Allow);
                    continue;
                };
                let (offset, count) = ev.range.unwrap_or((0, stat.st_size as u64));
                // A read that got EIO is retried by the kernel at once
                // (readahead, then the page itself), and one read(2) can
                // need several ranges in turn: a miss that meets the failed
                // range, or comes from the process whose read failed, fails
                // at once, so a reader waits at most one timeout. Other
                // readers' ranges go on. The memory is short, so a read made
                // after the source recovered goes to the network again.
                let now = Instant::now();
                failed.retain(|f| f.until > now);
                if failed.iter().any(|f| f.covers(blob, offset, count, ev.pid)) {
                    answer(&group, ev.response_fd, Response::DenyErrno(libc::EIO));
                    continue;
                }
                let id = next_id;
                next_id += 1;
                let mut miss = PendingMiss {
                    file,
                    response_fd: ev.response_fd,
                    blob,
                    offset,
                    count,
                    pid: ev.pid,
                    deadline: Instant::now() + timeout,
                    sent: false,
                };
                tracing::debug!(id, blob, offset, count, pid = ev.pid, "miss");
                if worker.ready {
                    miss.sent = forward(&worker, id, &miss);
                }
                pending.insert(id, miss);
            }
        }

        if worker_ready {
            match protocol::recv(worker.sock.as_fd()) {
                Ok(Some((msg, _))) => match msg {
                    Message::Hello => {
                        tracing::info!(pid = worker.child.id(), "worker ready");
                        worker.ready = true;
                        hand_over(&worker, &group, &superblock);
                        for (id, miss) in pending.iter_mut().filter(|(_, m)| !m.sent) {
                            miss.sent = forward(&worker, *id, miss);
                        }
                    }
                    Message::Done { id, errno } => {
                        if let Some(miss) = pending.remove(&id) {
                            let response = if errno == 0 {
                                Response::Allow
                            } else {
                                failed.push(FailedRange::after(&miss));
                                Response::DenyErrno(errno)
                            };
                            answer(&group, miss.response_fd, response);
                        }
                    }
                    Message::Complete { blob } => {
                        if let Some(path) = paths.get(blob as usize) {
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
                    }
                    Message::Miss { .. }
                    | Message::GroupFd
                    | Message::SuperblockFd
                    | Message::Shutdown => {}
                },
                Ok(None) | Err(_) => {
                    // The worker is gone: keep the events, start another.
                    let _ = worker.child.kill();
                    let status = worker.child.wait();
                    tracing::warn!("worker exited ({status:?}); restarting");
                    // Back off while workers keep dying young (0.5 s up to 8 s);
                    // pending readers still get EIO at their deadline.
                    if last_respawn.elapsed() < Duration::from_secs(10) {
                        respawn_delay = (respawn_delay * 2).min(Duration::from_secs(8));
                    } else {
                        respawn_delay = Duration::from_millis(500);
                    }
                    let wake = Instant::now() + respawn_delay;
                    while Instant::now() < wake {
                        expire(&group, &mut pending, &mut failed);
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    last_respawn = Instant::now();
                    worker = loop {
                        match spawn_worker(&exe, config_path, &log) {
                            Ok(w) => break w,
                            Err(e) => {
                                tracing::warn!("starting a worker: {e}; retrying");
                                for _ in 0..20 {
                                    expire(&group, &mut pending, &mut failed);
                                    std::thread::sleep(Duration::from_millis(50));
                                }
                            }
                        }
                    };
                    for miss in pending.values_mut() {
                        miss.sent = false;
                    }
                }
            }
        }

        expire(&group, &mut pending, &mut failed);

        if unmounted {
            // Nobody can read any more: what is pending cannot be waited for.
            for (_, miss) in pending.drain() {
                let _ = group.respond(miss.response_fd, Response::DenyErrno(libc::EIO));
            }
            tracing::info!("the filesystem is gone; exiting");
            stop_worker(worker);
            // The run dir describes a live mount; there is none now.
            let _ = std::fs::remove_dir_all(&config.run_dir);
            return Ok(());
        }
    }
}

/// Gives the worker copies of the group and of the superblock watch: if the
/// holder is killed, the group stays open in the worker, which finishes the
/// misses in hand and fails later reads with EIO, instead of the kernel
/// letting reads see zeros.
fn hand_over(worker: &Worker, group: &FanotifyGroup, superblock: &OwnedFd) {
    let sent =
        protocol::send(worker.sock.as_fd(), Message::GroupFd, Some(group.as_fd())).and_then(|()| {
            protocol::send(
                worker.sock.as_fd(),
                Message::SuperblockFd,
                Some(superblock.as_fd()),
            )
        });
    if let Err(e) = sent {
        tracing::warn!("handing the group to the worker: {e}");
    }
}

/// Tells the worker the mount is gone and closes its socket, so that it
/// saves its fill records and exits; kills it if it has not within two
/// seconds.
fn stop_worker(worker: Worker) {
    let Worker {
        mut child, sock, ..
    } = worker;
    if let Err(e) = protocol::send_owned(&sock, Message::Shutdown, None) {
        tracing::warn!("telling the worker to stop: {e}");
    }
    drop(sock);
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A range whose read just failed; until `until`, new misses of that blob
/// that meet it, or come from the same reading process, fail at once.
struct FailedRange {
    blob: u32,
    start: u64,
    end: u64,
    pid: i32,
    until: Instant,
}

impl FailedRange {
    /// Long enough to cover the kernel's immediate retries and the next
    /// range of the same read(2), short enough that a later read tries the
    /// network again.
    const MEMORY: Duration = Duration::from_millis(250);

    fn after(miss: &PendingMiss) -> Self {
        FailedRange {
            blob: miss.blob,
            start: miss.offset,
            end: miss.offset.saturating_add(miss.count.max(1)),
            pid: miss.pid,
            until: Instant::now() + Self::MEMORY,
        }
    }

    fn covers(&self, blob: u32, offset: u64, count: u64, pid: i32) -> bool {
        let meets = offset < self.end && offset.saturating_add(count.max(1)) > self.start;
        blob == self.blob && (meets || pid == self.pid)
    }
}

/// Readers never wait past the timeout: expired misses get EIO.
fn expire(
    group: &FanotifyGroup,
    pending: &mut HashMap<u64, PendingMiss>,
    failed: &mut Vec<FailedRange>,
) {
    let now = Instant::now();
    let expired: Vec<u64> = pending
        .iter()
        .filter(|(_, m)| m.deadline <= now)
        .map(|(id, _)| *id)
        .collect();
    for id in expired {
        if let Some(miss) = pending.remove(&id) {
            tracing::error!(
                blob = miss.blob,
                offset = miss.offset,
                count = miss.count,
                "blob {} bytes {}+{}: timed out, reader gets EIO",
                miss.blob,
                miss.offset,
                miss.count
            );
            failed.push(FailedRange::after(&miss));
            answer(group, miss.response_fd, Response::DenyErrno(libc::EIO));
        }
    }
}

/// Answers an event; a failed answer is logged, never fatal (the holder
/// must outlive every error while the mount exists).
fn answer(group: &FanotifyGroup, fd: i32, response: Response) {
    if let Err(e) = group.respond(fd, response) {
        tracing::error!("answering event fd {fd}: {e}");
    }
}

fn forward(worker: &Worker, id: u64, miss: &PendingMiss) -> bool {
    let msg = Message::Miss {
        id,
        blob: miss.blob,
        offset: miss.offset,
        count: miss.count,
        response_fd: miss.response_fd,
    };
    protocol::send_owned(&worker.sock, msg, Some(&miss.file)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_range_fails_fast_only_for_its_range_and_its_reader() {
        let f = FailedRange {
            blob: 1,
            start: 4096,
            end: 8192,
            pid: 77,
            until: Instant::now() + FailedRange::MEMORY,
        };
        assert!(
            f.covers(1, 4096, 4096, 99),
            "the kernel's retry of the range"
        );
        assert!(f.covers(1, 0, 4097, 99), "a range that meets it");
        assert!(
            f.covers(1, 1 << 20, 4096, 77),
            "the next range of the same read"
        );
        assert!(!f.covers(1, 8192, 4096, 99), "another reader's range");
        assert!(!f.covers(2, 4096, 4096, 77), "another blob");
    }
}
