//! Keeping the daemon's resident set flat in the size of the image: the
//! metadata and lookup table are mapped, and every page a lookup touches
//! would stay resident in the daemon; they are released again (they stay in
//! the page cache) once the daemon has mapped in more than an allowance.

use super::*;

/// Bytes of file pages the daemon may map in beyond what it had resident
/// after its start or its last release, before it releases the mapped
/// metadata and lookup table pages again.
pub(crate) const MAPPED_RSS_ALLOWANCE: u64 = 1 << 20;

/// How often the resident set is looked at.
pub(crate) const MAPPED_RSS_CHECK: Duration = Duration::from_millis(100);

/// Checks in a row without new file pages after which a daemon that mapped
/// any pages since the mark counts as idle and releases them (1 s).
pub(crate) const MAPPED_RSS_IDLE_CHECKS: u32 = 10;

/// Keeps the daemon's resident set flat in the size of the image: a thread
/// that releases the mapped metadata and lookup table pages
/// ([`lamina_sys::release_mapped_files`]) whenever [`release_due`] says so,
/// the mark being the resident file pages after the start or the last
/// release (the binary's own pages count, and are not released: so the mark
/// is taken after each release). The pages stay in the page cache, as the
/// kernel's own EROFS mount keeps its metadata; a lookup that touches one
/// again maps it back with a minor fault.
pub(crate) fn keep_mapped_pages_bounded(stats: Arc<Stats>) {
    let spawned = std::thread::Builder::new()
        .name("lamina-rss".into())
        .spawn(move || {
            if let Err(e) = bound_mapped_pages(&stats) {
                tracing::warn!("resident set no longer bounded: {e}");
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("resident set not bounded: {e}");
    }
}

/// The loop of [`keep_mapped_pages_bounded`]; returns only on an error.
pub(crate) fn bound_mapped_pages(stats: &Stats) -> std::io::Result<()> {
    let mut mark = lamina_sys::resident_file_bytes()?;
    let (mut last, mut unchanged) = (mark, 0);
    loop {
        std::thread::sleep(MAPPED_RSS_CHECK);
        let resident = lamina_sys::resident_file_bytes()?;
        unchanged = if resident == last { unchanged + 1 } else { 0 };
        last = resident;
        if release_due(resident, mark, unchanged) {
            mark = release_mapped(stats)?;
            (last, unchanged) = (mark, 0);
        }
    }
}

/// Whether to release the mapped pages, with `resident` file bytes now,
/// `mark` after the last release and `unchanged` checks in a row without
/// new pages: over the allowance while busy, and anything over the mark
/// once idle (so a daemon at rest holds no more than after its start).
pub(crate) fn release_due(resident: u64, mark: u64, unchanged: u32) -> bool {
    resident > mark + MAPPED_RSS_ALLOWANCE
        || (resident > mark && unchanged >= MAPPED_RSS_IDLE_CHECKS)
}

/// Releases the mapped pages (counted) and returns the resident file pages
/// after.
pub(crate) fn release_mapped(stats: &Stats) -> std::io::Result<u64> {
    let resident = lamina_sys::resident_file_bytes()?;
    lamina_sys::release_mapped_files()?;
    let n = stats.mapped_releases.fetch_add(1, Ordering::Relaxed) + 1;
    let after = lamina_sys::resident_file_bytes()?;
    tracing::debug!(resident, after, releases = n, "mapped pages released");
    Ok(after)
}
