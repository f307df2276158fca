//! One host a registry is reached through: the registry itself or a mirror
//! from `hosts.toml`. Each has its own HTTP clients (CAs, client
//! certificate, headers, proxy choice), its own credentials and token
//! cache, and a health mark that sends requests elsewhere for a while after
//! it failed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use reqwest::blocking::{Client, RequestBuilder, Response};
use reqwest::header::{HeaderMap, WWW_AUTHENTICATE};
use reqwest::{Method, StatusCode, Url};
use serde::Deserialize;

use super::auth::{check_realm, parse_challenge, Challenge};
use super::creds::{load_credentials, CredEnv, Credentials};
use super::transport::{build_client, http_error, literal_loopback, reach, ClientSpec, Reach};
use super::{api_host, backoff, expect_status, read_limited, AUTH_ENV};
use crate::error::OciError;
use crate::hosts::{Capabilities, HostEntry, Scheme};
use crate::source::SourceOptions;

/// How long a host that failed is tried only after the healthy ones.
pub(crate) const UNHEALTHY_FOR: Duration = Duration::from_secs(30);

/// Requests a reachable host may fail in a row before it is tried last.
/// One failed request (a dfdaemon whose P2P task failed answers 500) moves
/// only that request on; demoting the host for it would send every later
/// read of the image around the mirror.
pub(crate) const FAILURES_BEFORE_UNHEALTHY: u32 = 3;

#[derive(Debug, Default)]
struct AuthState {
    /// Bearer tokens by scope.
    tokens: HashMap<String, String>,
    /// The registry asked for Basic auth.
    basic: bool,
}

/// One host of a registry client.
#[derive(Debug)]
pub(crate) struct Endpoint {
    /// `host[:port]`, for messages and credentials.
    pub(crate) host: String,
    /// `scheme://host[:port]/API-ROOT/`: request paths are relative to it.
    base: Url,
    /// The registry host, sent as `?ns=` when this host is not it.
    ns: Option<String>,
    /// What it may be used for.
    pub(crate) caps: Capabilities,
    /// Bulk reads only (`bulk_only` in hosts.toml).
    pub(crate) bulk_only: bool,
    client: Client,
    /// Opens a new connection for every request: for retries.
    fresh_client: Client,
    /// Plain HTTP to a loopback address (may use an http token realm).
    plain_loopback: bool,
    credentials: Option<Credentials>,
    auth: Mutex<AuthState>,
    unhealthy_until: Mutex<Option<Instant>>,
    /// Host failures since its last answer that was used.
    failures_in_row: AtomicU32,
    /// How long an answer may take in all.
    pub(crate) budget: super::budget::Budget,
}

impl Endpoint {
    /// The endpoint for `entry`, one of registry `namespace`'s hosts.
    pub(crate) fn new(
        namespace: &str,
        entry: &HostEntry,
        opts: &SourceOptions,
        timeout: Duration,
    ) -> Result<Endpoint, OciError> {
        // Only the registry itself, unnamed by `server`, is reached the way
        // lamina reaches any registry (plain on loopback, the flags); a
        // configured URL says its scheme.
        let (plain, pin, loopback, url_host) = match entry.scheme {
            None => {
                let Reach { plain, loopback } = reach(&entry.host, opts);
                let is_loopback = loopback.is_some();
                let host = api_host(&entry.host).to_string();
                (plain, loopback.unwrap_or_default(), is_loopback, host)
            }
            Some(scheme) => (
                scheme == Scheme::Http,
                Vec::new(),
                literal_loopback(&entry.host),
                entry.host.clone(),
            ),
        };
        let scheme = if plain { "http" } else { "https" };
        let base_str = format!("{scheme}://{url_host}{}/", entry.path);
        let base = Url::parse(&base_str).map_err(|e| OciError::Registry {
            host: entry.host.clone(),
            message: format!("invalid registry URL {base_str}: {e}"),
        })?;
        let mut spec = ClientSpec::new(&entry.host, opts, timeout);
        spec.connect_timeout = entry.dial_timeout;
        spec.pin = &pin;
        spec.loopback = loopback;
        spec.ca_files.extend(entry.ca.iter().map(|p| p.as_path()));
        spec.identity = entry
            .client
            .first()
            .map(|c| (c.cert.as_path(), c.key.as_deref()));
        spec.skip_verify = entry.skip_verify;
        spec.headers = &entry.headers;
        let is_registry = url_host == namespace || url_host == api_host(namespace);
        Ok(Endpoint {
            host: entry.host.clone(),
            base,
            ns: (!is_registry).then(|| namespace.to_string()),
            caps: entry.capabilities,
            bulk_only: entry.bulk_only,
            client: build_client(&spec, true)?,
            fresh_client: build_client(&spec, false)?,
            plain_loopback: plain && loopback,
            credentials: load_credentials(&entry.host, &CredEnv::from_process(opts))?,
            auth: Mutex::new(AuthState::default()),
            unhealthy_until: Mutex::new(None),
            failures_in_row: AtomicU32::new(0),
            budget: super::budget::Budget::new(timeout, opts.min_rate),
        })
    }

    /// The URL of `path` (relative to the API root, e.g.
    /// `REPO/blobs/DIGEST`), with `?ns=` for a mirror.
    pub(crate) fn url(&self, path: &str) -> Result<Url, OciError> {
        let mut url = self.base.join(path).map_err(|e| OciError::Registry {
            host: self.host.clone(),
            message: format!("invalid URL path {path:?}: {e}"),
        })?;
        self.add_ns(&mut url);
        Ok(url)
    }

    /// Tells a mirror which registry the request is for, as containerd does.
    pub(crate) fn add_ns(&self, url: &mut Url) {
        if let Some(ns) = &self.ns {
            url.query_pairs_mut().append_pair("ns", ns);
        }
    }

    /// Whether the host has not failed lately.
    pub(crate) fn healthy(&self) -> bool {
        let until = self
            .unhealthy_until
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        until.is_none_or(|t| Instant::now() >= t)
    }

    /// A request to this host failed with `err`. Returns whether the host
    /// is now tried last for a while, having been healthy until now (the
    /// caller says so once): at once if it cannot be reached, after
    /// [`FAILURES_BEFORE_UNHEALTHY`] failures in a row if it answers.
    pub(crate) fn note_failure(&self, err: &OciError) -> bool {
        if !host_failure(err) {
            return false;
        }
        let in_row = self.failures_in_row.fetch_add(1, Ordering::Relaxed) + 1;
        (unreachable(err) || in_row >= FAILURES_BEFORE_UNHEALTHY) && self.mark_unhealthy()
    }

    /// A request to this host succeeded.
    pub(crate) fn note_success(&self) {
        self.failures_in_row.store(0, Ordering::Relaxed);
    }

    /// Try the other hosts first for a while.
    /// Returns whether it was healthy until now (the caller says so once).
    pub(crate) fn mark_unhealthy(&self) -> bool {
        let mut until = self
            .unhealthy_until
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let was_healthy = until.is_none_or(|t| Instant::now() >= t);
        *until = Some(Instant::now() + UNHEALTHY_FOR);
        was_healthy
    }

    fn authorize(&self, req: RequestBuilder, scope: &str) -> RequestBuilder {
        let state = self.auth.lock().unwrap_or_else(|p| p.into_inner());
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
    /// errors and 5xx answers up to `retries` times with backoff, on a fresh
    /// connection from the first attempt when `fresh` and from the first
    /// retry in any case: the connection a failure came on is not trusted
    /// again. `build` adds headers and body (called once per attempt).
    pub(crate) fn send(
        &self,
        fresh: bool,
        retries: u32,
        method: Method,
        url: &Url,
        scope: &str,
        build: &dyn Fn(RequestBuilder) -> Result<RequestBuilder, OciError>,
    ) -> Result<Response, OciError> {
        let mut retried = 0;
        let mut challenged = false;
        loop {
            let client = if fresh || retried > 0 {
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
                    if (e.is_connect() || e.is_timeout()) && retried < retries =>
                {
                    retried += 1;
                    backoff(retried);
                }
                Err(e) => return Err(e),
                Ok(resp) if resp.status() == StatusCode::UNAUTHORIZED && !challenged => {
                    challenged = true;
                    self.handle_challenge(resp.headers(), scope)?;
                }
                Ok(resp) if resp.status() == StatusCode::UNAUTHORIZED => {
                    return Err(self.auth_error(format!(
                        "{method} {url}: still HTTP 401 after authenticating (credentials \
                         rejected or no access to this repository)"
                    )));
                }
                Ok(resp) if resp.status().is_server_error() && retried < retries => {
                    retried += 1;
                    backoff(retried);
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
        let body = read_limited(resp, 1 << 20, &url, self.budget)?;
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
}

/// Whether an error says the host could not be reached or did not answer
/// in time (connection refused or failed, timed out, bad certificate). A
/// connection cut mid-answer counts as a failed request, not as this.
fn unreachable(err: &OciError) -> bool {
    match err {
        OciError::Http { source, .. } => source.is_connect() || source.is_timeout(),
        OciError::Tls { .. } => true,
        _ => false,
    }
}

/// Whether an error says the host itself is in trouble (unreachable, slow,
/// failing, overloaded or answering nonsense), not just that it lacks one
/// object: such a host may be tried last for a while.
pub(crate) fn host_failure(err: &OciError) -> bool {
    match err {
        OciError::HttpStatus { status, .. } => *status >= 500 || *status == 429,
        OciError::Http { .. }
        | OciError::Tls { .. }
        | OciError::Io { .. }
        | OciError::Registry { .. } => true,
        _ => false,
    }
}
