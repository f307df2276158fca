//! Tenants' cache dirs (issue 42). Under Kubernetes every pod is in
//! containerd's `k8s.io` namespace, so a tenant is what the node's config
//! says it is: the images under a registry and repository prefix, or the
//! images a pod pulled with a pull secret of a given user at a registry.
//! Each tenant's lamina mounts keep their cache files, metadata and run
//! dirs in a cache dir of its own, which the operator bounds as the
//! filesystem allows (a filesystem of its own, or an XFS or ext4 project
//! quota on the dir): one tenant's fills then meet only its own limit, and
//! never make another's reads fail. Images no tenant names use the
//! snapshotter's own cache.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use lamina_oci::RegistryRef;

/// Which images are a tenant's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    /// The images under `HOST` or `HOST/REPOSITORY-PREFIX`, as in image
    /// references.
    Prefix(String),
    /// The images of `host` pulled with a pod's pull secret for `user`
    /// (CRI keychain). A pod that names the user with a wrong password
    /// gets here too, but its mounts fetch with that password and are
    /// refused by the registry; and a mount's trust domain includes its
    /// credentials, so it shares no cache file with the tenant's.
    Secret {
        /// The secret's user name.
        user: String,
        /// The registry it is for.
        host: String,
    },
}

/// One tenant: which images are its, and its dir.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantCache {
    /// Its images.
    pub selector: Selector,
    /// Its cache dir.
    pub cache_dir: PathBuf,
}

impl FromStr for TenantCache {
    type Err = String;

    /// `PREFIX=DIR` or `secret:USER@HOST=DIR`, DIR absolute.
    fn from_str(s: &str) -> Result<TenantCache, String> {
        let form = || {
            format!(
                "{s:?}: want PREFIX=DIR or secret:USER@HOST=DIR, DIR absolute \
                 (e.g. registry.example.com/team-a=/srv/lamina/a)"
            )
        };
        // DIR is absolute: the selector ends at the first "=/" (a user name
        // may hold '=' or '@').
        let at = s.find("=/").ok_or_else(form)?;
        let (selector, dir) = (s[..at].trim(), PathBuf::from(s[at + 1..].trim()));
        let selector = match selector.strip_prefix("secret:") {
            Some(secret) => {
                let (user, host) = secret.rsplit_once('@').ok_or_else(form)?;
                if user.is_empty() || host.is_empty() || host.contains(['/', ' ']) {
                    return Err(form());
                }
                Selector::Secret {
                    user: user.to_string(),
                    host: host.to_string(),
                }
            }
            None => {
                let prefix = selector.trim_end_matches('/');
                if prefix.is_empty() || prefix.contains(['@', ' ', '=']) {
                    return Err(form());
                }
                Selector::Prefix(prefix.to_string())
            }
        };
        Ok(TenantCache {
            selector,
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
    /// `default` for images no tenant names.
    pub fn new(default: PathBuf, mut tenants: Vec<TenantCache>) -> CacheDirs {
        // Secrets first, then the longest prefix.
        tenants.sort_by_key(|t| match &t.selector {
            Selector::Secret { .. } => (0, std::cmp::Reverse(0)),
            Selector::Prefix(p) => (1, std::cmp::Reverse(p.len())),
        });
        CacheDirs { default, tenants }
    }

    /// The cache dir of `image` (`HOST/REPO:TAG` or `HOST/REPO@DIGEST`),
    /// pulled with a pull secret of `user` if one is given: a tenant
    /// named by that secret, else the most specific prefix.
    pub fn for_image(&self, image: &str, user: Option<&str>) -> &Path {
        let Ok(r) = RegistryRef::parse(image) else {
            return &self.default;
        };
        let name = format!("{}/{}", r.host, r.repository);
        self.tenants
            .iter()
            .find(|t| match &t.selector {
                Selector::Secret { user: u, host } => Some(u.as_str()) == user && *host == r.host,
                Selector::Prefix(prefix) => under(&name, prefix),
            })
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

/// Refuses tenants chosen by pull secret without the CRI keychain, which
/// alone brings pods' secrets: they would never be chosen.
pub fn check(tenants: &[TenantCache], cri_keychain: bool) -> Result<(), String> {
    let by_secret = tenants
        .iter()
        .any(|t| matches!(t.selector, Selector::Secret { .. }));
    if by_secret && !cri_keychain {
        return Err(
            "a tenant chosen by pull secret (--tenant-cache secret:USER@HOST=DIR) \
             needs --cri-keychain: without it no pod's secret reaches the snapshotter"
                .into(),
        );
    }
    Ok(())
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
                t("secret:alice@reg.example:5000=/c/alice"),
                t("secret:bob@example.com@other.example=/c/bob"),
            ],
        )
    }

    #[test]
    fn an_image_goes_to_its_most_specific_tenant() {
        let d = dirs();
        let dir = |i: &str| d.for_image(i, None).to_str().unwrap().to_string();
        assert_eq!(dir("reg.example:5000/team/app:1"), "/c/team");
        assert_eq!(dir("reg.example:5000/team@sha256:0000000000000000000000000000000000000000000000000000000000000000"), "/c/team");
        assert_eq!(dir("reg.example:5000/team/special/app:1"), "/c/special");
        assert_eq!(dir("other.example/any/thing:1"), "/c/other");
        // A prefix ends at a path boundary; no prefix: the default.
        assert_eq!(dir("reg.example:5000/teammate/app:1"), "/c/default");
        assert_eq!(dir("reg.example:5000/app:1"), "/c/default");
        assert_eq!(dir("not a reference"), "/c/default");
        assert_eq!(d.all().len(), 6);
    }

    #[test]
    fn a_pull_secrets_user_names_its_tenant_at_its_registry_only() {
        let d = dirs();
        let dir = |i: &str, u: &str| d.for_image(i, Some(u)).to_str().unwrap().to_string();
        // The secret's tenant beats every prefix, at its own registry.
        assert_eq!(dir("reg.example:5000/team/app:1", "alice"), "/c/alice");
        assert_eq!(dir("reg.example:5000/app:1", "alice"), "/c/alice");
        assert_eq!(dir("other.example/x:1", "bob@example.com"), "/c/bob");
        // Another user, or the user at another registry: as without one.
        assert_eq!(dir("reg.example:5000/team/app:1", "mallory"), "/c/team");
        assert_eq!(dir("other.example/x:1", "alice"), "/c/other");
        assert_eq!(dir("third.example/x:1", "alice"), "/c/default");
    }

    #[test]
    fn a_secrets_tenant_needs_the_cri_keychain() {
        let prefix = vec!["reg/x=/c/x".parse::<TenantCache>().unwrap()];
        let secret = vec!["secret:u@reg=/c/u".parse::<TenantCache>().unwrap()];
        assert!(check(&prefix, false).is_ok());
        assert!(check(&secret, true).is_ok());
        assert!(check(&secret, false)
            .unwrap_err()
            .contains("--cri-keychain"));
    }

    #[test]
    fn a_tenant_is_prefix_equals_absolute_dir() {
        for bad in [
            "noequals",
            "=/c",
            "reg/x=relative",
            "reg/x@sha256:00=/c",
            "secret:nohost=/c",
            "secret:@reg=/c",
            "secret:u@reg/x=/c",
        ] {
            assert!(bad.parse::<TenantCache>().is_err(), "{bad}");
        }
        let t: TenantCache = "reg.example/team/=/c/t".parse().unwrap();
        assert_eq!(t.selector, Selector::Prefix("reg.example/team".into()));
        let t: TenantCache = "secret:a=b@c.d@reg:5000=/c/t".parse().unwrap();
        let want = Selector::Secret {
            user: "a=b@c.d".into(),
            host: "reg:5000".into(),
        };
        assert_eq!((t.selector, t.cache_dir), (want, PathBuf::from("/c/t")));
    }
}
