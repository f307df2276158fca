//! gzip: member headers and trailers (RFC 1952) parsed here, the deflate
//! data inflated raw so points can be taken at block boundaries.

use std::io::Read;

use zlib_rs::crc32::crc32;

use crate::input::Input;
use crate::raw::{
    InflateFlush, RawInflate, ReturnCode, AT_BLOCK_BOUNDARY, BUFFERED_BITS, LAST_BLOCK_SEEN,
};
use crate::record::Recorder;
use crate::sparse::Probe;
use crate::{SpanKind, ZranError, WINDOW_SIZE};

/// Longest FNAME or FCOMMENT accepted (FEXTRA is bounded by its u16 length).
pub(crate) const MAX_HEADER_FIELD: usize = 64 << 10;

const FTEXT: u8 = 1;
const FHCRC: u8 = 2;
const FEXTRA: u8 = 4;
const FNAME: u8 = 8;
const FCOMMENT: u8 = 16;
const FRESERVED: u8 = !(FTEXT | FHCRC | FEXTRA | FNAME | FCOMMENT);

/// zlib-rs makes progress at least every few calls (its bit buffer holds a
/// handful of empty blocks at most); more stalls than this means it is stuck.
pub(crate) const MAX_STALLS: u32 = 16;

/// Reads a member header, keeping the CRC for FHCRC.
struct Header<'a, R> {
    input: &'a mut Input<R>,
    crc: u32,
}

impl<R: Read> Header<'_, R> {
    fn byte(&mut self) -> Result<u8, ZranError> {
        let byte = self.input.next_byte("a gzip header")?;
        self.crc = crc32(self.crc, &[byte]);
        Ok(byte)
    }

    fn error(offset: u64, reason: impl Into<String>) -> ZranError {
        ZranError::GzipHeader {
            offset,
            reason: reason.into(),
        }
    }

    /// Skips a NUL-terminated field (FNAME, FCOMMENT), bounded.
    fn skip_string(&mut self, field: &str) -> Result<(), ZranError> {
        let start = self.input.position();
        for _ in 0..MAX_HEADER_FIELD {
            if self.byte()? == 0 {
                return Ok(());
            }
        }
        Err(Self::error(
            start,
            format!("{field} is longer than {MAX_HEADER_FIELD} bytes"),
        ))
    }

    /// Consumes a whole member header; the input is left at the deflate data.
    fn skip(mut self) -> Result<(), ZranError> {
        let start = self.input.position();
        let mut fixed = [0u8; 10];
        for byte in &mut fixed {
            *byte = self.byte()?;
        }
        if fixed[..2] != [0x1f, 0x8b] {
            return Err(Self::error(
                start,
                format!("bad magic {:02x} {:02x}", fixed[0], fixed[1]),
            ));
        }
        if fixed[2] != 8 {
            return Err(Self::error(
                start + 2,
                format!("compression method {} is not deflate", fixed[2]),
            ));
        }
        let flags = fixed[3];
        if flags & FRESERVED != 0 {
            return Err(Self::error(
                start + 3,
                format!("reserved flags set ({flags:#04x})"),
            ));
        }
        if flags & FEXTRA != 0 {
            let xlen = u16::from_le_bytes([self.byte()?, self.byte()?]);
            for _ in 0..xlen {
                self.byte()?;
            }
        }
        if flags & FNAME != 0 {
            self.skip_string("FNAME")?;
        }
        if flags & FCOMMENT != 0 {
            self.skip_string("FCOMMENT")?;
        }
        if flags & FHCRC != 0 {
            let at = self.input.position();
            let expected = self.crc as u16;
            let stored = u16::from_le_bytes([self.byte()?, self.byte()?]);
            if stored != expected {
                return Err(Self::error(
                    at,
                    format!("header CRC16 {stored:#06x}, computed {expected:#06x}"),
                ));
            }
        }
        Ok(())
    }
}

/// The last `WINDOW_SIZE` uncompressed bytes of the current member.
struct History {
    buf: Box<[u8]>,
    next: usize,
    full: bool,
}

impl History {
    fn new() -> Self {
        History {
            buf: vec![0; WINDOW_SIZE].into_boxed_slice(),
            next: 0,
            full: false,
        }
    }

    fn clear(&mut self) {
        self.next = 0;
        self.full = false;
    }

    fn push(&mut self, data: &[u8]) {
        if data.len() >= WINDOW_SIZE {
            self.buf.copy_from_slice(&data[data.len() - WINDOW_SIZE..]);
            self.next = 0;
            self.full = true;
            return;
        }
        let first = data.len().min(WINDOW_SIZE - self.next);
        self.buf[self.next..self.next + first].copy_from_slice(&data[..first]);
        let rest = &data[first..];
        self.buf[..rest.len()].copy_from_slice(rest);
        self.full |= self.next + data.len() >= WINDOW_SIZE;
        self.next = (self.next + data.len()) % WINDOW_SIZE;
    }

    /// The history, oldest byte first.
    fn window(&self) -> Vec<u8> {
        if self.full {
            [&self.buf[self.next..], &self.buf[..self.next]].concat()
        } else {
            self.buf[..self.next].to_vec()
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Header,
    Deflate,
    Trailer,
    Done,
}

/// Indexes a gzip stream member by member.
pub(crate) struct GzipIndexer {
    raw: RawInflate,
    phase: Phase,
    members: u64,
    /// CRC32 and length of the current member's data, for its trailer.
    crc: u32,
    member_out: u64,
    history: History,
    stalls: u32,
    /// The open span's start, while its window is being narrowed.
    probe: Option<Probe>,
}

fn inflate_init_error(rc: ReturnCode) -> ZranError {
    ZranError::Deflate {
        offset: 0,
        reason: format!("cannot set up zlib-rs inflate: {rc:?}"),
    }
}

impl GzipIndexer {
    pub(crate) fn new() -> Result<Self, ZranError> {
        Ok(GzipIndexer {
            raw: RawInflate::new().map_err(inflate_init_error)?,
            phase: Phase::Header,
            members: 0,
            crc: 0,
            member_out: 0,
            history: History::new(),
            stalls: 0,
            probe: None,
        })
    }

    pub(crate) fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// Fills `out` with uncompressed bytes; 0 only at the end of the stream.
    pub(crate) fn read<R: Read>(
        &mut self,
        input: &mut Input<R>,
        rec: &mut Recorder,
        out: &mut [u8],
    ) -> Result<usize, ZranError> {
        loop {
            match self.phase {
                Phase::Header => self.start_member(input, rec)?,
                Phase::Deflate => {
                    let produced = self.inflate(input, rec, out)?;
                    if produced > 0 {
                        return Ok(produced);
                    }
                }
                Phase::Trailer => self.check_trailer(input)?,
                Phase::Done => return Ok(0),
            }
        }
    }

    /// At a member boundary: the next member's header, or the end of the
    /// stream (trailing zeros allowed, as `gzip -d` does).
    fn start_member<R: Read>(
        &mut self,
        input: &mut Input<R>,
        rec: &mut Recorder,
    ) -> Result<(), ZranError> {
        let offset = input.position();
        match input.peek()? {
            None if self.members == 0 => {
                return Err(ZranError::Truncated {
                    offset,
                    inside: "the first gzip member (empty input)",
                });
            }
            None => {
                self.phase = Phase::Done;
                return Ok(());
            }
            Some(0) if self.members > 0 => {
                skip_zeros(input)?;
                self.phase = Phase::Done;
                return Ok(());
            }
            Some(byte) if self.members > 0 && byte != 0x1f => {
                return Err(ZranError::TrailingData { offset })
            }
            Some(_) => {}
        }
        Header {
            input: &mut *input,
            crc: 0,
        }
        .skip()?;
        self.raw.reset();
        self.crc = 0;
        self.member_out = 0;
        self.history.clear();
        rec.open(input.position(), 0, Vec::new(), SpanKind::GzipMemberStart);
        self.phase = Phase::Deflate;
        Ok(())
    }

    /// One inflate call, stopping at block boundaries to consider a point.
    fn inflate<R: Read>(
        &mut self,
        input: &mut Input<R>,
        rec: &mut Recorder,
        out: &mut [u8],
    ) -> Result<usize, ZranError> {
        let avail = input.available()?;
        if avail.is_empty() {
            return Err(ZranError::Truncated {
                offset: input.position(),
                inside: "deflate data",
            });
        }
        let (used, produced, rc) = self.raw.inflate(avail, out, InflateFlush::Block);
        if self
            .probe
            .as_mut()
            .is_some_and(|p| p.feed(&avail[..used], produced))
        {
            self.finish_probe(rec);
        }
        input.consume(used);
        let data = &out[..produced];
        self.crc = crc32(self.crc, data);
        self.member_out += produced as u64;
        self.history.push(data);
        rec.feed(data);
        self.stalls = if used == 0 && produced == 0 {
            self.stalls + 1
        } else {
            0
        };
        match rc {
            ReturnCode::Ok | ReturnCode::BufError if self.stalls <= MAX_STALLS => {
                self.maybe_point(input, rec);
            }
            ReturnCode::StreamEnd => self.end_deflate(input, rec),
            _ => {
                let reason = if self.stalls > MAX_STALLS {
                    "inflate makes no progress"
                } else {
                    self.raw.error_message()
                };
                return Err(ZranError::Deflate {
                    offset: input.position(),
                    reason: reason.into(),
                });
            }
        }
        Ok(produced)
    }

    /// Bit offset in the blob where the inflater stands: what it consumed
    /// less what still sits unused in its bit buffer.
    fn bit_position<R: Read>(&self, input: &Input<R>) -> u64 {
        input.position() * 8 - (self.raw.data_type() & BUFFERED_BITS) as u64
    }

    fn maybe_point<R: Read>(&mut self, input: &Input<R>, rec: &mut Recorder) {
        let data_type = self.raw.data_type();
        if data_type & AT_BLOCK_BOUNDARY == 0 || data_type & LAST_BLOCK_SEEN != 0 {
            return;
        }
        let bit = self.bit_position(input);
        if !rec.due(bit / 8) {
            return;
        }
        self.finish_probe(rec);
        rec.close(bit.div_ceil(8));
        let (skip_bits, window) = ((bit % 8) as u8, self.history.window());
        let consumed = (input.position() - bit / 8) as usize;
        self.probe = input
            .behind(consumed)
            .map(|first| Probe::new(first, skip_bits, window.clone()));
        rec.open(bit / 8, skip_bits, window, SpanKind::GzipInside);
    }

    /// Narrows the open span's window, if it is being probed.
    fn finish_probe(&mut self, rec: &mut Recorder) {
        if let Some(window) = self.probe.take().and_then(Probe::finish) {
            rec.narrow_window(window);
        }
    }

    /// The deflate data ended: close the member's last span where it ends and
    /// give back the trailer bytes the inflater read ahead.
    fn end_deflate<R: Read>(&mut self, input: &mut Input<R>, rec: &mut Recorder) {
        let end = self.bit_position(input).div_ceil(8);
        input.unread((input.position() - end) as usize);
        self.finish_probe(rec);
        rec.close(end);
        self.phase = Phase::Trailer;
    }

    fn check_trailer<R: Read>(&mut self, input: &mut Input<R>) -> Result<(), ZranError> {
        let offset = input.position();
        let mut trailer = [0u8; 8];
        for byte in &mut trailer {
            *byte = input.next_byte("a gzip trailer")?;
        }
        let [c0, c1, c2, c3, s0, s1, s2, s3] = trailer;
        let checks = [
            ("CRC32", u32::from_le_bytes([c0, c1, c2, c3]), self.crc),
            (
                "ISIZE",
                u32::from_le_bytes([s0, s1, s2, s3]),
                self.member_out as u32,
            ),
        ];
        for (field, stored, actual) in checks {
            if stored != actual {
                return Err(ZranError::GzipTrailer {
                    offset,
                    field,
                    stored,
                    actual,
                });
            }
        }
        self.members += 1;
        self.phase = Phase::Header;
        Ok(())
    }
}

/// Zeros after the last member: padding `gzip -d` accepts silently. Anything
/// else there is an error.
fn skip_zeros<R: Read>(input: &mut Input<R>) -> Result<(), ZranError> {
    loop {
        let offset = input.position();
        let avail = input.available()?;
        if avail.is_empty() {
            return Ok(());
        }
        if let Some(nonzero) = avail.iter().position(|&b| b != 0) {
            return Err(ZranError::TrailingData {
                offset: offset + nonzero as u64,
            });
        }
        let n = avail.len();
        input.consume(n);
    }
}

/// Decodes `len` bytes of raw deflate from `compressed`, primed with
/// `skip_bits` and `window` for a point inside a member; `offset` is
/// `compressed`'s place in the blob.
pub(crate) fn decode(
    compressed: &[u8],
    skip_bits: u8,
    window: &[u8],
    len: usize,
    offset: u64,
) -> Result<Vec<u8>, ZranError> {
    let mut raw = RawInflate::new().map_err(inflate_init_error)?;
    let mut input = compressed;
    if skip_bits > 0 {
        let (&first, rest) = input.split_first().ok_or(ZranError::Truncated {
            offset,
            inside: "a gzip span (no bytes)",
        })?;
        // The first byte's high bits belong to this span: feed them as bits.
        let rc = raw.prime(8 - skip_bits, u32::from(first >> skip_bits));
        check_rc(rc, &raw, offset)?;
        input = rest;
    }
    if !window.is_empty() {
        check_rc(raw.set_dictionary(window), &raw, offset)?;
    }
    let base = offset + (compressed.len() - input.len()) as u64;
    inflate_exactly(&mut raw, input, len, base, offset)
}

/// Inflates `input` (at blob offset `base`) until `len` bytes are out.
fn inflate_exactly(
    raw: &mut RawInflate,
    input: &[u8],
    len: usize,
    base: u64,
    offset: u64,
) -> Result<Vec<u8>, ZranError> {
    let mut out = vec![0u8; len];
    let (mut used, mut produced, mut stalls) = (0, 0, 0);
    while produced < len {
        let (u, p, rc) = raw.inflate(&input[used..], &mut out[produced..], InflateFlush::NoFlush);
        used += u;
        produced += p;
        stalls = if u == 0 && p == 0 { stalls + 1 } else { 0 };
        let at = base + used as u64;
        match rc {
            ReturnCode::Ok | ReturnCode::BufError if stalls <= MAX_STALLS => {}
            ReturnCode::Ok | ReturnCode::BufError if used == input.len() => {
                let inside = "a gzip span";
                return Err(ZranError::Truncated { offset: at, inside });
            }
            ReturnCode::StreamEnd if produced < len => {
                let (decoded, expected) = (produced as u64, len as u64);
                return Err(ZranError::ShortSpan {
                    offset,
                    decoded,
                    expected,
                });
            }
            ReturnCode::StreamEnd => {}
            _ => {
                let reason = error_reason(raw, stalls);
                return Err(ZranError::Deflate { offset: at, reason });
            }
        }
    }
    Ok(out)
}

fn error_reason(raw: &RawInflate, stalls: u32) -> String {
    if stalls > MAX_STALLS {
        "inflate makes no progress".into()
    } else {
        raw.error_message().into()
    }
}

fn check_rc(rc: ReturnCode, raw: &RawInflate, offset: u64) -> Result<(), ZranError> {
    match rc {
        ReturnCode::Ok => Ok(()),
        other => Err(ZranError::Deflate {
            offset,
            reason: format!("{other:?}: {}", raw.error_message()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_keeps_the_last_window_in_order() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut history = History::new();
        history.push(&data[..10]);
        assert_eq!(history.window(), &data[..10]);
        for chunk in data[10..].chunks(7_919) {
            history.push(chunk);
        }
        assert_eq!(history.window(), &data[data.len() - WINDOW_SIZE..]);
        history.push(&data[..WINDOW_SIZE + 5]);
        assert_eq!(history.window(), &data[5..WINDOW_SIZE + 5]);
        history.clear();
        assert!(history.window().is_empty());
    }
}
