//! The compressed side of the indexer: a fixed buffer over the inner reader
//! that knows each byte's blob offset.

use std::io::{self, Read};

use crate::ZranError;

const BUFFER_SIZE: usize = 128 << 10;

/// Consumed bytes kept when the buffer is refilled, so the last few can be
/// given back: zlib-rs may have read up to 7 whole bytes past the end of a
/// deflate stream into its 64-bit bit buffer.
pub(crate) const KEEP_BEHIND: usize = 8;

pub(crate) struct Input<R> {
    inner: R,
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
    /// Blob offset of `buf[0]`.
    offset: u64,
    eof: bool,
}

impl<R: Read> Input<R> {
    pub(crate) fn new(inner: R) -> Self {
        Input {
            inner,
            buf: vec![0; BUFFER_SIZE].into_boxed_slice(),
            pos: 0,
            end: 0,
            offset: 0,
            eof: false,
        }
    }

    /// Blob offset of the next unconsumed byte.
    pub(crate) fn position(&self) -> u64 {
        self.offset + self.pos as u64
    }

    /// The buffered unconsumed bytes, refilled first if there are none;
    /// empty only at the end of the input.
    pub(crate) fn available(&mut self) -> Result<&[u8], ZranError> {
        if self.pos == self.end {
            self.fill()?;
        }
        Ok(&self.buf[self.pos..self.end])
    }

    pub(crate) fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.end - self.pos);
        self.pos += n;
    }

    /// The last `n` consumed bytes, while still buffered (at least
    /// [`KEEP_BEHIND`] are).
    pub(crate) fn behind(&self, n: usize) -> Option<&[u8]> {
        (n <= self.pos).then(|| &self.buf[self.pos - n..self.pos])
    }

    /// Gives back the last `n` (at most [`KEEP_BEHIND`]) consumed bytes.
    pub(crate) fn unread(&mut self, n: usize) {
        assert!(
            n <= self.pos && n <= KEEP_BEHIND,
            "unread({n}) past the kept bytes"
        );
        self.pos -= n;
    }

    /// The next byte without consuming it; `None` at the end of the input.
    pub(crate) fn peek(&mut self) -> Result<Option<u8>, ZranError> {
        Ok(self.available()?.first().copied())
    }

    /// The next byte; the end of the input is an error inside `inside`.
    pub(crate) fn next_byte(&mut self, inside: &'static str) -> Result<u8, ZranError> {
        let offset = self.position();
        let byte = self
            .peek()?
            .ok_or(ZranError::Truncated { offset, inside })?;
        self.pos += 1;
        Ok(byte)
    }

    fn fill(&mut self) -> Result<(), ZranError> {
        if self.eof {
            return Ok(());
        }
        let keep = self.pos.min(KEEP_BEHIND);
        self.buf.copy_within(self.pos - keep..self.end, 0);
        self.offset += (self.pos - keep) as u64;
        self.end -= self.pos - keep;
        self.pos = keep;
        loop {
            match self.inner.read(&mut self.buf[self.end..]) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(());
                }
                Ok(n) => {
                    self.end += n;
                    return Ok(());
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => return Err(ZranError::Io(err)),
            }
        }
    }
}
