//! Lazy reads for the FUSE path: a FUSE read of bytes whose blob is not yet
//! complete asks [`Filler::fill`], which waits until the worker has fetched,
//! verified and written them (or failed, or the timeout passed: EIO).
//!
//! The FUSE daemon plays the holder's part: the same worker, started from
//! the same config, behind the same relay (timeouts, failed ranges,
//! respawn). A thread of its own runs the relay; FUSE request threads hand
//! it their misses through a channel and sleep until answered. The worker's
//! answer is the only thing that lets a read of an incomplete blob through:
//! it comes after the bytes were verified and their fill record updated.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};

use crate::config::DaemonConfig;
use crate::relay::{Miss, News, Relay, Reply, Worker};

/// Answers a FUSE read's miss by waking its thread with the errno.
struct ChannelReply(mpsc::SyncSender<i32>);

impl Reply for ChannelReply {
    fn attachment(&self) -> (Option<BorrowedFd<'_>>, i32) {
        (None, -1)
    }

    fn answer(self, errno: i32) {
        // The reader may have given up (its thread gone): nothing to do.
        let _ = self.0.send(errno);
    }
}

enum Request {
    Miss(Miss<ChannelReply>),
    Shutdown,
}

/// The FUSE daemon's link to its worker.
pub struct Filler {
    requests: mpsc::Sender<Request>,
    wake: Arc<OwnedFd>,
    /// Per blob: complete in the cache (reads need not ask).
    complete: Arc<Vec<AtomicBool>>,
    relay: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Filler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Filler")
            .field("complete", &self.complete)
            .finish_non_exhaustive()
    }
}

impl Filler {
    /// Starts the worker of the lazy mount described by `config_path` and
    /// the relay thread that talks to it.
    pub fn start(config_path: &Path) -> io::Result<Filler> {
        let config = DaemonConfig::load(config_path)?;
        let complete: Arc<Vec<AtomicBool>> = Arc::new(
            config
                .blobs
                .iter()
                .map(|b| AtomicBool::new(b.complete))
                .collect(),
        );
        let log = config.run_dir.join("worker.log");
        let worker = Worker::spawn(config_path, &log)?;
        let timeout = Duration::from_secs(config.timeout_secs.max(1));
        let relay = Relay::new(worker, config_path, &log, timeout);
        let wake = Arc::new(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?);
        let (tx, rx) = mpsc::channel();
        let thread = {
            let (wake, complete) = (wake.clone(), complete.clone());
            std::thread::Builder::new()
                .name("relay".into())
                .spawn(move || run_relay(relay, &rx, &wake, &complete))?
        };
        Ok(Filler {
            requests: tx,
            wake,
            complete,
            relay: Mutex::new(Some(thread)),
        })
    }

    /// Whether every blob is complete in the cache: reads no longer ask.
    pub fn all_complete(&self) -> bool {
        self.complete.iter().all(|c| c.load(Ordering::Acquire))
    }

    /// Whether blob `blob` is complete in the cache.
    pub fn blob_complete(&self, blob: u32) -> bool {
        self.complete
            .get(blob as usize)
            .is_some_and(|c| c.load(Ordering::Acquire))
    }

    /// Waits until bytes `[offset, offset + count)` of blob `blob` are
    /// verified in the cache: `Err(errno)` when they cannot be (the reader
    /// gets it). `pid` is the reading process.
    pub fn fill(&self, blob: u32, offset: u64, count: u64, pid: i32) -> Result<(), i32> {
        if self.blob_complete(blob) {
            return Ok(());
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let miss = Miss {
            blob,
            offset,
            count,
            pid,
            reply: ChannelReply(tx),
        };
        self.send(Request::Miss(miss))?;
        // The relay answers every miss by its deadline; a relay that is
        // gone drops the sender, which fails closed.
        match rx.recv() {
            Ok(0) => Ok(()),
            Ok(errno) => Err(errno),
            Err(_) => Err(libc::EIO),
        }
    }

    fn send(&self, request: Request) -> Result<(), i32> {
        let sent = self.requests.send(request).map_err(|_| libc::EIO);
        // A failed wake-up only delays the relay to its next poll timeout.
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
        sent
    }

    /// The mount is gone: fails what is pending, tells the worker to save
    /// its records and exit, and waits for that.
    pub fn shutdown(&self) {
        let _ = self.send(Request::Shutdown);
        let thread = self.relay.lock().ok().and_then(|mut t| t.take());
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}

fn run_relay(
    mut relay: Relay<ChannelReply>,
    requests: &mpsc::Receiver<Request>,
    wake: &OwnedFd,
    complete: &[AtomicBool],
) {
    loop {
        let wait = relay.poll_wait(Duration::from_millis(200));
        let (woken, worker_ready) = {
            let worker_fd = relay.worker_sock();
            let mut fds = [
                PollFd::new(wake, PollFlags::IN),
                PollFd::new(&worker_fd, PollFlags::IN),
            ];
            let ts = rustix::event::Timespec {
                tv_sec: wait.as_secs() as i64,
                tv_nsec: i64::from(wait.subsec_nanos()),
            };
            if let Err(e) = poll(&mut fds, Some(&ts)) {
                if e != rustix::io::Errno::INTR {
                    tracing::warn!("poll: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            (
                fds[0].revents().contains(PollFlags::IN),
                !fds[1].revents().is_empty(),
            )
        };
        if woken {
            let _ = rustix::io::read(wake.as_fd(), &mut [0u8; 8]);
        }
        // Requests are drained on every turn: a lost wake-up costs a turn.
        loop {
            match requests.try_recv() {
                Ok(Request::Miss(miss)) => relay.submit(miss),
                Ok(Request::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => {
                    relay.shutdown();
                    return;
                }
                Err(mpsc::TryRecvError::Empty) => break,
            }
        }
        if worker_ready {
            relay.on_worker(
                |_| {},
                |news| {
                    // Ready ranges are a fast path of the kernel path's
                    // holder; here reads ask the worker until completion.
                    let News::Complete(blob) = news else { return };
                    if let Some(c) = complete.get(blob as usize) {
                        tracing::info!(blob, "blob complete: reads no longer ask the worker");
                        c.store(true, Ordering::Release);
                    }
                },
            );
        }
        relay.expire();
    }
}
