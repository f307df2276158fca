//! A total deadline for each registry answer. The client's timeout bounds
//! the wait for the headers and for each read of the body, so a registry
//! that sends a byte now and then (a byte every 59 s against a 60 s timeout)
//! would hold a request for ever; a [`Budget`] gives each answer the time
//! its size needs at a floor rate, on top of that timeout, and ends it then.
//! The deadline is checked between reads, so a request ends at most one
//! timeout after it.

use std::io::{self, Read};
use std::time::{Duration, Instant};

/// Default floor: answers slower than this on average are given up.
pub const DEFAULT_MIN_RATE: u64 = 64 << 10;

/// How long an answer may take: `base` plus its size at `min_rate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Budget {
    base: Duration,
    /// Bytes per second, at least 1.
    min_rate: u64,
}

impl Budget {
    pub(crate) fn new(base: Duration, min_rate: u64) -> Self {
        Budget {
            base,
            min_rate: min_rate.max(1),
        }
    }

    /// The time an answer of `bytes` may take in all.
    pub(crate) fn for_bytes(&self, bytes: u64) -> Duration {
        self.base
            .saturating_add(Duration::from_secs(bytes / self.min_rate))
    }

    /// `inner`, an answer of at most `bytes`, ended once it has taken
    /// longer than [`for_bytes`](Self::for_bytes) from now.
    pub(crate) fn reader<R: Read>(&self, inner: R, bytes: u64) -> Deadlined<R> {
        let allowed = self.for_bytes(bytes);
        Deadlined {
            inner,
            deadline: Instant::now().checked_add(allowed),
            allowed,
            min_rate: self.min_rate,
        }
    }
}

/// A reader that fails with `TimedOut` once its deadline has passed.
#[derive(Debug)]
pub struct Deadlined<R> {
    inner: R,
    /// `None`: too far ahead to matter.
    deadline: Option<Instant>,
    allowed: Duration,
    min_rate: u64,
}

impl<R> Deadlined<R> {
    /// The reader inside.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }
}

impl<R: Read> Read for Deadlined<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the answer took over its deadline of {} s (the request timeout, and its \
                     size at the floor of {} bytes/s: --registry-min-rate)",
                    self.allowed.as_secs(),
                    self.min_rate
                ),
            ));
        }
        self.inner.read(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source that gives one byte per read, `pause` apart.
    struct Drip {
        left: usize,
        pause: Duration,
    }

    impl Read for Drip {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.left == 0 || buf.is_empty() {
                return Ok(0);
            }
            std::thread::sleep(self.pause);
            self.left -= 1;
            buf[0] = b'x';
            Ok(1)
        }
    }

    #[test]
    fn a_drip_is_ended_at_its_deadline_and_a_steady_answer_is_not() {
        let budget = Budget::new(Duration::from_millis(200), 1 << 20);
        let drip = Drip {
            left: 1000,
            pause: Duration::from_millis(20),
        };
        let mut out = Vec::new();
        let err = budget.reader(drip, 1000).read_to_end(&mut out).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(out.len() < 1000, "read it all: {}", out.len());
        let steady = Drip {
            left: 5,
            pause: Duration::ZERO,
        };
        let mut out = Vec::new();
        budget.reader(steady, 5).read_to_end(&mut out).unwrap();
        assert_eq!(out.len(), 5);
    }

    #[test]
    fn the_budget_grows_with_the_size() {
        let budget = Budget::new(Duration::from_secs(60), 64 << 10);
        assert_eq!(budget.for_bytes(0), Duration::from_secs(60));
        assert_eq!(budget.for_bytes(64 << 20), Duration::from_secs(60 + 1024));
        assert_eq!(
            Budget::new(Duration::MAX, 0).for_bytes(u64::MAX),
            Duration::MAX
        );
    }
}
