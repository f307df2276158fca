//! Hedged range requests. A request that has not answered within a bound
//! learned from recent answers gets a second copy on a fresh connection
//! (which, with several hosts, goes to the next healthy one); whichever
//! answer verifies first is used. A stalled or slow response then costs
//! the bound, not a timeout.
//!
//! The bound is the 95th percentile of recent answer times, scaled up for
//! a request larger than the typical one (a 4 MiB request takes longer on
//! the same link than a 256 KiB one), and never below a floor, so that a
//! fast link's small jitter does not turn into a stream of hedges. Hedges
//! are capped at a few percent of requests. The copy that loses is not
//! waited for: its answer is dropped when it comes (its thread ends at the
//! request timeout at the latest).
//!
//! A hedge the cap refuses is asked for again a bound later (the cap grows
//! with the requests sent meanwhile); a request unanswered for
//! [`STALLED_AFTER_BOUNDS`] bounds gets its copy whatever the cap says. A
//! copy that answers with bad bytes or an error while another is still out
//! allows one more copy a bound after the last one went: the one still out
//! may be stalled too, and waiting for it would cost the stall.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use lamina_oci::Digest;

use crate::fetch::RangeSource;

/// No hedge sooner than this after a request went out.
pub const HEDGE_FLOOR: Duration = Duration::from_millis(50);
/// The bound until enough answers have been timed.
pub const HEDGE_FIRST_BOUND: Duration = Duration::from_millis(250);
/// Hedges allowed per 100 requests, beyond [`HEDGE_BURST`].
pub const HEDGE_PERCENT: u64 = 5;
/// Hedges allowed before any request was counted (the first stalls of a
/// start should not wait for 40 requests to earn a hedge).
pub const HEDGE_BURST: u64 = 2;
/// A request unanswered for this many bounds is taken as stalled: its
/// copy goes whatever the cap says, as a failed request's retry does. The
/// cap is for speculation, and by its definition about 5% of healthy
/// answers take longer than the p95 bound, which spends it: under a
/// mirror that stalls one request in 30 (the benchmark's fault mix), the
/// cap refused 356 of 469 hedges of a data-science start, and stalled
/// requests waited out their 3 s. A healthy answer that takes twice the
/// p95 gets a copy it did not need: a little load, not a wrong byte.
pub const STALLED_AFTER_BOUNDS: u32 = 2;
/// Answers remembered for the bound.
const SAMPLES: usize = 128;
/// Answers timed before the bound is learned from them.
const MIN_SAMPLES: usize = 8;

/// Hedging state shared by the requests of one worker.
#[derive(Debug)]
pub struct Hedging {
    floor: Duration,
    /// Recent answers: how long each took, and its length.
    samples: Mutex<VecDeque<(Duration, u64)>>,
    /// First copies sent.
    pub requests: AtomicU64,
    /// Second copies sent.
    pub hedges: AtomicU64,
    /// Second copies whose answer was used (the first was slower or bad).
    pub wins: AtomicU64,
}

impl Default for Hedging {
    fn default() -> Self {
        Hedging::new(HEDGE_FLOOR)
    }
}

impl Hedging {
    /// Hedging with no hedge sooner than `floor`.
    pub fn new(floor: Duration) -> Self {
        Hedging {
            floor,
            samples: Mutex::new(VecDeque::with_capacity(SAMPLES)),
            requests: AtomicU64::new(0),
            hedges: AtomicU64::new(0),
            wins: AtomicU64::new(0),
        }
    }

    /// How long a request of `len` bytes may go unanswered before it is
    /// hedged: learned from answers of half to twice its size when there
    /// are enough of them, else from all. A miss's one chunk must not wait
    /// as long as the 2 MiB batches of predictions beside it: in a
    /// data-science start through the fault mix their p95 made a stalled
    /// miss's bound 765 ms.
    pub fn bound(&self, len: u64) -> Duration {
        let samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if samples.len() < MIN_SAMPLES {
            return HEDGE_FIRST_BOUND.max(self.floor);
        }
        let comparable =
            |s: &&(Duration, u64)| s.1 <= len.saturating_mul(2) && s.1.saturating_mul(2) >= len;
        let similar = samples.iter().filter(comparable).count() >= MIN_SAMPLES;
        let chosen: Vec<(Duration, u64)> = samples
            .iter()
            .filter(|s| !similar || comparable(s))
            .copied()
            .collect();
        drop(samples);
        let mut times: Vec<Duration> = chosen.iter().map(|s| s.0).collect();
        let mut lens: Vec<u64> = chosen.iter().map(|s| s.1.max(1)).collect();
        times.sort_unstable();
        lens.sort_unstable();
        let p95 = times[(times.len() * 95 / 100).min(times.len() - 1)];
        let typical = lens[lens.len() / 2];
        let scale = (len as f64 / typical as f64).max(1.0);
        p95.mul_f64(scale).max(self.floor)
    }

    /// Notes an answer of `len` bytes that took `took`.
    pub fn note(&self, took: Duration, len: u64) {
        let mut samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if samples.len() == SAMPLES {
            samples.pop_front();
        }
        samples.push_back((took, len));
    }

    /// Counts a copy of a stalled request, which the cap does not refuse.
    fn take_stalled(&self) {
        self.hedges.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes one hedge if the cap allows it.
    fn try_hedge(&self) -> bool {
        let allowed = HEDGE_BURST + self.requests.load(Ordering::Relaxed) * HEDGE_PERCENT / 100;
        if self.hedges.fetch_add(1, Ordering::Relaxed) < allowed {
            return true;
        }
        self.hedges.fetch_sub(1, Ordering::Relaxed);
        false
    }
}

/// One answer to a range request.
struct Answer {
    hedge: bool,
    took: Duration,
    result: io::Result<Vec<u8>>,
}

/// The answers to one range request, in the order they arrive: the first
/// copy's, and the hedge's if one was sent. The caller takes answers until
/// one verifies.
pub(crate) struct Answers<'a> {
    source: &'a Arc<dyn RangeSource>,
    hedging: Option<&'a Hedging>,
    blob: &'a Digest,
    offset: u64,
    len: u64,
    tx: mpsc::Sender<Answer>,
    rx: mpsc::Receiver<Answer>,
    outstanding: usize,
    /// When the last copy went out.
    sent: Instant,
    /// Whether another copy may go once the last is a bound old: not while
    /// a hedge is out and every answer so far was good.
    may_hedge: bool,
    /// When to ask a cap that refused a hedge again.
    ask_again: Option<Instant>,
}

impl<'a> Answers<'a> {
    /// Sends the request (on a fresh connection when `fresh`). Without
    /// `hedging` it is read here and now; with it, on a thread of its own
    /// so that it can be hedged.
    pub(crate) fn send(
        source: &'a Arc<dyn RangeSource>,
        hedging: Option<&'a Hedging>,
        blob: &'a Digest,
        (offset, len): (u64, u64),
        fresh: bool,
    ) -> Self {
        let (tx, rx) = mpsc::channel();
        let mut answers = Answers {
            source,
            hedging,
            blob,
            offset,
            len,
            tx,
            rx,
            outstanding: 0,
            sent: Instant::now(),
            may_hedge: true,
            ask_again: None,
        };
        match hedging {
            Some(h) => {
                h.requests.fetch_add(1, Ordering::Relaxed);
                answers.spawn(fresh, false);
            }
            None => {
                let result = read(source.as_ref(), blob, offset, len, fresh);
                answers.push(false, Instant::now(), result);
            }
        }
        answers
    }

    fn push(&mut self, hedge: bool, sent: Instant, result: io::Result<Vec<u8>>) {
        let took = sent.elapsed();
        let _ = self.tx.send(Answer {
            hedge,
            took,
            result,
        });
        self.outstanding += 1;
    }

    fn spawn(&mut self, fresh: bool, hedge: bool) {
        let (source, blob, tx) = (self.source.clone(), self.blob.clone(), self.tx.clone());
        let (offset, len) = (self.offset, self.len);
        let sent = Instant::now();
        let spawned = std::thread::Builder::new()
            .name("range".into())
            .spawn(move || {
                let result = match hedge {
                    true => source.read_range_beside(&blob, offset, len),
                    false => read(source.as_ref(), &blob, offset, len, fresh),
                };
                let took = sent.elapsed();
                let _ = tx.send(Answer {
                    hedge,
                    took,
                    result,
                });
            });
        match spawned {
            Ok(_) => self.outstanding += 1,
            Err(e) => self.push(hedge, sent, Err(e)),
        }
    }

    /// The next answer (and whether it came from the hedge), or `None`
    /// when every copy sent has answered.
    pub(crate) fn next(&mut self) -> Option<(bool, io::Result<Vec<u8>>)> {
        while self.outstanding > 0 {
            let received = match self.hedge_at() {
                Some(at) => self
                    .rx
                    .recv_timeout(at.saturating_duration_since(Instant::now())),
                None => self
                    .rx
                    .recv()
                    .map_err(|_| mpsc::RecvTimeoutError::Disconnected),
            };
            match received {
                Ok(answer) => {
                    self.outstanding -= 1;
                    if let (Some(h), Ok(bytes)) = (self.hedging, &answer.result) {
                        h.note(answer.took, bytes.len() as u64);
                    }
                    return Some((answer.hedge, answer.result));
                }
                Err(mpsc::RecvTimeoutError::Timeout) => self.hedge(),
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
            }
        }
        None
    }

    /// When to send the next copy if no answer comes: `None` for never.
    fn hedge_at(&self) -> Option<Instant> {
        let h = self.hedging.filter(|_| self.may_hedge)?;
        Some(
            self.ask_again
                .unwrap_or_else(|| self.sent + h.bound(self.len)),
        )
    }

    /// The last copy is a bound old: a hedge, if the cap allows one; a
    /// copy anyway once it is [`STALLED_AFTER_BOUNDS`] bounds old.
    fn hedge(&mut self) {
        let Some(h) = self.hedging else { return };
        let bound = h.bound(self.len);
        let stalled_at = self.sent + bound * STALLED_AFTER_BOUNDS;
        let stalled = Instant::now() >= stalled_at;
        let allowed = h.try_hedge() || {
            if stalled {
                h.take_stalled();
            }
            stalled
        };
        tracing::debug!(
            blob = %self.blob, offset = self.offset, len = self.len,
            after_ms = self.sent.elapsed().as_millis() as u64, hedged = allowed, stalled,
            "a request is slow"
        );
        if allowed {
            self.spawn(true, true);
            self.sent = Instant::now();
            self.may_hedge = false;
            self.ask_again = None;
        } else {
            self.ask_again = Some((Instant::now() + bound).min(stalled_at));
        }
    }

    /// The answer just taken was bad (an error, or bytes that did not
    /// verify). A copy still out may be stalled as well: another may go a
    /// bound after the last was sent.
    pub(crate) fn answer_failed(&mut self) {
        if self.outstanding > 0 {
            self.may_hedge = true;
        }
    }

    /// Counts a hedge whose answer was the one used.
    pub(crate) fn hedge_won(&self) {
        if let Some(h) = self.hedging {
            h.wins.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Reads a range, hedged when `hedging` is given: the first answer that
/// is not an error (the caller verifies it), or the last error.
pub fn read_first_answer(
    source: &Arc<dyn RangeSource>,
    hedging: Option<&Hedging>,
    blob: &Digest,
    range: (u64, u64),
    fresh: bool,
) -> io::Result<Vec<u8>> {
    let mut answers = Answers::send(source, hedging, blob, range, fresh);
    let mut last = io::Error::other("no answer");
    while let Some((hedge, answer)) = answers.next() {
        match answer {
            Ok(bytes) => {
                if hedge {
                    answers.hedge_won();
                }
                return Ok(bytes);
            }
            Err(e) => {
                last = e;
                answers.answer_failed();
            }
        }
    }
    Err(last)
}

fn read(
    source: &dyn RangeSource,
    blob: &Digest,
    offset: u64,
    len: u64,
    fresh: bool,
) -> io::Result<Vec<u8>> {
    if fresh {
        source.read_range_again(blob, offset, len)
    } else {
        source.read_range(blob, offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_follows_recent_answers_with_a_floor() {
        let h = Hedging::new(Duration::from_millis(50));
        assert_eq!(h.bound(1), HEDGE_FIRST_BOUND, "before answers are timed");
        for k in 0..100u64 {
            // 95 answers of 10 ms, 5 of 200 ms, all 256 KiB.
            let took = if k % 20 == 0 { 200 } else { 10 };
            h.note(Duration::from_millis(took), 256 << 10);
        }
        // The p95 lies among the slow ones: no hedge for them.
        assert_eq!(h.bound(256 << 10), Duration::from_millis(200));
        // A request 4x the typical size may take 4x as long.
        assert_eq!(h.bound(1 << 20), Duration::from_millis(800));
        let fast = Hedging::new(Duration::from_millis(50));
        for _ in 0..100 {
            fast.note(Duration::from_millis(2), 64 << 10);
        }
        assert_eq!(fast.bound(64 << 10), Duration::from_millis(50), "the floor");
    }

    #[test]
    fn a_small_request_is_bounded_by_answers_of_its_size() {
        let h = Hedging::new(Duration::from_millis(10));
        for k in 0..100u64 {
            // Misses' single chunks in 20 ms beside batches of 2 MiB in 800 ms.
            match k % 3 {
                0 => h.note(Duration::from_millis(800), 2 << 20),
                _ => h.note(Duration::from_millis(20), 100 << 10),
            }
        }
        assert_eq!(h.bound(100 << 10), Duration::from_millis(20));
        assert_eq!(h.bound(2 << 20), Duration::from_millis(800));
        // Too few answers of a size: all of them, scaled as before.
        let few = Hedging::new(Duration::from_millis(10));
        for _ in 0..20 {
            few.note(Duration::from_millis(800), 2 << 20);
        }
        few.note(Duration::from_millis(20), 100 << 10);
        assert_eq!(few.bound(100 << 10), Duration::from_millis(800));
    }

    #[test]
    fn hedges_are_capped_to_a_few_percent() {
        let h = Hedging::default();
        assert!(h.try_hedge() && h.try_hedge(), "the burst");
        assert!(!h.try_hedge(), "no requests counted yet");
        h.requests.store(100, Ordering::Relaxed);
        let more = (0..100).filter(|_| h.try_hedge()).count() as u64;
        assert_eq!(more, HEDGE_PERCENT);
        assert_eq!(
            h.hedges.load(Ordering::Relaxed),
            HEDGE_BURST + HEDGE_PERCENT
        );
    }
}
