//! `unmap_big_allocations_on_free`, in a process of its own (the allocator's
//! tuning is process-wide): big blocks leave the resident set when freed,
//! also after glibc would have raised its threshold past them.

/// This process's anonymous resident memory in KiB (`RssAnon`).
fn rss_anon_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn freed_big_blocks_leave_the_resident_set() {
    lamina_sys::unmap_big_allocations_on_free().unwrap();
    let base = rss_anon_kib();
    // Shrinking sizes: by default the first free raises glibc's threshold
    // to 16 MiB, and the next blocks would stay on its heap once freed.
    for mib in [16, 12, 8] {
        let block = vec![1u8; mib << 20];
        std::hint::black_box(&block);
        let held = rss_anon_kib();
        assert!(
            held >= base + (mib as u64 - 2) * 1024,
            "{mib} MiB: {held} KiB (base {base})"
        );
        drop(block);
        let after = rss_anon_kib();
        assert!(
            after < base + 2048,
            "{mib} MiB freed, {after} KiB resident (base {base} KiB)"
        );
    }
}
