//! zstd: a frame boundary is the only place a decoder can start, so a span
//! is a run of whole frames. `decompress_stream` returns 0 exactly when a
//! frame (skippable ones included) is complete, with the input at its end.

use std::io::Read;

use zstd::zstd_safe::{get_error_name, DCtx, InBuffer, OutBuffer};

use crate::gzip::MAX_STALLS;
use crate::input::Input;
use crate::record::Recorder;
use crate::{SpanKind, ZranError};

fn zstd_error(offset: u64, code: usize) -> ZranError {
    ZranError::Zstd {
        offset,
        reason: get_error_name(code).to_string(),
    }
}

/// One `decompress_stream` call: (consumed, produced, hint; 0 = frame done).
fn step(dctx: &mut DCtx<'_>, input: &[u8], out: &mut [u8]) -> Result<(usize, usize, usize), usize> {
    let mut inb = InBuffer::around(input);
    let mut outb = OutBuffer::around(out);
    let hint = dctx.decompress_stream(&mut outb, &mut inb)?;
    Ok((inb.pos(), outb.pos(), hint))
}

pub(crate) struct ZstdIndexer {
    // Default limits: windows up to 128 MiB (zstd's `--long` default), so
    // memory stays bounded whatever the frame header claims.
    dctx: DCtx<'static>,
    frames: u64,
    mid_frame: bool,
    done: bool,
    stalls: u32,
}

impl ZstdIndexer {
    pub(crate) fn new(rec: &mut Recorder) -> Self {
        rec.open(0, 0, Vec::new(), SpanKind::Zstd);
        ZstdIndexer {
            dctx: DCtx::create(),
            frames: 0,
            mid_frame: false,
            done: false,
            stalls: 0,
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    pub(crate) fn read<R: Read>(
        &mut self,
        input: &mut Input<R>,
        rec: &mut Recorder,
        out: &mut [u8],
    ) -> Result<usize, ZranError> {
        while !self.done {
            let offset = input.position();
            let avail = input.available()?;
            if avail.is_empty() {
                self.end(offset, rec)?;
                break;
            }
            let (used, produced, hint) =
                step(&mut self.dctx, avail, out).map_err(|code| zstd_error(offset, code))?;
            input.consume(used);
            rec.feed(&out[..produced]);
            self.stalls = if used == 0 && produced == 0 {
                self.stalls + 1
            } else {
                0
            };
            if self.stalls > MAX_STALLS {
                return Err(ZranError::Zstd {
                    offset,
                    reason: "decoder makes no progress".into(),
                });
            }
            if hint == 0 {
                self.frame_done(input.position(), rec);
            } else if used > 0 {
                self.mid_frame = true;
            }
            if produced > 0 {
                return Ok(produced);
            }
        }
        Ok(0)
    }

    fn frame_done(&mut self, at: u64, rec: &mut Recorder) {
        self.frames += 1;
        self.mid_frame = false;
        if rec.due(at) {
            rec.close(at);
            rec.open(at, 0, Vec::new(), SpanKind::Zstd);
        }
    }

    fn end(&mut self, offset: u64, rec: &mut Recorder) -> Result<(), ZranError> {
        if self.mid_frame {
            return Err(ZranError::Truncated {
                offset,
                inside: "a zstd frame",
            });
        }
        if self.frames == 0 {
            return Err(ZranError::Truncated {
                offset,
                inside: "the first zstd frame (empty input)",
            });
        }
        rec.close(offset);
        self.done = true;
        Ok(())
    }
}

/// Decodes a run of whole frames to exactly `len` bytes; the input must end
/// where the last frame does.
pub(crate) fn decode(compressed: &[u8], len: usize, offset: u64) -> Result<Vec<u8>, ZranError> {
    let mut dctx = DCtx::create();
    let mut out = vec![0u8; len];
    let mut overflow = [0u8; 1];
    let (mut used, mut produced, mut hint, mut stalls) = (0, 0, 1, 0);
    while used < compressed.len() || hint != 0 {
        // Once `out` is full, anything more the frames produce is an error.
        let sink = if produced < len {
            &mut out[produced..]
        } else {
            &mut overflow[..]
        };
        let at = offset + used as u64;
        let (u, p, h) =
            step(&mut dctx, &compressed[used..], sink).map_err(|code| zstd_error(at, code))?;
        if produced == len && p > 0 {
            return Err(ZranError::LongSpan {
                offset,
                expected: len as u64,
            });
        }
        (used, produced, hint) = (used + u, produced + p, h);
        stalls = if u == 0 && p == 0 { stalls + 1 } else { 0 };
        if stalls > MAX_STALLS {
            return Err(ZranError::Truncated {
                offset: offset + used as u64,
                inside: "a zstd span",
            });
        }
    }
    if produced < len {
        return Err(ZranError::ShortSpan {
            offset,
            decoded: produced as u64,
            expected: len as u64,
        });
    }
    Ok(out)
}
