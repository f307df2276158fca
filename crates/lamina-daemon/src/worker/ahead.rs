//! Fetching ahead of readers: in blob order (fill-ahead) and by prediction
//! (a first miss in a library or a group of small files fetches the rest).

use super::*;

/// Starts `threads` threads fetching the windows `rx` gives, ahead of
/// readers, with the options and into the stats `how` picks of `Shared`.
pub(super) fn serve_ahead(
    shared: &Arc<Shared>,
    rx: mpsc::Receiver<(u32, std::ops::Range<usize>)>,
    threads: usize,
    how: fn(&Shared) -> (&FetchOptions, &FetchStats),
) {
    let rx = Arc::new(Mutex::new(rx));
    for _ in 0..threads {
        let (shared, rx) = (shared.clone(), rx.clone());
        std::thread::spawn(move || loop {
            let job = match rx.lock() {
                Ok(r) => r.recv(),
                Err(_) => return,
            };
            let Ok((blob, chunks)) = job else { return };
            let (opts, stats) = how(&shared);
            shared.fetch_ahead(blob, chunks, opts, stats);
        });
    }
}

impl Shared {
    /// Notes a read of `chunks` and queues the window to fetch ahead of it,
    /// if the blob is being read in order.
    pub(super) fn read_ahead_of(
        &self,
        blob: u32,
        store: &BlobStore,
        chunks: std::ops::Range<usize>,
    ) {
        let Some(ahead) = &self.ahead else { return };
        self.note_ahead_read(blob, store, chunks.clone());
        let Ok(mut stream) = self.streams[blob as usize].lock() else {
            return;
        };
        let entries = &store.blob.chunks;
        let size = |i: usize| u64::from(entries[i].size.get());
        let read = chunks.clone();
        if let Some(window) = stream.observe(chunks, entries.len(), self.config.fill_ahead, size) {
            // Not for the recorded start's own reads: a whole blob on the
            // wire would slow the start down.
            let booting = read
                .into_iter()
                .all(|i| self.boot_chunks.contains(&(blob, i as u32)));
            if !booting && self.stream_for_reader(blob) {
                return;
            }
            tracing::debug!(blob, ?window, "fetching ahead of a stream");
            if ahead.try_send((blob, window)).is_err() {
                tracing::debug!(blob, "fill-ahead queue full; the reader's misses fetch it");
            }
        }
    }

    /// Reads the metadata's tree into the map of files fetched together
    /// on a first miss (`crate::predict`); without it (too large,
    /// unreadable) nothing is predicted, and the log says why.
    pub(super) fn build_file_map(&self) {
        let file = match &self.config.metadata_fill {
            Some(MetadataFill::Whole) => File::open(&self.config.metadata_path),
            Some(MetadataFill::Frames { digest }) => match self.wait_metadata_whole(digest) {
                Some(file) => Ok(file),
                None => return,
            },
            None => return,
        };
        let map = file
            .and_then(read_metadata)
            .map_err(MapError::from)
            .and_then(|bytes| {
                let image = Image::new(&bytes)?;
                let (max, window) = (self.config.predict_max, crate::predict::WINDOW);
                // Only rests ask which bytes files use.
                let live = self.config.fetch_rests;
                FileMap::build(&image, self.stores.len(), max, window, live)
            });
        match map {
            Ok(map) => {
                tracing::info!(
                    groups = map.groups(),
                    mapped = map.mapped_files(),
                    windows = map.windows(),
                    "predicting misses: files fetched together on a first miss"
                );
                let _ = self.file_map.set(map);
            }
            Err(e) => tracing::info!("no predicted misses: {e}"),
        }
    }

    /// Waits until the metadata, filled frame by frame by the FUSE
    /// daemon, is recorded whole with the content the image names, and
    /// returns the file the record describes; `None` (and a log line) if
    /// it is not within `START_AT_MOST`.
    pub(super) fn wait_metadata_whole(&self, named: &str) -> Option<File> {
        let path = &self.config.metadata_path;
        let Ok(digest) = Digest::from_hex(named).map(|d| d.to_sha256()) else {
            tracing::info!("no predicted misses: the metadata's digest {named:?} is not SHA-256");
            return None;
        };
        let deadline = Instant::now() + START_AT_MOST;
        while Instant::now() < deadline {
            if let Ok(file) = lamina_fetch::private::open_existing(path) {
                if lamina_fetch::store::recorded_whole(&file, path, &digest).unwrap_or(false) {
                    return Some(file);
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        tracing::info!("no predicted misses: the metadata was not recorded whole in time");
        None
    }

    /// On the first miss in a mapped file or a group of small files
    /// (`crate::predict`) once the link proved fast, decides whether the
    /// rest of it is worth fetching ahead ([`crate::predict::worth_fetching`])
    /// and if so queues it, from the miss on.
    pub(super) fn predict_from(&self, blob: u32, offset: u64, needed: &std::ops::Range<usize>) {
        let (Some(tx), Some(map)) = (&self.predict, self.file_map.get()) else {
            return;
        };
        if self.is_streaming(blob) {
            return; // the stream brings the rest of the file
        }
        let Some(group) = map.group_at(blob, offset) else {
            return;
        };
        // Not decided yet: a later miss asks again, once the link proved
        // fast.
        if !self.miss_rate.fast_enough() {
            return;
        }
        // A window waits for a second chunk of it to be missed (undecided
        // till then): a start that reads one chunk of a window often reads
        // no other.
        if map.is_window(group) && !self.window_misses.second_chunk(blob, group, needed.start) {
            return;
        }
        // Decided once: a group asked again later would qualify only when
        // the start has read most of what it wanted of it (in a trial, the
        // rest of python3's binary came at the start's last misses).
        let first = self
            .predicted
            .lock()
            .is_ok_and(|mut decided| decided.insert((blob, group)));
        if !first {
            return;
        }
        let Ok(store) = self.lock_store(blob) else {
            return;
        };
        let mut chunks: Vec<usize> = map
            .ranges(group, blob)
            .flat_map(|r| store.chunks_covering(r.start, r.end - r.start))
            .collect();
        chunks.sort_unstable();
        chunks.dedup();
        let cost = unfilled_compressed_bytes(&store, &chunks);
        drop(store);
        // Boot pages known from the image stand for misses the start would
        // otherwise have had; recorded ones hold nearly all of a start, and
        // groups are for what they did not see.
        let missed = self.miss_stats.bytes.load(Ordering::Relaxed)
            + self.image_boot_bytes.load(Ordering::Relaxed);
        if !crate::predict::worth_fetching(cost, missed) {
            tracing::debug!(
                blob,
                group,
                cost,
                missed,
                "a file group not worth fetching ahead"
            );
            return;
        }
        self.predictions.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            blob,
            group,
            chunks = chunks.len(),
            cost,
            missed,
            "fetching a file group"
        );
        for batch in crate::predict::batches(&chunks, needed, PREDICT_BATCH) {
            let _ = tx.send((blob, batch));
        }
    }

    /// Counts the chunks of a read that were fetched ahead (once each).
    pub(super) fn note_ahead_read(
        &self,
        blob: u32,
        store: &BlobStore,
        chunks: std::ops::Range<usize>,
    ) {
        let Ok(mut unread) = self.ahead_unread.lock() else {
            return;
        };
        if unread.is_empty() {
            return;
        }
        for i in chunks {
            if unread.remove(&(blob, i)) {
                let size = u64::from(store.blob.chunks[i].size.get());
                self.ahead_used_bytes.fetch_add(size, Ordering::Relaxed);
            }
        }
    }

    /// Fetches a window ahead of a reader: what no one else holds.
    pub(super) fn fetch_ahead(
        &self,
        blob: u32,
        chunks: std::ops::Range<usize>,
        opts: &FetchOptions,
        stats: &FetchStats,
    ) {
        if !self.room_for_background() {
            return; // the reader's own misses fetch what it reads
        }
        let wanted = chunks.filter(|&i| !self.served_elsewhere.contains(&(blob, i)));
        let Ok(mine) = self.claim(blob, wanted, None, false) else {
            return;
        };
        if mine.is_empty() {
            return;
        }
        // Noted before the fetch: a reader that meets a chunk in flight
        // has used what was fetched ahead too.
        if let Ok(mut unread) = self.ahead_unread.lock() {
            unread.extend(mine.iter().map(|&i| (blob, i)));
        }
        if let Err(e) = self.fetch_with(blob, &mine, None, opts, Some(stats)) {
            // Not fatal: the reader's own misses fetch (and retry) these.
            tracing::warn!("fetching ahead: {e}");
        }
        self.note_fetched_ahead(blob, &mine);
        self.release(blob, &mine);
    }

    /// Counts the chunks of `mine` that a fetch ahead filled; forgets the
    /// others (a reader's miss fetches them).
    pub(super) fn note_fetched_ahead(&self, blob: u32, mine: &[usize]) {
        let Ok(store) = self.lock_store(blob) else {
            return;
        };
        let (filled, failed): (Vec<usize>, Vec<usize>) =
            mine.iter().partition(|&&i| store.is_filled(i));
        let bytes: u64 = filled
            .iter()
            .map(|&i| u64::from(store.blob.chunks[i].size.get()))
            .sum();
        drop(store);
        self.ahead_chunk_bytes.fetch_add(bytes, Ordering::Relaxed);
        if let Ok(mut unread) = self.ahead_unread.lock() {
            for i in failed {
                unread.remove(&(blob, i));
            }
        }
    }
}

/// The whole of a metadata file, for the worker's maps of it (predictions,
/// warming); refused over [`PREDICT_METADATA_MAX`] before anything is
/// allocated, and never more than the length it had when checked.
pub(super) fn read_metadata(file: File) -> io::Result<Vec<u8>> {
    let len = file.metadata()?.len();
    if len > PREDICT_METADATA_MAX {
        return Err(io::Error::other(format!("{len} bytes, too large")));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    io::Read::read_to_end(&mut io::Read::take(file, len), &mut bytes)?;
    Ok(bytes)
}

/// What fetching `chunks` would put on the wire: the compressed bytes of
/// those not filled yet.
fn unfilled_compressed_bytes(store: &BlobStore, chunks: &[usize]) -> u64 {
    chunks
        .iter()
        .filter(|&&i| !store.is_filled(i))
        .filter_map(|&i| store.blob.chunks.get(i))
        .map(|c| u64::from(c.compressed_size.get()))
        .sum()
}
