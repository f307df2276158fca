//! Issue 42 point 3: a mount fetches only with its own registry and
//! credentials, and shares cache files only within its trust domain.
//!
//! Tenant A's image is in a registry; tenant B names A's layers (the same
//! manifest) through a registry of its own that serves B every manifest
//! and metadata blob but no range of a data blob (503: B has no right to
//! A's bytes). Before, both mounts shared A's cache files: B read every
//! file with A's bytes, fetched by A (and B's worker, when its own
//! registry failed, fetched with A's registry and its configuration).

use std::collections::BTreeMap;

use crate::common::*;
use crate::images::{begin, convert, reference, tree_hashes};
use crate::reading::{check_reads, drop_caches, read_files};

/// A reads everything; B, mounted after on the same cache dir through its
/// own registry, gets none of A's bytes (every read fails: its registry
/// serves it no data) and cache files of its own; with B mounted and the
/// page cache dropped, A reads everything again with its own bytes.
#[test]
fn a_tenant_naming_anothers_layers_gets_none_of_its_bytes() {
    let Some((_time, t, src)) = begin(
        "a_tenant_naming_anothers_layers_gets_none_of_its_bytes",
        "tenants-domains",
    ) else {
        return;
    };
    let want = tree_hashes(&reference(&t, &src, "b"));
    let files: Vec<String> = want.keys().cloned().collect();
    let reg = Registry::start();
    let image_a = reg.reference("tenant:a");
    convert(&oci_ref(&src, "b"), &image_a);
    let b_registry = FaultProxy::start(t.path(), "b-registry", 0, reg.port, "503", &[]);
    let image_b = format!("docker://127.0.0.1:{}/tenant:a", b_registry.port);

    let cache = t.join("cache");
    let opts = [
        "--lazy",
        "--mode",
        "kernel",
        "--timeout",
        "3",
        "--prefetch",
        "none",
        "--fill-ahead",
        "0",
        "--readahead",
        "0",
    ];
    let a = Mount::with_args(&image_a, &t.join("mnt-a"), &cache, &opts);
    let mut f = Failures::default();
    let got = read_files(&a.path, &files, t.path(), "a-first");
    check_reads(&mut f, "A", &want, &files, &got);

    let b = Mount::with_args(&image_b, &t.join("mnt-b"), &cache, &opts);
    let shared: Vec<_> = b
        .blob_paths()
        .into_iter()
        .filter(|p| a.blob_paths().contains(p))
        .collect();
    f.check(shared.is_empty(), || {
        format!("B's mount uses A's cache files {shared:?}")
    });
    let got_b = read_files(&b.path, &files, t.path(), "b");
    let with_a_bytes: BTreeMap<_, _> = got_b
        .iter()
        .filter(|(p, r)| r.as_ref().is_ok_and(|h| *h == want[*p]))
        .collect();
    eprintln!(
        "figures: B read {} files, {} with A's bytes; B's registry: {}",
        got_b.len(),
        with_a_bytes.len(),
        b_registry.stats()
    );
    f.check(with_a_bytes.is_empty(), || {
        format!("B read A's bytes of {:?}", with_a_bytes.keys())
    });
    let asked = b_registry.stats()["eligible"].as_u64().unwrap_or(0);
    f.check(asked > 0, || {
        "B never asked its own registry for a range: the test tests nothing".into()
    });

    drop_caches();
    let again = read_files(&a.path, &files, t.path(), "a-again");
    check_reads(&mut f, "A with B mounted", &want, &files, &again);
    b.unmount();
    a.unmount();
    f.finish("a tenant naming another's layers");
}
