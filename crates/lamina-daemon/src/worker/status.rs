//! What a worker reports: `status.json` in the mount's run dir, rewritten
//! when it changes (`lamina status` reads it).

use super::*;

/// Live figures, written to `<run_dir>/status.json`.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Status {
    /// Worker pid.
    pub pid: u32,
    /// Image reference.
    pub image: String,
    /// Mountpoint.
    pub mountpoint: String,
    /// Compressed bytes fetched by this worker.
    pub fetched_bytes: u64,
    /// Range requests sent.
    pub requests: u64,
    /// Misses served: reads of watched cache files (pre-content events,
    /// kernel path) or of chunks not yet local (FUSE) that the worker
    /// answered.
    pub misses: u64,
    /// Reads of watched cache files the holder answered itself, within
    /// boot pages the worker had announced. With `misses`, the mount's
    /// pre-content events.
    #[serde(default)]
    pub ready_events: u64,
    /// Events of the worker's own writes (fills) and reads (warming),
    /// which the holder lets through at once.
    #[serde(default)]
    pub worker_events: u64,
    /// Bytes of boot pages read ahead into the mount's page cache as they
    /// landed (`lamina_daemon::warm`): reads of them raise no event.
    #[serde(default)]
    pub warmed_bytes: u64,
    /// Misses that failed (reader got EIO).
    pub failed_misses: u64,
    /// Chunks that failed verification and were fetched again.
    pub bad_chunks: u64,
    /// Bytes present in the cache / total, over all blobs.
    pub cached_bytes: u64,
    /// Total uncompressed bytes of all chunks.
    pub total_bytes: u64,
    /// Boot-set / prefetch chunks done.
    pub prefetch_done: u64,
    /// Boot-set / prefetch chunks planned.
    pub prefetch_total: u64,
    /// Bytes written into the cache from the image's boot pages.
    #[serde(default)]
    pub boot_page_bytes: u64,
    /// Boot-pages frames to load (0: none, or not asked to).
    #[serde(default)]
    pub boot_frames: u64,
    /// Of `boot_frames`, those applied or given up on.
    #[serde(default)]
    pub boot_frames_done: u64,
    /// Of `fetched_bytes`, what readers waited for (misses).
    #[serde(default)]
    pub miss_fetched_bytes: u64,
    /// Of `requests`, those for misses.
    #[serde(default)]
    pub miss_requests: u64,
    /// Of `fetched_bytes`, what was fetched ahead of a reader reading in
    /// blob order (`fill_ahead`).
    #[serde(default)]
    pub ahead_fetched_bytes: u64,
    /// Of `requests`, those fetched ahead.
    #[serde(default)]
    pub ahead_requests: u64,
    /// Of `fetched_bytes`, what was fetched for predicted misses (files
    /// fetched together on a first miss, `lamina_daemon::predict`).
    #[serde(default)]
    pub predicted_fetched_bytes: u64,
    /// Of `requests`, those for predicted misses.
    #[serde(default)]
    pub predicted_requests: u64,
    /// Chunk bytes (uncompressed) fetched ahead of readers, in order or
    /// predicted.
    #[serde(default)]
    pub ahead_chunk_bytes: u64,
    /// Of `ahead_chunk_bytes`, those a reader has read since: the rest is
    /// what fetching ahead cost without use (so far).
    #[serde(default)]
    pub ahead_used_bytes: u64,
    /// The rate of recent miss fetches (bytes over the time readers
    /// waited, round trips included; `crate::predict::RateMeter`), bytes
    /// per second; 0 before enough were timed.
    #[serde(default)]
    pub miss_rate_bps: u64,
    /// First misses in a shared library or a group of small files that
    /// fetched the rest of it (`crate::predict`); its bytes count in
    /// `ahead_chunk_bytes`.
    #[serde(default)]
    pub predictions: u64,
    /// Blobs whose rest was fetched on a miss, the start having waited on
    /// misses in it as long as the rest takes at the link's rate
    /// (`rest.rs`); their bytes count in `rest_fetched_bytes`.
    #[serde(default)]
    pub rests: u64,
    /// Of `fetched_bytes`, what was fetched as the rest of a blob.
    #[serde(default)]
    pub rest_fetched_bytes: u64,
    /// Rests being fetched now.
    #[serde(default)]
    pub rests_running: u64,
    /// Of `requests`, those for the rest of a blob.
    #[serde(default)]
    pub rest_requests: u64,
    /// The link's rate as the fastest single large fetch showed it, bytes
    /// per second (`crate::predict::LinkRate`; 0 before one): rests are
    /// fetched only at 30 MB/s or more.
    #[serde(default)]
    pub link_rate_bps: u64,
    /// Requests sent a second time because the first had not answered
    /// within the hedging bound (see `lamina_fetch::hedge`).
    #[serde(default)]
    pub hedges: u64,
    /// Of `hedges`, those whose answer was the one used.
    #[serde(default)]
    pub hedge_wins: u64,
    /// The current hedging bound for a 256 KiB request, in ms.
    #[serde(default)]
    pub hedge_bound_ms: u64,
    /// How long readers waited on misses: from the miss's arrival in the
    /// worker to its answer (EIO included).
    #[serde(default)]
    pub miss_latency: Histogram,
    /// Chunks copied from other images' cache files on this node instead
    /// of fetched (`lamina_fetch::locator`), and their bytes.
    #[serde(default)]
    pub located_chunks: u64,
    /// Bytes of `located_chunks` (uncompressed).
    #[serde(default)]
    pub located_bytes: u64,
    /// Per blob: (digest, chunks filled, chunks, complete).
    pub blobs: Vec<BlobStatus>,
}

/// One blob's progress.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct BlobStatus {
    /// Digest.
    pub digest: String,
    /// Chunks present.
    pub filled_chunks: usize,
    /// Chunks in all.
    pub chunks: usize,
    /// Whether complete.
    pub complete: bool,
}

impl Shared {
    pub(super) fn write_status(&self) -> io::Result<()> {
        write_atomic(
            &self.config.run_dir.join("status.json"),
            &self.status_json()?,
        )
    }

    pub(super) fn status_json(&self) -> io::Result<Vec<u8>> {
        let mut status = Status {
            pid: std::process::id(),
            image: self.config.image.clone(),
            mountpoint: self.config.mountpoint.display().to_string(),
            fetched_bytes: self.stats.bytes.load(Ordering::Relaxed),
            requests: self.stats.requests.load(Ordering::Relaxed),
            miss_fetched_bytes: self.miss_stats.bytes.load(Ordering::Relaxed),
            miss_requests: self.miss_stats.requests.load(Ordering::Relaxed),
            ahead_fetched_bytes: self.ahead_stats.bytes.load(Ordering::Relaxed),
            ahead_requests: self.ahead_stats.requests.load(Ordering::Relaxed),
            predicted_fetched_bytes: self.predict_stats.bytes.load(Ordering::Relaxed),
            predicted_requests: self.predict_stats.requests.load(Ordering::Relaxed),
            ahead_chunk_bytes: self.ahead_chunk_bytes.load(Ordering::Relaxed),
            ahead_used_bytes: self.ahead_used_bytes.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            ready_events: self.ready_events.load(Ordering::Relaxed),
            worker_events: self.worker_events.load(Ordering::Relaxed),
            warmed_bytes: self.warmed_bytes.load(Ordering::Relaxed),
            failed_misses: self.failed.load(Ordering::Relaxed),
            bad_chunks: self.stats.bad_chunks.load(Ordering::Relaxed),
            prefetch_done: self.prefetch_done.load(Ordering::Relaxed),
            prefetch_total: self.prefetch_total.load(Ordering::Relaxed),
            miss_latency: self.miss_latency.snapshot(),
            boot_frames: self.boot_frames.load(Ordering::SeqCst) as u64,
            boot_frames_done: (self.boot_frames.load(Ordering::SeqCst))
                .saturating_sub(self.boot_pending.load(Ordering::SeqCst))
                as u64,
            predictions: self.predictions.load(Ordering::Relaxed),
            rests: self.rests.load(Ordering::Relaxed),
            rest_fetched_bytes: self.rest_stats.bytes.load(Ordering::Relaxed),
            rests_running: self.rests_running.load(Ordering::Relaxed) as u64,
            rest_requests: self.rest_stats.requests.load(Ordering::Relaxed),
            link_rate_bps: self.link_rate.bps(),
            miss_rate_bps: self
                .miss_rate
                .rate()
                .map_or(0, |r| r.min(u64::MAX as f64) as u64),
            hedges: self.hedging.hedges.load(Ordering::Relaxed),
            hedge_wins: self.hedging.wins.load(Ordering::Relaxed),
            hedge_bound_ms: self.hedging.bound(256 << 10).as_millis() as u64,
            located_chunks: self.located_chunks.load(Ordering::Relaxed),
            located_bytes: self.located_bytes.load(Ordering::Relaxed),
            ..Status::default()
        };
        for (b, digest) in self.digests.iter().enumerate() {
            let lazy = &self.stores[b];
            let Some(s) = self.opened_store(b as u32)? else {
                // No chunk table yet: nothing was filled (fills need it),
                // unless the mount found the blob complete.
                let (count, size) = (lazy.summary.chunk_count, lazy.summary.data_size);
                status.total_bytes += size.unwrap_or(0);
                status.cached_bytes += if lazy.complete { size.unwrap_or(0) } else { 0 };
                status.blobs.push(BlobStatus {
                    digest: digest.to_string(),
                    filled_chunks: if lazy.complete { count } else { 0 },
                    chunks: count,
                    complete: lazy.complete,
                });
                continue;
            };
            let (filled, bytes) = s.filled();
            status.cached_bytes += bytes;
            status.boot_page_bytes += s.boot_bytes();
            status.total_bytes += s
                .blob
                .chunks
                .iter()
                .map(|c| u64::from(c.size.get()))
                .sum::<u64>();
            status.blobs.push(BlobStatus {
                digest: digest.to_string(),
                filled_chunks: filled,
                chunks: s.blob.chunks.len(),
                complete: s.is_complete(),
            });
        }
        serde_json::to_vec_pretty(&status).map_err(io::Error::other)
    }
}
