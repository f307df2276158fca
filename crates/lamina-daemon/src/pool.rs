//! The threads that serve misses (the worker's, and the FUSE daemon's reads
//! that wait for it): a few at start, one more whenever a miss arrives
//! while every thread is busy, up to a bound. A fixed pool let misses that
//! wait on a stalled registry (each up to the mount's timeout) hold up a
//! miss whose bytes are already in the cache file until they timed out.
//!
//! "Busy" counts jobs submitted but not yet taken: a pool that counted only
//! threads waiting for work saw a burst of submits as served by threads
//! that had not woken yet, grew too little, and queued a later read of
//! local data behind misses stalled for the whole timeout (seen in CI).

use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

/// Most threads a pool grows to: as many misses may wait at once on a
/// stalled registry without holding up any other (the FUSE daemon's own
/// miss threads are bounded alike, `lamina_fuse`).
pub const MAX_MISS_THREADS: usize = 128;

/// A growing pool of threads running `serve` on each job submitted.
pub struct MissPool<J: Send + 'static> {
    tx: mpsc::Sender<J>,
    rx: Arc<Mutex<mpsc::Receiver<J>>>,
    /// Threads free for a job, less the jobs submitted for them and not
    /// yet taken (negative: jobs queue for a thread).
    idle: Arc<AtomicIsize>,
    threads: AtomicUsize,
    max: usize,
    serve: Arc<dyn Fn(J) + Send + Sync>,
}

impl<J: Send + 'static> std::fmt::Debug for MissPool<J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MissPool")
            .field("threads", &self.threads)
            .field("idle", &self.idle)
            .field("max", &self.max)
            .finish_non_exhaustive()
    }
}

impl<J: Send + 'static> MissPool<J> {
    /// `min` threads now (at least one), at most `max` ever.
    pub fn new(min: usize, max: usize, serve: impl Fn(J) + Send + Sync + 'static) -> Self {
        let pool = Self::unstarted(max.max(min).max(1), serve);
        for _ in 0..min.max(1) {
            pool.spawn();
        }
        pool
    }

    /// A pool of no thread yet, that may start `max`.
    fn unstarted(max: usize, serve: impl Fn(J) + Send + Sync + 'static) -> Self {
        let (tx, rx) = mpsc::channel();
        MissPool {
            tx,
            rx: Arc::new(Mutex::new(rx)),
            idle: Arc::new(AtomicIsize::new(0)),
            threads: AtomicUsize::new(0),
            max,
            serve: Arc::new(serve),
        }
    }

    /// Hands `job` to an idle thread, or to a new one when none is idle
    /// and the bound allows. `Err` gives the job back if the pool has no
    /// thread (none could be started: it would wait in the queue forever)
    /// or its threads are gone; the caller serves or fails it.
    pub fn submit(&self, job: J) -> Result<(), mpsc::SendError<J>> {
        let free = self.idle.fetch_sub(1, Ordering::SeqCst);
        if free <= 0 && self.threads.load(Ordering::SeqCst) < self.max {
            self.spawn();
        }
        if self.threads.load(Ordering::SeqCst) == 0 {
            self.idle.fetch_add(1, Ordering::SeqCst);
            return Err(mpsc::SendError(job));
        }
        self.tx.send(job)
    }

    /// Threads started so far.
    #[cfg(test)]
    pub(crate) fn threads(&self) -> usize {
        self.threads.load(Ordering::SeqCst)
    }

    fn spawn(&self) {
        let (rx, idle, serve) = (self.rx.clone(), self.idle.clone(), self.serve.clone());
        // Free from now: a submit that found none takes it.
        idle.fetch_add(1, Ordering::SeqCst);
        let started = std::thread::Builder::new()
            .name("miss".into())
            .spawn(move || loop {
                let job = match rx.lock() {
                    Ok(r) => r.recv(),
                    Err(_) => return,
                };
                let Ok(job) = job else { return };
                serve(job);
                idle.fetch_add(1, Ordering::SeqCst);
            });
        match started {
            Ok(_) => {
                self.threads.fetch_add(1, Ordering::SeqCst);
            }
            Err(e) => {
                self.idle.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!("no thread for misses: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Jobs that block do not hold up a later one: the pool grows past its
    /// first threads (up to its bound), and the quick job is served while
    /// the slow ones still wait.
    #[test]
    fn a_quick_job_never_waits_behind_blocked_ones() {
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let release_rx = Arc::new(Mutex::new(release_rx));
        let (done_tx, done_rx) = mpsc::channel::<&'static str>();
        let done_tx = Mutex::new(done_tx);
        let pool = MissPool::new(2, 16, move |job: &'static str| {
            if job == "slow" {
                let _ = release_rx.lock().unwrap().recv();
            }
            let _ = done_tx.lock().unwrap().send(job);
        });
        for _ in 0..8 {
            pool.submit("slow").unwrap();
        }
        pool.submit("quick").unwrap();
        let first = done_rx.recv_timeout(Duration::from_secs(30)).unwrap();
        assert_eq!(first, "quick");
        assert!(pool.threads() >= 9, "{} threads", pool.threads());
        drop(release_tx);
        for _ in 0..8 {
            assert_eq!(
                done_rx.recv_timeout(Duration::from_secs(30)).unwrap(),
                "slow"
            );
        }
    }

    /// A pool none of whose threads could be started gives each job back
    /// instead of queueing it for no one (the FUSE daemon then serves the
    /// read itself, the worker fails the miss with EIO at once).
    #[test]
    fn a_pool_without_threads_gives_the_job_back() {
        // As if every spawn had failed.
        let pool = MissPool::unstarted(0, |_: u32| panic!("no thread should serve"));
        assert_eq!(pool.submit(7).unwrap_err().0, 7);
        assert_eq!(pool.submit(8).unwrap_err().0, 8);
        assert_eq!(pool.idle.load(Ordering::SeqCst), 0, "idle count restored");
    }

    /// The bound holds: a ninth blocked job waits for a thread.
    #[test]
    fn the_pool_stops_growing_at_its_bound() {
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let release_rx = Arc::new(Mutex::new(release_rx));
        let pool = MissPool::new(1, 4, move |_: u32| {
            let _ = release_rx.lock().unwrap().recv();
        });
        for k in 0..9 {
            pool.submit(k).unwrap();
        }
        assert_eq!(pool.threads(), 4);
        drop(release_tx);
    }
}
