//! Everything that can go wrong indexing a layer or decoding a span. Offsets
//! are blob offsets unless a message says otherwise.

use std::io;

/// An indexing or span-decoding failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ZranError {
    /// `SpanIndexer::new` was given a span size below [`crate::MIN_SPAN_SIZE`].
    #[error("span size {0} is below the minimum {min}", min = crate::MIN_SPAN_SIZE)]
    SpanSize(u64),
    /// The inner reader failed.
    #[error("reading the layer: {0}")]
    Io(#[from] io::Error),
    /// A malformed gzip member header.
    #[error("gzip header at offset {offset}: {reason}")]
    GzipHeader {
        /// Where the offending field starts.
        offset: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// A member's CRC32 or ISIZE trailer does not match its data.
    #[error(
        "gzip trailer at offset {offset}: {field} is {stored:#010x}, the data gives {actual:#010x}"
    )]
    GzipTrailer {
        /// Where the trailer starts.
        offset: u64,
        /// `CRC32` or `ISIZE`.
        field: &'static str,
        /// The trailer's value.
        stored: u32,
        /// The value computed from the data.
        actual: u32,
    },
    /// Bytes after the last gzip member that are neither a member nor zeros.
    #[error("trailing data at offset {offset} is not a gzip member")]
    TrailingData {
        /// Where they start.
        offset: u64,
    },
    /// Invalid deflate data.
    #[error("invalid deflate data near offset {offset}: {reason}")]
    Deflate {
        /// How far input had been consumed when it was found.
        offset: u64,
        /// zlib-rs's message.
        reason: String,
    },
    /// Invalid zstd data.
    #[error("invalid zstd data near offset {offset}: {reason}")]
    Zstd {
        /// How far input had been consumed when it was found.
        offset: u64,
        /// zstd's message.
        reason: String,
    },
    /// The input ended inside a structure.
    #[error("input ends at offset {offset} inside {inside}")]
    Truncated {
        /// Where the input ended.
        offset: u64,
        /// What it ended inside.
        inside: &'static str,
    },
    /// [`crate::SpanIndexer::finish`] before the stream was read to its end.
    #[error("the layer was not read to its end (stopped at compressed offset {offset})")]
    NotFinished {
        /// How far the compressed stream had been read.
        offset: u64,
    },
    /// [`crate::SpanIndexer::finish`] after a read had failed.
    #[error("indexing failed: {0}")]
    Failed(String),
    /// A span whose fields contradict each other or are out of bounds.
    #[error("invalid span: {0}")]
    InvalidSpan(String),
    /// [`crate::decode_span`] was given a slice of the wrong length.
    #[error("span needs {expected} compressed bytes, was given {given}")]
    CompressedLength {
        /// The span's compressed length.
        expected: u64,
        /// The slice's length.
        given: u64,
    },
    /// The span's data ends before the span's length.
    #[error("span at offset {offset} decodes to {decoded} bytes, the index says {expected}")]
    ShortSpan {
        /// The span's compressed start.
        offset: u64,
        /// Bytes decoded.
        decoded: u64,
        /// The span's length.
        expected: u64,
    },
    /// The span's data goes on after the span's length.
    #[error("span at offset {offset} decodes to more than the {expected} bytes the index says")]
    LongSpan {
        /// The span's compressed start.
        offset: u64,
        /// The span's length.
        expected: u64,
    },
    /// The decoded bytes are not the ones the index recorded.
    #[error("span at offset {offset}: sha256 of the decoded bytes does not match the index")]
    DigestMismatch {
        /// The span's compressed start.
        offset: u64,
    },
}

impl ZranError {
    /// For `Read`: the inner reader's own error as is, ours as `InvalidData`.
    pub(crate) fn into_io(self) -> io::Error {
        match self {
            ZranError::Io(err) => err,
            other => io::Error::new(io::ErrorKind::InvalidData, other),
        }
    }
}
