//! `lamina_zran::SpanIndexer` over arbitrary bytes as a gzip, zstd or plain
//! layer (first byte picks the codec), then every span it records decoded
//! alone: never panics; when indexing succeeds, the spans tile the output
//! and each decodes, from its compressed range only, to exactly its part.
#![no_main]

use std::io::Read;

use lamina_zran::{decode_span, Codec, SpanIndexer, MIN_SPAN_SIZE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, layer)) = data.split_first() else {
        return;
    };
    let codec = match pick % 3 {
        0 => Codec::Gzip,
        1 => Codec::Zstd,
        _ => Codec::Plain,
    };
    let Ok(mut indexer) = SpanIndexer::new(layer, codec, MIN_SPAN_SIZE) else {
        return;
    };
    // Bounded: a tiny input may claim a huge output (zstd, deflate).
    let mut out = Vec::new();
    if (&mut indexer).take(64 << 20).read_to_end(&mut out).is_err() || out.len() >= 64 << 20 {
        return;
    }
    let Ok(spans) = indexer.finish() else {
        return;
    };
    let mut at = 0u64;
    for span in &spans.spans {
        assert_eq!(span.uncompressed.start, at);
        at = span.uncompressed.end;
        let stored = &layer[span.compressed.start as usize..span.compressed.end as usize];
        let got = decode_span(span, stored).expect("a recorded span decodes");
        assert!(got == out[span.uncompressed.start as usize..span.uncompressed.end as usize]);
    }
    assert_eq!(at, out.len() as u64);
});
