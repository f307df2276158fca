//! Point 1: a hostile image naming another image's blob never changes
//! what the honest image reads, whichever mounted first.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::PathBuf;
use std::time::Instant;

use crate::common::*;
use crate::images::{
    begin, blob_table, convert, entry_stem, forge, layer_of, only_blob, reference, tree_hashes,
    HostileRegistry,
};
use crate::reading::{blob_names, cache_entries, check_reads, drop_caches, read_files};
use crate::{CHANGED, FILES, MISS_TIMEOUT};
use lamina_image::artifact::MEDIA_TYPE_BLOB;

// ---------------------------------------------------------------------------
// point 1

/// What every round of point 1 uses.
struct Tenants<'a> {
    t: &'a TestDir,
    honest: String,
    hostile: String,
    registry: &'a HostileRegistry,
    victim: String,
    honest_entry: String,
    hostile_entry: String,
    /// `umoci unpack` of B.
    ref_b: PathBuf,
    want_b: BTreeMap<String, String>,
    want_h: BTreeMap<String, String>,
    files: Vec<String>,
    /// Files of the honest image that share no chunk with a file the
    /// hostile image changes (not packed, not changed).
    apart: Vec<String>,
}

impl Tenants<'_> {
    /// One round on a fresh cache dir, both images mounted lazily
    /// (`mode`). B first: B mounted and the files read that share no chunk
    /// with what H changes (with no read-ahead, fill-ahead or prefetch, so
    /// those reads fill only their own chunks: H has chunks of the blob left
    /// that it could fill with its own bytes if the two shared a cache
    /// file), then H mounted and every file of H read. H first: H mounted
    /// and every file read, then B mounted. Then, with the page cache
    /// dropped, B reads every file with its own bytes, and the cache holds
    /// two entries for X, B's and H's.
    // Over 100 lines: one round of two tenants' mounts and reads in the order its doc gives.
    fn round(&self, f: &mut Failures, (mode, share): (&str, bool), b_first: bool) {
        let shared = if share { "-share-files" } else { "" };
        let order = if b_first { "b-first" } else { "h-first" };
        let label = format!("{mode}{shared}-{order}");
        let started = Instant::now();
        let cache = self.t.join(&format!("cache-{label}"));
        let mut opts = vec![
            "--lazy",
            "--mode",
            mode,
            "--timeout",
            MISS_TIMEOUT,
            "--prefetch",
            "none",
            "--fill-ahead",
            "0",
            "--readahead",
            "0",
        ];
        if share {
            opts.push("--share-files");
        }
        let served_before = self.registry.ranges_served(&self.victim);
        let mount_b = || {
            Mount::with_args(
                &self.honest,
                &self.t.join(&format!("mnt-b-{label}")),
                &cache,
                &opts,
            )
        };
        let mount_h = || {
            Mount::with_args(
                &self.hostile,
                &self.t.join(&format!("mnt-h-{label}")),
                &cache,
                &opts,
            )
        };
        // B first: mounted, and the files H cannot touch read.
        let early = b_first.then(|| {
            let b = mount_b();
            let got = read_files(&b.path, &self.apart, self.t.path(), &format!("{label}-b0"));
            check_reads(
                f,
                &format!("{label}: B before H"),
                &self.want_b,
                &self.apart,
                &got,
            );
            b
        });

        // H reads everything: its reads may get its bytes or fail, but end.
        let h = mount_h();
        let got_h = read_files(&h.path, &self.files, self.t.path(), &format!("{label}-h"));
        let served = self.registry.ranges_served(&self.victim) - served_before;
        f.check(served > 0, || {
            format!(
                "{label}: the hostile registry served no range of {} (H never fetched its bytes: the test tests nothing)",
                self.victim
            )
        });
        let tally = |want: &BTreeMap<String, String>| {
            got_h
                .iter()
                .filter(|(p, r)| r.as_ref().is_ok_and(|h| *h == want[*p]))
                .count()
        };
        eprintln!(
            "{label}: H read {} files: {} with H's bytes, {} with B's, {} failed; {served} range requests to the hostile registry",
            got_h.len(),
            tally(&self.want_h),
            tally(&self.want_b),
            got_h.values().filter(|r| r.is_err()).count()
        );

        // H first: B mounted after H read everything.
        let b = early.unwrap_or_else(mount_b);
        for (who, m, entry) in [
            ("B", &b, &self.honest_entry),
            ("H", &h, &self.hostile_entry),
        ] {
            f.check(blob_names(m) == [format!("{entry}.cache")], || {
                format!(
                    "{label}: {who}'s cache files {:?}, expected its own entry {entry}",
                    m.blob_paths()
                )
            });
        }

        // B, from its cache files: every byte its own.
        drop_caches();
        let got_b = read_files(&b.path, &self.files, self.t.path(), &format!("{label}-b"));
        let failed = f.0.len();
        check_reads(
            f,
            &format!("{label}: B after H"),
            &self.want_b,
            &self.files,
            &got_b,
        );
        if f.0.len() == failed {
            // The rest of the tree (metadata) too; after wrong bytes, the
            // next rounds run instead, and report theirs.
            drop_caches();
            treecmp(&[], &self.ref_b, &b.path);
        }

        let entries = cache_entries(&cache, &self.victim);
        let expected: BTreeSet<String> =
            [self.honest_entry.clone(), self.hostile_entry.clone()].into();
        f.check(entries == expected, || {
            format!(
                "{label}: cache entries of {}: {entries:?}, expected B's and H's: {expected:?}",
                self.victim
            )
        });
        h.unmount();
        b.unmount();
        eprintln!(
            "{label}: round took {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }
}

/// Issue 28 point 1. Image H is image B with three files' content changed
/// (same sizes, so the same chunk count and cache size; incompressible, so
/// even the same blob size), forged to name B's data blob X with H's own
/// chunk table, and served by a registry that answers X's ranges with H's
/// bytes; B comes from a real registry. On one cache dir per round, B and H
/// are mounted lazily, B first (having read only files H cannot touch) or H
/// first, on the kernel path (also with `--share-files`: files shared by
/// content, issue 43) and through FUSE; H reads everything (not
/// checked beyond ending in time); then, with the page cache dropped, every
/// file of B must equal `umoci unpack` of B, and the cache must hold two
/// entries for X: B's and H's, named by (X, cache size, table digest).
#[test]
fn a_hostile_image_naming_anothers_blob_never_changes_its_bytes() {
    let Some((_time, t, src)) = begin(
        "a_hostile_image_naming_anothers_blob_never_changes_its_bytes",
        "tenants-hostile",
    ) else {
        return;
    };
    let ref_b = reference(&t, &src, "b");
    let ref_h = reference(&t, &src, "h");
    let (want_b, want_h) = (tree_hashes(&ref_b), tree_hashes(&ref_h));
    let files: Vec<String> = want_b.keys().cloned().collect();
    assert_eq!(files.len(), FILES.len());
    let changed: Vec<&String> = files.iter().filter(|p| want_b[*p] != want_h[*p]).collect();
    assert_eq!(changed.len(), CHANGED.len(), "changed files: {changed:?}");
    let apart: Vec<String> = files
        .iter()
        .filter(|p| want_b[*p] == want_h[*p] && fs::metadata(ref_b.join(p)).unwrap().len() > 16384)
        .cloned()
        .collect();
    assert!(apart.len() >= 4, "{apart:?}");

    // B: into the real registry, and into a layout for its index.
    let reg = Registry::start();
    let honest = reg.reference("tenant:b");
    let report_b = convert(&oci_ref(&src, "b"), &honest);
    let out_b = t.join("out-b");
    let layout_b = convert(&oci_ref(&src, "b"), &oci_ref(&out_b, "b"));
    assert_eq!(report_b["manifest_digest"], layout_b["manifest_digest"]);
    let (victim, size_b, cache_b) = only_blob(&report_b);

    // H: converted, then forged to name X.
    let out_h = t.join("out-h");
    let report_h = convert(&oci_ref(&src, "h"), &oci_ref(&out_h, "h"));
    let (own_h, size_h, cache_h) = only_blob(&report_h);
    assert_ne!(own_h, victim);
    assert_eq!(cache_h, cache_b, "H must have B's cache size");
    let table_b = blob_table(&out_b, "b", t.path());
    let forged = forge(&out_h, "h", "forged", &victim, t.path());
    assert_eq!(forged.chunk_count, table_b[0].chunk_count);
    assert_eq!(forged.cache_size, table_b[0].cache_size);
    assert_ne!(forged.table_digest, table_b[0].table_digest);
    let forged_manifest = read_manifest(&out_h, "forged");
    let data = &forged_manifest["layers"][layer_of(&forged_manifest, MEDIA_TYPE_BLOB)];
    assert_eq!(data["digest"], victim.as_str());
    eprintln!(
        "blob X {victim}: {size_b} bytes in B, H's bytes {size_h} (served as X), cache size {cache_b}, {} chunks",
        forged.chunk_count
    );
    let honest_entry = entry_stem(&table_b[0]);
    let hostile_entry = entry_stem(&forged);
    assert_ne!(honest_entry, hostile_entry);

    let registry = HostileRegistry::start(t.path(), &out_h);
    let tenants = Tenants {
        t: &t,
        honest,
        hostile: format!("docker://127.0.0.1:{}/hostile:forged", registry.port),
        registry: &registry,
        victim,
        honest_entry,
        hostile_entry,
        ref_b,
        want_b,
        want_h,
        files,
        apart,
    };
    let mut f = Failures::default();
    // Issue 43: with files shared by content, too.
    let (kernel, shared, fuse) = (("kernel", false), ("kernel", true), ("fuse", false));
    for (mode, b_first) in [
        (kernel, true),
        (kernel, false),
        (shared, true),
        (shared, false),
        (fuse, true),
        (fuse, false),
    ] {
        tenants.round(&mut f, mode, b_first);
    }
    if !f.0.is_empty() {
        let log = fs::read_to_string(&registry.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        f.0.push(format!(
            "hostile registry: {}\nits last requests:\n{}",
            registry.bg.describe(),
            lines[lines.len().saturating_sub(20)..].join("\n")
        ));
    }
    f.finish("a hostile image naming another's blob");
}
