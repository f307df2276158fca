//! Where registry credentials come from, one host at a time:
//! `LAMINA_REGISTRY_AUTH=HOST[:PORT]=USER:PASSWORD` when it names the host,
//! else the docker config: the host's `credHelpers` helper or the
//! `credsStore` helper, then the inline `auths` entry.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use serde::Deserialize;

use super::helper::{helper_get, HELPER_TIMEOUT};
use super::transport::host_name;
use crate::error::OciError;
use crate::source::SourceOptions;

/// Environment variable with credentials for one registry host:
/// `HOST[:PORT]=USER:PASSWORD`.
pub const AUTH_ENV: &str = "LAMINA_REGISTRY_AUTH";

/// Credentials for one registry.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Credentials {
    /// User name and password, for Basic auth to the registry or its token
    /// realm.
    Basic { username: String, password: String },
    /// A refresh token (`docker login` through an identity provider),
    /// exchanged for a bearer token at the token realm.
    IdentityToken(String),
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::Basic { username, .. } => f
                .debug_struct("Basic")
                .field("username", username)
                .finish_non_exhaustive(),
            Credentials::IdentityToken(_) => f.write_str("IdentityToken(..)"),
        }
    }
}

/// What the lookup reads from the process, captured once (tests build
/// their own instead of changing the environment).
pub(crate) struct CredEnv {
    /// `LAMINA_REGISTRY_AUTH`, when set and not empty.
    pub(crate) auth: Option<OsString>,
    /// The docker config file; `true` when named explicitly (then it must
    /// exist).
    pub(crate) config: Option<(PathBuf, bool)>,
    /// `PATH`, searched for credential helpers.
    pub(crate) path: Option<OsString>,
    /// Deadline for one credential helper.
    pub(crate) helper_timeout: Duration,
}

/// What tells this process's registry credentials from another's, with
/// no secret in it: the docker config file it reads (credential helpers
/// are named there), a digest of `LAMINA_REGISTRY_AUTH`, and the
/// effective uid. Two mounts with the same identity present the same
/// credentials to every registry, so the registry grants both the same.
pub fn credentials_identity(opts: &SourceOptions) -> String {
    identity_of(&CredEnv::from_process(opts))
}

fn identity_of(env: &CredEnv) -> String {
    let auth = env.auth.as_ref().map(|a| {
        let digest = crate::sha256(a.as_encoded_bytes());
        format!("sha256:{}", hex::encode(digest))
    });
    let config = env.config.as_ref().map(|(p, _)| p.display().to_string());
    format!(
        "uid={} config={} {AUTH_ENV}={}",
        rustix::process::geteuid().as_raw(),
        config.as_deref().unwrap_or("-"),
        auth.as_deref().unwrap_or("-")
    )
}

impl CredEnv {
    pub(crate) fn from_process(opts: &SourceOptions) -> CredEnv {
        let config = match &opts.docker_config {
            Some(p) => Some((p.clone(), true)),
            None => std::env::var_os("DOCKER_CONFIG")
                .map(|d| PathBuf::from(d).join("config.json"))
                .or_else(|| {
                    std::env::var_os("HOME")
                        .map(|h| PathBuf::from(h).join(".docker").join("config.json"))
                })
                .map(|p| (p, false)),
        };
        CredEnv {
            auth: env_auth(opts, std::env::var_os(AUTH_ENV)),
            config,
            path: std::env::var_os("PATH"),
            helper_timeout: HELPER_TIMEOUT,
        }
    }
}

/// `LAMINA_REGISTRY_AUTH`'s value, unless a config file is named for
/// this source: then that file holds its only credentials (skopeo's
/// `--authfile`), and a pod's pull secret, say, is never overridden by
/// the node's variable.
fn env_auth(opts: &SourceOptions, value: Option<OsString>) -> Option<OsString> {
    match opts.docker_config {
        Some(_) => None,
        None => value.filter(|v| !v.is_empty()),
    }
}

/// The credentials for `host` (`host[:port]`), or `None` for anonymous
/// access.
pub(crate) fn load_credentials(host: &str, env: &CredEnv) -> Result<Option<Credentials>, OciError> {
    let auth_err = |message: String| OciError::Auth {
        host: host.to_string(),
        message,
    };
    if let Some(value) = &env.auth {
        let value = value.to_str().ok_or_else(|| auth_err(env_form()))?;
        let (for_host, creds) = parse_env_auth(value).map_err(auth_err)?;
        if same_registry(for_host, host) {
            return Ok(Some(creds));
        }
    }
    match &env.config {
        Some((path, explicit)) => from_docker_config(host, path, *explicit, env),
        None => Ok(None),
    }
}

fn env_form() -> String {
    format!(
        "{AUTH_ENV} must be HOST[:PORT]=USER:PASSWORD, naming the one registry the credentials \
         are for (the bare USER:PASSWORD form is refused: it sent them to every registry)"
    )
}

/// `HOST[:PORT]=USER:PASSWORD`. Errors never quote the value (it holds a
/// password).
fn parse_env_auth(value: &str) -> Result<(&str, Credentials), String> {
    let (host, creds) = value.split_once('=').ok_or_else(env_form)?;
    let (username, password) = creds.split_once(':').ok_or_else(env_form)?;
    if !valid_host(host) || username.is_empty() {
        return Err(env_form());
    }
    let creds = Credentials::Basic {
        username: username.to_string(),
        password: password.to_string(),
    };
    Ok((host, creds))
}

/// A registry host as in image references: a name or `[v6]`, an optional
/// numeric port.
fn valid_host(host: &str) -> bool {
    let name = host_name(host);
    let port = host.get(name.len()..).unwrap_or("");
    let port_ok = port.is_empty()
        || port
            .strip_prefix(':')
            .is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    let name_ok = match name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
        }
    };
    port_ok && name_ok
}

#[derive(Default, Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, DockerAuth>,
    #[serde(default, rename = "credsStore")]
    creds_store: Option<String>,
    #[serde(default, rename = "credHelpers")]
    cred_helpers: BTreeMap<String, String>,
}

#[derive(Default, Deserialize)]
struct DockerAuth {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    identitytoken: Option<String>,
}

impl DockerConfig {
    /// The helper that holds `host`'s credentials and the key naming it:
    /// the host's own `credHelpers` entry, else the default `credsStore`.
    fn helper_for(&self, host: &str) -> Option<(&str, &'static str)> {
        let own = self
            .cred_helpers
            .iter()
            .find(|(k, _)| same_registry(auth_key_host(k), host))
            .map(|(_, v)| (v.as_str(), "credHelpers"));
        own.or_else(|| {
            let store = self.creds_store.as_deref().filter(|s| !s.is_empty());
            store.map(|s| (s, "credsStore"))
        })
    }

    fn auth_entry(&self, host: &str) -> Option<&DockerAuth> {
        self.auths
            .iter()
            .find(|(k, _)| same_registry(auth_key_host(k), host))
            .map(|(_, v)| v)
    }
}

fn from_docker_config(
    host: &str,
    path: &Path,
    explicit: bool,
    env: &CredEnv,
) -> Result<Option<Credentials>, OciError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound && !explicit => return Ok(None),
        Err(e) => return Err(OciError::io("read docker config", path, e)),
    };
    let config: DockerConfig = serde_json::from_slice(&bytes)
        .map_err(|e| OciError::json(format!("docker config {}", path.display()), e))?;
    if let Some((name, key)) = config.helper_for(host) {
        let url = helper_server_url(host);
        let found =
            helper_get(name, url, env.path.as_deref(), env.helper_timeout).map_err(|e| {
                OciError::Auth {
                    host: host.to_string(),
                    message: format!(
                        "credential helper {name:?} ({key} in {}): {e}",
                        path.display()
                    ),
                }
            })?;
        if found.is_some() {
            return Ok(found);
        }
    }
    match config.auth_entry(host) {
        Some(entry) => inline_credentials(entry, host, path),
        None => Ok(None),
    }
}

/// The server URL a helper knows a host by: what `docker login` stored.
fn helper_server_url(host: &str) -> &str {
    if same_registry(host, "docker.io") {
        "https://index.docker.io/v1/"
    } else {
        host
    }
}

fn inline_credentials(
    entry: &DockerAuth,
    host: &str,
    path: &Path,
) -> Result<Option<Credentials>, OciError> {
    let bad = |what: &str| OciError::Auth {
        host: host.to_string(),
        message: format!("{}: auths entry {what}", path.display()),
    };
    if let Some(token) = entry.identitytoken.as_deref().filter(|t| !t.is_empty()) {
        return Ok(Some(Credentials::IdentityToken(token.to_string())));
    }
    if let Some(auth) = entry.auth.as_deref().filter(|a| !a.is_empty()) {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|_| bad("is not valid base64"))?;
        let text = String::from_utf8(decoded).map_err(|_| bad("is not UTF-8"))?;
        let (u, p) = text
            .split_once(':')
            .ok_or_else(|| bad("is not user:password"))?;
        return Ok(Some(Credentials::Basic {
            username: u.to_string(),
            password: p.to_string(),
        }));
    }
    match (&entry.username, &entry.password) {
        (Some(u), Some(p)) => Ok(Some(Credentials::Basic {
            username: u.clone(),
            password: p.clone(),
        })),
        _ => Ok(None),
    }
}

/// The registry part of a docker config key (`https://h:5000/v1/` -> `h:5000`).
fn auth_key_host(key: &str) -> &str {
    let k = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    k.split('/').next().unwrap_or(k)
}

/// Same registry: case-insensitive, the Docker Hub aliases as one.
fn same_registry(a: &str, b: &str) -> bool {
    let norm = |h: &str| -> String {
        match h.to_ascii_lowercase().as_str() {
            "docker.io" | "index.docker.io" | "registry-1.docker.io" => "docker.io".to_string(),
            other => other.to_string(),
        }
    };
    norm(a) == norm(b)
}

#[cfg(test)]
mod tests;
