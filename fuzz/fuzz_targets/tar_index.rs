//! `TarIndex::from_bytes` (a tar index's span table: its author controls
//! these bytes) on arbitrary bytes: never panics; whatever parses
//! re-serialises to bytes that parse to the same value, its spans tile each
//! layer's tar, and a window is there exactly where a span asks for one.
#![no_main]

use lamina_format::tar_index::{TarIndex, SPAN_GZIP, SPAN_WINDOW};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(index) = TarIndex::from_bytes(data) else {
        return;
    };
    let again = TarIndex::from_bytes(&index.to_bytes()).expect("a re-serialised index parses");
    assert_eq!(again, index);
    for layer in &index.layers {
        let tiled: u64 = layer.blob.chunks.iter().map(|c| u64::from(c.size.get())).sum();
        assert_eq!(tiled, layer.blob.cache_size);
        for (span, window) in layer.blob.chunks.iter().zip(&layer.windows) {
            let wants = span.flags.get() == SPAN_GZIP && span.reserved.get() & SPAN_WINDOW != 0;
            assert_eq!(wants, window.is_some());
        }
    }
});
