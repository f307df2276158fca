//! Tenants' cache dirs (issue 42). Under Kubernetes every pod is in
//! containerd's `k8s.io` namespace, so a tenant is what the node's config
//! says it is: here, the images under a registry and repository prefix.
//! Each tenant's lamina mounts keep their cache files, metadata and run
//! dirs in a cache dir of its own, which the operator bounds as the
//! filesystem allows (a filesystem of its own, or an XFS or ext4 project
//! quota on the dir): one tenant's fills then meet only its own limit, and
//! never make another's reads fail. Images no prefix names use the
//! snapshotter's own cache.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use lamina_oci::RegistryRef;

/// One tenant: the images under `prefix` (`HOST[/REPO...]`) and its dir.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantCache {
    /// `HOST` or `HOST/REPOSITORY-PREFIX`, as in image references.
    pub prefix: String,
    /// Its cache dir.
    pub cache_dir: PathBuf,
}

impl FromStr for TenantCache {
    type Err = String;

    /// `PREFIX=DIR`, DIR absolute.
    fn from_str(s: &str) -> Result<TenantCache, String> {
        let form =
            || format!("{s:?}: want PREFIX=DIR (e.g. registry.example.com/team-a=/srv/lamina/a)");
        let (prefix, dir) = s.split_once('=').ok_or_else(form)?;
        let prefix = prefix.trim().trim_end_matches('/');
        let dir = PathBuf::from(dir.trim());
        if prefix.is_empty() || prefix.contains(['@', ' ']) || !dir.is_absolute() {
            return Err(form());
        }
        Ok(TenantCache {
            prefix: prefix.to_string(),
            cache_dir: dir,
        })
    }
}

/// Which cache dir each image's mounts use.
#[derive(Debug, Clone)]
pub struct CacheDirs {
    default: PathBuf,
    /// Longest prefix first: the most specific tenant wins.
    tenants: Vec<TenantCache>,
}

impl CacheDirs {
    /// `default` for images no tenant's prefix names.
    pub fn new(default: PathBuf, mut tenants: Vec<TenantCache>) -> CacheDirs {
        tenants.sort_by_key(|t| std::cmp::Reverse(t.prefix.len()));
        CacheDirs { default, tenants }
    }

    /// The cache dir of `image` (`HOST/REPO:TAG` or `HOST/REPO@DIGEST`).
    pub fn for_image(&self, image: &str) -> &Path {
        let Ok(r) = RegistryRef::parse(image) else {
            return &self.default;
        };
        let name = format!("{}/{}", r.host, r.repository);
        self.tenants
            .iter()
            .find(|t| under(&name, &t.prefix))
            .map_or(&self.default, |t| &t.cache_dir)
    }

    /// Every cache dir: the default first.
    pub fn all(&self) -> Vec<PathBuf> {
        let mut dirs = vec![self.default.clone()];
        for t in &self.tenants {
            if !dirs.contains(&t.cache_dir) {
                dirs.push(t.cache_dir.clone());
            }
        }
        dirs
    }

    /// The cache dir holding `mountpoint`'s run dir, if any does.
    pub fn serving(&self, mountpoint: &Path) -> Option<PathBuf> {
        self.all()
            .into_iter()
            .find(|dir| lamina_mount::run_dir(dir, mountpoint).exists())
    }
}

/// Whether the repository `name` (`HOST/REPO`) is `prefix` or under it,
/// at a path boundary (`host/team-a` is not under `host/team`).
fn under(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dirs() -> CacheDirs {
        let t = |s: &str| s.parse::<TenantCache>().unwrap();
        CacheDirs::new(
            PathBuf::from("/c/default"),
            vec![
                t("reg.example:5000/team=/c/team"),
                t("reg.example:5000/team/special=/c/special"),
                t("other.example=/c/other"),
            ],
        )
    }

    #[test]
    fn an_image_goes_to_its_most_specific_tenant() {
        let d = dirs();
        let dir = |i: &str| d.for_image(i).to_str().unwrap().to_string();
        assert_eq!(dir("reg.example:5000/team/app:1"), "/c/team");
        assert_eq!(dir("reg.example:5000/team@sha256:0000000000000000000000000000000000000000000000000000000000000000"), "/c/team");
        assert_eq!(dir("reg.example:5000/team/special/app:1"), "/c/special");
        assert_eq!(dir("other.example/any/thing:1"), "/c/other");
        // A prefix ends at a path boundary; no prefix: the default.
        assert_eq!(dir("reg.example:5000/teammate/app:1"), "/c/default");
        assert_eq!(dir("reg.example:5000/app:1"), "/c/default");
        assert_eq!(dir("not a reference"), "/c/default");
        assert_eq!(d.all().len(), 4);
    }

    #[test]
    fn a_tenant_is_prefix_equals_absolute_dir() {
        for bad in ["noequals", "=/c", "reg/x=relative", "reg/x@sha256:00=/c"] {
            assert!(bad.parse::<TenantCache>().is_err(), "{bad}");
        }
        let t: TenantCache = "reg.example/team/=/c/t".parse().unwrap();
        assert_eq!(t.prefix, "reg.example/team");
    }
}
