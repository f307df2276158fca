//! `BootPages::from_bytes` with fuzzer-chosen cache sizes and chunk table
//! lengths: never panics, and whatever parses re-serialises to the very
//! same bytes.
//!
//! Input: one byte `n` (blob count, `n % 8`), `n` little-endian u64 cache
//! sizes, one byte per blob (its table length in 64-byte entries, 0: no
//! table), then the boot-pages blob.
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
    let Some((lens, rest)) = rest.split_at_checked(sizes.len()) else {
        return;
    };
    let lens: Vec<u64> = lens.iter().map(|&n| u64::from(n) * 64).collect();
    let Ok(boot) = BootPages::from_bytes(rest, &sizes, &lens) else {
        return;
    };
    let bytes = boot.to_bytes();
    assert_eq!(bytes, rest);
    let again = BootPages::from_bytes(&bytes, &sizes, &lens).expect("re-serialised boot pages parse");
    assert_eq!(again, boot);
    let carried: usize = boot.iter().map(|(_, page_bytes)| page_bytes.len()).sum();
    assert_eq!(carried, boot.data.len());
    for (blob, table) in &boot.tables {
        assert_eq!(table.len() as u64, lens[*blob as usize]);
    }
});
