//! `WWW-Authenticate` challenges and where a bearer token may be fetched.

use std::collections::HashMap;

use reqwest::Url;

use super::transport::ip_is_loopback;

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

/// Token realms must be https. The one exception: a plain-HTTP loopback
/// registry may name an http realm on loopback (an IP literal, `localhost`
/// or the registry's own host), since nothing then crosses a network in
/// clear. Checked before any request, with or without credentials.
pub(crate) fn check_realm(realm: &Url, registry: &Url, plain_loopback: bool) -> Result<(), String> {
    match realm.scheme() {
        "https" => Ok(()),
        "http" if plain_loopback && realm_on_loopback(realm, registry) => Ok(()),
        "http" => Err(format!(
            "token realm {realm} is plain http; refused for registry {registry} (credentials and \
             tokens go to an https realm only, or to an http realm on loopback when the \
             registry itself is a plain-HTTP loopback registry)"
        )),
        other => Err(format!("token realm {realm}: unsupported scheme {other:?}")),
    }
}

fn realm_on_loopback(realm: &Url, registry: &Url) -> bool {
    let Some(host) = realm.host_str() else {
        return false;
    };
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    match ip_is_loopback(bare) {
        Some(loopback) => loopback,
        // The registry's own name was resolved and pinned to loopback.
        None => host.eq_ignore_ascii_case("localhost") || Some(host) == registry.host_str(),
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

    fn url(s: &str) -> Url {
        Url::parse(s).expect("url")
    }

    #[test]
    fn realm_policy() {
        let tls = url("https://reg.example.com/");
        let plain = url("http://127.0.0.1:5000/");
        let named = url("http://myreg:5000/");
        // https: always.
        assert!(check_realm(&url("https://auth.example.com/token"), &tls, false).is_ok());
        assert!(check_realm(&url("https://auth.example.com/token"), &plain, true).is_ok());
        // http realm for a TLS registry: refused, even on loopback.
        let err = check_realm(&url("http://auth.example.com/token"), &tls, false)
            .expect_err("http realm, TLS registry");
        assert!(err.contains("plain http"), "{err}");
        assert!(check_realm(&url("http://127.0.0.1:8080/token"), &tls, false).is_err());
        // http realm for a plain-HTTP loopback registry: only on loopback.
        assert!(check_realm(&url("http://127.0.0.1:5000/token"), &plain, true).is_ok());
        assert!(check_realm(&url("http://[::1]:9/token"), &plain, true).is_ok());
        assert!(check_realm(&url("http://localhost:9/token"), &plain, true).is_ok());
        assert!(check_realm(&url("http://myreg:9/token"), &named, true).is_ok());
        assert!(check_realm(&url("http://auth.example.com/token"), &plain, true).is_err());
        assert!(check_realm(&url("http://127.example.com/token"), &plain, true).is_err());
        // A plain-HTTP registry that is not loopback (--insecure-registry).
        let insecure = url("http://10.0.0.5:5000/");
        assert!(check_realm(&url("http://10.0.0.5:5000/token"), &insecure, false).is_err());
        assert!(check_realm(&url("ftp://127.0.0.1/token"), &plain, true).is_err());
    }
}
