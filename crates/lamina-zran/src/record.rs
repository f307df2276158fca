//! The spans side of the indexer: the open span's start and running digest,
//! and the rule for when a span is due to close.

use ring::digest;

use crate::{Span, SpanKind, MAX_SPAN_EXPANSION, WINDOW_BUDGET};

struct Open {
    compressed_start: u64,
    uncompressed_start: u64,
    skip_bits: u8,
    window: Vec<u8>,
    kind: SpanKind,
    hasher: digest::Context,
}

pub(crate) struct Recorder {
    span_size: u64,
    spans: Vec<Span>,
    open: Option<Open>,
    /// Uncompressed bytes produced so far.
    out_pos: u64,
    /// What the closed spans' windows cost to store: their non-zero bytes
    /// (the zeros of a narrowed window compress to almost nothing).
    window_cost: u64,
}

/// What a window costs to store, about: its non-zero bytes.
fn window_cost(window: &[u8]) -> u64 {
    window.iter().filter(|&&b| b != 0).count() as u64
}

impl Recorder {
    pub(crate) fn new(span_size: u64) -> Self {
        Recorder {
            span_size,
            spans: Vec::new(),
            open: None,
            out_pos: 0,
            window_cost: 0,
        }
    }

    pub(crate) fn span_size(&self) -> u64 {
        self.span_size
    }

    pub(crate) fn uncompressed_size(&self) -> u64 {
        self.out_pos
    }

    /// Starts a span at the current uncompressed position.
    pub(crate) fn open(
        &mut self,
        compressed_start: u64,
        skip_bits: u8,
        window: Vec<u8>,
        kind: SpanKind,
    ) {
        debug_assert!(self.open.is_none(), "a span is already open");
        self.open = Some(Open {
            compressed_start,
            uncompressed_start: self.out_pos,
            skip_bits,
            window,
            kind,
            hasher: digest::Context::new(&digest::SHA256),
        });
    }

    /// Uncompressed bytes that belong to the open span.
    pub(crate) fn feed(&mut self, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let open = self.open.as_mut().expect("bytes produced outside a span");
        open.hasher.update(data);
        self.out_pos += data.len() as u64;
    }

    /// Replaces the open span's window with a narrower one that decodes it
    /// the same (`sparse::narrow_window`).
    pub(crate) fn narrow_window(&mut self, window: Vec<u8>) {
        if let Some(open) = self.open.as_mut() {
            open.window = window;
        }
    }

    /// Uncompressed bytes in the open span so far.
    pub(crate) fn open_len(&self) -> u64 {
        self.open
            .as_ref()
            .map_or(0, |open| self.out_pos - open.uncompressed_start)
    }

    /// Whether a point at `compressed_at` would close a big enough span:
    /// `span_size` compressed bytes while the windows so far are within
    /// [`WINDOW_BUDGET`] of the compressed bytes read (a stretch whose
    /// windows cost more gets longer spans), or `MAX_SPAN_EXPANSION` times
    /// `span_size` uncompressed whatever the windows cost.
    pub(crate) fn due(&self, compressed_at: u64) -> bool {
        self.open.as_ref().is_some_and(|open| {
            let within_budget = || {
                let cost = self.window_cost + window_cost(&open.window);
                cost.saturating_mul(WINDOW_BUDGET) <= compressed_at
            };
            (compressed_at.saturating_sub(open.compressed_start) >= self.span_size
                && within_budget())
                || self.open_len() >= self.span_size.saturating_mul(MAX_SPAN_EXPANSION)
        })
    }

    /// Ends the open span; one without bytes is dropped (an empty gzip
    /// member, trailing skippable zstd frames): no reader needs it.
    pub(crate) fn close(&mut self, compressed_end: u64) {
        let Some(open) = self.open.take() else { return };
        if self.out_pos == open.uncompressed_start {
            return;
        }
        self.window_cost += window_cost(&open.window);
        let digest = open.hasher.finish();
        self.spans.push(Span {
            uncompressed: open.uncompressed_start..self.out_pos,
            compressed: open.compressed_start..compressed_end,
            skip_bits: open.skip_bits,
            window: open.window,
            kind: open.kind,
            digest: digest.as_ref().try_into().expect("sha256 is 32 bytes"),
        });
    }

    pub(crate) fn span_count(&self) -> usize {
        self.spans.len()
    }

    pub(crate) fn into_spans(self) -> Vec<Span> {
        debug_assert!(self.open.is_none(), "a span is still open");
        self.spans
    }
}
