//! What `inspect` and `status` print: an image's layers and chunks, the
//! lazy mounts and their figures.

use lamina_image::artifact::{self, LaminaLayers};
use lamina_oci::open_source;

use super::*;

// Over 100 lines: one document, then the same fields as text; splitting would pass them all.
pub(super) fn inspect(
    image: &ImageRef,
    source: &SourceOptions,
    json: bool,
    list_chunks: bool,
) -> Result<()> {
    let src = open_source(image, source).with_context(|| format!("opening {image}"))?;
    let img = src.image();
    let ann = &img.manifest.annotations;
    let num = |key: &str| ann.get(key).and_then(|v| v.parse::<u64>().ok());
    let layers = match LaminaLayers::from_manifest(&img.manifest) {
        Ok(l) => l,
        Err(_) => {
            // A plain image: list its layers.
            let layers: Vec<_> = img
                .layers
                .iter()
                .map(|l| serde_json::json!({"digest": l.descriptor.digest.to_string(), "media_type": l.descriptor.media_type, "size": l.descriptor.size, "diff_id": l.diff_id.to_string()}))
                .collect();
            let doc = serde_json::json!({"image": image.to_string(), "lamina": false, "manifest_digest": img.manifest_digest.to_string(), "layers": layers});
            if json {
                print_json(&doc)?;
            } else {
                println!("{image}: not a lamina image ({} layers)", layers.len());
                for l in &img.layers {
                    println!(
                        "  {} {} {}",
                        l.descriptor.digest, l.descriptor.size, l.descriptor.media_type
                    );
                }
            }
            return Ok(());
        }
    };
    let index = artifact::read_index(src.as_ref(), &layers)?;
    let chunks: usize = index.blobs.iter().map(|b| b.chunk_count).sum();
    // Both index versions give each blob's data size (a paged one in its
    // blob table).
    let stored: u64 = index.blobs.iter().filter_map(|b| b.data_size).sum();
    let compressed: u64 = index.blobs.iter().map(|b| b.compressed_size).sum();
    let metadata_bytes = layers
        .metadata
        .annotations
        .get(artifact::ANNOTATION_UNCOMPRESSED_SIZE)
        .and_then(|v| v.parse::<u64>().ok());
    let file_bytes = num(artifact::ANNOTATION_STATS_FILE_BYTES);
    let referenced = num(artifact::ANNOTATION_STATS_REFERENCED_BYTES);
    // Boot pages: the segments' sizes summed (None when one lacks its size).
    let boot_bytes = (!layers.boot.is_empty())
        .then(|| {
            layers
                .boot
                .iter()
                .map(|b| {
                    b.annotations
                        .get(artifact::ANNOTATION_UNCOMPRESSED_SIZE)?
                        .parse::<u64>()
                        .ok()
                })
                .sum::<Option<u64>>()
        })
        .flatten();
    let boot_compressed =
        (!layers.boot.is_empty()).then(|| layers.boot.iter().map(|b| b.size).sum::<u64>());
    // Segments: the frames of the boot-pages layers (one per layer before frames).
    let boot_segments = artifact::boot_layers(&layers.boot, &index.blobs)
        .map(|l| l.iter().map(|b| b.frames.len()).sum::<usize>())
        .ok();
    let mut doc = serde_json::json!({
        "image": image.to_string(),
        "lamina": true,
        "manifest_digest": img.manifest_digest.to_string(),
        "source_manifest_digest": ann.get(artifact::ANNOTATION_SOURCE),
        "format": num(artifact::ANNOTATION_FORMAT),
        // Version 2: each blob ends with its chunk table.
        "paged_index": index.inline.is_empty() && !index.blobs.is_empty(),
        "chunk_size": num(artifact::ANNOTATION_CHUNK_SIZE),
        "pack_limit": num(artifact::ANNOTATION_PACK_LIMIT),
        "entries": num(artifact::ANNOTATION_STATS_ENTRIES),
        "files": num(artifact::ANNOTATION_STATS_FILES),
        "file_bytes": file_bytes,
        "metadata_bytes": metadata_bytes,
        "metadata_compressed_bytes": layers.metadata.size,
        "index_compressed_bytes": layers.index.size,
        "boot_set_chunks": index.prefetch.len(),
        "boot_pages_bytes": boot_bytes,
        "boot_pages_compressed_bytes": boot_compressed,
        "boot_pages_segments": boot_segments,
        "chunks": chunks,
        "stored_bytes": stored,
        "compressed_bytes": compressed,
        "referenced_bytes": referenced,
        "dedup_ratio": referenced.map(|f| if stored == 0 { 1.0 } else { f as f64 / stored as f64 }),
        "blobs": index.blobs.iter().zip(&layers.blobs).map(|(b, d)| serde_json::json!({
            "digest": d.digest.to_string(), "compressed_bytes": b.compressed_size,
            "cache_bytes": b.cache_size, "chunks": b.chunk_count,
        })).collect::<Vec<_>>(),
    });
    if list_chunks {
        for (blob, list) in chunk_lists(src.as_ref(), &index, &layers)?
            .into_iter()
            .enumerate()
        {
            doc["blobs"][blob]["chunk_list"] = list;
        }
    }
    if json {
        return print_json(&doc);
    }
    println!("{image}: lamina image {}", img.manifest_digest);
    println!(
        "  tree      {} entries, {} files, {} bytes",
        doc["entries"], doc["files"], doc["file_bytes"]
    );
    println!(
        "  metadata  {} bytes EROFS ({} compressed)",
        doc["metadata_bytes"], layers.metadata.size
    );
    println!(
        "  chunks    {chunks} stored, {stored} bytes, {compressed} compressed, chunk size {}",
        doc["chunk_size"]
    );
    println!("  dedup     {}", doc["dedup_ratio"]);
    if let Some(compressed) = boot_compressed {
        println!(
            "  boot      {} chunks; boot pages {} bytes ({compressed} compressed, {} segments)",
            index.prefetch.len(),
            doc["boot_pages_bytes"],
            layers.boot.len()
        );
    }
    for (b, d) in index.blobs.iter().zip(&layers.blobs) {
        println!(
            "  blob      {} {} bytes, {} chunks, cache {} bytes",
            d.digest, b.compressed_size, b.chunk_count, b.cache_size
        );
    }
    Ok(())
}

pub(super) fn status(cache_dir: &std::path::Path, json: bool) -> Result<()> {
    let mut mounts = Vec::new();
    if let Ok(dir) = std::fs::read_dir(cache_dir.join("mounts")) {
        for entry in dir.flatten() {
            let read = |name: &str| -> Option<serde_json::Value> {
                serde_json::from_slice(&std::fs::read(entry.path().join(name)).ok()?).ok()
            };
            let (Some(config), Some(ready)) = (read("config.json"), read("ready")) else {
                continue;
            };
            let alive = ready["pid"]
                .as_u64()
                .is_some_and(|p| std::path::Path::new(&format!("/proc/{p}")).exists());
            mounts.push(serde_json::json!({
                "mountpoint": config["mountpoint"],
                "image": config["image"],
                "manifest_digest": config["manifest_digest"],
                "holder_pid": ready["pid"],
                "alive": alive,
                "status": read("status.json"),
                // A FUSE daemon's counters (passthrough opens, reads served).
                "fuse": read(lamina_mount::FUSE_STATUS),
            }));
        }
    }
    if json {
        return print_json(&mounts);
    }
    if mounts.is_empty() {
        println!("no lazy mounts");
    }
    for m in &mounts {
        let s = &m["status"];
        println!(
            "{} {} ({})",
            m["mountpoint"],
            m["image"],
            if m["alive"] == true {
                "serving"
            } else {
                "holder gone"
            }
        );
        println!(
            "  cached {} / {} bytes, fetched {} bytes in {} requests, {} misses ({} failed), prefetch {}/{}",
            s["cached_bytes"], s["total_bytes"], s["fetched_bytes"], s["requests"],
            s["misses"], s["failed_misses"], s["prefetch_done"], s["prefetch_total"]
        );
        let f = &m["fuse"]["metadata_frames"];
        if f.is_object() {
            println!(
                "  metadata frames (FUSE daemon): {} of {} written, fetched {} bytes in {} requests ({} bad answers)",
                f["written"], f["frames"], f["fetched_bytes"], f["requests"], f["bad_answers"]
            );
        }
    }
    Ok(())
}

/// The lazy mounts under `cache_dir` as metrics (no `# EOF`: a textfile
/// collector may concatenate files).
pub(super) fn mount_metrics(cache_dir: &std::path::Path) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(lamina_mount::metrics::MountsCollector::new(
        cache_dir.to_path_buf(),
    )));
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode_registry(&mut text, &registry);
    text
}

/// Each blob's chunks, as `inspect --chunks` lists them: from an inline
/// index, or from each blob's own table (the blob is read up to it and the
/// table checked against the digest the index gives it).
fn chunk_lists(
    src: &dyn lamina_oci::ImageSource,
    index: &lamina_format::index::IndexTop,
    layers: &LaminaLayers,
) -> Result<Vec<serde_json::Value>> {
    use lamina_format::index::{ChunkEntry, IndexBlob, MAX_TABLE_CHUNKS};
    use std::io::Read;
    let list = |chunks: &[ChunkEntry]| {
        serde_json::Value::from_iter(chunks.iter().map(|c| {
            serde_json::json!({
                "digest": hex::encode(c.digest), "size": c.size.get(),
                "compressed_size": c.compressed_size.get(),
                "compressed_offset": c.compressed_offset.get(), "cache_offset": c.cache_offset.get(),
            })
        }))
    };
    if !index.inline.is_empty() {
        return Ok(index.inline.iter().map(|b| list(&b.chunks)).collect());
    }
    let table_max = u64::from(MAX_TABLE_CHUNKS) * size_of::<ChunkEntry>() as u64;
    index
        .blobs
        .iter()
        .zip(&layers.blobs)
        .map(|(summary, desc)| {
            let (at, len) = summary
                .table_range()
                .with_context(|| format!("blob {}: no chunk table", desc.digest))?;
            anyhow::ensure!(
                len <= table_max,
                "blob {}: a chunk table of {len} bytes",
                desc.digest
            );
            let mut blob = src.open_blob(desc)?;
            std::io::copy(&mut (&mut blob).take(at), &mut std::io::sink())?;
            let mut table = vec![0u8; len as usize];
            blob.read_exact(&mut table)
                .with_context(|| format!("blob {}: reading its chunk table", desc.digest))?;
            let blob = IndexBlob::from_table(summary, index.chunk_bits, &table)
                .with_context(|| format!("blob {}", desc.digest))?;
            Ok(list(&blob.chunks))
        })
        .collect()
}
