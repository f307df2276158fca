//! The windows of a tar index's gzip spans (`lamina_format::tar_index`):
//! most of an index's bytes, and a start needs only those of the spans it
//! reads. So each is fetched by range from the index's windows blob while
//! its span is fetched, checked against its digest (as a zstd chunk), and
//! kept in memory only until that span is decoded.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use lamina_fetch::fetch::{
    fetch_chunks, BlobChunks, ChunkCodec, FetchOptions, FetchStats, RangeSource,
};
use lamina_format::index::ChunkEntry;
use lamina_oci::Digest;

use crate::config::WindowsSpec;

/// Per layer, per span: where its window is (`None`: it needs none).
pub(crate) type WindowEntries = Vec<Vec<Option<ChunkEntry>>>;

/// Windows by (layer, span).
type Held = HashMap<(u32, usize), Arc<Vec<u8>>>;

/// The windows of one mount's tar index.
pub(crate) struct SpanWindows {
    entries: WindowEntries,
    /// The windows blob and where it is; `None` when no span needs one.
    blob: Option<(Digest, Arc<dyn RangeSource>)>,
    /// Windows fetched and verified, by (layer, span), until decoded.
    have: Mutex<Held>,
    arrived: Condvar,
}

impl SpanWindows {
    /// The windows of `entries`, fetched from `spec`'s blob; every entry
    /// must lie inside it.
    pub(crate) fn new(
        entries: WindowEntries,
        spec: Option<&WindowsSpec>,
        timeout_secs: u64,
    ) -> io::Result<SpanWindows> {
        let needed = entries.iter().flatten().flatten();
        let blob = match spec {
            Some(spec) => {
                let outside = needed.clone().any(|w| {
                    w.compressed_offset.get() + u64::from(w.compressed_size.get()) > spec.size
                });
                if outside {
                    return Err(io::Error::other(format!(
                        "a window lies outside the windows blob {} ({} bytes)",
                        spec.digest, spec.size
                    )));
                }
                let digest = Digest::parse(&spec.digest).map_err(io::Error::other)?;
                let source = crate::sources::range_source(&spec.source, timeout_secs)?;
                Some((digest, source))
            }
            None if needed.clone().next().is_some() => {
                return Err(io::Error::other(
                    "the tar index's spans need windows, and it names no windows blob",
                ))
            }
            None => None,
        };
        Ok(SpanWindows {
            entries,
            blob,
            have: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
        })
    }

    /// Runs `fetch` (a fetch of `spans` of `layer` with the codec given)
    /// while the windows those spans need are fetched beside it: a span
    /// waits in its decode for its window, not before its request.
    pub(crate) fn with_windows<R>(
        &self,
        layer: u32,
        spans: &[usize],
        opts: &FetchOptions,
        stats: &FetchStats,
        fetch: impl FnOnce(ChunkCodec<'_>) -> R,
    ) -> R {
        let loading = AtomicBool::new(true);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                if let Err(e) = self.fetch(layer, spans, opts, stats) {
                    tracing::error!("layer {layer}: windows: {e}");
                }
                loading.store(false, Ordering::SeqCst);
                let _held = self.have.lock();
                self.arrived.notify_all();
            });
            let window_of = |span: usize| self.wait(layer, span, &loading);
            let result = fetch(ChunkCodec::Spans(&window_of));
            // Decoded, or failed: a retry fetches the window again.
            if let Ok(mut have) = self.have.lock() {
                for &span in spans {
                    have.remove(&(layer, span));
                }
            }
            result
        })
    }

    /// Fetches and checks the windows of `spans` of `layer` not held yet.
    fn fetch(
        &self,
        layer: u32,
        spans: &[usize],
        opts: &FetchOptions,
        stats: &FetchStats,
    ) -> io::Result<()> {
        let Some(entries) = self.entries.get(layer as usize) else {
            return Ok(());
        };
        let held = |span: &usize| {
            self.have
                .lock()
                .is_ok_and(|h| h.contains_key(&(layer, *span)))
        };
        let wanted: Vec<usize> = spans
            .iter()
            .copied()
            .filter(|&s| entries.get(s).is_some_and(Option::is_some) && !held(&s))
            .collect();
        let (Some((digest, source)), false) = (&self.blob, wanted.is_empty()) else {
            return Ok(());
        };
        let chunks: Vec<ChunkEntry> = wanted.iter().filter_map(|&s| entries[s].clone()).collect();
        let blob = BlobChunks {
            digest,
            chunks: &chunks,
            codec: ChunkCodec::Lamina,
        };
        let all: Vec<usize> = (0..chunks.len()).collect();
        fetch_chunks(source, blob, &all, opts, stats, |k, window| {
            let mut have = self.have.lock().map_err(|_| io::Error::other("poisoned"))?;
            have.insert((layer, wanted[k]), Arc::new(window));
            self.arrived.notify_all();
            Ok(())
        })
        .map_err(io::Error::other)
    }

    /// The window of `span` of `layer`: at once when it needs none or is
    /// held, else once it arrives; `None` once `loading` ends without it.
    fn wait(&self, layer: u32, span: usize, loading: &AtomicBool) -> Option<Arc<Vec<u8>>> {
        let needs = self
            .entries
            .get(layer as usize)
            .and_then(|e| e.get(span))
            .is_some_and(Option::is_some);
        if !needs {
            return None;
        }
        let mut have = self.have.lock().ok()?;
        loop {
            if let Some(window) = have.get(&(layer, span)) {
                return Some(window.clone());
            }
            if !loading.load(Ordering::SeqCst) {
                return None;
            }
            have = self
                .arrived
                .wait_timeout(have, Duration::from_millis(50))
                .ok()?
                .0;
        }
    }
}
