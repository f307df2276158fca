//! Boot pages: the pages a recorded start read, applied while misses are
//! served; misses on their chunks wait for them. Also the trace a
//! recording mount writes.

use super::boot_stream::StreamedFrame;
use super::*;
use lamina_format::boot::{BootExtent, BOOT_PAGE};

/// One frame of the boot pages: its number in its layer, the layer, where
/// it lies.
pub(super) type FrameJob<'a> = (usize, &'a BootPagesSpec, BootFrameSpec);

/// Decompresses zstd `compressed` to exactly `size` bytes (bounded at
/// mount: nothing is allocated for what a frame header claims).
pub(super) fn decompress_exactly(compressed: &[u8], size: u64) -> io::Result<Vec<u8>> {
    let decoder = zstd::stream::read::Decoder::new(compressed)?;
    let mut raw = Vec::with_capacity(size as usize);
    io::copy(
        &mut io::Read::take(decoder, size.saturating_add(1)),
        &mut raw,
    )?;
    if raw.len() as u64 != size {
        return Err(io::Error::other("wrong uncompressed size"));
    }
    Ok(raw)
}

/// The pages the boot frames bring (the first frame's directory), per
/// blob: byte ranges of the cache file, sorted, adjacent ones merged.
#[derive(Debug, Default)]
pub(super) struct BootDirectory(HashMap<u32, Vec<(u64, u64)>>);

impl BootDirectory {
    pub(super) fn new(extents: &[BootExtent]) -> Self {
        let mut by_blob: HashMap<u32, Vec<(u64, u64)>> = HashMap::new();
        for e in extents {
            let start = e.cache_offset.get();
            let end = start + u64::from(e.pages.get()) * BOOT_PAGE;
            by_blob.entry(e.blob.get()).or_default().push((start, end));
        }
        for ranges in by_blob.values_mut() {
            ranges.sort_unstable();
            let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
            for &(start, end) in ranges.iter() {
                match merged.last_mut() {
                    Some(last) if start <= last.1 => last.1 = last.1.max(end),
                    _ => merged.push((start, end)),
                }
            }
            *ranges = merged;
        }
        BootDirectory(by_blob)
    }

    /// Whether every page of bytes `offset..offset + count` of blob
    /// `blob` comes with a frame.
    pub(super) fn covers(&self, blob: u32, offset: u64, count: u64) -> bool {
        let start = offset / BOOT_PAGE * BOOT_PAGE;
        let end = offset.saturating_add(count.max(1)).div_ceil(BOOT_PAGE) * BOOT_PAGE;
        let Some(ranges) = self.0.get(&blob) else {
            return false;
        };
        let at = ranges.partition_point(|r| r.1 <= start);
        ranges.get(at).is_some_and(|r| r.0 <= start && end <= r.1)
    }
}

impl Shared {
    /// While boot pages are still coming and the range lies in boot-set
    /// chunks, waits for them. Returns whether the range is ready (false:
    /// fetch its chunks). Bounded by the miss timeout; a segment that
    /// failed counts as done, so its chunks are fetched instead. Once the
    /// first frame's directory says the range is not all in the boot
    /// pages, it is not waited for: those pages would come only after every
    /// frame, as a fetch.
    pub(super) fn wait_boot_pages(
        &self,
        blob: u32,
        offset: u64,
        count: u64,
        needed: std::ops::Range<usize>,
    ) -> io::Result<bool> {
        let booted = needed
            .into_iter()
            .any(|i| self.boot_chunks.contains(&(blob, i as u32)));
        if !booted {
            return Ok(false);
        }
        let deadline = Instant::now() + Duration::from_secs(self.config.timeout_secs);
        loop {
            if self.lock_store(blob)?.range_ready(offset, count) {
                return Ok(true);
            }
            if self.boot_pending.load(Ordering::SeqCst) == 0 || Instant::now() >= deadline {
                return Ok(false);
            }
            if let Some(directory) = self.boot_directory.get() {
                if !directory.covers(blob, offset, count) {
                    tracing::debug!(
                        blob,
                        offset,
                        count,
                        "a read of boot-set chunks outside the boot pages: fetched now"
                    );
                    return Ok(false);
                }
            }
            self.wait_landed(Duration::from_millis(10))?;
        }
    }

    /// Appends a miss to the trace: the part of each chunk it reads.
    pub(super) fn record(
        &self,
        trace: &Mutex<File>,
        blob: u32,
        offset: u64,
        count: u64,
    ) -> io::Result<()> {
        let store = self.lock_store(blob)?;
        let end = offset.saturating_add(count.max(1));
        let mut lines = String::new();
        for i in store.chunks_covering(offset, count.max(1)) {
            let c = &store.blob.chunks[i];
            let start = c.cache_offset.get();
            let from = offset.max(start);
            let to = end.min(start + u64::from(c.size.get()));
            if to > from {
                lines.push_str(&format!(
                    "{} {} {}\n",
                    hex::encode(c.digest),
                    from - start,
                    to - from
                ));
            }
        }
        drop(store);
        let mut t = trace
            .lock()
            .map_err(|_| io::Error::other("trace lock poisoned"))?;
        t.write_all(lines.as_bytes())
    }

    /// Fetches and applies the boot pages, frame by frame in read order:
    /// the first alone (the start's first pages, as soon as possible), then
    /// the rest as they arrive (see [`boot_stream`](super::boot_stream)),
    /// each applied as soon as it is verified, so the start reads (and
    /// computes) while later frames are on the wire.
    pub(super) fn load_boot_pages(&self) {
        if self.boot_set_held() {
            self.boot_pending.store(0, Ordering::SeqCst);
            self.landed.notify_all();
            return;
        }
        let frames: Vec<FrameJob> = self
            .config
            .boot_pages
            .iter()
            .flat_map(|spec| {
                spec.frames()
                    .into_iter()
                    .enumerate()
                    .map(move |(k, f)| (k, spec, f))
            })
            .collect();
        let Some((first, rest)) = frames.split_first() else {
            return;
        };
        self.apply_frame_job(first, None);
        self.load_frames_streamed(rest);
        self.forget_warm_map_when_done();
    }

    /// Applies one frame (`streamed`: its bytes, read and verified from
    /// the frames' stream; else from the cache or a range), and counts it
    /// done whatever came of it: a frame that failed leaves its chunks to
    /// misses.
    pub(super) fn apply_frame_job(&self, job: &FrameJob, streamed: Option<StreamedFrame>) {
        let (k, spec, frame) = job;
        if let Err(e) = self.apply_boot_frame(*k, spec, frame, streamed) {
            tracing::warn!("boot pages frame {k} of {}: {e}", spec.layer_digest);
        }
        self.boot_pending.fetch_sub(1, Ordering::SeqCst);
        self.landed.notify_all();
    }

    /// Whether this node already held every chunk of the boot set (the
    /// chunk locator knew each digest), now copied into this image's cache
    /// files as verified fills: then the boot pages, which would be fetched
    /// only to repeat those bytes, are not (a node updating to a new
    /// version of an image it ran). Asked only of a locator that holds
    /// something: the check needs the chunk tables, which a fresh node
    /// takes from the boot pages instead.
    fn boot_set_held(&self) -> bool {
        match &self.locator {
            Some(locator) if locator.may_hold_any() && !self.boot_set.is_empty() => {}
            other => {
                tracing::debug!(
                    locator = other.is_some(),
                    boot_set = self.boot_set.len(),
                    "boot set not looked up on this node"
                );
                return false;
            }
        }
        let mut by_blob: std::collections::BTreeMap<u32, Vec<usize>> = Default::default();
        for &(b, i) in &self.boot_set {
            if (b as usize) < self.stores.len() {
                by_blob.entry(b).or_default().push(i as usize);
            }
        }
        let held = std::thread::scope(|scope| {
            let checks: Vec<_> = by_blob
                .iter()
                .map(|(&blob, chunks)| scope.spawn(move || self.copy_all_located(blob, chunks)))
                .collect();
            checks
                .into_iter()
                .all(|c| c.join().unwrap_or(Ok(false)).unwrap_or(false))
        });
        tracing::debug!(
            held,
            chunks = self.boot_set.len(),
            "boot set looked up on this node"
        );
        if held {
            tracing::info!(
                "boot pages not fetched: the {} chunks of the boot set were on this node already",
                self.boot_set.len()
            );
        }
        held
    }

    /// Copies the chunks of `blob` the locator finds; whether it found all.
    fn copy_all_located(&self, blob: u32, chunks: &[usize]) -> io::Result<bool> {
        let (entries, key, missing) = {
            let store = self.lock_store(blob)?;
            let missing: Vec<usize> = chunks
                .iter()
                .copied()
                .filter(|&i| i < store.blob.chunks.len() && !store.is_filled(i))
                .collect();
            (store.blob.chunks.clone(), store.key, missing)
        };
        if missing.is_empty() {
            return Ok(true);
        }
        let rest = self.copy_located(blob, (&entries, &key), &missing, None)?;
        Ok(rest.is_empty())
    }

    /// Loads frame `k` of a boot-pages layer (its bytes from the frames'
    /// stream, verified there; else a cached copy that still hashes right,
    /// else a range of the layer, retried and hedged, checked against the
    /// frame's digest), decompresses it to exactly its size and
    /// writes its pages into the cache files.
    pub(super) fn apply_boot_frame(
        &self,
        k: usize,
        spec: &BootPagesSpec,
        frame: &BootFrameSpec,
        streamed: Option<StreamedFrame>,
    ) -> io::Result<()> {
        let cache_path = spec.frame_path(k);
        let (compressed, fetched, fresh) = match streamed {
            Some(s) => (s.bytes, s.took, true),
            None => {
                let digest = Digest::parse(&frame.digest).map_err(io::Error::other)?;
                let cached = std::fs::read(&cache_path)
                    .ok()
                    .filter(|z| Digest::of_bytes(z) == digest);
                let fresh = cached.is_none();
                let fetching = Instant::now();
                let compressed = match cached {
                    Some(z) => z,
                    None => self.fetch_boot_frame(spec, frame, &digest)?,
                };
                (compressed, fetching.elapsed(), fresh)
            }
        };
        let raw = decompress_exactly(&compressed, frame.size)?;
        if spec.from_image {
            self.image_boot_bytes
                .fetch_add(compressed.len() as u64, Ordering::Relaxed);
        }
        let sizes: Vec<u64> = self.stores.iter().map(|s| s.summary.cache_size).collect();
        let table_lens: Vec<u64> = self
            .stores
            .iter()
            .map(|s| s.summary.table_range().map_or(0, |(_, len)| len))
            .collect();
        let boot = BootPages::from_bytes(&raw, &sizes, &table_lens).map_err(io::Error::other)?;
        // One layer of boot pages (older images split them into layers of
        // their own, without a directory): its directory is the whole set.
        if !boot.directory.is_empty() && self.config.boot_pages.len() == 1 {
            let _ = self.boot_directory.set(BootDirectory::new(&boot.directory));
        }
        for (blob, table) in &boot.tables {
            self.take_table(*blob, table)?;
        }
        let mut written = 0;
        let mut ready = Vec::new();
        for (extent, bytes) in boot.iter() {
            let (blob, offset) = (extent.blob.get(), extent.cache_offset.get());
            let mut store = self.lock_store(blob)?;
            written += store.fill_pages(offset, bytes)?;
            let runs = store.ready_runs(offset, bytes.len() as u64);
            drop(store);
            for run in runs {
                self.announce_ready(blob, run.start, run.end - run.start);
                ready.push((blob, run));
            }
        }
        let warming = Instant::now();
        self.warm(ready);
        tracing::debug!(
            "boot pages frame {k}: {} runs, {written} bytes written {:.0} ms after the worker started \
             (fetched in {:.1} ms, warmed in {:.1} ms)",
            boot.extents.len(),
            self.started.elapsed().as_secs_f64() * 1e3,
            fetched.as_secs_f64() * 1e3,
            warming.elapsed().as_secs_f64() * 1e3
        );
        if fresh {
            // Kept for later workers, which check it against the frame's
            // digest before use, so a torn copy is only fetched again.
            let _ = write_atomic(&cache_path, &compressed);
        }
        Ok(())
    }

    /// One frame of a boot-pages layer from the registry: a range, retried
    /// and hedged like a miss's, checked against the frame's digest.
    pub(super) fn fetch_boot_frame(
        &self,
        spec: &BootPagesSpec,
        frame: &BootFrameSpec,
        digest: &Digest,
    ) -> io::Result<Vec<u8>> {
        let layer = Digest::parse(&spec.layer_digest).map_err(io::Error::other)?;
        let range = (frame.offset, frame.compressed_size);
        let hedging = self.config.hedge.then_some(self.hedging.as_ref());
        let z = self.retried("boot pages", None, |fresh| {
            let z = read_first_answer(&self.source, hedging, &layer, range, fresh)?;
            self.stats
                .bytes
                .fetch_add(z.len() as u64, Ordering::Relaxed);
            self.stats.requests.fetch_add(1, Ordering::Relaxed);
            match Digest::of_bytes(&z) == *digest {
                true => Ok(z),
                false => Err(io::Error::other(format!(
                    "frame at {} does not match its digest {digest}",
                    frame.offset
                ))),
            }
        })?;
        Ok(z)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extent(blob: u32, page: u64, pages: u32) -> BootExtent {
        BootExtent {
            cache_offset: (page * BOOT_PAGE).into(),
            blob: blob.into(),
            pages: pages.into(),
        }
    }

    /// A read is waited for only when every page of it comes with a frame;
    /// extents that meet count as one run.
    #[test]
    fn the_directory_covers_whole_reads_only() {
        let d = BootDirectory::new(&[extent(0, 4, 2), extent(1, 0, 1), extent(0, 6, 1)]);
        let page = BOOT_PAGE;
        assert!(d.covers(0, 4 * page, page));
        assert!(
            d.covers(0, 4 * page + 100, 3 * page - 200),
            "pages 4-6, met"
        );
        assert!(!d.covers(0, 4 * page, 4 * page), "page 7 is not in");
        assert!(!d.covers(0, 3 * page + 4000, 200), "starts in page 3");
        assert!(!d.covers(0, 0, page));
        assert!(d.covers(1, 10, 1));
        assert!(!d.covers(1, page, 1));
        assert!(!d.covers(2, 0, 1), "no pages of blob 2");
    }
}
