//! Registry host configuration the containerd way: a directory of
//! `HOST[:PORT]/hosts.toml` files (containerd's `config_path`, usually
//! `/etc/containerd/certs.d`) naming mirrors, CAs, client certificates and
//! headers per registry host. The semantics follow containerd's
//! `docs/hosts.md`; `docs/registry.md` describes what lamina supports.
//!
//! [`HostsConfig`] is the directory; [`HostsConfig::hosts`] gives, for one
//! registry host, the [`HostEntry`]s to try in order, the upstream last.
//! Nothing here touches the network.

use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::Url;
use toml::{Table, Value};

/// Where containerd keeps host configuration, and lamina's default.
pub const DEFAULT_HOSTS_DIR: &str = "/etc/containerd/certs.d";

/// The fallback namespace consulted when no directory names the host.
const DEFAULT_NAMESPACE: &str = "_default";

/// A hosts file larger than this is not a hosts file.
const MAX_HOSTS_FILE: u64 = 1 << 20;

/// What can go wrong reading a hosts directory. Messages name the file and,
/// for a bad value, the key (as a dotted TOML path).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HostsError {
    /// The file could not be read.
    #[error("{file}: {source}")]
    Read {
        /// The file.
        file: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("{file}: invalid TOML: {message}")]
    Syntax {
        /// The file.
        file: PathBuf,
        /// The parser's complaint.
        message: String,
    },
    /// A key has a value of the wrong type or an unusable value.
    #[error("{file}: key {key}: {message}")]
    Key {
        /// The file.
        file: PathBuf,
        /// Dotted path of the key, e.g. `host."https://mirror.example".ca`.
        key: String,
        /// What is wrong with it.
        message: String,
    },
}

/// The operations a host may be used for (`capabilities`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Blob downloads (and manifests by digest).
    pub pull: bool,
    /// Turning a tag into a manifest: a trusted operation.
    pub resolve: bool,
    /// Uploads.
    pub push: bool,
}

impl Capabilities {
    /// What a host may do when `capabilities` is not given.
    pub const ALL: Capabilities = Capabilities {
        pull: true,
        resolve: true,
        push: true,
    };
}

/// URL scheme of a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// Plain HTTP.
    Http,
    /// TLS.
    Https,
}

/// A client certificate: `cert` holds the key too when `key` is `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCert {
    /// PEM certificate (chain).
    pub cert: PathBuf,
    /// PEM private key, when it is a file of its own.
    pub key: Option<PathBuf>,
}

/// One host to try for a registry: a mirror or the upstream.
#[derive(Debug, Clone, PartialEq)]
pub struct HostEntry {
    /// `None` for the upstream when no `server` names it: reached as any
    /// registry is (plain HTTP on loopback, `--insecure-registry`, ...).
    pub scheme: Option<Scheme>,
    /// `host[:port]`.
    pub host: String,
    /// API root, `/v2` unless `override_path` says otherwise; no trailing `/`.
    pub path: String,
    /// What the host may be used for.
    pub capabilities: Capabilities,
    /// Extra trusted CA files (PEM).
    pub ca: Vec<PathBuf>,
    /// Client certificates, in the order given.
    pub client: Vec<ClientCert>,
    /// Accept any server certificate.
    pub skip_verify: bool,
    /// Headers sent with every request, in file order.
    pub headers: Vec<(String, String)>,
    /// Bound on establishing a connection.
    pub dial_timeout: Option<Duration>,
    /// lamina's own key `bulk_only = true` (containerd ignores it): the host
    /// serves bulk reads only (whole blobs, boot pages, reads ahead and
    /// prefetches), never the ranges a reader waits for: a P2P mirror that
    /// moves pieces far larger than a miss (docs/dragonfly.md).
    pub bulk_only: bool,
    /// The upstream (`server`, or the registry host itself): tried last.
    pub upstream: bool,
}

impl HostEntry {
    /// The entry used when nothing is configured: the registry itself, with
    /// every capability.
    pub fn upstream(host: &str) -> HostEntry {
        HostEntry {
            scheme: None,
            host: host.to_string(),
            path: "/v2".to_string(),
            capabilities: Capabilities::ALL,
            ca: Vec::new(),
            client: Vec::new(),
            skip_verify: false,
            headers: Vec::new(),
            dial_timeout: None,
            bulk_only: false,
            upstream: true,
        }
    }
}

/// A hosts directory, or none. Cheap to clone; files are read when a
/// registry host is looked up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostsConfig {
    dir: Option<PathBuf>,
}

impl HostsConfig {
    /// The configuration in `dir` (which need not exist).
    pub fn new(dir: impl Into<PathBuf>) -> HostsConfig {
        HostsConfig {
            dir: Some(dir.into()),
        }
    }

    /// No configuration: every registry is its own only host.
    pub fn none() -> HostsConfig {
        HostsConfig::default()
    }

    /// The directory, if any.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The hosts to try for registry `host` (`host[:port]`), in order: the
    /// `[host]` tables of its `hosts.toml` as written, then the upstream.
    /// Without a configuration for it, the upstream alone. A directory
    /// without `hosts.toml` contributes its docker-style certificate files
    /// (`*.crt` CAs, `NAME.cert` + `NAME.key` client pairs) to the upstream.
    pub fn hosts(&self, host: &str) -> Result<Vec<HostEntry>, HostsError> {
        let Some(dir) = self.host_dir(host)? else {
            return Ok(vec![HostEntry::upstream(host)]);
        };
        let file = dir.join("hosts.toml");
        match read_small(&file)? {
            Some(text) if !text.trim().is_empty() => parse_hosts_file(&file, &text, host),
            _ => {
                let mut entry = HostEntry::upstream(host);
                docker_cert_files(&dir, &mut entry)?;
                Ok(vec![entry])
            }
        }
    }

    /// The first directory of [`namespace_dirs`] that exists, as containerd
    /// picks it: a host's own directory wins over `_default` even when it
    /// holds no `hosts.toml`.
    pub fn host_dir(&self, host: &str) -> Result<Option<PathBuf>, HostsError> {
        let Some(root) = &self.dir else {
            return Ok(None);
        };
        for name in namespace_dirs(host) {
            let dir = root.join(&name);
            match std::fs::metadata(&dir) {
                Ok(m) if m.is_dir() => return Ok(Some(dir)),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(HostsError::Read { file: dir, source }),
            }
        }
        Ok(None)
    }
}

/// The directory names consulted for `host`, in order: `HOST_PORT_` (a port
/// written the way containerd writes it), `HOST:PORT`, `_default`.
pub fn namespace_dirs(host: &str) -> Vec<String> {
    let mut names = Vec::new();
    if let Some(i) = host.rfind(':').filter(|&i| i > 0 && !host.ends_with(']')) {
        names.push(format!("{}_{}_", &host[..i], &host[i + 1..]));
    }
    names.push(host.to_string());
    names.push(DEFAULT_NAMESPACE.to_string());
    names
}

/// The file's text, `None` when it does not exist.
fn read_small(file: &Path) -> Result<Option<String>, HostsError> {
    use std::io::Read;
    let read_err = |source| HostsError::Read {
        file: file.to_path_buf(),
        source,
    };
    let f = match std::fs::File::open(file) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(read_err(e)),
    };
    let mut text = String::new();
    f.take(MAX_HOSTS_FILE + 1)
        .read_to_string(&mut text)
        .map_err(read_err)?;
    if text.len() as u64 > MAX_HOSTS_FILE {
        return Err(read_err(std::io::Error::other(format!(
            "larger than {MAX_HOSTS_FILE} bytes"
        ))));
    }
    Ok(Some(text))
}

/// Docker's certificate files in a host directory: every `*.crt` is a CA,
/// every `NAME.cert` with a `NAME.key` beside it a client pair.
fn docker_cert_files(dir: &Path, entry: &mut HostEntry) -> Result<(), HostsError> {
    let entries = std::fs::read_dir(dir).map_err(|source| HostsError::Read {
        file: dir.to_path_buf(),
        source,
    })?;
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for p in paths {
        match p.extension().and_then(|e| e.to_str()) {
            Some("crt") => entry.ca.push(p),
            Some("cert") if p.with_extension("key").is_file() => entry.client.push(ClientCert {
                key: Some(p.with_extension("key")),
                cert: p,
            }),
            _ => {}
        }
    }
    Ok(())
}

/// Parses a `hosts.toml` (`file` names it in errors and anchors relative
/// paths) for registry `namespace`. Unknown keys are ignored, as containerd
/// does.
pub fn parse_hosts_file(
    file: &Path,
    text: &str,
    namespace: &str,
) -> Result<Vec<HostEntry>, HostsError> {
    let table: Table = text
        .parse()
        .map_err(|e: toml::de::Error| HostsError::Syntax {
            file: file.to_path_buf(),
            message: e.message().to_string(),
        })?;
    let p = Parser {
        file,
        base: file.parent().unwrap_or(Path::new(".")),
    };
    let mut entries = Vec::new();
    if let Some(hosts) = table.get("host") {
        let hosts = p.table(hosts, "host")?;
        // With `preserve_order` the table keeps the file's order.
        for (url, value) in hosts {
            let key = format!("host.{}", quoted(url));
            let fields = p.table(value, &key)?;
            entries.push(p.entry(Some(url), fields, &key, false)?);
        }
    }
    let server = match table.get("server") {
        Some(v) => Some(p.string(v, "server")?),
        None => None,
    };
    let mut upstream = p.entry(server, &table, "", true)?;
    if server.is_none() {
        upstream.host = namespace.to_string();
    }
    entries.push(upstream);
    Ok(entries)
}

/// A TOML key as written in a dotted path.
fn quoted(key: &str) -> String {
    format!("{key:?}")
}

/// Typed access to a hosts file's values, with errors naming file and key.
struct Parser<'a> {
    file: &'a Path,
    base: &'a Path,
}

impl Parser<'_> {
    fn err(&self, key: &str, message: impl Into<String>) -> HostsError {
        HostsError::Key {
            file: self.file.to_path_buf(),
            key: key.to_string(),
            message: message.into(),
        }
    }

    fn table<'v>(&self, v: &'v Value, key: &str) -> Result<&'v Table, HostsError> {
        v.as_table()
            .ok_or_else(|| self.err(key, format!("expected a table, found {}", v.type_str())))
    }

    fn string<'v>(&self, v: &'v Value, key: &str) -> Result<&'v str, HostsError> {
        v.as_str()
            .ok_or_else(|| self.err(key, format!("expected a string, found {}", v.type_str())))
    }

    fn bool(&self, t: &Table, key: &str, path: &str) -> Result<bool, HostsError> {
        match t.get(key) {
            None => Ok(false),
            Some(v) => v.as_bool().ok_or_else(|| {
                self.err(
                    &join(path, key),
                    format!("expected true or false, found {}", v.type_str()),
                )
            }),
        }
    }

    /// A string or an array of strings.
    fn strings(&self, v: &Value, key: &str) -> Result<Vec<String>, HostsError> {
        match v {
            Value::String(s) => Ok(vec![s.clone()]),
            Value::Array(items) => items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    self.string(item, &format!("{key}[{i}]"))
                        .map(str::to_string)
                })
                .collect(),
            other => Err(self.err(
                key,
                format!(
                    "expected a string or an array of strings, found {}",
                    other.type_str()
                ),
            )),
        }
    }

    /// Relative paths are relative to the hosts file's directory.
    fn path(&self, p: &str) -> PathBuf {
        self.base.join(p)
    }

    /// One host: the `[host."URL"]` table, or the top level for `server`.
    fn entry(
        &self,
        url: Option<&str>,
        t: &Table,
        path: &str,
        upstream: bool,
    ) -> Result<HostEntry, HostsError> {
        let override_path = self.bool(t, "override_path", path)?;
        let mut entry = HostEntry::upstream("");
        entry.upstream = upstream;
        if let Some(url) = url {
            let key = if upstream { "server" } else { path };
            (entry.scheme, entry.host, entry.path) = self.url(url, override_path, key)?;
        }
        if let Some(v) = t.get("capabilities") {
            entry.capabilities = self.capabilities(v, &join(path, "capabilities"))?;
        }
        if let Some(v) = t.get("ca") {
            let key = join(path, "ca");
            entry.ca = self
                .strings(v, &key)?
                .iter()
                .map(|p| self.path(p))
                .collect();
        }
        if let Some(v) = t.get("client") {
            entry.client = self.client(v, &join(path, "client"))?;
        }
        entry.skip_verify = self.bool(t, "skip_verify", path)?;
        entry.bulk_only = self.bool(t, "bulk_only", path)?;
        if let Some(v) = t.get("header") {
            entry.headers = self.headers(v, &join(path, "header"))?;
        }
        if let Some(v) = t.get("dial_timeout") {
            let key = join(path, "dial_timeout");
            let s = self.string(v, &key)?;
            let d = parse_duration(s).ok_or_else(|| {
                self.err(
                    &key,
                    format!("{s:?} is not a duration such as \"1s\" or \"500ms\""),
                )
            })?;
            entry.dial_timeout = Some(d);
        }
        Ok(entry)
    }

    /// `[scheme://]host[:port][/path]`: https when no scheme is given; the
    /// path gets `/v2` appended unless it ends so or `override_path` is set.
    fn url(
        &self,
        raw: &str,
        override_path: bool,
        key: &str,
    ) -> Result<(Option<Scheme>, String, String), HostsError> {
        let with_scheme = if raw.contains("://") {
            raw.to_string()
        } else {
            format!("https://{raw}")
        };
        let url = Url::parse(&with_scheme).map_err(|e| self.err(key, format!("{raw:?}: {e}")))?;
        let scheme = match url.scheme() {
            "http" => Scheme::Http,
            "https" => Scheme::Https,
            other => return Err(self.err(key, format!("{raw:?}: unsupported scheme {other:?}"))),
        };
        let name = url
            .host_str()
            .ok_or_else(|| self.err(key, format!("{raw:?}: no host")))?;
        let host = match url.port() {
            Some(port) => format!("{name}:{port}"),
            None => name.to_string(),
        };
        Ok((Some(scheme), host, api_path(url.path(), override_path)))
    }

    fn capabilities(&self, v: &Value, key: &str) -> Result<Capabilities, HostsError> {
        let mut caps = Capabilities::default();
        for name in self.strings(v, key)? {
            match name.to_ascii_lowercase().as_str() {
                "pull" => caps.pull = true,
                "resolve" => caps.resolve = true,
                "push" => caps.push = true,
                // Known to containerd; lamina never asks for referrers.
                "referrers" => {}
                _ => {
                    return Err(self.err(
                        key,
                        format!("unknown capability {name:?} (pull, resolve, push)"),
                    ))
                }
            }
        }
        Ok(caps)
    }

    /// A path, an array of paths, or an array of `[cert, key]` pairs (an
    /// empty key: the key is in the certificate file).
    fn client(&self, v: &Value, key: &str) -> Result<Vec<ClientCert>, HostsError> {
        let single = |p: &str| ClientCert {
            cert: self.path(p),
            key: None,
        };
        let items = match v {
            Value::String(s) => return Ok(vec![single(s)]),
            Value::Array(items) => items,
            other => {
                return Err(self.err(
                    key,
                    format!("expected a path or an array, found {}", other.type_str()),
                ))
            }
        };
        let mut certs = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let item_key = format!("{key}[{i}]");
            match item {
                Value::String(s) => certs.push(single(s)),
                Value::Array(pair) => {
                    let pair = self.strings(&Value::Array(pair.clone()), &item_key)?;
                    let [cert, k] = pair.as_slice() else {
                        return Err(self.err(&item_key, "expected a [cert, key] pair"));
                    };
                    certs.push(ClientCert {
                        cert: self.path(cert),
                        key: (!k.is_empty()).then(|| self.path(k)),
                    });
                }
                other => {
                    return Err(self.err(
                        &item_key,
                        format!("expected a path or a pair, found {}", other.type_str()),
                    ))
                }
            }
        }
        Ok(certs)
    }

    /// A table of header names to a string or an array of strings.
    fn headers(&self, v: &Value, key: &str) -> Result<Vec<(String, String)>, HostsError> {
        let mut headers = Vec::new();
        for (name, value) in self.table(v, key)? {
            let name_key = format!("{key}.{}", quoted(name));
            if reqwest::header::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(self.err(&name_key, "not a valid HTTP header name"));
            }
            for value in self.strings(value, &name_key)? {
                if reqwest::header::HeaderValue::from_str(&value).is_err() {
                    return Err(
                        self.err(&name_key, format!("{value:?} is not a valid header value"))
                    );
                }
                headers.push((name.clone(), value));
            }
        }
        Ok(headers)
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// The API root for a URL path: cleaned, without a trailing `/`, and with
/// `/v2` appended unless it already ends so or `override_path` is set.
fn api_path(raw: &str, override_path: bool) -> String {
    let parts: Vec<&str> = raw
        .split('/')
        .filter(|s| !s.is_empty() && *s != ".")
        .collect();
    let mut path = String::new();
    for part in parts {
        path.push('/');
        path.push_str(part);
    }
    if !override_path && !path.ends_with("/v2") {
        path.push_str("/v2");
    }
    path
}

/// A Go duration (`"1s"`, `"1.5s"`, `"300ms"`, `"1m30s"`), as containerd's
/// `dial_timeout` takes; `None` if it is not one or is negative.
pub fn parse_duration(s: &str) -> Option<Duration> {
    if s == "0" {
        return Some(Duration::ZERO);
    }
    let mut rest = s;
    let mut total = 0f64;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += number * seconds;
    }
    (!s.is_empty()).then(|| Duration::try_from_secs_f64(total).ok())?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str, ns: &str) -> Vec<HostEntry> {
        parse_hosts_file(Path::new("/etc/certs.d/x/hosts.toml"), text, ns).expect("parse")
    }

    fn parse_err(text: &str) -> String {
        parse_hosts_file(Path::new("/etc/certs.d/x/hosts.toml"), text, "x")
            .expect_err("must fail")
            .to_string()
    }

    #[test]
    fn hosts_in_file_order_then_server() {
        let hosts = parse(
            r#"
server = "https://registry.example:5000"

[host."https://zz-mirror.example"]
  capabilities = ["pull"]
[host."http://127.0.0.1:5001"]
  capabilities = ["pull", "resolve"]
[host."https://aa-mirror.example/us"]
"#,
            "registry.example:5000",
        );
        let names: Vec<_> = hosts
            .iter()
            .map(|h| (h.host.as_str(), h.path.as_str()))
            .collect();
        assert_eq!(
            names,
            [
                ("zz-mirror.example", "/v2"),
                ("127.0.0.1:5001", "/v2"),
                ("aa-mirror.example", "/us/v2"),
                ("registry.example:5000", "/v2"),
            ]
        );
        assert_eq!(hosts[0].scheme, Some(Scheme::Https));
        assert_eq!(hosts[1].scheme, Some(Scheme::Http));
        let pull = Capabilities {
            pull: true,
            ..Capabilities::default()
        };
        assert_eq!(hosts[0].capabilities, pull);
        assert_eq!(
            hosts[1].capabilities,
            Capabilities {
                resolve: true,
                ..pull
            }
        );
        assert_eq!(hosts[2].capabilities, Capabilities::ALL);
        assert_eq!(
            hosts.iter().map(|h| h.upstream).collect::<Vec<_>>(),
            [false, false, false, true]
        );
    }

    #[test]
    fn no_server_means_the_registry_itself_with_its_own_reach() {
        let hosts = parse(
            "[host.\"http://127.0.0.1:1\"]\ncapabilities = [\"pull\"]\n",
            "127.0.0.1:5000",
        );
        assert_eq!(hosts.len(), 2);
        assert_eq!(hosts[1], HostEntry::upstream("127.0.0.1:5000"));
    }

    #[test]
    fn server_without_scheme_is_https_and_top_level_keys_are_the_servers() {
        let hosts = parse(
            "server = \"registry.example\"\ncapabilities = [\"pull\"]\nskip_verify = true\n\
             dial_timeout = \"1.5s\"\nca = \"ca.pem\"\n",
            "x",
        );
        assert_eq!(hosts.len(), 1);
        let h = &hosts[0];
        assert_eq!(
            (h.scheme, h.host.as_str()),
            (Some(Scheme::Https), "registry.example")
        );
        assert!(h.skip_verify && h.capabilities.pull && !h.capabilities.push);
        assert_eq!(h.dial_timeout, Some(Duration::from_millis(1500)));
        assert_eq!(h.ca, [PathBuf::from("/etc/certs.d/x/ca.pem")]);
    }

    #[test]
    fn override_path_keeps_the_path_as_written() {
        let hosts = parse(
            r#"
[host."https://m.example/v2/upstream"]
  override_path = true
[host."https://n.example/api/"]
  override_path = true
[host."https://o.example/v2"]
[host."https://p.example/a/../b/"]
"#,
            "x",
        );
        let paths: Vec<_> = hosts.iter().map(|h| h.path.as_str()).collect();
        assert_eq!(paths, ["/v2/upstream", "/api", "/v2", "/b/v2", "/v2"]);
    }

    #[test]
    fn ca_client_and_headers_in_every_form() {
        let hosts = parse(
            r#"
[host."https://m.example"]
  ca = ["/abs/a.pem", "rel/b.pem"]
  client = [["c.cert", "c.key"], ["both.pem", ""], "single.pem"]
  [host."https://m.example".header]
    x-one = "1"
    x-two = ["a", "b"]
[host."https://n.example"]
  client = "/abs/client.pem"
"#,
            "x",
        );
        let m = &hosts[0];
        assert_eq!(
            m.ca,
            [
                PathBuf::from("/abs/a.pem"),
                PathBuf::from("/etc/certs.d/x/rel/b.pem")
            ]
        );
        let d = Path::new("/etc/certs.d/x");
        assert_eq!(
            m.client,
            [
                ClientCert {
                    cert: d.join("c.cert"),
                    key: Some(d.join("c.key"))
                },
                ClientCert {
                    cert: d.join("both.pem"),
                    key: None
                },
                ClientCert {
                    cert: d.join("single.pem"),
                    key: None
                },
            ]
        );
        let headers: Vec<_> = m
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(headers, [("x-one", "1"), ("x-two", "a"), ("x-two", "b")]);
        assert_eq!(hosts[1].client[0].cert, PathBuf::from("/abs/client.pem"));
    }

    #[test]
    fn unknown_keys_are_ignored() {
        let hosts = parse(
            "future = 1\n[host.\"https://m.example\"]\nsomething_new = [1, 2]\n[other]\nx = 1\n",
            "x",
        );
        assert_eq!(hosts.len(), 2);
    }

    #[test]
    fn bad_values_name_file_and_key() {
        let e = parse_err("[host.\"https://m.example\"]\ncapabilities = [\"pull\", \"fly\"]\n");
        assert!(
            e.contains("/etc/certs.d/x/hosts.toml")
                && e.contains("key host.\"https://m.example\".capabilities")
                && e.contains("\"fly\""),
            "{e}"
        );
        let e = parse_err("[host.\"https://m.example\"]\nca = 3\n");
        assert!(e.contains("host.\"https://m.example\".ca:"), "{e}");
        let e = parse_err("skip_verify = \"yes\"\n");
        assert!(e.contains("key skip_verify:"), "{e}");
        let e = parse_err("dial_timeout = \"soon\"\n");
        assert!(e.contains("key dial_timeout:"), "{e}");
        let e = parse_err("[host.\"https://m.example\"]\nclient = [[\"a\"]]\n");
        assert!(e.contains("client[0]"), "{e}");
        let e = parse_err("[host.\"ftp://m.example\"]\n");
        assert!(e.contains("unsupported scheme"), "{e}");
        let e = parse_err("[host.\"https://m.example\".header]\n\"bad header\" = \"x\"\n");
        assert!(e.contains("header.\"bad header\""), "{e}");
        let e = parse_err("server = [1]\n");
        assert!(e.contains("key server:"), "{e}");
        let e = parse_err("host = 1\n");
        assert!(e.contains("key host:"), "{e}");
        let e = parse_err("[host\n");
        assert!(e.contains("/etc/certs.d/x/hosts.toml: invalid TOML"), "{e}");
    }

    #[test]
    fn namespace_dirs_in_containerds_order() {
        assert_eq!(
            namespace_dirs("registry.example:5000"),
            [
                "registry.example_5000_",
                "registry.example:5000",
                "_default"
            ]
        );
        assert_eq!(
            namespace_dirs("registry.example"),
            ["registry.example", "_default"]
        );
        assert_eq!(
            namespace_dirs("[::1]:5000"),
            ["[::1]_5000_", "[::1]:5000", "_default"]
        );
        assert_eq!(namespace_dirs("[::1]"), ["[::1]", "_default"]);
    }

    #[test]
    fn directory_lookup_port_forms_default_and_missing() {
        let root = tempfile::tempdir().expect("tmp");
        let write = |dir: &str, text: &str| {
            let d = root.path().join(dir);
            std::fs::create_dir_all(&d).expect("mkdir");
            std::fs::write(d.join("hosts.toml"), text).expect("write");
        };
        let mirror = |url: &str| format!("[host.\"{url}\"]\n");
        write("_default", &mirror("http://127.0.0.1:1"));
        write("127.0.0.1_5000_", &mirror("http://127.0.0.1:2"));
        write("127.0.0.1:5001", &mirror("http://127.0.0.1:3"));
        let config = HostsConfig::new(root.path());
        let first = |host: &str| config.hosts(host).expect("hosts")[0].host.clone();
        assert_eq!(first("127.0.0.1:5000"), "127.0.0.1:2");
        assert_eq!(first("127.0.0.1:5001"), "127.0.0.1:3");
        assert_eq!(first("127.0.0.1:5002"), "127.0.0.1:1");
        assert_eq!(
            config.hosts("127.0.0.1:5002").expect("hosts")[1].host,
            "127.0.0.1:5002"
        );

        // The host's own directory wins even without hosts.toml: its
        // docker-style certificate files go to the upstream.
        let own = root.path().join("127.0.0.1:5003");
        std::fs::create_dir_all(&own).expect("mkdir");
        std::fs::write(own.join("ca.crt"), "").expect("write");
        std::fs::write(own.join("me.cert"), "").expect("write");
        std::fs::write(own.join("me.key"), "").expect("write");
        std::fs::write(own.join("lonely.cert"), "").expect("write");
        let hosts = config.hosts("127.0.0.1:5003").expect("hosts");
        assert_eq!(hosts.len(), 1);
        assert_eq!(hosts[0].ca, [own.join("ca.crt")]);
        assert_eq!(
            hosts[0].client,
            [ClientCert {
                cert: own.join("me.cert"),
                key: Some(own.join("me.key"))
            }]
        );

        let missing = HostsConfig::new(root.path().join("nope"));
        assert_eq!(
            missing
                .hosts("127.0.0.1:5000")
                .expect("missing dir is fine"),
            [HostEntry::upstream("127.0.0.1:5000")]
        );
        assert_eq!(
            HostsConfig::none().hosts("h").expect("none"),
            [HostEntry::upstream("h")]
        );

        write("bad.example", "capabilities = 7\n");
        let e = config
            .hosts("bad.example")
            .expect_err("bad file")
            .to_string();
        assert!(
            e.contains("bad.example/hosts.toml: key capabilities"),
            "{e}"
        );
    }

    #[test]
    fn go_durations() {
        assert_eq!(parse_duration("1s"), Some(Duration::from_secs(1)));
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_duration("0"), Some(Duration::ZERO));
        for bad in ["", "1", "s", "1x", "-1s", "1..2s"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }
}
