//! Registry credentials (docker config, environment) and
//! `WWW-Authenticate` challenge parsing.

use std::collections::HashMap;
use std::io;
use std::path::PathBuf;

use base64::Engine as _;
use serde::Deserialize;

use crate::error::OciError;
use crate::source::SourceOptions;

/// Environment variable overriding registry credentials (`user:password`).
pub const AUTH_ENV: &str = "LAMINA_REGISTRY_AUTH";

#[derive(Clone)]
pub(crate) struct Credentials {
    pub(crate) username: String,
    pub(crate) password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

/// A parsed `WWW-Authenticate` challenge.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Challenge {
    pub(crate) scheme: String,
    pub(crate) params: HashMap<String, String>,
}

/// Parse `Scheme k="v", k2=v2` (quoted values may contain commas).
pub(crate) fn parse_challenge(header: &str) -> Option<Challenge> {
    let header = header.trim();
    let (scheme, rest) = match header.split_once(char::is_whitespace) {
        Some((s, r)) => (s, r),
        None => (header, ""),
    };
    if scheme.is_empty() {
        return None;
    }
    let mut params = HashMap::new();
    let mut chars = rest.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace() || *c == ',') {
            chars.next();
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c == ',' {
                break;
            }
            key.push(c);
            chars.next();
        }
        let key = key.trim().to_ascii_lowercase();
        if key.is_empty() {
            break;
        }
        if chars.next() != Some('=') {
            return None;
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            let mut closed = false;
            while let Some(c) = chars.next() {
                match c {
                    '\\' => {
                        if let Some(n) = chars.next() {
                            value.push(n);
                        }
                    }
                    '"' => {
                        closed = true;
                        break;
                    }
                    other => value.push(other),
                }
            }
            if !closed {
                return None;
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c == ',' {
                    break;
                }
                value.push(c);
                chars.next();
            }
            value = value.trim().to_string();
        }
        params.insert(key, value);
    }
    Some(Challenge {
        scheme: scheme.to_string(),
        params,
    })
}

#[derive(Debug, Default, Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: HashMap<String, DockerAuth>,
}

#[derive(Debug, Default, Deserialize)]
struct DockerAuth {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

fn docker_config_path(opts: &SourceOptions) -> Option<PathBuf> {
    if let Some(p) = &opts.docker_config {
        return Some(p.clone());
    }
    if let Some(d) = std::env::var_os("DOCKER_CONFIG") {
        return Some(PathBuf::from(d).join("config.json"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".docker").join("config.json"))
}

/// The registry part of a docker config `auths` key (`https://h/v1/` -> `h`).
fn auth_key_host(key: &str) -> &str {
    let k = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    k.split('/').next().unwrap_or(k)
}

fn same_registry(a: &str, b: &str) -> bool {
    let norm = |h: &str| -> String {
        match h {
            "docker.io" | "index.docker.io" | "registry-1.docker.io" => "docker.io".to_string(),
            other => other.to_ascii_lowercase(),
        }
    };
    norm(a) == norm(b)
}

pub(crate) fn load_credentials(
    host: &str,
    opts: &SourceOptions,
) -> Result<Option<Credentials>, OciError> {
    if let Ok(v) = std::env::var(AUTH_ENV) {
        let (u, p) = v.split_once(':').ok_or_else(|| OciError::Auth {
            host: host.to_string(),
            message: format!("{AUTH_ENV} must be user:password"),
        })?;
        return Ok(Some(Credentials {
            username: u.to_string(),
            password: p.to_string(),
        }));
    }
    let Some(path) = docker_config_path(opts) else {
        return Ok(None);
    };
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound && opts.docker_config.is_none() => {
            return Ok(None)
        }
        Err(e) => return Err(OciError::io("read docker config", path, e)),
    };
    let config: DockerConfig = serde_json::from_slice(&bytes)
        .map_err(|e| OciError::json(format!("docker config {}", path.display()), e))?;
    let Some(entry) = config
        .auths
        .iter()
        .find(|(k, _)| same_registry(auth_key_host(k), host))
        .map(|(_, v)| v)
    else {
        return Ok(None);
    };
    if let Some(auth) = entry.auth.as_deref().filter(|a| !a.is_empty()) {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|e| OciError::Auth {
                host: host.to_string(),
                message: format!("{}: auths entry is not valid base64: {e}", path.display()),
            })?;
        let text = String::from_utf8(decoded).map_err(|_| OciError::Auth {
            host: host.to_string(),
            message: format!("{}: auths entry is not UTF-8", path.display()),
        })?;
        let (u, p) = text.split_once(':').ok_or_else(|| OciError::Auth {
            host: host.to_string(),
            message: format!("{}: auths entry is not user:password", path.display()),
        })?;
        return Ok(Some(Credentials {
            username: u.to_string(),
            password: p.to_string(),
        }));
    }
    match (&entry.username, &entry.password) {
        (Some(u), Some(p)) => Ok(Some(Credentials {
            username: u.clone(),
            password: p.clone(),
        })),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bearer_challenge() {
        let c = parse_challenge(
            r#"Bearer realm="https://auth.example.com/token",service="registry.example.com",scope="repository:a/b:pull,push""#,
        )
        .expect("parse");
        assert_eq!(c.scheme, "Bearer");
        assert_eq!(c.params["realm"], "https://auth.example.com/token");
        assert_eq!(c.params["service"], "registry.example.com");
        assert_eq!(c.params["scope"], "repository:a/b:pull,push");
        let c = parse_challenge(r#"Basic realm="Registry Realm""#).expect("basic");
        assert_eq!(c.scheme, "Basic");
        assert_eq!(c.params["realm"], "Registry Realm");
        assert!(parse_challenge(r#"Bearer realm="unterminated"#).is_none());
    }

    #[test]
    fn auth_keys() {
        assert_eq!(
            auth_key_host("https://index.docker.io/v1/"),
            "index.docker.io"
        );
        assert!(same_registry("index.docker.io", "docker.io"));
    }

    #[test]
    fn credentials_from_docker_config() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("config.json");
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cr:et");
        std::fs::write(
            &path,
            format!(
                r#"{{"auths":{{"https://reg.example.com/v1/":{{"auth":"{auth}"}},"other.io":{{"username":"bob","password":"pw"}}}}}}"#
            ),
        )
        .expect("write");
        let opts = SourceOptions {
            docker_config: Some(path),
            ..SourceOptions::default()
        };
        if std::env::var_os(AUTH_ENV).is_some() {
            return;
        }
        let c = load_credentials("reg.example.com", &opts)
            .expect("load")
            .expect("some");
        assert_eq!(
            (c.username.as_str(), c.password.as_str()),
            ("alice", "s3cr:et")
        );
        let c = load_credentials("other.io", &opts)
            .expect("load")
            .expect("some");
        assert_eq!(c.username, "bob");
        assert!(load_credentials("none.io", &opts).expect("load").is_none());
    }
}
