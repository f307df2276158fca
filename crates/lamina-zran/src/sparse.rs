//! Narrow windows: of the 32 KiB of history a gzip point inside a member
//! carries, a span reads only the bytes its first output copies from. The
//! rest is zeroed and the history before the first byte read is dropped, so
//! the stored window compresses to a fraction of it (most of an index's
//! bytes are windows).
//!
//! Which bytes a span reads is found without a deflate parser of our own.
//! Deflate's output is literals and copies of earlier bytes, and which byte
//! a copy takes depends only on the compressed bits, never on what the
//! history holds. So the span's start is decoded with a window whose byte
//! `i` is `i & 0xff`, again with `!(i & 0xff)`, and once with `i >> 8`: an
//! output byte that differs between the first two came from the window, and
//! the first and third spell which window byte. The narrowed window is then
//! checked: it must decode the same bytes as the whole one, or the whole one
//! is kept.

use crate::{gzip, WINDOW_SIZE};

/// How far into a span its copies can still reach the window: a copy starts
/// at most 32 KiB after the point and is at most 258 bytes long.
pub(crate) const REACH: usize = WINDOW_SIZE + 258;

/// Most compressed bytes kept to narrow one window. REACH bytes of output
/// take about that much deflate or less; a stream that needs more (empty
/// blocks, say) keeps its whole window.
pub(crate) const MAX_PROBE_INPUT: usize = 256 << 10;

/// The part of `window` that the first `len` bytes out of `compressed`
/// (a span inside a member, `skip_bits` as its point says) copy from: the
/// history from the first byte read on, unread bytes zeroed. At least one
/// byte (the format stores no empty window). `None` when the span's start
/// does not decode, or the narrowed window would decode it otherwise.
pub(crate) fn narrow_window(
    compressed: &[u8],
    skip_bits: u8,
    window: &[u8],
    len: usize,
) -> Option<Vec<u8>> {
    let decode = |w: &[u8]| gzip::decode(compressed, skip_bits, w, len, 0).ok();
    let expected = decode(window)?;
    let label = |f: fn(usize) -> u8| (0..window.len()).map(f).collect::<Vec<u8>>();
    let low = decode(&label(|i| i as u8))?;
    let flipped = decode(&label(|i| !(i as u8)))?;
    let high = decode(&label(|i| (i >> 8) as u8))?;
    let mut read = vec![false; window.len()];
    for ((&l, &f), &h) in low.iter().zip(&flipped).zip(&high) {
        if l != f {
            *read.get_mut(usize::from(l) | usize::from(h) << 8)? = true;
        }
    }
    let first = read
        .iter()
        .position(|&r| r)
        .unwrap_or(window.len().saturating_sub(1));
    let narrowed: Vec<u8> = window[first..]
        .iter()
        .zip(&read[first..])
        .map(|(&byte, &r)| if r { byte } else { 0 })
        .collect();
    (decode(&narrowed)? == expected).then_some(narrowed)
}

/// The compressed start of the open span inside a member, kept until its
/// window is narrowed.
pub(crate) struct Probe {
    compressed: Vec<u8>,
    skip_bits: u8,
    window: Vec<u8>,
    out: usize,
}

impl Probe {
    /// A probe of a span that starts `skip_bits` into `first_bytes` (the
    /// bytes from its first one on that the inflater consumed already).
    pub(crate) fn new(first_bytes: &[u8], skip_bits: u8, window: Vec<u8>) -> Self {
        Probe {
            compressed: first_bytes.to_vec(),
            skip_bits,
            window,
            out: 0,
        }
    }

    /// Notes `consumed` compressed and `produced` uncompressed bytes. True
    /// once the probe has what it needs, or can no longer have it.
    pub(crate) fn feed(&mut self, consumed: &[u8], produced: usize) -> bool {
        self.compressed.extend_from_slice(consumed);
        self.out += produced;
        self.out >= REACH || self.compressed.len() > MAX_PROBE_INPUT
    }

    /// The narrowed window, or `None` to keep the whole one.
    pub(crate) fn finish(self) -> Option<Vec<u8>> {
        if self.compressed.len() > MAX_PROBE_INPUT || self.out == 0 {
            return None;
        }
        narrow_window(
            &self.compressed,
            self.skip_bits,
            &self.window,
            self.out.min(REACH),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use flate2::write::DeflateEncoder;
    use flate2::Compression;

    use super::*;

    /// Raw deflate of `history` then `data`, and the bit where `data`'s
    /// blocks start (a full flush ends the history's on a byte boundary).
    fn deflate_after(history: &[u8], data: &[u8]) -> (Vec<u8>, usize) {
        let mut enc = DeflateEncoder::new(Vec::new(), Compression::new(6));
        enc.write_all(history).unwrap();
        enc.flush().unwrap();
        let start = enc.get_ref().len();
        enc.write_all(data).unwrap();
        (enc.finish().unwrap(), start)
    }

    fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn keeps_only_the_bytes_copied_and_decodes_the_same() {
        let history = noise(WINDOW_SIZE, 1);
        // Copies of two stretches of the history, between fresh bytes.
        let data = [
            &noise(500, 2)[..],
            &history[20_000..20_300],
            &noise(700, 3),
            &history[30_000..30_100],
            &noise(40_000, 4),
        ]
        .concat();
        let (stream, start) = deflate_after(&history, &data);
        let len = data.len().min(REACH);
        let narrowed = narrow_window(&stream[start..], 0, &history, len).unwrap();
        // Chance 3-byte matches may keep a few more bytes, none before the
        // first stretch.
        let first = WINDOW_SIZE - narrowed.len();
        assert_eq!(first, 20_000);
        let kept = narrowed.iter().filter(|&&b| b != 0).count();
        assert!((398..=600).contains(&kept), "{kept} bytes kept");
        assert_eq!(&narrowed[..300], &history[20_000..20_300]);
        assert_eq!(&narrowed[10_000..10_100], &history[30_000..30_100]);
        let out = gzip::decode(&stream[start..], 0, &narrowed, data.len(), 0).unwrap();
        assert_eq!(out, data);
    }

    #[test]
    fn a_span_that_reads_no_history_keeps_one_byte() {
        let (stream, start) = deflate_after(&noise(WINDOW_SIZE, 5), &noise(50_000, 6));
        let narrowed = narrow_window(&stream[start..], 0, &noise(WINDOW_SIZE, 5), REACH).unwrap();
        assert_eq!(narrowed.len(), 1);
    }

    #[test]
    fn a_stream_that_does_not_decode_keeps_its_window() {
        let history = noise(WINDOW_SIZE, 7);
        let (stream, start) = deflate_after(&history, &history[30_000..32_000]);
        // A window shorter than the copies reach: the decode fails.
        assert_eq!(
            narrow_window(&stream[start..], 0, &history[..100], 2_000),
            None
        );
        assert_eq!(narrow_window(&[0xff; 16], 0, &history, 5_000), None);
    }
}
