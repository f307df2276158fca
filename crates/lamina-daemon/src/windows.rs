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
        let none = |_: usize| Ok(None);
        if !spans.iter().any(|&s| self.needs((layer, s))) {
            // zstd, plain and member-start spans: no loader thread per fetch.
            return fetch(ChunkCodec::Spans(&none));
        }
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
            let window_of = |span: usize| self.wait((layer, span), &loading, opts, stats);
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

    /// Whether `span` of `layer` needs a window.
    fn needs(&self, (layer, span): (u32, usize)) -> bool {
        self.entries
            .get(layer as usize)
            .and_then(|e| e.get(span))
            .is_some_and(Option::is_some)
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
            .filter(|&s| self.needs((layer, s)) && !held(&s))
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
    /// held, else once it arrives. If `loading` ends without it (it failed,
    /// or another fetch of the span held it then and has dropped it since),
    /// it is fetched once more here; an error if that fails too (the span
    /// then fails at once: its bytes are not what is missing).
    fn wait(
        &self,
        (layer, span): (u32, usize),
        loading: &AtomicBool,
        opts: &FetchOptions,
        stats: &FetchStats,
    ) -> Result<Option<Arc<Vec<u8>>>, String> {
        if !self.needs((layer, span)) {
            return Ok(None);
        }
        let poisoned = || "windows lock poisoned".to_string();
        let mut have = self.have.lock().map_err(|_| poisoned())?;
        loop {
            if let Some(window) = have.get(&(layer, span)) {
                return Ok(Some(window.clone()));
            }
            if !loading.load(Ordering::SeqCst) {
                drop(have);
                self.fetch(layer, &[span], opts, stats)
                    .map_err(|e| format!("the window of span {span}: {e}"))?;
                let have = self.have.lock().map_err(|_| poisoned())?;
                return match have.get(&(layer, span)) {
                    Some(window) => Ok(Some(window.clone())),
                    None => Err(format!("the window of span {span} could not be had")),
                };
            }
            have = self
                .arrived
                .wait_timeout(have, Duration::from_millis(50))
                .map_err(|_| poisoned())?
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lamina_format::tar_index::window_entry;
    use std::sync::atomic::AtomicU32;

    /// A windows blob that answers the first `bad` requests with flipped
    /// bytes.
    #[derive(Debug)]
    struct Blob {
        bytes: Vec<u8>,
        bad: AtomicU32,
    }

    impl RangeSource for Blob {
        fn read_range(&self, _: &Digest, offset: u64, len: u64) -> io::Result<Vec<u8>> {
            let mut out = self.bytes[offset as usize..(offset + len) as usize].to_vec();
            if self.bad.load(Ordering::SeqCst) > 0 {
                self.bad.fetch_sub(1, Ordering::SeqCst);
                out.iter_mut().for_each(|b| *b ^= 0xff);
            }
            Ok(out)
        }
    }

    /// Two windows of layer 0 (spans 1 and 2; span 0 needs none).
    fn windows(bad: u32) -> (SpanWindows, Vec<Vec<u8>>) {
        let raw: Vec<Vec<u8>> = (1..3u8).map(|k| vec![k; 1000]).collect();
        let mut bytes = Vec::new();
        let mut entries = vec![None];
        for w in &raw {
            let frame = zstd::bulk::compress(w, 3).unwrap();
            entries.push(Some(window_entry(
                w,
                bytes.len() as u64,
                frame.len() as u32,
            )));
            bytes.extend_from_slice(&frame);
        }
        let source: Arc<dyn RangeSource> = Arc::new(Blob {
            bytes,
            bad: AtomicU32::new(bad),
        });
        let w = SpanWindows {
            entries: vec![entries],
            blob: Some((Digest::of_bytes(b"windows"), source)),
            have: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
        };
        (w, raw)
    }

    fn options() -> FetchOptions {
        FetchOptions {
            backoff: Duration::from_millis(1),
            ..FetchOptions::default()
        }
    }

    /// Each span gets its own window (a corrupt answer fetched again), a
    /// span that needs none gets none, and none is kept afterwards.
    #[test]
    fn spans_get_their_windows_checked() {
        let (w, raw) = windows(1);
        let stats = FetchStats::default();
        let got = w.with_windows(0, &[0, 1, 2], &options(), &stats, |codec| {
            let ChunkCodec::Spans(window_of) = codec else {
                panic!("not spans");
            };
            (0..3).map(|s| window_of(s).unwrap()).collect::<Vec<_>>()
        });
        assert!(got[0].is_none());
        assert_eq!(got[1].as_deref(), Some(&raw[0]));
        assert_eq!(got[2].as_deref(), Some(&raw[1]));
        // Both windows came in the one spoilt answer, then again.
        assert_eq!(stats.bad_chunks.load(Ordering::Relaxed), 2);
        assert_eq!(stats.requests.load(Ordering::Relaxed), 2);
        assert!(w.have.lock().unwrap().is_empty(), "windows kept");
    }

    /// A window that cannot be had is an error for its span, at once.
    #[test]
    fn a_window_never_had_is_an_error() {
        let (w, _) = windows(u32::MAX);
        let stats = FetchStats::default();
        let got = w.with_windows(0, &[1], &options(), &stats, |codec| {
            let ChunkCodec::Spans(window_of) = codec else {
                panic!("not spans");
            };
            window_of(1)
        });
        assert!(got.unwrap_err().contains("window of span 1"));
    }
}
