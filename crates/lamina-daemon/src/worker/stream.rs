//! Prefetching a whole blob in one request, through a bulk_only host (a P2P
//! daemon): its bytes are read in order and each chunk still wanted when
//! the stream reaches it is verified and filled. dfdaemon schedules a task
//! per request, and a range's task often went back to the registry (its
//! seed had not registered yet); one request per blob and node is
//! scheduled once, the way dfdaemon is built to be used.

use std::collections::VecDeque;
use std::io::Read;

use lamina_fetch::fetch::decode_chunk;
use lamina_format::index::ChunkEntry;

use super::*;

/// Compressed bytes of wanted chunks claimed ahead of the stream: a miss on
/// one of them waits for the stream (at 100 Mbit/s, well under a second
/// away), a miss further on fetches its chunks itself.
const CLAIM_AHEAD: u64 = 8 << 20;

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
                        let unsettled = self.stream_blob(*blob, chunks);
                        if let Ok(mut left) = left.lock() {
                            left.extend(unsettled.into_iter().map(|i| (*blob, i)));
                        }
                    }
                });
            }
        });
        left.into_inner().unwrap_or_default()
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
        // Chunks this node holds already are copied, not streamed.
        let mut order = match self.copy_located(blob, (&entries, &key), &order, None) {
            Ok(rest) => rest,
            Err(_) => order,
        };
        if order.is_empty() {
            return order;
        }
        order.sort_by_key(|&i| (entries[i].compressed_offset.get(), i));
        let digest = &self.digests[blob as usize];
        let reader = match self.source.stream_blob(digest) {
            Ok(Some(reader)) => reader,
            Ok(None) => return order,
            Err(e) => {
                tracing::warn!(
                    blob,
                    "prefetch of the whole blob: {e}; fetching it in ranges"
                );
                return order;
            }
        };
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let mut stream = InOrder {
            reader,
            start: 0,
            buf: Vec::new(),
            read: 0,
        };
        let settled = self.fill_from_stream(blob, (&entries, &key), &order, &mut stream);
        self.stats.bytes.fetch_add(stream.read, Ordering::Relaxed);
        self.landed.notify_all();
        self.check_complete(blob);
        if let Err(e) = &settled {
            tracing::warn!(
                blob,
                "prefetch of the whole blob stopped after {} bytes: {e}; the rest in ranges",
                stream.read
            );
        }
        // Also what a miss was fetching when the stream passed it, and lost.
        if let Ok(store) = self.lock_store(blob) {
            order.retain(|&i| !store.is_filled(i));
        }
        order
    }

    /// The loop of [`stream_blob`](Self::stream_blob); on failure its
    /// claims are released.
    fn fill_from_stream(
        &self,
        blob: u32,
        (entries, key): (&[ChunkEntry], &lamina_fetch::store::EntryKey),
        order: &[usize],
        stream: &mut InOrder,
    ) -> io::Result<()> {
        let mut claimed: VecDeque<usize> = VecDeque::new();
        let (mut next, mut ahead) = (0, 0u64);
        let mut decompressor = zstd::bulk::Decompressor::new()?;
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
                .and_then(|stored| match ours {
                    false => Ok(()),
                    true => {
                        let data = decode_chunk(&mut decompressor, entry, stored)
                            .map_err(|e| io::Error::other(format!("chunk {i}: {e}")))?;
                        self.lock_store(blob)?.fill(i, &data, None)?;
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
            self.prefetch_done.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}
