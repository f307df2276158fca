//! A whole blob in one request, through a bulk_only host (a P2P daemon),
//! for `--prefetch all` or a reader reading the blob in order: its bytes
//! are read in order and each chunk still wanted when the stream reaches
//! it is verified and filled. A Dragonfly task's seed fetches what the task
//! was first asked for, and every range is a download of its own that goes
//! to the registry from each node when the seed lacks its pieces; a blob
//! asked for whole is fetched by the seed once for the fleet
//! (docs/dragonfly.md). Without a P2P host that answers, nothing is
//! streamed: the chunks go in ranges, as a lazy mount fetches them.

use std::collections::VecDeque;
use std::io::Read;

use lamina_fetch::fetch::decode_chunk;
use lamina_format::index::ChunkEntry;

use super::*;

/// Compressed bytes of wanted chunks claimed ahead of the stream: a miss on
/// one of them waits for the stream (at 100 Mbit/s, well under a second
/// away), a miss further on fetches its chunks itself.
const CLAIM_AHEAD: u64 = 8 << 20;

/// Blobs smaller than this are not streamed for a reader: a P2P task
/// waits about a third of a second before its first byte, the time the
/// registry takes to send 4 MiB at 100 Mbit/s; their ranges go straight.
const STREAM_AT_LEAST: u64 = 4 << 20;

/// How long a miss on a blob whose stream is opening waits for it before
/// fetching its chunks in ranges. Eight nodes asking one fleet's dfdaemons
/// for the same blobs at once waited about 2 s for the answer on the test
/// machine, while each node's misses sent about 1 MB per blob straight to
/// the registry (docs/dragonfly.md); a lone node waits about a third of a
/// second.
const STREAM_OPEN_WAIT: Duration = Duration::from_secs(5);

/// How many times a stream cut short is asked for again, and after how
/// long: a P2P daemon breaks its answer when its scheduler sends it to the
/// registry, and serves the next request from the task it fetches then.
const STREAM_TRIES: usize = 1;
const STREAM_AGAIN_AFTER: Duration = Duration::from_millis(200);

/// Why a stream stopped: cut short (its bytes stopped coming: asked for
/// again) or failed (a chunk that does not verify, the cache: not).
enum StreamStop {
    Cut(io::Error),
    Failed(io::Error),
}

/// A stream that has brought nothing for this long has stalled: a miss on
/// chunks it claimed fetches them in ranges. Longer than a P2P piece's
/// wait while its seed fetches three blobs at once at 100 Mbit/s (4 MiB
/// pieces, about 1 s each).
const STREAM_STALLED_AFTER: Duration = Duration::from_secs(2);

/// `Shared::streaming` states: never streamed, a stream asked for and not
/// yet answered, a stream running, streamed.
const NOT_STREAMED: u8 = 0;
const OPENING: u8 = 1;
const STREAMING: u8 = 2;
const STREAMED: u8 = 3;

/// A blob's bytes read in order, with the span of the last chunk asked for
/// kept (entries may share stored bytes).
struct InOrder {
    reader: Box<dyn Read + Send>,
    /// Blob offset of `buf[0]`.
    start: u64,
    buf: Vec<u8>,
    /// Bytes taken from `reader`.
    read: u64,
}

impl InOrder {
    /// The `len` bytes at `offset`, which must not lie before the last
    /// offset asked for.
    fn bytes_at(&mut self, offset: u64, len: usize) -> io::Result<&[u8]> {
        if offset < self.start {
            return Err(io::Error::other("a chunk lies behind the stream"));
        }
        let end = self.start + self.buf.len() as u64;
        if offset >= end {
            let gap = offset - end;
            let skipped = io::copy(&mut (&mut self.reader).take(gap), &mut io::sink())?;
            self.read += skipped;
            if skipped < gap {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            self.buf.clear();
        } else {
            self.buf.drain(..(offset - self.start) as usize);
        }
        self.start = offset;
        if self.buf.len() < len {
            let have = self.buf.len();
            self.buf.resize(len, 0);
            self.reader.read_exact(&mut self.buf[have..])?;
            self.read += (len - have) as u64;
        }
        Ok(&self.buf[..len])
    }
}

impl Shared {
    /// Streams each blob of `rest` (blob, chunk) whole, up to `streams`
    /// blobs at once; the (blob, chunk) pairs left to fetch in ranges.
    pub(super) fn stream_blobs(&self, rest: &[(u32, usize)], streams: usize) -> Vec<(u32, usize)> {
        let mut by_blob: Vec<(u32, Vec<usize>)> = Vec::new();
        for &(b, i) in rest {
            match by_blob.iter_mut().find(|(blob, _)| *blob == b) {
                Some((_, chunks)) => chunks.push(i),
                None => by_blob.push((b, vec![i])),
            }
        }
        let next = AtomicUsize::new(0);
        let left = Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for _ in 0..streams.min(by_blob.len()) {
                scope.spawn(|| {
                    while let Some((blob, chunks)) =
                        by_blob.get(next.fetch_add(1, Ordering::Relaxed))
                    {
                        let unsettled = match self.room_for_background() {
                            true => self.stream_blob(*blob, chunks),
                            false => chunks.clone(),
                        };
                        let settled = chunks.len().saturating_sub(unsettled.len());
                        self.prefetch_done
                            .fetch_add(settled as u64, Ordering::Relaxed);
                        if let Ok(mut left) = left.lock() {
                            left.extend(unsettled.into_iter().map(|i| (*blob, i)));
                        }
                    }
                });
            }
        });
        left.into_inner().unwrap_or_default()
    }

    /// Whether blob `blob` is being streamed whole (or was): what a miss,
    /// a prediction or a prefetch would fetch of it in ranges comes with
    /// the stream, and only the chunks a reader waits for are fetched.
    pub(super) fn is_streaming(&self, blob: u32) -> bool {
        self.streaming
            .get(blob as usize)
            .is_some_and(|s| s.load(Ordering::Relaxed) == STREAMING)
            || self.stream_opening_until(blob).is_some()
    }

    /// While blob `blob`'s stream is asked for and not yet answered, and for
    /// at most [`STREAM_OPEN_WAIT`] after it was asked for: until when. A
    /// P2P daemon that hangs costs the blob's readers that once, not each
    /// miss; past it the blob is read as if no stream were coming.
    fn stream_opening_until(&self, blob: u32) -> Option<Instant> {
        let state = self.streaming.get(blob as usize)?;
        let asked = self.stream_asked_ms.get(blob as usize)?;
        if state.load(Ordering::Relaxed) != OPENING {
            return None;
        }
        let asked = Duration::from_millis(asked.load(Ordering::Relaxed));
        let until = self.started + asked + STREAM_OPEN_WAIT;
        (Instant::now() < until).then_some(until)
    }

    /// Waits while blob `blob`'s stream is asked for and not yet answered
    /// ([`stream_opening_until`](Self::stream_opening_until)): once it runs,
    /// the chunks it has claimed come with it, and a miss fetching them in
    /// ranges meanwhile would send the same bytes to the registry from every
    /// node.
    pub(super) fn wait_stream_open(&self, blob: u32) -> io::Result<()> {
        let mut waited = false;
        while let Some(until) = self.stream_opening_until(blob) {
            waited = true;
            let left = until.saturating_duration_since(Instant::now());
            // A state change notifies `landed`; the tick bounds a missed one.
            self.wait_landed(left.min(Duration::from_millis(50)))?;
        }
        if waited && self.streaming[blob as usize].load(Ordering::Relaxed) == OPENING {
            tracing::info!(
                blob,
                "the blob's stream did not answer in {STREAM_OPEN_WAIT:?}; its misses go in ranges"
            );
        }
        Ok(())
    }

    /// Notes that blob `blob`'s stream is being asked for now.
    fn note_stream_asked(&self, blob: u32) {
        self.stream_asked_ms[blob as usize].store(self.elapsed_ms(), Ordering::Relaxed);
        self.note_stream_moved(blob);
    }

    /// Notes that blob `blob`'s stream brought bytes (or opened) now.
    fn note_stream_moved(&self, blob: u32) {
        self.stream_moved_ms[blob as usize].store(self.elapsed_ms(), Ordering::Relaxed);
    }

    /// Whether blob `blob` is being streamed and its stream has brought
    /// nothing for [`STREAM_STALLED_AFTER`]: a P2P daemon's piece waiting for a
    /// parent, a connection that stopped. A miss on chunks it claimed then
    /// fetches them in ranges (`serve_miss`) instead of waiting up to the
    /// stream's read timeout, which is also the miss's own deadline.
    pub(super) fn stream_stalled(&self, blob: u32) -> bool {
        let (Some(state), Some(moved)) = (
            self.streaming.get(blob as usize),
            self.stream_moved_ms.get(blob as usize),
        ) else {
            return false;
        };
        let quiet = self
            .elapsed_ms()
            .saturating_sub(moved.load(Ordering::Relaxed));
        state.load(Ordering::Relaxed) == STREAMING
            && quiet >= STREAM_STALLED_AFTER.as_millis() as u64
    }

    /// A reader is reading blob `blob` in order, through a node whose
    /// bulk reads go to a P2P daemon: the blob comes whole, once, in one
    /// request on a thread of its own (started once per blob), instead of
    /// windows of ranges ahead of the reader. Returns false where that is
    /// not how this mount fetches ahead (the caller queues a window).
    pub(super) fn stream_for_reader(&self, blob: u32) -> bool {
        let small = self.stores[blob as usize].summary.compressed_size < STREAM_AT_LEAST;
        if !self.bulk_apart() || self.windows.is_some() || small {
            return false;
        }
        // Once per blob: after its stream the blob is whole, or the stream
        // failed (or did not answer in time) and windows go ahead of the
        // reader in ranges.
        let state = &self.streaming[blob as usize];
        if state
            .compare_exchange(NOT_STREAMED, OPENING, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return self.is_streaming(blob);
        }
        self.note_stream_asked(blob);
        let Some(me) = self.me.get().and_then(std::sync::Weak::upgrade) else {
            state.store(NOT_STREAMED, Ordering::Relaxed);
            return false;
        };
        let spawned = std::thread::Builder::new()
            .name("blob-stream".into())
            .spawn(move || {
                let count = me.stores[blob as usize].summary.chunk_count;
                let chunks: Vec<usize> = (0..count)
                    .filter(|&i| !me.served_elsewhere.contains(&(blob, i)))
                    .collect();
                tracing::debug!(
                    blob,
                    "read in order: the whole blob streamed through the P2P host"
                );
                let left = me.stream_blob(blob, &chunks);
                // Also when the stream never started (it set nothing).
                me.streaming[blob as usize].store(STREAMED, Ordering::Relaxed);
                me.landed.notify_all();
                tracing::debug!(blob, left = left.len(), "blob stream over");
            });
        if spawned.is_err() {
            state.store(STREAMED, Ordering::Relaxed);
        }
        spawned.is_ok()
    }

    /// Streams blob `blob` whole from the bulk source and fills the chunks
    /// of `wanted` that nobody has filled or claimed by the time the stream
    /// reaches them ([`CLAIM_AHEAD`] bytes of them are claimed ahead).
    /// Returns the chunks of `wanted` the stream did not settle, for the
    /// caller to fetch in ranges: all of them when the source has no
    /// whole-blob read, the rest when the stream fails.
    pub(super) fn stream_blob(&self, blob: u32, wanted: &[usize]) -> Vec<usize> {
        let (entries, key) = match self.lock_store(blob) {
            Ok(store) => (store.blob.chunks.clone(), store.key),
            Err(_) => return wanted.to_vec(),
        };
        let order: Vec<usize> = wanted
            .iter()
            .copied()
            .filter(|&i| i < entries.len())
            .collect();
        // Chunks this node holds already are copied, not streamed; a blob
        // a reader's stream filled is not asked for again.
        let mut order = match self.copy_located(blob, (&entries, &key), &order, None) {
            Ok(rest) => rest,
            Err(_) => order,
        };
        if let Ok(store) = self.lock_store(blob) {
            order.retain(|&i| !store.is_filled(i));
        }
        if order.is_empty() {
            return order;
        }
        order.sort_by_key(|&i| (entries[i].compressed_offset.get(), i));
        let digest = &self.digests[blob as usize];
        let state = &self.streaming[blob as usize];
        self.note_stream_asked(blob);
        state.store(OPENING, Ordering::Relaxed);
        let opened = self.source.stream_blob(digest);
        let reader = match opened {
            Ok(Some(reader)) => reader,
            Ok(None) | Err(_) => {
                // Not streamed: a reader's in-order reads may ask again.
                state.store(NOT_STREAMED, Ordering::Relaxed);
                self.landed.notify_all();
                if let Err(e) = opened {
                    tracing::warn!(
                        blob,
                        "prefetch of the whole blob: {e}; fetching it in ranges"
                    );
                }
                return order;
            }
        };
        self.note_stream_moved(blob);
        state.store(STREAMING, Ordering::Relaxed);
        self.landed.notify_all();
        self.stream_until_done(blob, (&entries, &key), &mut order, reader);
        state.store(STREAMED, Ordering::Relaxed);
        self.landed.notify_all();
        self.check_complete(blob);
        order
    }

    /// Fills `order`'s chunks from `reader`, the blob's stream; a stream
    /// cut short is asked for once more ([`STREAM_AGAIN_AFTER`] later): a
    /// P2P daemon whose peer the scheduler sent to the registry mid-way
    /// breaks its answer (dragonfly-client 1.5.10: `error decoding response
    /// body`, after 0 bytes or 8 MB), and the task it then fetches serves
    /// the next request, where ranges would each go to the registry
    /// (docs/dragonfly.md). Leaves in `order` what is still not filled.
    fn stream_until_done(
        &self,
        blob: u32,
        (entries, key): (&[ChunkEntry], &lamina_fetch::store::EntryKey),
        order: &mut Vec<usize>,
        mut reader: Box<dyn Read + Send>,
    ) {
        for attempt in 1.. {
            self.stats.requests.fetch_add(1, Ordering::Relaxed);
            let mut stream = InOrder {
                reader,
                start: 0,
                buf: Vec::new(),
                read: 0,
            };
            let settled = self.fill_from_stream(blob, (entries, key), order, &mut stream);
            self.stats.bytes.fetch_add(stream.read, Ordering::Relaxed);
            // Also what a miss was fetching when the stream passed it, and lost.
            if let Ok(store) = self.lock_store(blob) {
                order.retain(|&i| !store.is_filled(i));
            }
            let (e, cut) = match settled {
                Ok(()) => return,
                Err(StreamStop::Cut(e)) => (e, true),
                Err(StreamStop::Failed(e)) => (e, false),
            };
            let read = stream.read;
            if !cut || attempt > STREAM_TRIES || order.is_empty() {
                tracing::warn!(
                    blob,
                    "prefetch of the whole blob stopped after {read} bytes: {e}; the rest in ranges"
                );
                return;
            }
            tracing::warn!(
                blob,
                "prefetch of the whole blob stopped after {read} bytes: {e}; asking for it again"
            );
            std::thread::sleep(STREAM_AGAIN_AFTER);
            reader = match self.source.stream_blob(&self.digests[blob as usize]) {
                Ok(Some(reader)) => {
                    self.note_stream_moved(blob);
                    reader
                }
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(
                        blob,
                        "prefetch of the whole blob, again: {e}; the rest in ranges"
                    );
                    return;
                }
            };
        }
    }

    /// The loop of [`stream_blob`](Self::stream_blob); on failure its
    /// claims are released.
    fn fill_from_stream(
        &self,
        blob: u32,
        (entries, key): (&[ChunkEntry], &lamina_fetch::store::EntryKey),
        order: &[usize],
        stream: &mut InOrder,
    ) -> Result<(), StreamStop> {
        let mut claimed: VecDeque<usize> = VecDeque::new();
        let (mut next, mut ahead) = (0, 0u64);
        let mut decompressor = zstd::bulk::Decompressor::new().map_err(StreamStop::Failed)?;
        for (k, &i) in order.iter().enumerate() {
            while next < order.len() && (next <= k || ahead < CLAIM_AHEAD) {
                let c = order[next];
                if let Ok(mine) = self.claim(blob, std::iter::once(c), None, false) {
                    if !mine.is_empty() {
                        claimed.push_back(c);
                        ahead += u64::from(entries[c].compressed_size.get());
                    }
                }
                next += 1;
            }
            let ours = claimed.front() == Some(&i);
            let entry = &entries[i];
            let filled = stream
                .bytes_at(
                    entry.compressed_offset.get(),
                    entry.compressed_size.get() as usize,
                )
                .map_err(StreamStop::Cut)
                .inspect(|_| self.note_stream_moved(blob))
                .and_then(|stored| match ours {
                    false => Ok(()),
                    true => {
                        let data = decode_chunk(&mut decompressor, entry, stored).map_err(|e| {
                            StreamStop::Failed(io::Error::other(format!("chunk {i}: {e}")))
                        })?;
                        self.lock_store(blob)
                            .and_then(|mut store| store.fill(i, &data, None))
                            .map_err(StreamStop::Failed)?;
                        self.note_located(entry, key);
                        Ok(())
                    }
                });
            if ours {
                claimed.pop_front();
                ahead -= u64::from(entry.compressed_size.get());
                self.release(blob, &[i]);
            }
            if let Err(e) = filled {
                let rest: Vec<usize> = claimed.into_iter().collect();
                self.release(blob, &rest);
                return Err(e);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(bytes: &[u8]) -> InOrder {
        InOrder {
            reader: Box::new(io::Cursor::new(bytes.to_vec())),
            start: 0,
            buf: Vec::new(),
            read: 0,
        }
    }

    #[test]
    fn chunks_in_blob_order_skip_gaps_and_share_bytes() {
        let blob: Vec<u8> = (0..=255u8).collect();
        let mut s = stream(&blob);
        assert_eq!(s.bytes_at(10, 5).unwrap(), &blob[10..15]);
        // Two entries sharing stored bytes, then one overlapping them.
        assert_eq!(s.bytes_at(20, 8).unwrap(), &blob[20..28]);
        assert_eq!(s.bytes_at(20, 8).unwrap(), &blob[20..28]);
        assert_eq!(s.bytes_at(24, 10).unwrap(), &blob[24..34]);
        assert_eq!(s.bytes_at(250, 6).unwrap(), &blob[250..256]);
        assert_eq!(s.read, 256, "every byte read once");
    }

    #[test]
    fn a_chunk_behind_the_stream_or_past_its_end_is_an_error() {
        let blob = vec![7u8; 100];
        let mut s = stream(&blob);
        s.bytes_at(50, 10).unwrap();
        assert!(s.bytes_at(40, 5).is_err(), "behind the stream");
        let mut s = stream(&blob);
        let short = s.bytes_at(90, 20).unwrap_err();
        assert_eq!(short.kind(), io::ErrorKind::UnexpectedEof);
        let mut s = stream(&blob);
        let gap = s.bytes_at(200, 1).unwrap_err();
        assert_eq!(gap.kind(), io::ErrorKind::UnexpectedEof);
    }
}
