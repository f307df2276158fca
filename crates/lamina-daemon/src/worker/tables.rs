//! Blob stores and their chunk tables: a store is opened when its blob is
//! first needed, its table loaded from beside the cache file, taken from
//! boot pages, or fetched (and kept for later workers).

use super::*;

/// A blob's store. With a paged index it is opened when the blob is first
/// needed: its chunk table is loaded from the cache, or fetched, then.
pub(super) struct LazyStore {
    pub(super) summary: BlobSummary,
    /// The mount found the cache file complete.
    pub(super) complete: bool,
    pub(super) store: Mutex<Option<BlobStore>>,
    /// Why the store can never be opened (its cache file is not the
    /// mount's any more): every read of the blob fails, at once.
    pub(super) refused: OnceLock<String>,
}

/// A locked, opened store.
pub(super) struct StoreGuard<'a>(pub(super) std::sync::MutexGuard<'a, Option<BlobStore>>);

impl std::ops::Deref for StoreGuard<'_> {
    type Target = BlobStore;
    fn deref(&self) -> &BlobStore {
        // Made only over an opened store (`Shared::lock_store`).
        self.0.as_ref().expect("an opened store")
    }
}

impl std::ops::DerefMut for StoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut BlobStore {
        self.0.as_mut().expect("an opened store")
    }
}

/// Opens the store of `blob` in `dir`, which must be the very cache file
/// the mount was made with (`spec`); fills it through a quiet fd.
pub(super) fn open_store(dir: &Path, blob: IndexBlob, spec: &BlobSpec) -> io::Result<BlobStore> {
    let mut store = BlobStore::open(dir, blob)?;
    spec.check_file(store.cache_file())?;
    if !store.is_complete() {
        // Background fills must not become misses in other mounts
        // that share this cache file: write them through a quiet fd.
        match lamina_sys::open_quiet(store.cache_file()).and_then(|f| store.set_writer(f)) {
            Ok(()) => {}
            Err(e) => tracing::warn!("quiet fd for {}: {e}", store.cache_path.display()),
        }
    }
    Ok(store)
}

/// The mount's chunk index as the worker serves it; for a tar index, its
/// spans are the chunks (all inline) and its windows come along.
pub(super) fn load_index(config: &DaemonConfig) -> io::Result<(IndexTop, Option<SpanWindows>)> {
    let bytes = std::fs::read(&config.index_path)?;
    if !config.tar_index {
        return Ok((
            ChunkIndex::parse_top(&bytes).map_err(io::Error::other)?,
            None,
        ));
    }
    let index = TarIndex::from_bytes(&bytes).map_err(io::Error::other)?;
    let (inline, windows): (Vec<IndexBlob>, WindowEntries) = index
        .layers
        .into_iter()
        .map(|layer| (layer.blob, layer.windows))
        .unzip();
    let top = IndexTop {
        chunk_bits: index.span_bits,
        blobs: inline.iter().map(IndexBlob::summary).collect(),
        prefetch: index.prefetch,
        inline,
    };
    let windows = SpanWindows::new(windows, config.tar_windows.as_ref(), config.timeout_secs)?;
    Ok((top, Some(windows)))
}

impl Shared {
    /// The store of `blob`, opened first if need be (its chunk table
    /// fetched: other users of the blob wait for it, as they need it too).
    pub(super) fn lock_store(&self, blob: u32) -> io::Result<StoreGuard<'_>> {
        let mut slot = self.stores[blob as usize]
            .store
            .lock()
            .map_err(|_| io::Error::other("store lock poisoned"))?;
        if slot.is_none() {
            let lazy = &self.stores[blob as usize];
            if let Some(why) = lazy.refused.get() {
                return Err(io::Error::other(why.clone()));
            }
            let table = self.table_of(blob)?;
            *slot = Some(self.open_or_refuse(blob, table)?);
        }
        Ok(StoreGuard(slot))
    }

    /// Opens the store of `blob` with `table`, its chunk table as boot pages
    /// carry it (checked against the index), unless it is open already.
    pub(super) fn take_table(&self, blob: u32, table: &[u8]) -> io::Result<()> {
        let lazy = &self.stores[blob as usize];
        let mut slot = lazy
            .store
            .lock()
            .map_err(|_| io::Error::other("store lock poisoned"))?;
        if slot.is_none() {
            let parsed = IndexBlob::from_table(&lazy.summary, self.chunk_bits, table)
                .map_err(io::Error::other)?;
            self.keep_table(blob, table);
            *slot = Some(self.open_or_refuse(blob, parsed)?);
        }
        Ok(())
    }

    /// Opens the store of `blob` (see [`open_store`]); a cache file that is
    /// not the mount's any more refuses the blob for good.
    pub(super) fn open_or_refuse(&self, blob: u32, table: IndexBlob) -> io::Result<BlobStore> {
        let spec = &self.config.blobs[blob as usize];
        open_store(&self.config.blob_dir, table, spec).inspect_err(|e| {
            tracing::error!("blob {blob}: {e}; failing its reads");
            let _ = self.stores[blob as usize].refused.set(e.to_string());
        })
    }

    /// The store of `blob` if it is open (status and records never fetch).
    pub(super) fn opened_store(&self, blob: u32) -> io::Result<Option<StoreGuard<'_>>> {
        let slot = self.stores[blob as usize]
            .store
            .lock()
            .map_err(|_| io::Error::other("store lock poisoned"))?;
        Ok(slot.is_some().then_some(StoreGuard(slot)))
    }

    /// The chunk table of `blob`: kept by another mount of it (since this
    /// worker started), or fetched, whichever comes first: a mount whose
    /// registry is dead or stalled takes the table another mount fetched
    /// (every mount sharing the cache file must allow each read of it).
    pub(super) fn table_of(&self, blob: u32) -> io::Result<IndexBlob> {
        let summary = &self.stores[blob as usize].summary;
        let kept = || {
            load_table(&self.config.blob_dir, summary, self.chunk_bits)
                .ok()
                .flatten()
        };
        if let Some(table) = kept() {
            return Ok(table);
        }
        let Some(me) = self.me.get().and_then(std::sync::Weak::upgrade) else {
            return self.fetch_table(blob);
        };
        let (tx, rx) = mpsc::sync_channel(1);
        let started = Instant::now();
        let mine = me.clone();
        std::thread::Builder::new()
            .name("table-fetch".into())
            .spawn(move || {
                let _ = tx.send(mine.fetch_table(blob));
            })?;
        let mut failed: Option<(io::Error, Instant)> = None;
        let mut borrowed = false;
        loop {
            // Ours failed, or is slow: other mounts' registries too (a
            // table fetched there is kept, and found below).
            if !borrowed && (failed.is_some() || started.elapsed() >= HEDGE_AFTER) {
                borrowed = true;
                let me = me.clone();
                std::thread::Builder::new()
                    .name("table-borrow".into())
                    .spawn(move || {
                        let sources = me.other_mounts.sources(&me.config, blob as usize);
                        for source in &sources {
                            match me.fetch_table_from(blob, source) {
                                Ok(_) => break,
                                Err(e) => tracing::warn!(blob, "another mount's registry: {e}"),
                            }
                        }
                    })?;
            }
            if failed.is_none() {
                match rx.recv_timeout(SETTLE_TICK * 5) {
                    Ok(Ok(table)) => return Ok(table),
                    Ok(Err(e)) => failed = Some((e, Instant::now())),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        failed = Some((io::Error::other("the table fetch is gone"), Instant::now()))
                    }
                }
            } else {
                std::thread::sleep(SETTLE_TICK * 5);
            }
            if let Some(table) = kept() {
                return Ok(table);
            }
            // Ours failed: another mount's may still land, for a while.
            if let Some((e, at)) = failed.take() {
                if at.elapsed() >= HEDGE_AFTER * 4 {
                    return Err(e);
                }
                failed = Some((e, at));
            }
        }
    }

    /// Fetches the chunk table at the end of `blob` (paged index): one
    /// range request, hedged like a miss's (every miss of the blob waits
    /// for it), checked against the digest the index gives, retried on a
    /// fresh connection; kept beside the cache file for later mounts.
    pub(super) fn fetch_table(&self, blob: u32) -> io::Result<IndexBlob> {
        // Wanted by a miss, and small: never through a bulk-only host.
        self.fetch_table_from(blob, &self.miss_source)
    }

    /// [`fetch_table`](Self::fetch_table) from `source`.
    pub(super) fn fetch_table_from(
        &self,
        blob: u32,
        source: &Arc<dyn RangeSource>,
    ) -> io::Result<IndexBlob> {
        let summary = &self.stores[blob as usize].summary;
        let Some((at, len)) = summary.table_range() else {
            return Err(io::Error::other("a version 1 blob without its chunks"));
        };
        let digest = &self.digests[blob as usize];
        let what = format!("chunk table of blob {blob}");
        let deadline = Instant::now() + Duration::from_secs(self.config.timeout_secs);
        let hedging = self.config.hedge.then_some(self.hedging.as_ref());
        let fetched = self.retried(&what, Some(deadline), |fresh| {
            let bytes = read_first_answer(source, hedging, digest, (at, len), fresh)?;
            self.stats
                .bytes
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            self.stats.requests.fetch_add(1, Ordering::Relaxed);
            let table = IndexBlob::from_table(summary, self.chunk_bits, &bytes).map_err(|e| {
                // Counted with bad chunks: per-chunk data that failed its
                // digest.
                self.stats.bad_chunks.fetch_add(1, Ordering::Relaxed);
                io::Error::other(e)
            })?;
            Ok((bytes, table))
        });
        match fetched {
            Ok((bytes, table)) => {
                self.keep_table(blob, &bytes);
                Ok(table)
            }
            Err(e) => {
                tracing::error!("{what}: {e}; failing its reads");
                Err(e)
            }
        }
    }

    /// Keeps a verified chunk table beside its blob's cache file, for later
    /// workers; one that cannot be kept is only fetched again.
    pub(super) fn keep_table(&self, blob: u32, table: &[u8]) {
        let summary = &self.stores[blob as usize].summary;
        if let Err(e) = save_table(&self.config.blob_dir, summary, table) {
            tracing::warn!("keeping the chunk table of blob {blob}: {e}");
        }
    }

    /// Runs `attempt` (given whether to use a fresh connection) until it
    /// succeeds: at most 4 times, 100, 200 and 400 ms apart, and with a
    /// `deadline` none starts after it.
    pub(super) fn retried<T>(
        &self,
        what: &str,
        deadline: Option<Instant>,
        mut attempt: impl FnMut(bool) -> io::Result<T>,
    ) -> io::Result<T> {
        let mut tries = 0u32;
        loop {
            match attempt(tries > 0) {
                Ok(value) => return Ok(value),
                // At once on a fresh connection, then after 0.1 to 1.6 s.
                Err(e) if tries < 6 && deadline.is_none_or(|d| Instant::now() < d) => {
                    tracing::warn!("{what}: {e}; retrying");
                    if tries > 0 {
                        std::thread::sleep(Duration::from_millis(100 << (tries - 1)));
                    }
                    tries += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }
}
