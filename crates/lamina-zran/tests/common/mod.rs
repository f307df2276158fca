//! Shared by the integration tests: deterministic data, indexing helpers and
//! the checks every layer's spans must pass.
#![allow(dead_code)]

use std::io::{self, Read, Write};
use std::sync::OnceLock;

use flate2::write::GzEncoder;
use flate2::Compression;
use lamina_zran::{decode_span, Codec, LayerSpans, SpanIndexer, ZranError};

/// The span size the tests index with.
pub const SPAN: u64 = 256 << 10;

/// xorshift64*: small, deterministic, good enough to defeat deflate.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Alternating stretches of pseudo-random bytes and tar-ish text.
pub fn mixed_data(len: usize, seed: u64) -> Vec<u8> {
    const WORDS: &[&str] = &[
        "lamina ",
        "layer ",
        "usr/bin/",
        "lib/x86_64-linux-gnu/",
        "0000644 ",
        "root ",
        "\n",
        "span ",
        "window ",
        "deflate ",
        "block ",
        "etc/ssl/certs/",
        ".so.6",
        "0",
    ];
    let mut rng = Rng::new(seed);
    let mut out = Vec::with_capacity(len + (64 << 10));
    while out.len() < len {
        let chunk = 1 + rng.below(48 << 10);
        if rng.below(2) == 0 {
            out.extend((0..chunk / 8 + 1).flat_map(|_| rng.next().to_le_bytes()));
        } else {
            let end = out.len() + chunk;
            while out.len() < end {
                out.extend_from_slice(WORDS[rng.below(WORDS.len())].as_bytes());
            }
        }
    }
    out.truncate(len);
    out
}

/// ~20 MB of mixed data, made once per test binary.
pub fn big_data() -> &'static [u8] {
    static DATA: OnceLock<Vec<u8>> = OnceLock::new();
    DATA.get_or_init(|| mixed_data(20_000_000, 0x001a_314a))
}

pub fn gzip(data: &[u8], level: u32) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::new(level));
    enc.write_all(data).unwrap();
    enc.finish().unwrap()
}

/// Indexes `blob`, reading it all: the uncompressed bytes and the spans.
pub fn index(
    blob: &[u8],
    codec: Codec,
    span_size: u64,
) -> Result<(Vec<u8>, LayerSpans), ZranError> {
    let mut indexer = SpanIndexer::new(blob, codec, span_size)?;
    let mut out = Vec::new();
    indexer.read_to_end(&mut out).map_err(unwrap_io)?;
    Ok((out, indexer.finish()?))
}

/// Our error back out of the `io::Error` `Read` wrapped it in.
pub fn unwrap_io(err: io::Error) -> ZranError {
    match err
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<ZranError>())
    {
        Some(_) => *err.into_inner().unwrap().downcast::<ZranError>().unwrap(),
        None => ZranError::Io(err),
    }
}

pub fn compressed<'a>(blob: &'a [u8], span: &lamina_zran::Span) -> &'a [u8] {
    &blob[span.compressed.start as usize..span.compressed.end as usize]
}

/// Spans tile `data` exactly, and each decodes alone to its bytes.
pub fn check_layer(blob: &[u8], data: &[u8], layer: &LayerSpans) {
    assert_eq!(layer.uncompressed_size, data.len() as u64);
    assert_eq!(layer.compressed_size, blob.len() as u64);
    let mut pos = 0;
    for (i, span) in layer.spans.iter().enumerate() {
        assert_eq!(
            span.uncompressed.start,
            pos,
            "span {i} does not start where span {} ended",
            i.wrapping_sub(1)
        );
        assert!(span.uncompressed.end > pos, "span {i} is empty");
        assert!(
            span.compressed.start < span.compressed.end && span.compressed.end <= blob.len() as u64
        );
        let bytes = decode_span(span, compressed(blob, span))
            .unwrap_or_else(|e| panic!("span {i} {span:?}: {e}"));
        assert!(
            bytes == data[span.uncompressed.start as usize..span.uncompressed.end as usize],
            "span {i} bytes"
        );
        pos = span.uncompressed.end;
    }
    assert_eq!(pos, data.len() as u64, "spans stop short of the end");
}
