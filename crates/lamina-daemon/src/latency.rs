//! How long readers waited on misses: fixed-bucket histogram counts, kept
//! in atomics by the worker and written into `status.json`, from which
//! metrics are made (`lamina_mount::metrics`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets, in seconds: 1 ms to 10 s, then +Inf.
pub const BOUNDS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A histogram as written to `status.json`. A file written before
/// histograms existed parses as an empty one (no bounds, no counts).
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Histogram {
    /// Upper bounds of the buckets but the last (+Inf), in seconds; written
    /// with the counts so that a reader never assumes them.
    pub bounds: Vec<f64>,
    /// Observations per bucket, not cumulative: one more than `bounds`.
    pub counts: Vec<u64>,
    /// Sum of all observations, in seconds.
    pub sum: f64,
}

impl Histogram {
    /// Observations in all.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Whether the bounds and counts agree (a hand-edited or future file
    /// might not).
    pub fn is_well_formed(&self) -> bool {
        self.counts.len() == self.bounds.len() + 1
    }

    /// Adds `other` into `self`. An empty `self` takes `other`'s bounds; a
    /// histogram with other bounds cannot be added and is left out
    /// (returns false).
    pub fn merge(&mut self, other: &Histogram) -> bool {
        if !other.is_well_formed() {
            return false;
        }
        if self.counts.is_empty() {
            self.bounds = other.bounds.clone();
            self.counts = vec![0; other.counts.len()];
        }
        if self.bounds != other.bounds {
            return false;
        }
        for (into, from) in self.counts.iter_mut().zip(&other.counts) {
            *into += from;
        }
        self.sum += other.sum;
        true
    }

    /// (upper bound, count) per bucket, the last one +Inf: what a
    /// Prometheus encoder takes.
    pub fn buckets(&self) -> Vec<(f64, u64)> {
        self.bounds
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(self.counts.iter().copied())
            .collect()
    }
}

/// The live histogram: lock-free, so that serving threads never wait on it.
#[derive(Debug, Default)]
pub struct Recorder {
    counts: [AtomicU64; BOUNDS.len() + 1],
    sum_micros: AtomicU64,
}

impl Recorder {
    /// Counts one wait.
    pub fn observe(&self, waited: Duration) {
        let secs = waited.as_secs_f64();
        let bucket = BOUNDS
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(BOUNDS.len());
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        let micros = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    /// The counts so far.
    pub fn snapshot(&self) -> Histogram {
        Histogram {
            bounds: BOUNDS.to_vec(),
            counts: self
                .counts
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
            sum: self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_land_in_the_first_bucket_that_holds_them() {
        let r = Recorder::default();
        r.observe(Duration::from_micros(500)); // <= 1 ms
        r.observe(Duration::from_millis(1)); // a bound is inclusive
        r.observe(Duration::from_millis(30)); // <= 50 ms
        r.observe(Duration::from_secs(11)); // +Inf
        let h = r.snapshot();
        assert!(h.is_well_formed());
        assert_eq!(h.count(), 4);
        assert_eq!(h.counts[0], 2);
        assert_eq!(h.counts[5], 1);
        assert_eq!(h.counts[BOUNDS.len()], 1);
        assert!((h.sum - 11.0315).abs() < 1e-9, "{}", h.sum);
        let buckets = h.buckets();
        assert_eq!(buckets.len(), BOUNDS.len() + 1);
        assert_eq!(buckets[BOUNDS.len()], (f64::INFINITY, 1));
    }

    #[test]
    fn merging_adds_like_bounds_and_refuses_others() {
        let r = Recorder::default();
        r.observe(Duration::from_millis(3));
        let mut total = Histogram::default();
        assert!(total.merge(&r.snapshot()));
        assert!(total.merge(&r.snapshot()));
        assert_eq!(total.count(), 2);
        assert_eq!(total.counts[2], 2);
        let odd = Histogram {
            bounds: vec![1.0],
            counts: vec![1, 0],
            sum: 0.5,
        };
        assert!(!total.merge(&odd), "other bounds");
        assert!(!total.merge(&Histogram::default()), "an old status file");
        assert_eq!(total.count(), 2);
    }

    #[test]
    fn a_status_file_without_a_histogram_still_parses() {
        let old = r#"{"pid":1,"image":"i","mountpoint":"/m","fetched_bytes":1,"requests":1,
            "misses":1,"failed_misses":0,"bad_chunks":0,"cached_bytes":1,"total_bytes":2,
            "prefetch_done":0,"prefetch_total":0,"blobs":[]}"#;
        let s: crate::worker::Status = serde_json::from_str(old).unwrap();
        assert_eq!(s.miss_latency, Histogram::default());
    }
}
