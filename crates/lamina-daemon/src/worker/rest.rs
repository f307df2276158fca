//! The rest of a blob, fetched on a miss: on a fast link a start without a
//! boot set waits on round trips, not bytes (at 1 Gbit/s the Node.js
//! start's misses waited 1.96 s of its 2.86 s, about 4 ms a request), so
//! once a start has waited on misses in a blob as long as the rest of the
//! blob takes at the link's rate, the rest comes in large ranges, several
//! in flight, beside the misses: the rule of renting until the rent paid
//! equals the price. A start that reads much of a blob waits at most about
//! twice what the better choice costs. Opt-in (`--fetch-rests`): it trades
//! bytes for time, and a start that reads little of a large blob also
//! pays the rent where misses are slow to serve (python3's start of the
//! Debian image, in debug builds, fetched 24-32 MB instead of 4 MB).
//!
//! Only chunks some file uses that nobody has filled or claimed are
//! fetched (a blob streamed whole instead read again what misses had
//! fetched: tried and not kept, docs/coldstart-heavy.md), in windows of
//! [`REST_WINDOW`] claimed one at a time, so a miss meets at most one
//! window in flight.

use super::*;

/// The slowest link (as `crate::predict::LinkRate` measures it) on which
/// the rest of a blob is fetched (a stream of a whole blob beside the
/// misses made the heavy starts 1.5-2.1x slower at 100 Mbit/s, 0.69-0.72x
/// at 1 Gbit/s).
const REST_MIN_RATE: f64 = 30e6;
/// A window that comes slower than this (about a 100 Mbit/s link) stops
/// the rest of every blob: the link is shared, or slow for large requests.
/// Below [`REST_MIN_RATE`], since a window's time includes verifying and
/// decoding its chunks (28 MB/s in a debug build on the CI machines while
/// test builds left the codecs unoptimized).
const REST_STOP_RATE: f64 = 12e6;
/// Blobs smaller than this are left to misses and predictions.
const REST_AT_LEAST: u64 = 4 << 20;
/// Compressed bytes claimed at a time: a miss that meets them waits for
/// this window only (about 75 ms at 1 Gbit/s).
const REST_WINDOW: u64 = 8 << 20;
/// Largest request of a window; a window's requests go in parallel.
const REST_REQUEST: u64 = 2 << 20;
/// A window that fetched less than this says little of the link (its round
/// trips take most of its time): it is not timed.
const REST_TIMED_AT_LEAST: u64 = 1 << 20;
/// Rests fetched at once, at most.
const REST_AT_ONCE: usize = 2;

impl Shared {
    /// A miss at chunk `at` of blob `blob`, with `--fetch-rests`, on a start
    /// without a boot set, with predictions on: once
    /// [`waited_long_enough_on`] the blob, the rest of it is fetched on a
    /// thread of its own, from `at` on and then from its start, once per
    /// blob, where the cache has room for background fills. Not through a P2P daemon (bulk goes whole through
    /// it), nor a tar index (spans decode with windows).
    ///
    /// [`waited_long_enough_on`]: Shared::waited_long_enough_on
    pub(super) fn fetch_rest_on_miss(&self, blob: u32, at: usize) {
        let wanted = self.config.fetch_rests
            && self.predict.is_some()
            && self.boot_set.is_empty()
            && self.config.boot_pages.is_empty()
            && !self.bulk_apart()
            && self.windows.is_none()
            && !self.rests_slow.load(Ordering::Relaxed)
            && !self.rest_asked[blob as usize].load(Ordering::Relaxed)
            && self.waited_long_enough_on(blob)
            && self.rests_running.load(Ordering::Relaxed) < REST_AT_ONCE
            && self.room_for_background();
        if !wanted || self.rest_asked[blob as usize].swap(true, Ordering::Relaxed) {
            return;
        }
        let Some(me) = self.me.get().and_then(std::sync::Weak::upgrade) else {
            return;
        };
        self.rests.fetch_add(1, Ordering::Relaxed);
        self.rests_running.fetch_add(1, Ordering::Relaxed);
        let spawned = std::thread::Builder::new()
            .name("blob-rest".into())
            .spawn(move || {
                tracing::debug!(blob, "misses waited as long as the rest takes: fetched");
                me.fetch_rest(blob, at);
                me.rests_running.fetch_sub(1, Ordering::Relaxed);
            });
        if let Err(e) = spawned {
            tracing::warn!(blob, "the rest of the blob: no thread: {e}");
            self.rests_running.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Whether blob `blob` is large enough ([`REST_AT_LEAST`]), the link
    /// fast enough ([`REST_MIN_RATE`]), and readers have waited on misses in
    /// it as long as the rest of it takes at the link's rate.
    fn waited_long_enough_on(&self, blob: u32) -> bool {
        let size = self.stores[blob as usize].summary.compressed_size;
        let missed = self.blob_missed[blob as usize].load(Ordering::Relaxed);
        let waited_ns = self.blob_waited_ns[blob as usize].load(Ordering::Relaxed);
        rent_paid(size, missed, waited_ns, self.link_rate.bps())
    }

    /// Fetches the chunks of blob `blob` nobody filled or claimed, from
    /// chunk `at` on and then from the start, a window at a time; stops
    /// when the cache reaches its reserve, a fetch fails (misses fetch
    /// their own chunks) or a window comes slower than [`REST_STOP_RATE`].
    fn fetch_rest(&self, blob: u32, at: usize) {
        // Not hedged, as fill-ahead's: a second request for 2 MiB is what
        // a shared link needs least, and both answers' bytes go on it.
        let opts = FetchOptions {
            max_request: REST_REQUEST,
            hedging: None,
            ..self.predict_fetch.clone()
        };
        let Ok(order) = self.rest_order(blob, at) else {
            return;
        };
        for window in windows_of(&order, REST_WINDOW) {
            // Another rest came slowly: this one stops too.
            if self.rests_slow.load(Ordering::Relaxed) || !self.room_for_background() {
                return;
            }
            let Ok(mine) = self.claim(blob, window.iter().map(|&(i, _)| i), None, false) else {
                return;
            };
            if mine.is_empty() {
                continue; // misses took them meanwhile
            }
            let started = Instant::now();
            let counted = FetchStats::default();
            let fetched = self.fetch_with(blob, &mine, None, &opts, Some(&counted));
            self.release(blob, &mine);
            add_stats(&self.rest_stats, &counted);
            if let Err(e) = fetched {
                tracing::warn!(blob, "the rest of the blob stopped: {e}; misses go on");
                return;
            }
            let bytes = counted.bytes.load(Ordering::Relaxed);
            if too_slow(bytes, started.elapsed()) {
                self.rests_slow.store(true, Ordering::Relaxed);
                tracing::info!(
                    blob,
                    bytes,
                    took_ms = started.elapsed().as_millis() as u64,
                    "the rest of the blob came slower than 12 MB/s: no more rests are fetched"
                );
                return;
            }
        }
    }

    /// The blob's chunks still unfilled that some file of the image uses
    /// (`FileMap::live`; none before the map is built), with their
    /// compressed sizes, in blob order from chunk `at` on, then those
    /// before it; none this mount's reads never ask of its cache file.
    fn rest_order(&self, blob: u32, at: usize) -> io::Result<Vec<(usize, u64)>> {
        let Some(map) = self.file_map.get() else {
            return Ok(Vec::new());
        };
        let store = self.lock_store(blob)?;
        let entries = &store.blob.chunks;
        let live: HashSet<usize> = map
            .live(blob)
            .iter()
            .flat_map(|r| store.chunks_covering(r.start, r.end - r.start))
            .collect();
        let mut order: Vec<usize> = live
            .into_iter()
            .filter(|&i| !store.is_filled(i) && !self.served_elsewhere.contains(&(blob, i)))
            .collect();
        order.sort_by_key(|&i| (entries[i].compressed_offset.get(), i));
        let first = order.partition_point(|&i| {
            let (offset, mine) = (entries[i].compressed_offset.get(), entries.get(at));
            mine.is_some_and(|m| offset < m.compressed_offset.get())
        });
        order.rotate_left(first);
        Ok(order
            .into_iter()
            .map(|i| (i, u64::from(entries[i].compressed_size.get())))
            .collect())
    }
}

/// The renting rule: a blob of `size` compressed bytes, `missed` of them
/// fetched for misses that waited `waited_ns` in all, on a link of
/// `link_bps`: whether the misses waited as long as the rest takes.
fn rent_paid(size: u64, missed: u64, waited_ns: u64, link_bps: u64) -> bool {
    let rate = link_bps as f64;
    if size < REST_AT_LEAST || rate < REST_MIN_RATE {
        return false;
    }
    waited_ns as f64 / 1e9 >= size.saturating_sub(missed) as f64 / rate
}

/// Whether `bytes` in `took` is slower than [`REST_STOP_RATE`], for at
/// least [`REST_TIMED_AT_LEAST`] bytes.
fn too_slow(bytes: u64, took: Duration) -> bool {
    bytes >= REST_TIMED_AT_LEAST && (bytes as f64) < REST_STOP_RATE * took.as_secs_f64()
}

/// `order` cut into windows of about `window` compressed bytes (each at
/// least one chunk).
fn windows_of(order: &[(usize, u64)], window: u64) -> Vec<&[(usize, u64)]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (k, &(_, size)) in order.iter().enumerate() {
        if k > start && bytes + size > window {
            out.push(&order[start..k]);
            (start, bytes) = (k, 0);
        }
        bytes += size;
    }
    if start < order.len() {
        out.push(&order[start..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rest_is_bought_once_the_rent_paid_equals_it() {
        let mb = 1_000_000;
        // 100 MB blob, 30 MB missed, 70 MB left at 100 MB/s: 0.7 s.
        assert!(!rent_paid(100 * mb, 30 * mb, 600_000_000, 100 * mb));
        assert!(rent_paid(100 * mb, 30 * mb, 700_000_000, 100 * mb));
        // A slow link or a small blob: never.
        assert!(!rent_paid(100 * mb, 30 * mb, u64::MAX, 29 * mb));
        assert!(!rent_paid(4 * mb, 0, u64::MAX, 100 * mb));
        // No rate measured yet: never.
        assert!(!rent_paid(100 * mb, 0, u64::MAX, 0));
        // All of it missed already: at once.
        assert!(rent_paid(100 * mb, 100 * mb, 0, 100 * mb));
    }

    #[test]
    fn a_window_under_the_least_rate_is_too_slow() {
        assert!(too_slow(1_199_999, Duration::from_millis(100)));
        assert!(!too_slow(1_200_000, Duration::from_millis(100)));
        // A window with little left to fetch is not timed.
        assert!(!too_slow(100_000, Duration::from_secs(1)));
        assert!(!too_slow(0, Duration::from_millis(1)));
    }

    #[test]
    fn windows_cut_by_bytes_keep_every_chunk_once() {
        let order: Vec<(usize, u64)> = (0..10).map(|i| (i, 3)).collect();
        let windows = windows_of(&order, 7);
        let sizes: Vec<usize> = windows.iter().map(|w| w.len()).collect();
        assert_eq!(sizes, [2, 2, 2, 2, 2]);
        let all: Vec<usize> = windows.concat().iter().map(|&(i, _)| i).collect();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        // A chunk larger than the window is a window of its own.
        let big = [(0, 10), (1, 1), (2, 10)];
        let sizes: Vec<usize> = windows_of(&big, 5).iter().map(|w| w.len()).collect();
        assert_eq!(sizes, [1, 1, 1]);
        assert!(windows_of(&[], 5).is_empty());
    }
}
