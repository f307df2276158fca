//! Background fetching once the start is over: the boot set's chunks, later
//! layers, the whole image (`--prefetch-all`), yielding to every miss
//! (unless it goes through a bulk_only host, not the misses' path).

use super::boot::decompress_exactly;
use super::*;

/// Whole blobs a prefetch streams at once through a bulk_only host.
const P2P_STREAMS: usize = 4;
/// A background batch waits until no miss has come for this long: a start
/// that begins while the image streams in waits for one batch at most.
const BULK_QUIET: Duration = Duration::from_millis(100);
/// The most compressed bytes a background batch asks for in one request
/// (0.17 s at 100 Mbit/s): what a miss arriving just after it waits behind.
const BULK_BATCH_BYTES: u64 = 2 << 20;
/// The most chunks a background batch asks for.
const BULK_BATCH_CHUNKS: usize = 32;

/// Hashes, syncs and records the layer files the mount wrote without a
/// record, off the mount's path; a failure only means a later mount hashes
/// them again. This is where such a file's content digest (the layer's
/// annotation) is checked: the mount checked the layer's own digest, so
/// the file holds the layer's content either way, but only a file that
/// hashes to the annotation is recorded for later mounts to trust.
pub(super) fn adopt_in_background(files: Vec<AdoptSpec>) {
    if files.is_empty() {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("lamina-adopt".into())
        .spawn(move || {
            for f in files {
                let digest = Digest::parse(&f.digest).ok().map(|d| d.to_sha256());
                let Some(digest) = digest else {
                    tracing::warn!("{}: bad digest {:?}, not recorded", f.path.display(), f.digest);
                    continue;
                };
                match lamina_fetch::store::adopt_whole(&f.path, &digest) {
                    Ok(true) => tracing::debug!("{} synced and recorded", f.path.display()),
                    Ok(false) => tracing::error!(
                        "{} does not hash to its content digest {}: not recorded (the layer's annotation is wrong, or the file was replaced after the mount wrote it)",
                        f.path.display(),
                        f.digest
                    ),
                    Err(e) => tracing::warn!("{}: not recorded: {e}", f.path.display()),
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the thread that records layer files: {e}");
    }
}

impl Shared {
    /// A zstd lamina layer, fetched whole (one request, retried), checked
    /// against its digest and decompressed to exactly `size` bytes (bounded
    /// at mount: nothing is allocated for what a frame header claims).
    pub(super) fn fetch_layer(
        &self,
        what: &str,
        digest: &str,
        layer_size: u64,
        size: u64,
    ) -> io::Result<Vec<u8>> {
        let layer = Digest::parse(digest).map_err(io::Error::other)?;
        let compressed = self.retried(what, None, |fresh| match fresh {
            false => self.source.read_range(&layer, 0, layer_size),
            true => self.source.read_range_again(&layer, 0, layer_size),
        })?;
        self.stats
            .bytes
            .fetch_add(compressed.len() as u64, Ordering::Relaxed);
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        if Digest::of_bytes(&compressed) != layer {
            return Err(io::Error::other(format!(
                "{what} layer does not match its digest {layer}"
            )));
        }
        decompress_exactly(&compressed, size).map_err(|e| io::Error::other(format!("{what}: {e}")))
    }

    /// Fetches the layers the mount left for later (after the boot pages:
    /// the start comes first), each stored synced with its fill record.
    pub(super) fn store_later_layers(&self) {
        while self.boot_pending.load(Ordering::SeqCst) > 0 {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.wait_start_over();
        for spec in &self.config.later_layers {
            match self.store_layer(spec) {
                Ok(()) => tracing::info!(
                    "{} stored {:.0} ms after the worker started",
                    spec.what,
                    self.started.elapsed().as_secs_f64() * 1e3
                ),
                Err(e) => tracing::error!("{}: {e}; not stored", spec.what),
            }
        }
    }

    pub(super) fn store_layer(&self, spec: &LayerSpec) -> io::Result<()> {
        let digest = Digest::parse(&spec.digest).map_err(io::Error::other)?;
        let content = digest.to_sha256();
        if lamina_fetch::store::adopt_whole(&spec.path, &content).unwrap_or(false) {
            return Ok(()); // another mount stored it
        }
        let raw = self.fetch_layer(&spec.what, &spec.layer_digest, spec.layer_size, spec.size)?;
        if lamina_oci::sha256(&raw) != content {
            return Err(io::Error::other(format!(
                "content does not match its digest {digest}"
            )));
        }
        let file = lamina_fetch::private::write_atomic_file(&spec.path, &raw, true)?;
        lamina_fetch::store::record_whole(&file, &spec.path, &content)
    }

    /// Background fetching. The boot set goes first and at once: the
    /// workload it was recorded from is starting right now and will miss on
    /// exactly these chunks, so they are fetched in recorded order, a few MiB
    /// at a time, each window sorted and merged into few large requests, and
    /// misses on them wait for the chunks in flight. The rest of the image
    /// (`--prefetch-all`) then yields to every miss.
    pub(super) fn prefetch(&self) {
        // Boot pages first: they are what the start reads next.
        while self.boot_pending.load(Ordering::SeqCst) > 0 {
            let _ = self.wait_landed(Duration::from_millis(10));
        }
        // Chunks a --share-files mount's reads never ask of its files.
        let mut planned: HashSet<(u32, usize)> = self.served_elsewhere.clone();
        let mut boot: Vec<(u32, usize)> = Vec::new();
        // With boot pages the boot set is already in; its chunks only lead
        // the order of --prefetch-all.
        let chunk_boot_set = self.config.prefetch && self.config.boot_pages.is_empty();
        if chunk_boot_set {
            for &(b, i) in &self.boot_set {
                if (b as usize) < self.stores.len() && planned.insert((b, i as usize)) {
                    boot.push((b, i as usize));
                }
            }
        }
        let mut rest: Vec<(u32, usize)> = Vec::new();
        // With boot pages, the boot set's whole chunks follow once the start
        // is over (no miss for a while), so that the pages around those it
        // read are local too: starts differ by a page or two. Not through a
        // P2P daemon (a bulk_only host): ranges go straight to the registry
        // there, from every node; a page a later start misses costs less.
        let boot_chunks_later = self.config.prefetch
            && self.config.boot_chunks
            && !self.config.boot_pages.is_empty()
            && !self.bulk_apart();
        if self.config.prefetch_all || boot_chunks_later {
            for &(b, i) in &self.boot_set {
                if (b as usize) < self.stores.len() && planned.insert((b, i as usize)) {
                    rest.push((b, i as usize));
                }
            }
            // Fetched after the start, so blob order (fewer, merged
            // requests) beats the order they were read in.
            rest.sort_unstable();
        }
        if self.config.prefetch_all {
            for b in 0..self.stores.len() {
                let chunks = self.stores[b].summary.chunk_count;
                for i in 0..chunks {
                    if planned.insert((b as u32, i)) {
                        rest.push((b as u32, i));
                    }
                }
            }
        }
        self.prefetch_total
            .store((boot.len() + rest.len()) as u64, Ordering::Relaxed);

        const WINDOW: u64 = 4 << 20;
        let mut at = 0;
        while at < boot.len() {
            let mut end = at;
            let mut bytes = 0u64;
            while end < boot.len() && (bytes < WINDOW || end == at) {
                let (b, i) = boot[end];
                bytes += self.compressed_bytes(b, i);
                end += 1;
            }
            for blob in 0..self.stores.len() as u32 {
                let mut chunks: Vec<usize> = boot[at..end]
                    .iter()
                    .filter(|p| p.0 == blob)
                    .map(|p| p.1)
                    .collect();
                if chunks.is_empty() {
                    continue;
                }
                chunks.sort_unstable();
                self.prefetch_chunks(blob, chunks, &self.boot_fetch);
            }
            self.prefetch_done
                .fetch_add((end - at) as u64, Ordering::Relaxed);
            at = end;
        }

        // Through a P2P daemon the whole image goes blob by blob
        // (`stream_blobs`), after the start too: its seed peer takes the
        // registry's link for as long as the image takes.
        if boot_chunks_later || self.streams_whole_blobs() {
            self.wait_quiet(self.start_quiet());
        } else if !rest.is_empty() {
            // The rest of the image (`--prefetch all`) shares the link with
            // the start's misses: it waits for the start to be over, as
            // SOCI's and stargz's background fetchers wait out a silence
            // period. Begun at mount, it made the heavy starts 1.4-2.5x
            // slower (docs/coldstart-heavy.md, "`--prefetch all` during a
            // start").
            self.wait_first_read();
            self.wait_quiet(self.start_quiet());
        }
        if !rest.is_empty() {
            tracing::info!(
                chunks = rest.len(),
                "fetching the rest in the background, yielding to misses"
            );
        }
        self.prefetch_rest(&rest);
    }

    /// Fetches `rest` (blob, chunk): through a bulk_only host (a P2P
    /// daemon) with `--prefetch all`, each blob whole ([`P2P_STREAMS`] at
    /// once, `stream.rs`); what that leaves, and everything otherwise, in
    /// batches of one blob ([`BULK_BATCH_CHUNKS`], [`BULK_BATCH_BYTES`]),
    /// one batch at a time, each once no miss came for [`BULK_QUIET`]:
    /// ranges go the misses' way, on the link both use.
    fn prefetch_rest(&self, rest: &[(u32, usize)]) {
        let leftover;
        let rest = if self.streams_whole_blobs() {
            leftover = self.stream_blobs(rest, P2P_STREAMS);
            &leftover[..]
        } else {
            rest
        };
        for batch in self.bulk_batches(rest) {
            self.wait_quiet(BULK_QUIET);
            let mut chunks: Vec<usize> = batch.iter().map(|p| p.1).collect();
            chunks.sort_unstable(); // boot-set order is not blob order: merge what is adjacent
            self.prefetch_chunks(batch[0].0, chunks, &self.fetch);
            self.prefetch_done
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
        }
    }

    /// `rest` cut into runs of one blob's chunks of at most
    /// [`BULK_BATCH_CHUNKS`] and [`BULK_BATCH_BYTES`] (a single larger
    /// chunk alone).
    fn bulk_batches<'a>(&self, rest: &'a [(u32, usize)]) -> Vec<&'a [(u32, usize)]> {
        let mut batches = Vec::new();
        let mut at = 0;
        while at < rest.len() {
            let (mut end, mut bytes) = (at, 0);
            while end < rest.len() && end - at < BULK_BATCH_CHUNKS && rest[end].0 == rest[at].0 {
                bytes += self.compressed_bytes(rest[end].0, rest[end].1);
                if bytes > BULK_BATCH_BYTES && end > at {
                    break;
                }
                end += 1;
            }
            batches.push(&rest[at..end]);
            at = end;
        }
        batches
    }

    /// Chunk `i` of blob `blob`'s compressed size (0 for none such): what
    /// fetching it puts on the wire.
    fn compressed_bytes(&self, blob: u32, i: usize) -> u64 {
        self.lock_store(blob)
            .ok()
            .and_then(|s| {
                s.blob
                    .chunks
                    .get(i)
                    .map(|c| u64::from(c.compressed_size.get()))
            })
            .unwrap_or(0)
    }

    /// Whether bulk reads go another way than misses (a bulk_only host).
    pub(super) fn bulk_apart(&self) -> bool {
        !Arc::ptr_eq(&self.source, &self.miss_source)
    }

    /// Whether `--prefetch all` fetches each blob in one request: through
    /// a bulk_only host (a P2P daemon), for a lamina image (a tar index's
    /// spans decode with windows, fetched in ranges).
    fn streams_whole_blobs(&self) -> bool {
        self.config.prefetch_all && self.bulk_apart() && self.windows.is_none()
    }

    /// Returns once the start the mount was made for seems over: its first
    /// miss came and then none for [`START_QUIET`] (reads the holder
    /// answered within boot pages count as misses here), or no miss came for
    /// [`START_AT_MOST`]. Layers no reader waits for (the FUSE lookup table:
    /// 8.5 MB of a million-file image) go on the wire after it, not
    /// before the first read or beside the start's misses.
    pub(super) fn wait_start_over(&self) {
        self.wait_first_read();
        self.wait_quiet(START_QUIET);
    }

    /// Returns at the mount's first read (a miss, or a read the holder
    /// answered within boot pages), or once [`START_AT_MOST`] passed
    /// without one.
    fn wait_first_read(&self) {
        let reads =
            || self.misses.load(Ordering::Relaxed) + self.ready_events.load(Ordering::Relaxed);
        while reads() == 0 && self.started.elapsed() < START_AT_MOST {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// How long without a miss ends the start. Reads of warmed boot pages
    /// raise none (`crate::warm`): a start served from them looks quiet
    /// long before it is over, and the boot set's whole chunks fetched
    /// then came in the middle of the data-science start at 1gbit.
    fn start_quiet(&self) -> Duration {
        if self.warmed_bytes.load(Ordering::Relaxed) > 0 {
            WARMED_START_QUIET
        } else {
            START_QUIET
        }
    }

    /// Returns once no miss has arrived for `quiet` and none is in progress.
    pub(super) fn wait_quiet(&self, quiet: Duration) {
        loop {
            let now = self.elapsed_ms();
            let last = self.last_miss_ms.load(Ordering::Relaxed);
            let idle = Duration::from_millis(now.saturating_sub(last));
            if idle >= quiet && self.active_misses.load(Ordering::Relaxed) == 0 {
                return;
            }
            std::thread::sleep((quiet - idle.min(quiet)).max(Duration::from_millis(20)));
        }
    }

    /// Whether fills no reader waits for (prefetches, reads ahead,
    /// predictions) may take more of the cache filesystem: they leave its
    /// last `cache_reserve` bytes to the reads readers wait on, this
    /// mount's and every other's (issue 42, point 7: one image under
    /// `--prefetch all` filled the disk and other tenants' reads failed).
    /// Says so in the log once each time the reserve is reached.
    pub(super) fn room_for_background(&self) -> bool {
        let room = match rustix::fs::statvfs(&self.config.blob_dir) {
            Ok(fs) => {
                let (free, total) = (fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize);
                let reserve = self
                    .config
                    .cache_reserve
                    .unwrap_or((total / 10).min(crate::config::DEFAULT_CACHE_RESERVE_MAX));
                let room = free > reserve;
                if !room && !self.reserve_reached.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        free,
                        reserve,
                        "fills no reader waits for stop: the cache filesystem is down to its \
                         reserve (--cache-reserve), kept for reads readers wait on"
                    );
                }
                room
            }
            Err(e) => {
                tracing::warn!("statvfs {}: {e}", self.config.blob_dir.display());
                true
            }
        };
        if room {
            self.reserve_reached.store(false, Ordering::Relaxed);
        }
        room
    }

    pub(super) fn prefetch_chunks(&self, blob: u32, chunks: Vec<usize>, opts: &FetchOptions) {
        if self.is_streaming(blob) {
            return; // they come with the blob's stream
        }
        if !self.room_for_background() {
            return;
        }
        if let Ok(mine) = self.claim(blob, chunks.into_iter(), None, false) {
            if let Err(e) = self.fetch_with(blob, &mine, None, opts, None) {
                tracing::warn!("prefetch: {e}");
            }
            self.release(blob, &mine);
        }
    }
}
