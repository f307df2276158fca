//! `BootPages::from_bytes` with fuzzer-chosen cache sizes: never panics, and
//! whatever parses re-serialises to the very same bytes.
//!
//! Input: one byte `n` (blob count, `n % 8`), `n` little-endian u64 cache
//! sizes, then the boot-pages blob.
#![no_main]

use lamina_format::boot::BootPages;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&n, mut rest)) = data.split_first() else {
        return;
    };
    let mut sizes = Vec::new();
    for _ in 0..n % 8 {
        let Some((size, tail)) = rest.split_first_chunk::<8>() else {
            return;
        };
        sizes.push(u64::from_le_bytes(*size));
        rest = tail;
    }
    let Ok(boot) = BootPages::from_bytes(rest, &sizes) else {
        return;
    };
    let bytes = boot.to_bytes();
    assert_eq!(bytes, rest);
    let again = BootPages::from_bytes(&bytes, &sizes).expect("re-serialised boot pages parse");
    assert_eq!(again, boot);
    let carried: usize = boot.iter().map(|(_, page_bytes)| page_bytes.len()).sum();
    assert_eq!(carried, boot.data.len());
});
