//! Fetching ahead of a reader that reads a blob in order.
//!
//! A workload that reads most of an image (a build, a scan, `find -exec
//! cat`) reads files in directory order, and the converter lays their data
//! out in that order too: each blob is then read front to back, one small
//! file after another. Served miss by miss, that is one round trip per file
//! (thousands); detected as a stream, it is a few large requests fetched
//! ahead of the reader while it reads what already landed, as the kernel's
//! readahead does for one file.
//!
//! One [`Stream`] per blob watches the chunks each read touches (landed or
//! not): reads that keep moving forward, with small gaps, make a stream;
//! after [`STREAK`] of them the first window is fetched, and each next one,
//! twice as large up to the configured maximum, once the reader is within
//! half a window of the end of what was requested. A read elsewhere (a file deduplicated with
//! an earlier one, another layer) does not break the stream; only a run of
//! them does, which resets the window. Scattered reads (a start) never
//! reach the streak and cost nothing.

use std::ops::Range;

/// Sequential reads before the first window is fetched.
pub const STREAK: u32 = 6;
/// The first window's size, in cache bytes.
pub const FIRST_WINDOW: u64 = 512 << 10;
/// A read this many chunks beyond the stream's end still continues it
/// (files never read, such as those a later layer replaced).
const SKIP: usize = 4;
/// Reads elsewhere in a row that end the stream.
const STRAYS: u32 = 8;

/// The read state of one blob.
#[derive(Debug, Default)]
pub struct Stream {
    /// The chunk after the furthest one the stream read.
    next: usize,
    /// The chunk after the last one requested ahead.
    ahead_end: usize,
    /// Sequential reads in a row (strays aside).
    streak: u32,
    /// Reads elsewhere since the last sequential one.
    strays: u32,
    /// Size of the last window requested; 0 until the stream starts.
    window: u64,
}

impl Stream {
    /// Takes note of a read of `chunks` in a blob of `count` chunks whose
    /// chunk `i` holds `size(i)` bytes, and returns the chunks to fetch
    /// ahead of it, if any, fetching at most `max` bytes at a time.
    pub fn observe(
        &mut self,
        chunks: Range<usize>,
        count: usize,
        max: u64,
        size: impl Fn(usize) -> u64,
    ) -> Option<Range<usize>> {
        if max == 0 || chunks.is_empty() {
            return None;
        }
        let frontier = self.next.max(self.ahead_end);
        if chunks.start >= self.next && chunks.start <= frontier + SKIP {
            self.streak += 1;
            self.strays = 0;
            self.next = chunks.end;
        } else if chunks.end <= self.next
            && (self.streak >= STREAK || chunks.start + 2 >= self.next)
        {
            // Behind the stream (an earlier file's chunk), or the rest of
            // the last chunk read: neither.
            return None;
        } else {
            // A stream survives a few reads elsewhere; a candidate does not.
            self.strays += 1;
            if self.streak >= STREAK && self.strays < STRAYS {
                return None;
            }
            *self = Stream {
                next: chunks.end,
                ahead_end: chunks.end,
                streak: 1,
                ..Stream::default()
            };
            return None;
        }
        if self.streak < STREAK {
            return None;
        }
        let from = self.ahead_end.max(self.next);
        let left: u64 = (self.next..from).map(&size).sum();
        if from >= count || (self.window > 0 && left > self.window / 2) {
            return None;
        }
        self.window = match self.window {
            0 => FIRST_WINDOW.min(max),
            w => (w * 2).min(max),
        };
        let mut to = from;
        let mut bytes = 0;
        while to < count && bytes < self.window {
            bytes += size(to);
            to += 1;
        }
        self.ahead_end = to;
        Some(from..to)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNK: u64 = 64 << 10;
    const MAX: u64 = 4 << 20;

    fn read(s: &mut Stream, at: usize) -> Option<Range<usize>> {
        s.observe(at..at + 1, 10_000, MAX, |_| CHUNK)
    }

    #[test]
    fn reading_in_order_fetches_growing_windows_ahead() {
        let mut s = Stream::default();
        let mut fetched = Vec::new();
        for i in 0..400 {
            if let Some(r) = read(&mut s, i) {
                assert!(r.start > i, "ahead of the reader: {r:?} at {i}");
                fetched.push(r);
            }
        }
        assert_eq!(fetched[0].start, STREAK as usize);
        let sizes: Vec<u64> = fetched.iter().map(|r| r.len() as u64 * CHUNK).collect();
        assert_eq!(sizes[..4], [FIRST_WINDOW, 1 << 20, 2 << 20, 4 << 20]);
        assert!(sizes[4..].iter().all(|&b| b == MAX), "{sizes:?}");
        // Windows follow one another without gaps or overlaps.
        for w in fetched.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        // Only what the reader is near is requested.
        assert!(fetched.last().unwrap().end <= 400 + 3 * (MAX / CHUNK) as usize / 2);
    }

    #[test]
    fn chunks_read_in_several_reads_make_a_stream() {
        let mut s = Stream::default();
        let mut first = None;
        for i in 0..20 {
            for _ in 0..2 {
                if let Some(r) = read(&mut s, i) {
                    first.get_or_insert((i, r));
                }
            }
        }
        assert_eq!(first.map(|f| f.0), Some(STREAK as usize - 1));
    }

    #[test]
    fn scattered_reads_fetch_nothing() {
        let mut s = Stream::default();
        let mut x: usize = 7;
        for _ in 0..1000 {
            x = (x * 7919 + 13) % 9973;
            assert_eq!(read(&mut s, x), None);
        }
    }

    #[test]
    fn a_few_reads_elsewhere_keep_the_stream() {
        let mut s = Stream::default();
        let mut fetched = 0;
        for i in 0..200 {
            fetched += read(&mut s, i).map_or(0, |r| r.len());
            if i % 10 == 0 {
                // A deduplicated file's chunk far back, then one far ahead.
                assert_eq!(read(&mut s, 3), None);
                assert_eq!(read(&mut s, 9000), None);
            }
        }
        assert!(fetched > 100, "the stream went on: {fetched} chunks ahead");
    }

    #[test]
    fn a_run_of_reads_elsewhere_starts_over() {
        let mut s = Stream::default();
        for i in 0..50 {
            read(&mut s, i);
        }
        for k in 0..STRAYS as usize {
            assert_eq!(read(&mut s, 5000 + 100 * k), None);
        }
        // A new stream needs its own streak, and starts at the first window.
        let mut first = None;
        for i in 6000..6010 {
            if let Some(r) = read(&mut s, i) {
                first.get_or_insert(r);
            }
        }
        let first = first.expect("a new stream");
        assert_eq!(first.len() as u64 * CHUNK, FIRST_WINDOW);
    }

    #[test]
    fn windows_stop_at_the_blob_end_and_zero_disables() {
        let mut s = Stream::default();
        let mut last = 0..0;
        for i in 0..20 {
            if let Some(r) = s.observe(i..i + 1, 20, MAX, |_| CHUNK) {
                last = r;
            }
        }
        assert_eq!(last.end, 20);
        let mut off = Stream::default();
        assert!((0..100).all(|i| off.observe(i..i + 1, 100, 0, |_| CHUNK).is_none()));
    }
}
