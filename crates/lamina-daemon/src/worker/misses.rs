//! Serving a miss: claim the chunks (across mounts sharing the cache file),
//! fetch what no one else is fetching, answer as soon as the range is
//! filled by anyone, hedge towards other mounts' registries.

use super::*;

impl Shared {
    /// Serves one miss and answers its reader.
    pub(super) fn serve_job(self: &Arc<Self>, job: Job) {
        let Job {
            id,
            blob,
            offset,
            count,
            file,
            response_fd,
            received,
        } = job;
        let errno = match self.serve_miss(blob, offset, count, file.as_ref()) {
            Ok(()) => 0,
            Err(e) => {
                tracing::error!(
                    blob,
                    offset,
                    count,
                    "blob {blob} bytes {offset}+{count}: {e}; reader gets EIO"
                );
                self.failed.fetch_add(1, Ordering::Relaxed);
                libc::EIO
            }
        };
        self.answer(id, response_fd, errno);
        let waited = received.elapsed();
        self.miss_latency.observe(waited);
        tracing::debug!(
            blob,
            offset,
            count,
            errno,
            waited_ms = waited.as_secs_f64() * 1e3,
            "miss answered"
        );
        self.active_misses.fetch_sub(1, Ordering::Relaxed);
    }

    /// Fills the chunks under `[offset, offset + count)` (and the rest of the
    /// fill window around it), writing through the event's `file`. Chunks
    /// that another thread or another mount sharing the cache file is
    /// fetching are waited for and then verified, fetched here too only
    /// once another mount has held them for [`HEDGE_AFTER`]; a fetch that
    /// fails leaves its chunks to the next claimant.
    ///
    /// Mounts of one cache file share its inode, so every mount's worker is
    /// asked about every read of it, and the read fails if any of them
    /// says EIO. So the miss is answered as soon as its chunks are filled
    /// by anyone (verified here), even while this worker's own fetch is
    /// still on its way; and this worker's failure fails the read only when
    /// no other mount is fetching those chunks. A dead registry, expired
    /// credentials or a slow link of one mount never fail, and do not delay
    /// beyond the hedge, a read another mount can serve.
    pub(super) fn serve_miss(
        self: &Arc<Self>,
        blob: u32,
        offset: u64,
        count: u64,
        file: Option<&File>,
    ) -> io::Result<()> {
        if let Some(trace) = &self.trace {
            // A trace that cannot be written must not fail the reader.
            if let Err(e) = self.record(trace, blob, offset, count) {
                tracing::warn!("trace: {e}");
            }
        }
        let (needed, window) = {
            let store = self.lock_store(blob)?;
            let needed = store.chunks_covering(offset, count.max(1));
            // Landed reads count too: a stream reads mostly what was
            // fetched ahead of it, and must see its reader come near the end.
            self.read_ahead_of(blob, &store, needed.clone());
            if store.range_ready(offset, count) {
                return Ok(());
            }
            drop(store);
            if self.wait_boot_pages(blob, offset, count, needed.clone())? {
                return Ok(());
            }
            self.fetch_rest_on_miss(blob, needed.start);
            self.predict_from(blob, offset, &needed);
            // A stream not answered yet may still bring these chunks; one
            // that did not answer in time leaves the blob to windows.
            self.wait_stream_open(blob)?;
            if self.is_streaming(blob) {
                // The rest of the window comes with the blob's stream.
                (needed.clone(), needed)
            } else {
                let store = self.lock_store(blob)?;
                let w = self.config.fill_window.max(1);
                let start = offset / w * w;
                let win = store.chunks_covering(start, w.max(offset + count - start));
                (needed, win)
            }
        };
        let started = Instant::now();
        let deadline = started + Duration::from_secs(self.config.timeout_secs);
        let mut wanted: Vec<usize> = window.chain(needed.clone()).collect();
        let (mut own, mut borrowed, mut straight) = (Fetch::NotYet, Fetch::NotYet, Fetch::NotYet);
        loop {
            if self.settled(blob, needed.clone(), file)? {
                return Ok(());
            }
            // Ours landed but chunks are still missing (others held some
            // when we claimed, and may have given them up): claim again.
            if matches!(own, Fetch::Done) {
                own = Fetch::NotYet;
            }
            if own.not_yet() {
                let hedge = started.elapsed() >= HEDGE_AFTER;
                let mine = self.claim(blob, wanted.iter().copied(), file, hedge)?;
                if !mine.is_empty() {
                    own = Fetch::Running(self.fetch_in_background(blob, mine, file)?);
                }
                wanted = needed.clone().collect();
            }
            // Ours failed, or is slow: other mounts' registries too.
            if borrowed.not_yet() && (own.failed() || started.elapsed() >= HEDGE_AFTER) {
                borrowed = match self.fetch_from_others(blob, needed.clone(), file)? {
                    Some(done) => Fetch::Running(done),
                    None => Fetch::Failed(io::Error::other("no other mount of this blob")),
                };
            }
            // Chunks this mount's stream of the blob holds while it has
            // sent nothing for a while: fetched in ranges too, at once.
            if straight.not_yet() && self.stream_stalled(blob) {
                straight = Fetch::Running(self.fetch_past_stream(blob, needed.clone(), file)?);
            }
            if Instant::now() >= deadline {
                return Err(own.into_error().unwrap_or_else(|| {
                    io::Error::new(io::ErrorKind::TimedOut, "waiting for chunks")
                }));
            }
            if own.wait(SETTLE_TICK) || borrowed.wait(SETTLE_TICK) || straight.wait(SETTLE_TICK) {
                continue;
            }
            // Ours failed (and others' registries did not help): only
            // another mount's fetch can still fill the chunks; with none
            // under way, the read fails now.
            if own.failed() && borrowed.failed() && !self.others_fetching(blob, needed.clone())? {
                return Err(own
                    .into_error()
                    .unwrap_or_else(|| io::Error::other("fetch failed")));
            }
            // Others (a thread of ours, another mount) are fetching what
            // we need: a thread of ours wakes us, others' fills are polled.
            self.wait_landed(SETTLE_TICK)?;
        }
    }

    /// Fetches the unfilled chunks of `needed` that a stalled stream of the
    /// blob holds, from this mount's miss source, without claiming them (the
    /// stream's claims stay its own; a chunk both fill is the same verified
    /// bytes, and a fill of a filled chunk writes nothing).
    fn fetch_past_stream(
        self: &Arc<Self>,
        blob: u32,
        needed: std::ops::Range<usize>,
        via: Option<&File>,
    ) -> io::Result<mpsc::Receiver<io::Result<()>>> {
        self.fetch_on_thread("miss-past-stream", via, move |shared, via| {
            let result = shared.unfilled(blob, needed).and_then(|chunks| {
                tracing::info!(
                    blob,
                    chunks = chunks.len(),
                    "the blob's stream stalled: a miss's chunks in ranges"
                );
                shared.fetch_into(blob, &chunks, via)
            });
            shared.landed.notify_all();
            result
        })
    }

    /// Fetches the unfilled chunks of `needed` from the sources of other
    /// mounts of this blob's cache entry (`crate::sources`), on a thread
    /// of its own; `None` when there are none.
    pub(super) fn fetch_from_others(
        self: &Arc<Self>,
        blob: u32,
        needed: std::ops::Range<usize>,
        via: Option<&File>,
    ) -> io::Result<Option<mpsc::Receiver<io::Result<()>>>> {
        let sources = self.other_mounts.sources(&self.config, blob as usize);
        if sources.is_empty() {
            return Ok(None);
        }
        let done = self.fetch_on_thread("miss-borrow", via, move |shared, via| {
            let mut result = Err(io::Error::other("no other mount's source served"));
            for source in &sources {
                let chunks = shared.unfilled(blob, needed.clone())?;
                let (opts, stats) = (&shared.fetch, Some(&shared.miss_stats));
                result = shared.fetch_from(source, blob, &chunks, via, opts, stats);
                match &result {
                    Ok(()) => {
                        tracing::info!(blob, "chunks fetched from another mount's registry");
                        break;
                    }
                    Err(e) => tracing::warn!(blob, "another mount's registry: {e}"),
                }
            }
            result
        })?;
        Ok(Some(done))
    }

    /// Runs `fetch` on a thread named `name`, with a handle of its own on
    /// `via`; its result comes on the channel returned.
    fn fetch_on_thread(
        self: &Arc<Self>,
        name: &str,
        via: Option<&File>,
        fetch: impl FnOnce(&Shared, Option<&File>) -> io::Result<()> + Send + 'static,
    ) -> io::Result<mpsc::Receiver<io::Result<()>>> {
        let via = via.map(File::try_clone).transpose()?;
        let (tx, rx) = mpsc::sync_channel(1);
        let shared = self.clone();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let _ = tx.send(fetch(&shared, via.as_ref()));
            })?;
        Ok(rx)
    }

    /// The chunks of `needed` not filled yet.
    fn unfilled(&self, blob: u32, needed: std::ops::Range<usize>) -> io::Result<Vec<usize>> {
        let store = self.lock_store(blob)?;
        Ok(needed.filter(|&i| !store.is_filled(i)).collect())
    }

    /// Whether every chunk of `needed` is filled: verified by this worker,
    /// or recorded, or written and re-hashed here, by another mount's.
    pub(super) fn settled(
        &self,
        blob: u32,
        needed: std::ops::Range<usize>,
        via: Option<&File>,
    ) -> io::Result<bool> {
        let mut store = self.lock_store(blob)?;
        for i in needed {
            if store.is_filled(i) {
                continue;
            }
            if !store.adopt(i, via)? {
                return Ok(false);
            }
            // Whole at last (boot pages, or another mount's fill): the
            // node holds it for later images too.
            self.note_located(&store.blob.chunks[i], &store.key);
        }
        Ok(true)
    }

    /// Whether another mount holds the claim of a chunk of `needed` that
    /// is not filled (is fetching it).
    pub(super) fn others_fetching(
        &self,
        blob: u32,
        needed: std::ops::Range<usize>,
    ) -> io::Result<bool> {
        let store = self.lock_store(blob)?;
        for i in needed.filter(|&i| !store.is_filled(i)) {
            if !store.try_lock_chunk(i)? {
                return Ok(true);
            }
            store.unlock_chunk(i)?;
        }
        Ok(false)
    }

    /// Fetches `chunks` (claimed) on a thread of their own, then releases
    /// them: the miss waits for this or for others' fills, whichever comes
    /// first. The result arrives on the returned channel.
    pub(super) fn fetch_in_background(
        self: &Arc<Self>,
        blob: u32,
        chunks: Vec<usize>,
        via: Option<&File>,
    ) -> io::Result<mpsc::Receiver<io::Result<()>>> {
        let via = via.map(File::try_clone).transpose();
        let via = match via {
            Ok(via) => via,
            Err(e) => {
                self.release(blob, &chunks);
                return Err(e);
            }
        };
        let (tx, rx) = mpsc::sync_channel(1);
        let shared = self.clone();
        let spawned = std::thread::Builder::new()
            .name("miss-fetch".into())
            .spawn(move || {
                let result = shared.fetch_into(blob, &chunks, via.as_ref());
                shared.release(blob, &chunks);
                let _ = tx.send(result);
            });
        spawned.map(|_| rx)
    }

    /// Answers a miss at once, on the thread that receives misses, when
    /// its range is local already; false when it must be served by a miss
    /// thread. Misses waiting on the network then never hold up reads of
    /// local data (a FUSE daemon asks about every read of an incomplete
    /// blob). Not while recording a trace: every miss is written to it.
    pub(super) fn answer_if_ready(
        &self,
        id: u64,
        blob: u32,
        offset: u64,
        count: u64,
        response_fd: i32,
    ) -> bool {
        if self.trace.is_some() {
            return false;
        }
        // Never wait here: a store held by a fill is served by a thread.
        let Ok(slot) = self.stores[blob as usize].store.try_lock() else {
            return false;
        };
        let Some(store) = slot.as_ref() else {
            return false;
        };
        if !store.range_ready(offset, count) {
            return false;
        }
        self.read_ahead_of(blob, store, store.chunks_covering(offset, count.max(1)));
        drop(slot);
        self.answer(id, response_fd, 0);
        true
    }

    pub(super) fn wait_landed(&self, at_most: Duration) -> io::Result<()> {
        let inflight = self
            .inflight
            .lock()
            .map_err(|_| io::Error::other("lock poisoned"))?;
        drop(
            self.landed
                .wait_timeout(inflight, at_most)
                .map_err(|_| io::Error::other("lock poisoned"))?,
        );
        Ok(())
    }

    /// Makes the chunks among `chunks` that nobody is fetching ours: in
    /// this process (the in-flight set) and across processes (the chunk's
    /// lock in the cache file). A chunk whose bytes another process already
    /// wrote is verified (read through `via` or the quiet writer) and
    /// adopted instead of fetched. Returns the chunks to fetch.
    ///
    /// With `hedge`, a chunk another mount has claimed is taken all the
    /// same (its claim is not ours to release): that fetch has taken too
    /// long, and the bytes both write are the same verified bytes.
    pub(super) fn claim(
        &self,
        blob: u32,
        chunks: impl Iterator<Item = usize>,
        via: Option<&File>,
        hedge: bool,
    ) -> io::Result<Vec<usize>> {
        let mut inflight = self
            .inflight
            .lock()
            .map_err(|_| io::Error::other("lock poisoned"))?;
        let mut store = self.lock_store(blob)?;
        let mut mine = Vec::new();
        for i in chunks {
            if store.is_filled(i) || inflight.contains(&(blob, i)) {
                continue;
            }
            let locked = store.try_lock_chunk(i)?;
            if !locked && !hedge {
                continue; // another mount is fetching it
            }
            if store.adopt(i, via)? {
                if locked {
                    store.unlock_chunk(i)?;
                }
                self.note_located(&store.blob.chunks[i], &store.key);
                continue;
            }
            inflight.insert((blob, i));
            mine.push(i);
        }
        Ok(mine)
    }

    pub(super) fn release(&self, blob: u32, chunks: &[usize]) {
        if let Ok(store) = self.lock_store(blob) {
            for &i in chunks {
                if let Err(e) = store.unlock_chunk(i) {
                    tracing::warn!("unlocking chunk {i} of blob {blob}: {e}");
                }
            }
        }
        if let Ok(mut inflight) = self.inflight.lock() {
            for i in chunks {
                inflight.remove(&(blob, *i));
            }
        }
        self.landed.notify_all();
    }

    /// Fetches chunks a reader is waiting for.
    pub(super) fn fetch_into(
        &self,
        blob: u32,
        chunks: &[usize],
        via: Option<&File>,
    ) -> io::Result<()> {
        let (started, mine) = (Instant::now(), FetchStats::default());
        let source = &self.miss_source;
        let result = self.fetch_from(source, blob, chunks, via, &self.fetch, Some(&mine));
        add_stats(&self.miss_stats, &mine);
        let bytes = mine.bytes.load(Ordering::Relaxed);
        self.blob_missed[blob as usize].fetch_add(bytes, Ordering::Relaxed);
        let waited = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.blob_waited_ns[blob as usize].fetch_add(waited, Ordering::Relaxed);
        if result.is_ok() {
            self.miss_rate.note(started.elapsed(), bytes);
        }
        result
    }

    /// Fetches chunks nobody is waiting for yet (ahead of a reader,
    /// predicted, prefetched) in ranges. Never through a bulk_only host: a
    /// P2P daemon moves 4 MiB pieces per range and schedules each range as
    /// a download of its own, which goes to the registry from every node
    /// (docs/dragonfly.md); through it go whole blobs (`stream.rs`).
    pub(super) fn fetch_with(
        &self,
        blob: u32,
        chunks: &[usize],
        via: Option<&File>,
        opts: &FetchOptions,
        also_count: Option<&FetchStats>,
    ) -> io::Result<()> {
        let source = &self.miss_source;
        self.fetch_from(source, blob, chunks, via, opts, also_count)
    }

    /// [`fetch_with`](Self::fetch_with) from `source`.
    pub(super) fn fetch_from(
        &self,
        source: &Arc<dyn RangeSource>,
        blob: u32,
        chunks: &[usize],
        via: Option<&File>,
        opts: &FetchOptions,
        also_count: Option<&FetchStats>,
    ) -> io::Result<()> {
        let (entries, key) = {
            let store = self.lock_store(blob)?;
            (store.blob.chunks.clone(), store.key)
        };
        let chunks = &self.copy_located(blob, (&entries, &key), chunks, via)?;
        let (counted, started) = (FetchStats::default(), Instant::now());
        let fetch = |codec: ChunkCodec<'_>| {
            let target = BlobChunks {
                digest: &self.digests[blob as usize],
                chunks: &entries,
                codec,
            };
            fetch_chunks(source, target, chunks, opts, &counted, |i, data| {
                self.lock_store(blob)?.fill(i, &data, via)?;
                self.note_located(&entries[i], &key);
                Ok(())
            })
        };
        let result = match &self.windows {
            Some(windows) => windows.with_windows(blob, chunks, opts, &counted, fetch),
            None => fetch(ChunkCodec::Lamina),
        };
        let bytes = counted.bytes.load(Ordering::Relaxed);
        if result.is_ok() && counted.requests.load(Ordering::Relaxed) == 1 {
            self.link_rate.note(started.elapsed(), bytes);
        }
        add_stats(&self.stats, &counted);
        if let Some(stats) = also_count {
            add_stats(stats, &counted);
        }
        self.landed.notify_all();
        self.check_complete(blob);
        result.map_err(io::Error::other)
    }

    pub(super) fn check_complete(&self, blob: u32) {
        let complete = match self.opened_store(blob) {
            Ok(Some(s)) => s.is_complete(),
            Ok(None) => self.stores[blob as usize].complete,
            Err(_) => false,
        };
        if complete && !self.complete_sent[blob as usize].swap(true, Ordering::Relaxed) {
            let _ = protocol::send_owned(&self.sock, Message::Complete { blob }, None);
        }
    }
}
