//! `ChunkIndex::from_bytes` on arbitrary bytes: never panics, and whatever
//! parses re-serialises to bytes that parse to the same value.
#![no_main]

use lamina_format::index::ChunkIndex;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(index) = ChunkIndex::from_bytes(data) else {
        return;
    };
    let bytes = index.to_bytes();
    let again = ChunkIndex::from_bytes(&bytes).expect("a re-serialised index parses");
    assert_eq!(again, index);
    for blob in &index.blobs {
        assert_eq!(blob.chunks_covering(0, u64::MAX).len(), blob.chunks.len());
    }
});
