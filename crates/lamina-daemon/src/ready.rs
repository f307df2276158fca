//! The holder's map of what it may answer itself: the ranges of a mount's
//! cache files its worker announced as verified boot pages
//! ([`crate::protocol::Message::Ready`]).
//!
//! A start served from boot pages reads them a page at a time (readahead
//! is off while they serve it), each read a pre-content event. Asking the
//! worker about each one costs two more messages, an fd passed and a
//! thread woken; answered here, an event costs the holder a lookup.
//! Announced bytes stay valid for the mount's life: a mount's cache files
//! are never cut or rewritten while it lives, and the map is dropped with
//! a blob once it is complete (then no event comes at all).

use std::collections::HashMap;
use std::ops::Range;

use rangemap::RangeSet;

/// Ranges of each blob (by device index) that may be read.
#[derive(Debug, Default)]
pub(crate) struct ReadyRanges {
    blobs: HashMap<u32, RangeSet<u64>>,
    /// Events answered from this map, since the mount.
    pub(crate) answered: u64,
    /// Events of the worker's own writes and reads, since the mount.
    pub(crate) worker_events: u64,
}

impl ReadyRanges {
    /// Notes that `range` of `blob` may be read.
    pub(crate) fn add(&mut self, blob: u32, range: Range<u64>) {
        if !range.is_empty() {
            self.blobs.entry(blob).or_default().insert(range);
        }
    }

    /// Whether every byte of `[offset, offset + count)` of `blob` may be
    /// read (an empty read: its first byte).
    pub(crate) fn covers(&self, blob: u32, offset: u64, count: u64) -> bool {
        let end = offset.saturating_add(count.max(1));
        self.blobs
            .get(&blob)
            .and_then(|set| set.get(&offset))
            .is_some_and(|r| r.end >= end)
    }

    /// Forgets `blob` (complete: its reads no longer come here).
    pub(crate) fn forget(&mut self, blob: u32) {
        self.blobs.remove(&blob);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_is_covered_only_within_announced_ranges_of_its_blob() {
        let mut ready = ReadyRanges::default();
        assert!(!ready.covers(0, 0, 4096));
        ready.add(0, 4096..8192);
        ready.add(0, 8192..16384);
        ready.add(0, 20480..20480);
        assert!(ready.covers(0, 4096, 12288), "adjacent runs join");
        assert!(ready.covers(0, 16383, 0));
        assert!(!ready.covers(0, 16384, 0));
        assert!(!ready.covers(0, 0, 4096));
        assert!(!ready.covers(0, 12288, 8192), "runs past the end");
        assert!(!ready.covers(1, 4096, 4096), "another blob");
        assert!(!ready.covers(0, u64::MAX, 10));
        ready.forget(0);
        assert!(!ready.covers(0, 4096, 4096));
    }
}
