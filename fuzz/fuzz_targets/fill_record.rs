//! `FillRecord::from_bytes` on arbitrary bytes: never panics; whatever
//! parses re-serialises to the very same bytes (the checksum covers them);
//! and a record describes only the one file identity it names.
#![no_main]

use lamina_format::fill::{FileIdentity, FillRecord};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(record) = FillRecord::from_bytes(data) else {
        return;
    };
    assert_eq!(record.to_bytes(), data);
    let n = record.filled.len();
    assert!(record.describes(&record.subject, record.cache_size, n, record.file));
    let other = FileIdentity {
        ino: record.file.ino ^ 1,
        ..record.file
    };
    assert!(!record.describes(&record.subject, record.cache_size, n, other));
});
