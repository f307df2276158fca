//! The crate's only unsafe code: a safe wrapper around zlib-rs's raw inflate
//! API, which the stable `zlib_rs::Inflate` lacks the parts of that a
//! checkpoint needs (`prime`, `data_type`).

use std::ffi::CStr;

use zlib_rs::c_api::z_stream;
use zlib_rs::inflate::{self, InflateConfig, InflateStream};
pub(crate) use zlib_rs::{InflateFlush, ReturnCode};

/// `data_type` bit: the inflater stopped at a block boundary.
pub(crate) const AT_BLOCK_BOUNDARY: i32 = 128;
/// `data_type` bit: the last block's header has been read.
pub(crate) const LAST_BLOCK_SEEN: i32 = 64;
/// `data_type` bits: input bits read but not yet used (zlib-rs buffers
/// 64-bit words, so this can be 8 or more).
pub(crate) const BUFFERED_BITS: i32 = 63;

/// A raw deflate (no zlib or gzip wrapper) inflater with a 32 KiB window.
pub(crate) struct RawInflate {
    // Initialized by `inflate::init` in `new`, released in `drop`; never moved
    // out. zlib-rs keeps no pointer back to it, so moving the struct is fine.
    strm: z_stream,
}

// SAFETY: the stream exclusively owns its state allocation (made with the
// Rust global allocator), `next_in`/`next_out` only point at caller buffers
// for the duration of one `inflate` call, and zlib-rs itself declares its
// `InflateStream` `Send`.
unsafe impl Send for RawInflate {}

impl RawInflate {
    pub(crate) fn new() -> Result<Self, ReturnCode> {
        let mut strm = z_stream::default();
        match inflate::init(&mut strm, InflateConfig { window_bits: -15 }) {
            ReturnCode::Ok => Ok(RawInflate { strm }),
            other => Err(other),
        }
    }

    fn stream(&mut self) -> &mut InflateStream<'_> {
        // SAFETY: `strm` was initialized by `inflate::init` (state and
        // allocator set) and is only released in `drop`; `InflateStream` is
        // `repr(C)` with `z_stream`'s layout. The returned borrow is tied to
        // `&mut self`, so nothing else touches `strm` while it lives.
        unsafe { InflateStream::from_stream_mut(&mut self.strm) }
            .expect("zlib-rs stream initialized in RawInflate::new")
    }

    /// Back to the start of a new raw deflate stream, window emptied.
    pub(crate) fn reset(&mut self) {
        let _ = inflate::reset(self.stream());
    }

    /// Inflates from `input` into `output`: (bytes consumed, bytes produced,
    /// zlib's return code). Consumed bytes may sit unused in the bit buffer;
    /// see [`RawInflate::data_type`].
    pub(crate) fn inflate(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        flush: InflateFlush,
    ) -> (usize, usize, ReturnCode) {
        let avail_in = input.len().min(u32::MAX as usize);
        let avail_out = output.len().min(u32::MAX as usize);
        self.strm.next_in = input.as_ptr();
        self.strm.avail_in = avail_in as u32;
        self.strm.next_out = output.as_mut_ptr();
        self.strm.avail_out = avail_out as u32;
        // SAFETY: the stream is initialized; next_in/avail_in describe
        // `input` and next_out/avail_out `output`, both borrowed for this call
        // only (zlib-rs reads input and writes at most avail_out bytes).
        let rc = unsafe { inflate::inflate(self.stream(), flush) };
        let consumed = avail_in - self.strm.avail_in as usize;
        let produced = avail_out - self.strm.avail_out as usize;
        // Leave no pointers into buffers we no longer borrow.
        self.strm.next_in = std::ptr::null();
        self.strm.avail_in = 0;
        self.strm.next_out = std::ptr::null_mut();
        self.strm.avail_out = 0;
        (consumed, produced, rc)
    }

    /// Feeds `bits` (1..=16) low bits of `value` ahead of the next input.
    pub(crate) fn prime(&mut self, bits: u8, value: u32) -> ReturnCode {
        inflate::prime(self.stream(), i32::from(bits), value as i32)
    }

    /// Presets the window: the history the next input's matches refer to.
    pub(crate) fn set_dictionary(&mut self, dictionary: &[u8]) -> ReturnCode {
        inflate::set_dictionary(self.stream(), dictionary)
    }

    /// zlib's `data_type` after the last call: buffered bits (low 6 bits),
    /// [`LAST_BLOCK_SEEN`], [`AT_BLOCK_BOUNDARY`].
    pub(crate) fn data_type(&self) -> i32 {
        self.strm.data_type
    }

    /// zlib-rs's message for the last error, if any.
    pub(crate) fn error_message(&self) -> &'static str {
        if self.strm.msg.is_null() {
            return "unknown error";
        }
        // SAFETY: zlib-rs only ever sets `msg` to a NUL-terminated string
        // literal (it asserts the NUL), so it is valid and 'static.
        let msg = unsafe { CStr::from_ptr(self.strm.msg) };
        msg.to_str().unwrap_or("unknown error")
    }
}

impl Drop for RawInflate {
    fn drop(&mut self) {
        let _ = inflate::end(self.stream());
    }
}
