//! A small blocking client for the OCI distribution (docker registry v2)
//! API, with token/basic auth, and the registry source and sink.

pub(crate) mod auth;
mod creds;
mod helper;
mod image;
mod transport;

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::blocking::{Client, RequestBuilder, Response};
use reqwest::header::{
    HeaderMap, ACCEPT, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, LOCATION, RANGE,
    WWW_AUTHENTICATE,
};
use reqwest::{Method, StatusCode, Url};
use serde::Deserialize;

use crate::digest::{Digest, VerifyingReader};
use crate::error::OciError;
use crate::reference::RegistryReference;
use crate::source::{SourceOptions, MAX_MANIFEST_SIZE};
use crate::types::Descriptor;

use auth::{check_realm, parse_challenge, Challenge};
pub use creds::AUTH_ENV;
use creds::{load_credentials, CredEnv, Credentials};
pub use image::{RegistrySink, RegistrySource};
use transport::{build_client, http_error, reach, Reach};

/// Retries after the first attempt, for connection errors and 5xx answers.
const MAX_RETRIES: u32 = 3;
/// Default per-request timeout (headers, and each body read).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Environment variable overriding the request timeout, in seconds.
pub const TIMEOUT_ENV: &str = "LAMINA_REGISTRY_TIMEOUT";

const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.manifest.v1+json, \
    application/vnd.oci.image.index.v1+json, \
    application/vnd.docker.distribution.manifest.v2+json, \
    application/vnd.docker.distribution.manifest.list.v2+json";

#[derive(Debug, Default)]
struct AuthState {
    /// Bearer tokens by scope.
    tokens: HashMap<String, String>,
    /// The registry asked for Basic auth.
    basic: bool,
}

/// A manifest (or index) fetched from a registry.
#[derive(Debug, Clone)]
pub struct FetchedManifest {
    /// The bytes as served.
    pub bytes: Vec<u8>,
    /// The Content-Type, without parameters.
    pub media_type: Option<String>,
    /// Digest of `bytes`.
    pub digest: Digest,
}

/// A blocking registry client for one host. Cloning shares the connection
/// pool and the token cache.
#[derive(Debug, Clone)]
pub struct RegistryClient {
    host: String,
    base: Url,
    client: Client,
    /// Opens a new connection for every request: for retries.
    fresh_client: Client,
    timeout: Duration,
    /// Plain HTTP to a loopback address (may use an http token realm).
    plain_loopback: bool,
    credentials: Option<Credentials>,
    auth: Arc<Mutex<AuthState>>,
}

/// The API endpoint of a registry host (`docker.io` lives elsewhere).
fn api_host(host: &str) -> &str {
    match host {
        "docker.io" | "index.docker.io" => "registry-1.docker.io",
        other => other,
    }
}

/// The repository path as the registry knows it: Docker Hub puts
/// single-component names under `library/`.
pub(crate) fn effective_repository(host: &str, repo: &str) -> String {
    if api_host(host) == "registry-1.docker.io" && !repo.contains('/') {
        format!("library/{repo}")
    } else {
        repo.to_string()
    }
}

fn pull_scope(repo: &str) -> String {
    format!("repository:{repo}:pull")
}

fn push_scope(repo: &str) -> String {
    format!("repository:{repo}:pull,push")
}

impl RegistryClient {
    /// A client for `host` (`host[:port]`): plain HTTP for loopback hosts
    /// (by resolved address) and `opts.insecure_hosts`, HTTPS otherwise
    /// (and for `opts.tls_hosts`), trusting the system roots and
    /// `opts.ca_file`. Credentials come from `LAMINA_REGISTRY_AUTH` when it
    /// names this host, else the docker config file. The request timeout
    /// is [`DEFAULT_TIMEOUT`] unless `LAMINA_REGISTRY_TIMEOUT` (seconds) says
    /// otherwise.
    pub fn new(host: &str, opts: &SourceOptions) -> Result<RegistryClient, OciError> {
        let timeout = match std::env::var(TIMEOUT_ENV) {
            Ok(v) => v
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|s| *s > 0)
                .map(Duration::from_secs)
                .ok_or_else(|| {
                    OciError::Unsupported(format!(
                        "{TIMEOUT_ENV}={v:?}: expected a positive number of seconds"
                    ))
                })?,
            Err(_) => DEFAULT_TIMEOUT,
        };
        RegistryClient::with_timeout(host, opts, timeout)
    }

    /// Like [`new`](Self::new) with an explicit request timeout (time to the
    /// response headers, and for each body read; uploads get extra time in
    /// proportion to their size).
    pub fn with_timeout(
        host: &str,
        opts: &SourceOptions,
        timeout: Duration,
    ) -> Result<RegistryClient, OciError> {
        let Reach { plain, loopback } = reach(host, opts);
        let scheme = if plain { "http" } else { "https" };
        let base_str = format!("{scheme}://{}/", api_host(host));
        let base = Url::parse(&base_str).map_err(|e| OciError::Registry {
            host: host.to_string(),
            message: format!("invalid registry URL {base_str}: {e}"),
        })?;
        let pin = loopback.as_deref().unwrap_or_default();
        let client = build_client(host, opts, timeout, pin, true)?;
        let fresh_client = build_client(host, opts, timeout, pin, false)?;
        let credentials = load_credentials(host, &CredEnv::from_process(opts))?;
        Ok(RegistryClient {
            host: host.to_string(),
            base,
            client,
            fresh_client,
            timeout,
            plain_loopback: plain && loopback.is_some(),
            credentials,
            auth: Arc::new(Mutex::new(AuthState::default())),
        })
    }

    /// The registry host this client talks to.
    pub fn host(&self) -> &str {
        &self.host
    }

    fn url(&self, path: &str) -> Result<Url, OciError> {
        self.base.join(path).map_err(|e| OciError::Registry {
            host: self.host.clone(),
            message: format!("invalid URL path {path:?}: {e}"),
        })
    }

    fn authorize(&self, req: RequestBuilder, scope: &str) -> RequestBuilder {
        let state = match self.auth.lock() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Some(token) = state.tokens.get(scope) {
            return req.bearer_auth(token);
        }
        match (&self.credentials, state.basic) {
            (Some(Credentials::Basic { username, password }), true) => {
                req.basic_auth(username, Some(password))
            }
            _ => req,
        }
    }

    /// Send a request, handling one auth challenge and retrying connection
    /// errors and 5xx answers with backoff. `build` adds headers and body
    /// (called once per attempt).
    fn send(
        &self,
        method: Method,
        url: &Url,
        scope: &str,
        build: &dyn Fn(RequestBuilder) -> Result<RequestBuilder, OciError>,
    ) -> Result<Response, OciError> {
        self.send_on(false, method, url, scope, build)
    }

    /// [`send`](Self::send), on a fresh connection from the first attempt
    /// when `fresh`, and from the first retry in any case: the connection a
    /// failure came on is not trusted again.
    fn send_on(
        &self,
        fresh: bool,
        method: Method,
        url: &Url,
        scope: &str,
        build: &dyn Fn(RequestBuilder) -> Result<RequestBuilder, OciError>,
    ) -> Result<Response, OciError> {
        let mut retries = 0;
        let mut challenged = false;
        loop {
            let client = if fresh || retries > 0 {
                &self.fresh_client
            } else {
                &self.client
            };
            let req = client.request(method.clone(), url.clone());
            let req = build(self.authorize(req, scope))?;
            match req
                .send()
                .map_err(|e| http_error(method.as_str(), url.as_str(), e))
            {
                Err(OciError::Http { source: e, .. })
                    if (e.is_connect() || e.is_timeout()) && retries < MAX_RETRIES =>
                {
                    retries += 1;
                    backoff(retries);
                }
                Err(e) => return Err(e),
                Ok(resp) if resp.status() == StatusCode::UNAUTHORIZED && !challenged => {
                    challenged = true;
                    self.handle_challenge(resp.headers(), scope)?;
                }
                Ok(resp) if resp.status() == StatusCode::UNAUTHORIZED => {
                    return Err(OciError::Auth {
                        host: self.host.clone(),
                        message: format!(
                            "{method} {url}: still HTTP 401 after authenticating (credentials \
                             rejected or no access to this repository)"
                        ),
                    });
                }
                Ok(resp) if resp.status().is_server_error() && retries < MAX_RETRIES => {
                    retries += 1;
                    backoff(retries);
                }
                Ok(resp) => return Ok(resp),
            }
        }
    }

    fn auth_error(&self, message: String) -> OciError {
        OciError::Auth {
            host: self.host.clone(),
            message,
        }
    }

    fn handle_challenge(&self, headers: &HeaderMap, scope: &str) -> Result<(), OciError> {
        let header = headers
            .get(WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| {
                self.auth_error("HTTP 401 without a WWW-Authenticate header".to_string())
            })?;
        let challenge = parse_challenge(header).ok_or_else(|| {
            self.auth_error(format!("unparsable WWW-Authenticate header {header:?}"))
        })?;
        if challenge.scheme.eq_ignore_ascii_case("basic") {
            return self.accept_basic(scope);
        }
        if !challenge.scheme.eq_ignore_ascii_case("bearer") {
            return Err(self.auth_error(format!("unsupported auth scheme {:?}", challenge.scheme)));
        }
        let token = self.fetch_token(&challenge, scope)?;
        let mut state = self.auth.lock().unwrap_or_else(|p| p.into_inner());
        state.tokens.insert(scope.to_string(), token);
        Ok(())
    }

    /// Answer a Basic challenge: from now on send this host's user and
    /// password with every request.
    fn accept_basic(&self, scope: &str) -> Result<(), OciError> {
        match &self.credentials {
            Some(Credentials::Basic { .. }) => {}
            Some(Credentials::IdentityToken(_)) => {
                return Err(self.auth_error(
                    "registry wants Basic credentials; an identity token works only with \
                     a bearer token service"
                        .to_string(),
                ))
            }
            None => {
                return Err(self.auth_error(format!(
                    "registry wants Basic credentials and none are configured for this \
                     host (set {AUTH_ENV}={}=USER:PASSWORD or log in with docker login)",
                    self.host
                )))
            }
        }
        let mut state = self.auth.lock().unwrap_or_else(|p| p.into_inner());
        state.basic = true;
        state.tokens.remove(scope);
        Ok(())
    }

    /// Get a bearer token from the challenge's realm: anonymously, with
    /// Basic credentials, or by the OAuth2 refresh-token grant for an
    /// identity token.
    fn fetch_token(&self, challenge: &Challenge, scope: &str) -> Result<String, OciError> {
        let realm = challenge
            .params
            .get("realm")
            .ok_or_else(|| self.auth_error("Bearer challenge without realm".to_string()))?;
        let mut url = Url::parse(realm)
            .map_err(|e| self.auth_error(format!("invalid token realm {realm:?}: {e}")))?;
        check_realm(&url, &self.base, self.plain_loopback).map_err(|m| self.auth_error(m))?;
        let service = challenge.params.get("service").map(String::as_str);
        let scope = challenge.params.get("scope").map_or(scope, String::as_str);
        let (method, req) = self.token_request(&mut url, service, scope);
        let resp = req
            .send()
            .map_err(|e| http_error(method, url.as_str(), e))?;
        let resp = expect_status(resp, method, &url, &[StatusCode::OK])?;
        #[derive(Deserialize)]
        struct TokenResponse {
            token: Option<String>,
            access_token: Option<String>,
        }
        let body = read_limited(resp, 1 << 20, &url)?;
        let parsed: TokenResponse = serde_json::from_slice(&body)
            .map_err(|e| OciError::json(format!("token response from {url}"), e))?;
        parsed
            .token
            .filter(|t| !t.is_empty())
            .or(parsed.access_token)
            .ok_or_else(|| self.auth_error(format!("token response from {url} has no token")))
    }

    /// The token request to `url` (the realm): a POST of the refresh-token
    /// grant for an identity token, else a GET with the service and scope in
    /// the query and Basic credentials if there are any.
    fn token_request(
        &self,
        url: &mut Url,
        service: Option<&str>,
        scope: &str,
    ) -> (&'static str, RequestBuilder) {
        match &self.credentials {
            Some(Credentials::IdentityToken(token)) => {
                let mut form = vec![
                    ("grant_type", "refresh_token"),
                    ("client_id", "lamina"),
                    ("refresh_token", token.as_str()),
                    ("scope", scope),
                ];
                form.extend(service.map(|s| ("service", s)));
                ("POST", self.client.post(url.clone()).form(&form))
            }
            creds => {
                {
                    let mut q = url.query_pairs_mut();
                    if let Some(service) = service {
                        q.append_pair("service", service);
                    }
                    q.append_pair("scope", scope);
                }
                let req = self.client.get(url.clone());
                match creds {
                    Some(Credentials::Basic { username, password }) => {
                        ("GET", req.basic_auth(username, Some(password)))
                    }
                    _ => ("GET", req),
                }
            }
        }
    }

    /// Fetch a manifest or index by tag or digest. A digest reference is
    /// verified against the content.
    pub fn get_manifest(
        &self,
        repo: &str,
        reference: &RegistryReference,
    ) -> Result<FetchedManifest, OciError> {
        let repo = effective_repository(&self.host, repo);
        let repo = repo.as_str();
        let url = self.url(&format!("v2/{repo}/manifests/{reference}"))?;
        let resp = self.send(Method::GET, &url, &pull_scope(repo), &|r| {
            Ok(r.header(ACCEPT, MANIFEST_ACCEPT))
        })?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Err(OciError::NotFound {
                location: format!("registry {}/{repo}", self.host),
                wanted: format!("manifest {reference}"),
                available: Vec::new(),
            });
        }
        let resp = expect_status(resp, "GET", &url, &[StatusCode::OK])?;
        let media_type = resp
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or(v).trim().to_string());
        let header_digest = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<Digest>().ok());
        let bytes = read_limited(resp, MAX_MANIFEST_SIZE, &url)?;
        let digest = Digest::of_bytes(&bytes);
        if let RegistryReference::Digest(expected) = reference {
            if *expected != digest {
                return Err(OciError::DigestMismatch {
                    expected: expected.clone(),
                    actual: digest,
                });
            }
        }
        if let Some(h) = header_digest {
            if h != digest {
                return Err(OciError::Registry {
                    host: self.host.clone(),
                    message: format!(
                        "manifest {repo}:{reference}: Docker-Content-Digest says {h} but the content hashes to {digest}"
                    ),
                });
            }
        }
        Ok(FetchedManifest {
            bytes,
            media_type,
            digest,
        })
    }

    fn blob_response(&self, repo: &str, digest: &Digest) -> Result<Response, OciError> {
        let repo = effective_repository(&self.host, repo);
        let repo = repo.as_str();
        let url = self.url(&format!("v2/{repo}/blobs/{digest}"))?;
        let resp = self.send(Method::GET, &url, &pull_scope(repo), &|r| Ok(r))?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Err(OciError::BlobNotFound {
                location: format!("registry {}/{repo}", self.host),
                digest: digest.clone(),
            });
        }
        expect_status(resp, "GET", &url, &[StatusCode::OK])
    }

    /// Stream a blob. The content is verified against `digest` when the
    /// stream reaches its end (an `InvalidData` error on mismatch).
    pub fn get_blob(
        &self,
        repo: &str,
        digest: &Digest,
    ) -> Result<VerifyingReader<Response>, OciError> {
        let resp = self.blob_response(repo, digest)?;
        Ok(VerifyingReader::new(resp, digest.clone(), None))
    }

    /// Read `len` bytes of a blob starting at `offset` with an HTTP range
    /// request. Fewer bytes are returned only when the blob ends first. The
    /// bytes cannot be verified against the digest (it covers the whole blob).
    pub fn get_blob_range(
        &self,
        repo: &str,
        digest: &Digest,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, OciError> {
        self.blob_range(false, repo, digest, offset, len)
    }

    /// [`get_blob_range`](Self::get_blob_range) on a new connection: the
    /// retry after a reset, truncated or corrupt answer.
    pub fn get_blob_range_fresh(
        &self,
        repo: &str,
        digest: &Digest,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, OciError> {
        self.blob_range(true, repo, digest, offset, len)
    }

    fn blob_range(
        &self,
        fresh: bool,
        repo: &str,
        digest: &Digest,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, OciError> {
        let repo = effective_repository(&self.host, repo);
        let repo = repo.as_str();
        if len == 0 {
            return Ok(Vec::new());
        }
        let last = offset
            .checked_add(len - 1)
            .ok_or_else(|| OciError::Registry {
                host: self.host.clone(),
                message: format!("blob {digest}: range {offset}+{len} overflows"),
            })?;
        let url = self.url(&format!("v2/{repo}/blobs/{digest}"))?;
        let range = format!("bytes={offset}-{last}");
        let resp = self.send_on(fresh, Method::GET, &url, &pull_scope(repo), &|r| {
            Ok(r.header(RANGE, range.as_str()))
        })?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Err(OciError::BlobNotFound {
                location: format!("registry {}/{repo}", self.host),
                digest: digest.clone(),
            });
        }
        let resp = expect_status(
            resp,
            "GET",
            &url,
            &[StatusCode::PARTIAL_CONTENT, StatusCode::OK],
        )?;
        let partial = resp.status() == StatusCode::PARTIAL_CONTENT;
        let mut body: Box<dyn Read> = if partial {
            let content_range = resp
                .headers()
                .get(CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let start_ok = content_range
                .strip_prefix("bytes ")
                .and_then(|r| r.split_once('-'))
                .and_then(|(start, _)| start.trim().parse::<u64>().ok())
                == Some(offset);
            if !start_ok {
                return Err(OciError::Registry {
                    host: self.host.clone(),
                    message: format!(
                        "blob {digest}: asked for {range}, got Content-Range {content_range:?}"
                    ),
                });
            }
            Box::new(resp)
        } else {
            // Range ignored: skip to the offset ourselves.
            let mut resp = resp;
            let skipped = io::copy(&mut (&mut resp).take(offset), &mut io::sink())
                .map_err(|e| OciError::io("read", url.as_str(), e))?;
            if skipped < offset {
                return Ok(Vec::new());
            }
            Box::new(resp)
        };
        let mut buf = Vec::with_capacity(usize::try_from(len.min(64 << 20)).unwrap_or(0));
        (&mut body)
            .take(len.saturating_add(1))
            .read_to_end(&mut buf)
            .map_err(|e| OciError::io("read", url.as_str(), e))?;
        if buf.len() as u64 > len {
            if partial {
                return Err(OciError::Registry {
                    host: self.host.clone(),
                    message: format!("blob {digest}: asked for {range}, got more than {len} bytes"),
                });
            }
            // A 200 answer carries the rest of the blob: cut it.
            buf.truncate(usize::try_from(len).unwrap_or(usize::MAX));
        }
        Ok(buf)
    }

    /// The size of a blob if the registry has it (HEAD request).
    pub fn blob_exists(&self, repo: &str, digest: &Digest) -> Result<Option<u64>, OciError> {
        let repo = effective_repository(&self.host, repo);
        let repo = repo.as_str();
        let url = self.url(&format!("v2/{repo}/blobs/{digest}"))?;
        let resp = self.send(Method::HEAD, &url, &push_scope(repo), &|r| Ok(r))?;
        match resp.status() {
            StatusCode::OK => Ok(Some(
                resp.headers()
                    .get(CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0),
            )),
            StatusCode::NOT_FOUND => Ok(None),
            _ => expect_status(resp, "HEAD", &url, &[StatusCode::OK]).map(|_| None),
        }
    }

    /// Upload a blob with a monolithic PUT, unless the registry already has
    /// it. The content is not re-hashed here (the registry checks the digest).
    pub fn put_blob(
        &self,
        repo: &str,
        desc: &Descriptor,
        body: BlobBody<'_>,
    ) -> Result<(), OciError> {
        let repo = effective_repository(&self.host, repo);
        let repo = repo.as_str();
        if self.blob_exists(repo, &desc.digest)?.is_some() {
            return Ok(());
        }
        let scope = push_scope(repo);
        let start = self.url(&format!("v2/{repo}/blobs/uploads/"))?;
        let resp = self.send(Method::POST, &start, &scope, &|r| {
            Ok(r.header(CONTENT_LENGTH, "0"))
        })?;
        let resp = expect_status(resp, "POST", &start, &[StatusCode::ACCEPTED])?;
        let location = resp
            .headers()
            .get(LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| OciError::Registry {
                host: self.host.clone(),
                message: format!("POST {start}: upload started without a Location header"),
            })?;
        let mut put_url = start.join(location).map_err(|e| OciError::Registry {
            host: self.host.clone(),
            message: format!("POST {start}: invalid upload Location {location:?}: {e}"),
        })?;
        put_url
            .query_pairs_mut()
            .append_pair("digest", desc.digest.as_str());
        // Allow about 1 MiB/s on top of the normal timeout.
        let upload_timeout = self.timeout + Duration::from_secs(desc.size >> 20);
        let size = desc.size;
        let resp = self.send(Method::PUT, &put_url, &scope, &|r| {
            let r = r
                .timeout(upload_timeout)
                .header(CONTENT_TYPE, "application/octet-stream")
                .header(CONTENT_LENGTH, size);
            Ok(match &body {
                BlobBody::Bytes(b) => r.body(b.to_vec()),
                BlobBody::File(p) => {
                    let f = File::open(p).map_err(|e| OciError::io("open", *p, e))?;
                    r.body(reqwest::blocking::Body::sized(f, size))
                }
            })
        })?;
        expect_status(resp, "PUT", &put_url, &[StatusCode::CREATED]).map(|_| ())
    }

    /// Upload a manifest under `reference` (tag or digest); returns its digest.
    pub fn put_manifest(
        &self,
        repo: &str,
        reference: &RegistryReference,
        bytes: &[u8],
        media_type: &str,
    ) -> Result<Digest, OciError> {
        let repo = effective_repository(&self.host, repo);
        let repo = repo.as_str();
        let digest = Digest::of_bytes(bytes);
        if let RegistryReference::Digest(d) = reference {
            if *d != digest {
                return Err(OciError::DigestMismatch {
                    expected: d.clone(),
                    actual: digest,
                });
            }
        }
        let url = self.url(&format!("v2/{repo}/manifests/{reference}"))?;
        let resp = self.send(Method::PUT, &url, &push_scope(repo), &|r| {
            Ok(r.header(CONTENT_TYPE, media_type).body(bytes.to_vec()))
        })?;
        let resp = expect_status(
            resp,
            "PUT",
            &url,
            &[StatusCode::CREATED, StatusCode::OK, StatusCode::ACCEPTED],
        )?;
        if let Some(h) = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<Digest>().ok())
        {
            if h != digest {
                return Err(OciError::Registry {
                    host: self.host.clone(),
                    message: format!(
                        "PUT {url}: registry stored the manifest as {h}, expected {digest}"
                    ),
                });
            }
        }
        Ok(digest)
    }
}

/// The body of a blob upload.
#[derive(Debug, Clone, Copy)]
pub enum BlobBody<'a> {
    /// From memory.
    Bytes(&'a [u8]),
    /// From a local file (re-opened for each attempt).
    File(&'a Path),
}

fn backoff(attempt: u32) {
    std::thread::sleep(Duration::from_millis(250u64 << attempt.min(6)));
}

fn expect_status(
    resp: Response,
    method: &str,
    url: &Url,
    ok: &[StatusCode],
) -> Result<Response, OciError> {
    if ok.contains(&resp.status()) {
        return Ok(resp);
    }
    let status = resp.status().as_u16();
    let mut body = Vec::new();
    let _ = resp.take(2048).read_to_end(&mut body);
    Err(OciError::HttpStatus {
        method: method.to_string(),
        url: url.to_string(),
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn read_limited(resp: Response, limit: u64, url: &Url) -> Result<Vec<u8>, OciError> {
    let mut buf = Vec::new();
    resp.take(limit + 1)
        .read_to_end(&mut buf)
        .map_err(|e| OciError::io("read", url.as_str(), e))?;
    if buf.len() as u64 > limit {
        return Err(OciError::TooLarge {
            what: url.to_string(),
            size: buf.len() as u64,
            limit,
        });
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts() {
        assert_eq!(
            effective_repository("docker.io", "busybox"),
            "library/busybox"
        );
        assert_eq!(effective_repository("quay.io", "busybox"), "busybox");
    }
}
