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

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

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
        docker_config,
        ..
    } = spec
    else {
        return Err(io::Error::other("not a registry source"));
    };
    let opts = SourceOptions {
        docker_config: docker_config.clone(),
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

/// The source for reads a reader waits on (misses): around the hosts
/// hosts.toml marks `bulk_only`, as [`bulk_and_miss_sources`] says.
pub fn miss_source(spec: &SourceSpec, timeout_secs: u64) -> io::Result<Arc<dyn RangeSource>> {
    Ok(bulk_and_miss_sources(spec, timeout_secs)?.1)
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
/// a config's run dir), each built once per version of that mount's
/// config: a miss that waits looks them up again, and a look-up is then a
/// directory listing and a `stat` per mount, not a config parse and a new
/// client (which may run a credential helper) each.
#[derive(Default)]
pub(crate) struct OtherMounts(Mutex<HashMap<PathBuf, Known>>);

/// One other mount as last seen.
struct Known {
    /// Its config.json's modification time and size when read.
    stamp: (SystemTime, u64),
    /// Its cache files.
    cache_paths: Vec<PathBuf>,
    /// Its source, when that is not ours (and could be built).
    source: Option<Arc<dyn RangeSource>>,
}

impl OtherMounts {
    /// The sources of the other mounts whose blob lies in the same cache
    /// file as `config`'s blob `blob`: the same entry, so the same chunk
    /// table, and the same trust domain (cache files are shared within one
    /// only), so the same host, configuration and credentials. Mounts with
    /// the same source as ours are left out (no help).
    pub(crate) fn sources(&self, config: &DaemonConfig, blob: usize) -> Vec<Arc<dyn RangeSource>> {
        let Some(ours) = config.blobs.get(blob) else {
            return Vec::new();
        };
        let Some(mounts) = config.run_dir.parent() else {
            return Vec::new();
        };
        let Ok(dir) = std::fs::read_dir(mounts) else {
            return Vec::new();
        };
        let runs: Vec<(PathBuf, (SystemTime, u64))> = dir
            .flatten()
            .map(|entry| entry.path())
            .filter(|run| *run != config.run_dir)
            .filter_map(|run| Some((run.clone(), config_stamp(&run)?)))
            .collect();
        let lock = || self.0.lock().unwrap_or_else(|e| e.into_inner());
        let stale: Vec<_> = {
            let known = lock();
            runs.iter()
                .filter(|(run, stamp)| known.get(run).is_none_or(|k| k.stamp != *stamp))
                .cloned()
                .collect()
        };
        // Read and built without the lock: a client resolves its host.
        let fresh: Vec<(PathBuf, Known)> = stale
            .into_iter()
            .filter_map(|(run, stamp)| Some((run.clone(), read_other(&run, stamp, config)?)))
            .collect();
        let mut known = lock();
        known.extend(fresh);
        known.retain(|run, _| runs.iter().any(|(live, _)| live == run));
        runs.iter()
            .filter_map(|(run, _)| known.get(run))
            .filter(|k| k.cache_paths.contains(&ours.cache_path))
            .filter_map(|k| k.source.clone())
            .collect()
    }
}

fn config_stamp(run: &Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(run.join("config.json")).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

/// What another mount's config says, its source built unless it is ours.
fn read_other(run: &Path, stamp: (SystemTime, u64), config: &DaemonConfig) -> Option<Known> {
    let other = other_config(run)?;
    let source = match same_source(&other.source, &config.source) {
        true => None,
        false => range_source(&other.source, config.timeout_secs)
            .inspect_err(|e| tracing::warn!("the source of the mount in {}: {e}", run.display()))
            .ok(),
    };
    Some(Known {
        stamp,
        cache_paths: other.blobs.into_iter().map(|b| b.cache_path).collect(),
        source,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn config(run: &Path, repository: &str, cache: &Path) -> DaemonConfig {
        serde_json::from_value(serde_json::json!({
            "image": "x", "manifest_digest": "sha256:00", "mountpoint": "/m",
            "metadata_path": "/m", "index_path": "/i", "blob_dir": "/b",
            "blobs": [{ "digest": "sha256:00", "cache_path": cache, "complete": false }],
            "source": {
                "kind": "registry", "host": "127.0.0.1:9", "repository": repository,
                "insecure_hosts": [], "tls_hosts": []
            },
            "run_dir": run, "timeout_secs": 1, "fill_window": 0, "workers": 1,
            "prefetch": false, "prefetch_all": false, "record_trace": null
        }))
        .unwrap()
    }

    /// Issue 42 point 12: a miss that waits asks for the other mounts'
    /// sources again and again; each is built once per version of that
    /// mount's config (a new client may run a credential helper), and only
    /// mounts of the same cache file with another source count.
    #[test]
    fn other_mounts_sources_are_built_once_per_config() {
        let dir = tempfile::tempdir().unwrap();
        let mounts = dir.path().join("mounts");
        let cache = dir.path().join("x.cache");
        let (ours, theirs, same) = (mounts.join("a"), mounts.join("b"), mounts.join("c"));
        for run in [&ours, &theirs, &same] {
            lamina_fetch::private::private_dir(run).unwrap();
        }
        let me = config(&ours, "mine", &cache);
        config(&theirs, "theirs", &cache)
            .save(&theirs.join("config.json"))
            .unwrap();
        config(&same, "mine", &cache)
            .save(&same.join("config.json"))
            .unwrap();
        let others = OtherMounts::default();
        let first = others.sources(&me, 0);
        assert_eq!(first.len(), 1, "only the mount with another source");
        let again = others.sources(&me, 0);
        assert!(Arc::ptr_eq(&first[0], &again[0]), "built again");
        std::thread::sleep(Duration::from_millis(20));
        config(&theirs, "theirs-now", &cache)
            .save(&theirs.join("config.json"))
            .unwrap();
        let changed = others.sources(&me, 0);
        assert!(
            !Arc::ptr_eq(&first[0], &changed[0]),
            "a new config, same source"
        );
        std::fs::remove_dir_all(&theirs).unwrap();
        assert!(others.sources(&me, 0).is_empty());
        assert!(others
            .sources(&config(&ours, "mine", &dir.path().join("y")), 0)
            .is_empty());
    }
}
