//! The relay between a mount's readers and its worker, shared by the two
//! serving paths: the kernel path's [holder](crate::holder) (misses are
//! fanotify events) and the FUSE daemon ([`Filler`]: misses are FUSE reads
//! of chunks not yet in the cache).
//!
//! Either way a miss waits in the relay until the worker says its bytes are
//! verified and in the cache (or failed), and never longer than the
//! timeout: then the reader gets EIO. When the worker dies the relay keeps
//! every pending miss, starts a new worker (backing off while workers keep
//! dying young) and hands them over again. A range that just failed fails
//! again at once for a short while, for its reader and for anyone meeting
//! it, so that the kernel's immediate retries do not each wait a timeout.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};

use crate::protocol::{self, Message};

/// How long a stopping worker may take to save its fill records: that
/// syncs its cache files, which under write load takes seconds. A worker
/// killed first loses the records of its last fills (their chunks are
/// fetched again by the next mount: time, never a wrong byte).
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(10);
/// A running worker and the holder's end of its socket.
pub(crate) struct Worker {
    child: Child,
    sock: OwnedFd,
    ready: bool,
}

impl Worker {
    /// The socket to this worker, for messages sent before it said hello
    /// (they wait in the socket until it reads them).
    pub(crate) fn sock(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }

    /// Its pid.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts this binary's `internal-worker CONFIG FD` (through
    /// [`lamina_sys::OWN_BINARY`]) with its output in `log`.
    pub(crate) fn spawn(config_path: &Path, log: &Path) -> io::Result<Worker> {
        let (ours, theirs) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        // The worker's end must survive exec. Another thread forking in
        // between would leak it into that child until it execs; both
        // callers spawn before (holder) or apart from (FUSE) other forks.
        rustix::io::fcntl_setfd(&theirs, rustix::io::FdFlags::empty())?;
        let log = File::options()
            .create(true)
            .append(true)
            .mode(lamina_fetch::private::FILE_MODE)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(log)?;
        let child = Command::new(lamina_sys::OWN_BINARY)
            .arg0("lamina")
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

    /// Kills it at once (a mount that never came up).
    pub(crate) fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Tells it the mount is gone and closes its socket, so that it saves
    /// its fill records and exits; kills it if it has not within
    /// [`STOP_GRACE`].
    fn stop(self) {
        let Worker {
            mut child, sock, ..
        } = self;
        if let Err(e) = protocol::send_owned(&sock, Message::Shutdown, None) {
            tracing::warn!("telling the worker to stop: {e}");
        }
        drop(sock);
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// How a miss is answered, and what travels with it to the worker.
pub(crate) trait Reply {
    /// The file the worker writes the miss's bytes through (a fanotify
    /// event's quiet fd), and that event's fd number in the holder.
    fn attachment(&self) -> (Option<BorrowedFd<'_>>, i32);
    /// Answers the reader: errno 0 means its bytes are in the cache.
    fn answer(self, errno: i32);
}

/// What a worker tells about its blobs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum News {
    /// The blob is complete: its reads need no answer any more.
    Complete(u32),
    /// These bytes of the blob hold verified boot pages.
    Ready {
        blob: u32,
        range: std::ops::Range<u64>,
    },
}

/// A read that needs bytes of blob `blob` at `[offset, offset + count)`.
pub(crate) struct Miss<R> {
    pub blob: u32,
    pub offset: u64,
    pub count: u64,
    /// The reading process.
    pub pid: i32,
    pub reply: R,
}

struct Pending<R> {
    miss: Miss<R>,
    deadline: Instant,
    sent: bool,
}

/// The relay: pending misses, the worker, and failed ranges.
pub(crate) struct Relay<R: Reply> {
    config_path: PathBuf,
    log: PathBuf,
    timeout: Duration,
    worker: Worker,
    pending: HashMap<u64, Pending<R>>,
    next_id: u64,
    failed: Vec<FailedRange>,
    last_respawn: Instant,
    respawn_delay: Duration,
}

impl<R: Reply> Relay<R> {
    /// A relay over `worker`, started from `config_path`; new workers log
    /// to `log`; readers wait at most `timeout`.
    pub(crate) fn new(worker: Worker, config_path: &Path, log: &Path, timeout: Duration) -> Self {
        Relay {
            config_path: config_path.to_path_buf(),
            log: log.to_path_buf(),
            timeout,
            worker,
            pending: HashMap::new(),
            next_id: 1,
            failed: Vec::new(),
            last_respawn: Instant::now(),
            respawn_delay: Duration::from_millis(250),
        }
    }

    /// The socket to poll for the worker's messages.
    pub(crate) fn worker_sock(&self) -> BorrowedFd<'_> {
        self.worker.sock.as_fd()
    }

    /// The worker's pid (its own writes are not misses).
    pub(crate) fn worker_pid(&self) -> i32 {
        self.worker.child.id() as i32
    }

    /// How long a poll may sleep before a pending miss must be expired.
    pub(crate) fn poll_wait(&self, at_most: Duration) -> Duration {
        let now = Instant::now();
        self.pending
            .values()
            .map(|p| p.deadline.saturating_duration_since(now))
            .min()
            .unwrap_or(at_most)
            .min(at_most)
    }

    /// Takes a miss: fails it at once if it meets a range that just
    /// failed, else keeps it and forwards it once the worker is ready.
    pub(crate) fn submit(&mut self, miss: Miss<R>) {
        // A read that got EIO is retried by the kernel at once (readahead,
        // then the page itself), and one read(2) can need several ranges
        // in turn: a miss that meets the failed range, or comes from the
        // process whose read failed, fails at once, so a reader waits at
        // most one timeout. Other readers' ranges go on. The memory is
        // short, so a read made after the source recovered goes to the
        // network again.
        let now = Instant::now();
        self.failed.retain(|f| f.until > now);
        if self
            .failed
            .iter()
            .any(|f| f.covers(miss.blob, miss.offset, miss.count, miss.pid))
        {
            miss.reply.answer(libc::EIO);
            return;
        }
        let id = self.next_id;
        self.next_id += 1;
        tracing::debug!(
            id,
            blob = miss.blob,
            offset = miss.offset,
            count = miss.count,
            pid = miss.pid,
            "miss"
        );
        let mut pending = Pending {
            miss,
            deadline: now + self.timeout,
            sent: false,
        };
        if self.worker.ready {
            pending.sent = forward(&self.worker, id, &pending.miss);
        }
        self.pending.insert(id, pending);
    }

    /// Handles what the worker sent (or its death). `on_hello` runs when
    /// a worker has just become ready, before pending misses go to it;
    /// `on_news` for what it says of its blobs.
    pub(crate) fn on_worker(
        &mut self,
        on_hello: impl FnOnce(BorrowedFd<'_>),
        mut on_news: impl FnMut(News),
    ) {
        match protocol::recv(self.worker.sock.as_fd()) {
            Ok(Some((Message::Hello, _))) => {
                tracing::info!(pid = self.worker.child.id(), "worker ready");
                self.worker.ready = true;
                on_hello(self.worker.sock.as_fd());
                for (id, p) in self.pending.iter_mut().filter(|(_, p)| !p.sent) {
                    p.sent = forward(&self.worker, *id, &p.miss);
                }
            }
            Ok(Some((Message::Done { id, errno }, _))) => {
                if let Some(p) = self.pending.remove(&id) {
                    if errno != 0 {
                        self.failed.push(FailedRange::after(&p.miss));
                    }
                    p.miss.reply.answer(errno);
                }
            }
            Ok(Some((Message::Complete { blob }, _))) => on_news(News::Complete(blob)),
            Ok(Some((Message::Ready { blob, offset, len }, _))) => on_news(News::Ready {
                blob,
                range: offset..offset.saturating_add(len),
            }),
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => self.replace_worker(),
        }
    }

    /// The worker is gone: keep the misses, start another.
    fn replace_worker(&mut self) {
        let _ = self.worker.child.kill();
        let status = self.worker.child.wait();
        tracing::warn!("worker exited ({status:?}); restarting");
        // Back off while workers keep dying young (0.5 s up to 8 s);
        // pending readers still get EIO at their deadline.
        if self.last_respawn.elapsed() < Duration::from_secs(10) {
            self.respawn_delay = (self.respawn_delay * 2).min(Duration::from_secs(8));
        } else {
            self.respawn_delay = Duration::from_millis(500);
        }
        self.wait_expiring(self.respawn_delay);
        self.last_respawn = Instant::now();
        self.worker = loop {
            match Worker::spawn(&self.config_path, &self.log) {
                Ok(w) => break w,
                Err(e) => {
                    tracing::warn!("starting a worker: {e}; retrying");
                    self.wait_expiring(Duration::from_secs(1));
                }
            }
        };
        for p in self.pending.values_mut() {
            p.sent = false;
        }
    }

    fn wait_expiring(&mut self, how_long: Duration) {
        let wake = Instant::now() + how_long;
        while Instant::now() < wake {
            self.expire();
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Readers never wait past the timeout: expired misses get EIO.
    pub(crate) fn expire(&mut self) {
        let now = Instant::now();
        let expired: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            if let Some(p) = self.pending.remove(&id) {
                let m = &p.miss;
                tracing::error!(
                    blob = m.blob,
                    offset = m.offset,
                    count = m.count,
                    "blob {} bytes {}+{}: timed out, reader gets EIO",
                    m.blob,
                    m.offset,
                    m.count
                );
                self.failed.push(FailedRange::after(m));
                p.miss.reply.answer(libc::EIO);
            }
        }
    }

    /// The mount is gone: what is pending cannot be waited for; the worker
    /// saves its records and exits.
    pub(crate) fn shutdown(mut self) {
        for (_, p) in self.pending.drain() {
            p.miss.reply.answer(libc::EIO);
        }
        self.worker.stop();
    }
}

fn forward<R: Reply>(worker: &Worker, id: u64, miss: &Miss<R>) -> bool {
    let (file, response_fd) = miss.reply.attachment();
    let msg = Message::Miss {
        id,
        blob: miss.blob,
        offset: miss.offset,
        count: miss.count,
        response_fd,
    };
    protocol::send(worker.sock.as_fd(), msg, file).is_ok()
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

    fn after<R>(miss: &Miss<R>) -> Self {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    /// Records its answer under a name.
    struct Recorded(&'static str, Rc<RefCell<Vec<(&'static str, i32)>>>);

    impl Reply for Recorded {
        fn attachment(&self) -> (Option<BorrowedFd<'_>>, i32) {
            (None, -1)
        }
        fn answer(self, errno: i32) {
            self.1.borrow_mut().push((self.0, errno));
        }
    }

    /// A relay whose worker is played by the test through the returned
    /// socket (the child is a stand-in that only sleeps).
    fn relay_with_fake_worker(timeout: Duration) -> (Relay<Recorded>, OwnedFd) {
        let (ours, theirs) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let child = Command::new("sleep").arg("60").spawn().unwrap();
        let worker = Worker {
            child,
            sock: ours,
            ready: false,
        };
        let path = Path::new("/nonexistent");
        (Relay::new(worker, path, path, timeout), theirs)
    }

    fn pending_message(sock: &OwnedFd) -> Option<Message> {
        let mut fds = [rustix::event::PollFd::new(
            sock,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 50_000_000,
        };
        rustix::event::poll(&mut fds, Some(&ts)).unwrap();
        if fds[0].revents().is_empty() {
            return None;
        }
        protocol::recv(sock.as_fd()).unwrap().map(|(m, _)| m)
    }

    fn miss(
        blob: u32,
        offset: u64,
        pid: i32,
        name: &'static str,
        log: &Rc<RefCell<Vec<(&'static str, i32)>>>,
    ) -> Miss<Recorded> {
        Miss {
            blob,
            offset,
            count: 4096,
            pid,
            reply: Recorded(name, log.clone()),
        }
    }

    #[test]
    fn misses_wait_for_the_worker_and_get_its_answer() {
        let log = Rc::new(RefCell::new(Vec::new()));
        let (mut relay, worker) = relay_with_fake_worker(Duration::from_secs(60));
        relay.submit(miss(0, 0, 10, "a", &log));
        assert_eq!(pending_message(&worker), None, "forwarded before Hello");

        protocol::send_owned(&worker, Message::Hello, None).unwrap();
        relay.on_worker(|_| {}, |_| {});
        let Some(Message::Miss { id, blob: 0, .. }) = pending_message(&worker) else {
            panic!("the pending miss was not forwarded after Hello");
        };
        assert!(log.borrow().is_empty(), "answered before the worker did");

        protocol::send_owned(&worker, Message::Done { id, errno: 0 }, None).unwrap();
        relay.on_worker(|_| {}, |_| {});
        assert_eq!(*log.borrow(), [("a", 0)]);

        let mut completed = Vec::new();
        protocol::send_owned(&worker, Message::Complete { blob: 3 }, None).unwrap();
        relay.on_worker(|_| {}, |n| completed.push(n));
        assert_eq!(completed, [News::Complete(3)]);
        relay.shutdown();
        assert_eq!(pending_message(&worker), Some(Message::Shutdown));
    }

    #[test]
    fn a_failure_fails_its_range_at_once_and_spares_others() {
        let log = Rc::new(RefCell::new(Vec::new()));
        let (mut relay, worker) = relay_with_fake_worker(Duration::from_secs(60));
        protocol::send_owned(&worker, Message::Hello, None).unwrap();
        relay.on_worker(|_| {}, |_| {});
        relay.submit(miss(1, 4096, 10, "failing", &log));
        let Some(Message::Miss { id, .. }) = pending_message(&worker) else {
            panic!("not forwarded");
        };
        protocol::send_owned(
            &worker,
            Message::Done {
                id,
                errno: libc::EIO,
            },
            None,
        )
        .unwrap();
        relay.on_worker(|_| {}, |_| {});

        relay.submit(miss(1, 4096, 11, "retry", &log));
        relay.submit(miss(1, 1 << 20, 11, "elsewhere", &log));
        assert_eq!(
            *log.borrow(),
            [("failing", libc::EIO), ("retry", libc::EIO)],
            "the retry of the failed range fails at once; another range waits"
        );
        assert!(
            matches!(pending_message(&worker), Some(Message::Miss { offset, .. }) if offset == 1 << 20),
            "the other range went to the worker"
        );
        relay.shutdown();
        assert_eq!(log.borrow().last(), Some(&("elsewhere", libc::EIO)));
    }

    #[test]
    fn a_miss_past_its_deadline_gets_eio() {
        let log = Rc::new(RefCell::new(Vec::new()));
        let (mut relay, _worker) = relay_with_fake_worker(Duration::from_millis(20));
        relay.submit(miss(0, 0, 10, "slow", &log));
        assert!(relay.poll_wait(Duration::from_secs(1)) <= Duration::from_millis(20));
        relay.expire();
        assert!(log.borrow().is_empty(), "expired before its deadline");
        std::thread::sleep(Duration::from_millis(30));
        relay.expire();
        assert_eq!(*log.borrow(), [("slow", libc::EIO)]);
        relay.shutdown();
    }

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
