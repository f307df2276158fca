//! Where a worker fetches from: its own mount's source, and, when that is
//! slow or failing, the sources of other mounts of the same cache entry.
//!
//! Mounts of one cache entry share its cache file's inode, and the kernel
//! asks every mount's holder about every read of it, one after another: a
//! read through mount A is failed by mount B's worker if B cannot fill it,
//! and A's worker is not even asked before B answers. Cache files are
//! shared only within a trust domain (`blobs/<domain>/`: one registry host
//! with one configuration and one set of credentials; see lamina-mount's
//! `common::domain_id`), so the mounts of an entry differ at most in their
//! repository, and each may fetch what the others may. B's worker, when
//! its own repository's answers fail or stall, fetches from the other
//! mounts' repositories (their configs, in the cache's `mounts/` dir) with
//! the same host, configuration and credentials as its own. The bytes are
//! checked against the entry's chunk table as always: another mount's
//! repository can make a fetch fail, never make it wrong.

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use lamina_fetch::fetch::{attempt_timeout, LayoutSource, RangeSource, RegistrySource};
use lamina_oci::{HostsConfig, RegistryClient, SourceOptions};

use crate::config::{DaemonConfig, SourceSpec};

/// The source `spec` names, each request given a third of `timeout_secs`
/// (see [`attempt_timeout`]).
pub(crate) fn range_source(
    spec: &SourceSpec,
    timeout_secs: u64,
) -> io::Result<Arc<dyn RangeSource>> {
    Ok(match spec {
        SourceSpec::Registry { repository, .. } => Arc::new(RegistrySource {
            client: registry_client(spec, timeout_secs)?,
            repository: repository.clone(),
        }),
        SourceSpec::Layout { dir } => Arc::new(LayoutSource { dir: dir.clone() }),
    })
}

/// The client of a registry source (any other source: an error).
fn registry_client(spec: &SourceSpec, timeout_secs: u64) -> io::Result<RegistryClient> {
    let SourceSpec::Registry {
        host,
        insecure_hosts,
        tls_hosts,
        ca_file,
        hosts_dir,
        ..
    } = spec
    else {
        return Err(io::Error::other("not a registry source"));
    };
    let opts = SourceOptions {
        insecure_hosts: insecure_hosts.clone(),
        tls_hosts: tls_hosts.clone(),
        ca_file: ca_file.clone(),
        hosts: hosts_dir
            .as_ref()
            .map_or_else(HostsConfig::none, HostsConfig::new),
        ..SourceOptions::default()
    };
    let timeout = attempt_timeout(Duration::from_secs(timeout_secs.max(1)));
    RegistryClient::with_timeout(host, &opts, timeout).map_err(io::Error::other)
}

/// The sources of a mount: for bulk reads (boot pages, reads ahead,
/// prefetches, whole layers) and for misses, the reads a reader waits on.
/// They differ only when hosts.toml marks a host `bulk_only` (a P2P daemon
/// that moves 4 MiB pieces per request: a miss goes around it).
pub(crate) fn bulk_and_miss_sources(
    spec: &SourceSpec,
    timeout_secs: u64,
) -> io::Result<(Arc<dyn RangeSource>, Arc<dyn RangeSource>)> {
    let SourceSpec::Registry { repository, .. } = spec else {
        let source = range_source(spec, timeout_secs)?;
        return Ok((source.clone(), source));
    };
    let client = registry_client(spec, timeout_secs)?;
    let of = |client: RegistryClient| -> Arc<dyn RangeSource> {
        Arc::new(RegistrySource {
            client,
            repository: repository.clone(),
        })
    };
    if !client.has_bulk_only_hosts() {
        let source = of(client);
        return Ok((source.clone(), source));
    }
    tracing::info!("misses go around the hosts marked bulk_only; bulk reads go through them");
    Ok((of(client.clone()), of(client.for_misses())))
}

/// The sources of the other mounts (in the cache's `mounts/` dir, beside
/// `config`'s run dir) whose blob lies in the same cache file as `config`'s
/// blob `blob`: the same entry, so the same chunk table. Mounts with the
/// same source as ours are left out (no help).
pub(crate) fn of_other_mounts(config: &DaemonConfig, blob: usize) -> Vec<Arc<dyn RangeSource>> {
    let Some(ours) = config.blobs.get(blob) else {
        return Vec::new();
    };
    let Some(mounts) = config.run_dir.parent() else {
        return Vec::new();
    };
    let Ok(dir) = std::fs::read_dir(mounts) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in dir.flatten() {
        let run = entry.path();
        if run == config.run_dir {
            continue;
        }
        let Some(other) = other_config(&run) else {
            continue;
        };
        let same_entry = other.blobs.iter().any(|b| b.cache_path == ours.cache_path);
        if !same_entry || same_source(&other.source, &config.source) {
            continue;
        }
        match range_source(&other.source, config.timeout_secs) {
            Ok(source) => found.push(source),
            Err(e) => tracing::warn!("the source of the mount in {}: {e}", run.display()),
        }
    }
    found
}

/// Another mount's config, if its run dir has one this process may trust.
fn other_config(run: &Path) -> Option<DaemonConfig> {
    DaemonConfig::load(&run.join("config.json")).ok()
}

fn same_source(a: &SourceSpec, b: &SourceSpec) -> bool {
    match (a, b) {
        (
            SourceSpec::Registry {
                host: ha,
                repository: ra,
                ..
            },
            SourceSpec::Registry {
                host: hb,
                repository: rb,
                ..
            },
        ) => ha == hb && ra == rb,
        (SourceSpec::Layout { dir: a }, SourceSpec::Layout { dir: b }) => a == b,
        _ => false,
    }
}
