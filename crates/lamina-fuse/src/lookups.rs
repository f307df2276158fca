//! The lookup table (O(1) lookups): checked against the image before use,
//! and for a mount that started without it, awaited from the worker while
//! lookups search the directories.

use super::*;

/// `table` as the lookup table of an image whose root is `root_nid`: its
/// shape and root checked (its digest and binding are the caller's).
pub(crate) fn checked_table(
    table: &'static [u8],
    root_nid: u64,
) -> Result<LookupTable<'static>, ReadError> {
    let table = LookupTable::parse_without_digest(table)
        .map_err(|e| ReadError::Corrupt(format!("lookup table: {e}")))?;
    if table.root_nid() != root_nid {
        return Err(ReadError::Corrupt(format!(
            "lookup table: root nid {}, the image's is {root_nid}",
            table.root_nid()
        )));
    }
    Ok(table)
}

/// A lookup table a lazy mount's worker fetches after the mount: the
/// daemon searches directories until the file at `path` is recorded
/// (synced, its content digest checked), then checks that it was built for
/// this metadata and answers lookups from it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LookupLater {
    /// Where the worker stores it.
    pub path: PathBuf,
    /// Its content digest (`sha256:<hex>`).
    pub digest: String,
    /// The metadata's content digest (`sha256:<hex>`), which its header
    /// must name.
    pub metadata_digest: String,
}

/// Watches for the lookup table a worker fetches (see [`LookupLater`]) and
/// puts it in `slot` once recorded and checked. Lookups search the
/// directories until then; a table that fails a check is never used.
pub(crate) fn await_lookup(
    later: LookupLater,
    slot: Arc<OnceLock<LookupTable<'static>>>,
    root_nid: u64,
) {
    let (Some(content), Some(metadata)) = (
        sha256_digest(&later.digest),
        sha256_digest(&later.metadata_digest),
    ) else {
        return tracing::error!("lookup table: bad digests in the config; directories searched");
    };
    let started = std::time::Instant::now();
    let spawned = std::thread::Builder::new()
        .name("lamina-lookup".into())
        .spawn(move || loop {
            let recorded = File::open(&later.path).ok().filter(|f| {
                lamina_fetch::store::recorded_whole(f, &later.path, &content).unwrap_or(false)
            });
            let Some(file) = recorded else {
                // Soon after the start, when it is due; seldom once late.
                let late = started.elapsed() > Duration::from_secs(30);
                std::thread::sleep(Duration::from_millis(if late { 1000 } else { 100 }));
                continue;
            };
            let checked = lamina_sys::map_file_forever(&file)
                .map_err(|e| e.to_string())
                .and_then(|bytes| {
                    let header = LookupTable::header(bytes).map_err(|e| e.to_string())?;
                    if header.image_digest != metadata {
                        return Err("built for another metadata image".to_string());
                    }
                    checked_table(bytes, root_nid).map_err(|e| e.to_string())
                });
            match checked {
                Ok(table) => {
                    let _ = slot.set(table);
                    tracing::info!("lookups through the lookup table from now on");
                }
                Err(e) => tracing::error!(
                    "lookup table {}: {e}; directories searched",
                    later.path.display()
                ),
            }
            return;
        });
    if let Err(e) = spawned {
        tracing::warn!("lookup table not awaited ({e}); directories searched");
    }
}
