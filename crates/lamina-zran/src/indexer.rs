//! [`SpanIndexer`]: one pass over the compressed layer that both yields the
//! uncompressed bytes (for a tar parser) and records the spans.

use std::fmt;
use std::io::{self, Read};

use crate::gzip::GzipIndexer;
use crate::input::Input;
use crate::record::Recorder;
use crate::zst::ZstdIndexer;
use crate::{Codec, LayerSpans, SpanKind, ZranError, MIN_SPAN_SIZE};

enum Engine {
    Gzip(Box<GzipIndexer>),
    Zstd(ZstdIndexer),
    Plain { done: bool },
}

/// A `Read` adapter: reads the compressed layer from `inner` once, yields its
/// uncompressed bytes, and records span points on the way.
///
/// Memory is bounded whatever the layer's size: an input buffer, the
/// decoder's state (gzip: 32 KiB window; zstd: its window, at most 128 MiB),
/// and the spans recorded so far (each gzip point inside a member carries its
/// 32 KiB window). `inner` should be a blocking reader: `Interrupted` is
/// retried, any other error (`WouldBlock` included) ends indexing.
///
/// Errors from `read` are the inner reader's own, or a [`ZranError`] wrapped
/// in an `InvalidData` `io::Error` (get it back with `get_ref`/`downcast`).
pub struct SpanIndexer<R: Read> {
    input: Input<R>,
    codec: Codec,
    engine: Engine,
    rec: Recorder,
    failed: Option<String>,
}

impl<R: Read> SpanIndexer<R> {
    /// An indexer placing points about every `span_size` compressed bytes
    /// (uncompressed for [`Codec::Plain`]); see [`crate::DEFAULT_SPAN_SIZE`].
    /// `span_size` below [`MIN_SPAN_SIZE`] is an error.
    pub fn new(inner: R, codec: Codec, span_size: u64) -> Result<Self, ZranError> {
        if span_size < MIN_SPAN_SIZE {
            return Err(ZranError::SpanSize(span_size));
        }
        let mut rec = Recorder::new(span_size);
        let engine = match codec {
            Codec::Gzip => Engine::Gzip(Box::new(GzipIndexer::new()?)),
            Codec::Zstd => Engine::Zstd(ZstdIndexer::new(&mut rec)),
            Codec::Plain => {
                rec.open(0, 0, Vec::new(), SpanKind::Plain);
                Engine::Plain { done: false }
            }
        };
        Ok(SpanIndexer {
            input: Input::new(inner),
            codec,
            engine,
            rec,
            failed: None,
        })
    }

    /// The spans, once the stream was read to its end (`read` returned 0).
    /// An error if it was not, or if a read failed.
    pub fn finish(self) -> Result<LayerSpans, ZranError> {
        if let Some(reason) = self.failed {
            return Err(ZranError::Failed(reason));
        }
        let done = match &self.engine {
            Engine::Gzip(gzip) => gzip.is_done(),
            Engine::Zstd(zstd) => zstd.is_done(),
            Engine::Plain { done } => *done,
        };
        if !done {
            return Err(ZranError::NotFinished {
                offset: self.input.position(),
            });
        }
        Ok(LayerSpans {
            codec: self.codec,
            uncompressed_size: self.rec.uncompressed_size(),
            compressed_size: self.input.position(),
            spans: self.rec.into_spans(),
        })
    }

    fn read_plain(&mut self, out: &mut [u8]) -> Result<usize, ZranError> {
        let Engine::Plain { done } = &mut self.engine else {
            unreachable!()
        };
        let at = self.input.position();
        let avail = self.input.available()?;
        if avail.is_empty() {
            self.rec.close(at);
            *done = true;
            return Ok(0);
        }
        let room = self.rec.span_size() - self.rec.open_len();
        let n = avail
            .len()
            .min(out.len())
            .min(usize::try_from(room).unwrap_or(usize::MAX));
        out[..n].copy_from_slice(&avail[..n]);
        self.input.consume(n);
        self.rec.feed(&out[..n]);
        let at = self.input.position();
        if self.rec.due(at) {
            self.rec.close(at);
            self.rec.open(at, 0, Vec::new(), SpanKind::Plain);
        }
        Ok(n)
    }

    fn read_inner(&mut self, out: &mut [u8]) -> Result<usize, ZranError> {
        match &mut self.engine {
            Engine::Gzip(gzip) => gzip.read(&mut self.input, &mut self.rec, out),
            Engine::Zstd(zstd) => zstd.read(&mut self.input, &mut self.rec, out),
            Engine::Plain { done: true } => Ok(0),
            Engine::Plain { done: false } => self.read_plain(out),
        }
    }
}

impl<R: Read> Read for SpanIndexer<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if let Some(reason) = &self.failed {
            return Err(ZranError::Failed(reason.clone()).into_io());
        }
        if out.is_empty() {
            return Ok(0);
        }
        self.read_inner(out).map_err(|err| {
            self.failed = Some(err.to_string());
            err.into_io()
        })
    }
}

impl<R: Read> fmt::Debug for SpanIndexer<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpanIndexer")
            .field("codec", &self.codec)
            .field("span_size", &self.rec.span_size())
            .field("compressed_pos", &self.input.position())
            .field("uncompressed_pos", &self.rec.uncompressed_size())
            .field("spans", &self.rec.span_count())
            .field("failed", &self.failed)
            .finish()
    }
}
