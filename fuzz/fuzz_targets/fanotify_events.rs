//! fanotify event records (`lamina_sys::parse_events`, the pure parser; no fd
//! is touched): never panics, yields at most one record per 24 bytes and
//! nothing after an error.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut records = 0usize;
    let mut failed = false;
    for record in lamina_sys::parse_events(data) {
        assert!(!failed, "a record after an error");
        match record {
            Ok(_) => records += 1,
            Err(_) => failed = true,
        }
    }
    assert!(records <= data.len() / 24);
});
