//! `ChunkIndex::from_bytes` and `parse_top` on arbitrary bytes: never
//! panic, and whatever parses re-serialises to bytes that parse to the same
//! value. A paged index's tables are checked against their sha256 before
//! anything else (so fuzzing them past that is left to `from_bytes`, which
//! runs the same chunk checks); the input's tail is tried as each table.
#![no_main]

use lamina_format::index::{ChunkIndex, IndexBlob};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(index) = ChunkIndex::from_bytes(data) {
        let bytes = index.to_bytes();
        let again = ChunkIndex::from_bytes(&bytes).expect("a re-serialised index parses");
        assert_eq!(again, index);
        for blob in &index.blobs {
            assert_eq!(blob.chunks_covering(0, u64::MAX).len(), blob.chunks.len());
        }
    }
    let Ok(top) = ChunkIndex::parse_top(data) else {
        return;
    };
    assert_eq!(
        top.inline.is_empty(),
        top.blobs.iter().all(|b| b.table_digest.is_some())
    );
    for blob in &top.blobs {
        let Some((at, len)) = blob.table_range() else {
            continue;
        };
        assert_eq!(at + len, blob.compressed_size);
        let tail = &data[data.len().saturating_sub(len as usize)..];
        if let Ok(table) = IndexBlob::from_table(blob, top.chunk_bits, tail) {
            assert_eq!(table.table_bytes(), tail);
        }
    }
});
