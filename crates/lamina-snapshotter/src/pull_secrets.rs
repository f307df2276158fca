//! Pods' image pull secrets, kept for the lamina mounts of the images they
//! were given for (issue 42, point 11).
//!
//! Each secret is written as a docker config that holds it alone,
//! `DIR/<sha256 of that config>.json` (0600 in a 0700 dir). A mount of the
//! image names that file as its only credentials (`SourceOptions::
//! docker_config`, handed on to its daemons), and the file's path is part of
//! the mount's trust domain: pods that bring the same secret share cache
//! files, pods with different secrets (or none) never do. `DIR/refs/<sha256
//! of the reference>` names the file the reference's last pull brought; a
//! pull that brings none removes it, and the image's mounts then fetch with
//! the node's credentials.

use std::io;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use lamina_fetch::private::{private_dir, read_trusted, write_atomic};
use lamina_oci::RegistryRef;

/// Credentials a pod brought with a pull (CRI's `AuthConfig`).
pub enum PodAuth {
    /// User name and password.
    Basic { username: String, password: String },
    /// `base64(user:password)`, as in a docker config's `auth`.
    Encoded(String),
    /// A refresh token for the registry's token service.
    IdentityToken(String),
}

impl std::fmt::Debug for PodAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PodAuth::Basic { username, .. } => write!(f, "Basic({username:?}, ..)"),
            PodAuth::Encoded(_) => f.write_str("Encoded(..)"),
            PodAuth::IdentityToken(_) => f.write_str("IdentityToken(..)"),
        }
    }
}

/// The pull secrets of one snapshotter.
#[derive(Debug)]
pub struct PullSecrets {
    dir: PathBuf,
}

impl PullSecrets {
    /// Keeps them in `dir` (made private; on a tmpfs such as /run they
    /// never outlive the mounts that use them).
    pub fn open(dir: &Path) -> io::Result<PullSecrets> {
        private_dir(dir)?;
        private_dir(&dir.join("refs"))?;
        Ok(PullSecrets {
            dir: dir.to_path_buf(),
        })
    }

    /// Keeps `auth` as what `reference`'s mounts fetch with, or with
    /// `None` forgets what an earlier pull of it brought. A reference
    /// lamina cannot parse is left alone: it names no lamina image.
    pub fn record(&self, reference: &str, auth: Option<&PodAuth>) -> Result<(), String> {
        let Ok(image) = RegistryRef::parse(reference) else {
            return Ok(());
        };
        let link = self.link_path(&image.to_string());
        let Some(auth) = auth else {
            return remove(&link).map_err(|e| e.to_string());
        };
        let config = docker_config(&image.host, auth)?;
        let name = format!("{}.json", hex::encode(lamina_oci::sha256(&config)));
        write_atomic(&self.dir.join(&name), &config, false).map_err(|e| e.to_string())?;
        write_atomic(&link, name.as_bytes(), false).map_err(|e| e.to_string())?;
        tracing::info!("{image}: its mounts fetch with the pull secret its pod brought");
        Ok(())
    }

    /// Gives `alias` (the `HOST/REPO@DIGEST` a mount is made by) what
    /// `reference` (the name it was pulled by) has, or nothing.
    pub fn alias(&self, reference: &str, alias: &str) -> io::Result<()> {
        let link = self.link_path(alias);
        match self.config_name(reference) {
            Some(name) => write_atomic(&link, name.as_bytes(), false),
            None => remove(&link),
        }
    }

    /// The docker config `reference`'s mounts fetch with, if its pull
    /// brought one.
    pub fn config_for(&self, reference: &str) -> Option<PathBuf> {
        let path = self.dir.join(self.config_name(reference)?);
        path.exists().then_some(path)
    }

    /// The user name of the secret `reference`'s pull brought, if it has
    /// one (a user and password; an identity token names no user): what
    /// a `secret:USER@HOST` tenant is chosen by.
    pub fn user_for(&self, reference: &str) -> Option<String> {
        let host = RegistryRef::parse(reference).ok()?.host;
        let config = read_trusted(&self.config_for(reference)?).ok()?;
        let config: serde_json::Value = serde_json::from_slice(&config).ok()?;
        let encoded = config["auths"][host.as_str()]["auth"].as_str()?;
        let pair = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .ok()?;
        let pair = String::from_utf8(pair).ok()?;
        Some(pair.split_once(':')?.0.to_string())
    }

    fn config_name(&self, reference: &str) -> Option<String> {
        let image = RegistryRef::parse(reference).ok()?;
        let name = read_trusted(&self.link_path(&image.to_string())).ok()?;
        let name = String::from_utf8(name).ok()?;
        let stem = name.strip_suffix(".json")?;
        (stem.len() == 64 && stem.bytes().all(|b| b.is_ascii_hexdigit())).then_some(name)
    }

    fn link_path(&self, normalized: &str) -> PathBuf {
        let digest = hex::encode(lamina_oci::sha256(normalized.as_bytes()));
        self.dir.join("refs").join(digest)
    }
}

fn remove(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// A docker config with `auth` for `host` and nothing else.
fn docker_config(host: &str, auth: &PodAuth) -> Result<Vec<u8>, String> {
    let entry = match auth {
        PodAuth::Basic { username, password } => {
            let pair = format!("{username}:{password}");
            let encoded = base64::engine::general_purpose::STANDARD.encode(pair);
            serde_json::json!({ "auth": encoded })
        }
        PodAuth::Encoded(encoded) => {
            let pair = base64::engine::general_purpose::STANDARD
                .decode(encoded.trim())
                .ok()
                .and_then(|p| String::from_utf8(p).ok());
            if !pair.is_some_and(|p| p.contains(':')) {
                return Err("its auth is not base64 of USER:PASSWORD".into());
            }
            serde_json::json!({ "auth": encoded.trim() })
        }
        PodAuth::IdentityToken(token) => serde_json::json!({ "identitytoken": token }),
    };
    let config = serde_json::json!({ "auths": { host: entry } });
    serde_json::to_vec(&config).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn basic(user: &str) -> PodAuth {
        PodAuth::Basic {
            username: user.into(),
            password: format!("{user}-secret"),
        }
    }

    #[test]
    fn a_secret_is_kept_for_its_image_only() {
        let t = tempfile::tempdir().unwrap();
        let secrets = PullSecrets::open(&t.path().join("credentials")).unwrap();
        secrets
            .record("h:5000/a/app:v1", Some(&basic("alice")))
            .unwrap();
        let config = secrets.config_for("h:5000/a/app:v1").expect("kept");
        let text = std::fs::read_to_string(&config).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let auth = json["auths"]["h:5000"]["auth"].as_str().unwrap();
        let pair = base64::engine::general_purpose::STANDARD
            .decode(auth)
            .unwrap();
        assert_eq!(pair, b"alice:alice-secret");
        let mode = std::fs::metadata(&config).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // Another tag, another repository: nothing.
        assert_eq!(secrets.config_for("h:5000/a/app:v2"), None);
        assert_eq!(secrets.config_for("h:5000/b/app:v1"), None);
        // The digest the top layer is mounted by gets it by alias.
        let pinned = format!("h:5000/a/app@sha256:{}", "ab".repeat(32));
        secrets.alias("h:5000/a/app:v1", &pinned).unwrap();
        assert_eq!(secrets.config_for(&pinned), Some(config.clone()));
        // Bob's secret is another file; the same secret is the same file.
        secrets
            .record("h:5000/a/app:v2", Some(&basic("bob")))
            .unwrap();
        let bob = secrets.config_for("h:5000/a/app:v2").unwrap();
        assert_ne!(bob, config);
        secrets
            .record("h:5000/a/other:v1", Some(&basic("alice")))
            .unwrap();
        assert_eq!(secrets.config_for("h:5000/a/other:v1"), Some(config));
        // Its user names the secret's tenant.
        assert_eq!(
            secrets.user_for("h:5000/a/app:v1").as_deref(),
            Some("alice")
        );
        assert_eq!(secrets.user_for(&pinned).as_deref(), Some("alice"));
        assert_eq!(secrets.user_for("h:5000/a/app:v2").as_deref(), Some("bob"));
        // A pull without a secret forgets the last one.
        secrets.record("h:5000/a/app:v1", None).unwrap();
        assert_eq!(secrets.config_for("h:5000/a/app:v1"), None);
        assert_eq!(secrets.user_for("h:5000/a/app:v1"), None);
    }

    #[test]
    fn an_auth_that_is_not_user_and_password_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let secrets = PullSecrets::open(t.path()).unwrap();
        let bad = PodAuth::Encoded("bm8tY29sb24=".into()); // "no-colon"
        assert!(secrets.record("h:5000/app:v1", Some(&bad)).is_err());
        assert_eq!(secrets.config_for("h:5000/app:v1"), None);
    }
}
