//! A small blocking client for the OCI distribution (docker registry v2)
//! API, with token/basic auth, and the registry source and sink.

pub(crate) mod auth;
mod budget;
mod creds;
mod endpoint;
mod helper;
mod image;
mod referrers;
mod signatures;
mod transport;

pub use budget::{Deadlined, DEFAULT_MIN_RATE};

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::blocking::Response;
use reqwest::header::{ACCEPT, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, LOCATION, RANGE};
use reqwest::{Method, StatusCode, Url};

use crate::digest::{Digest, VerifyingReader};
use crate::error::OciError;
use crate::hosts::Capabilities;
use crate::reference::RegistryReference;
use crate::source::{SourceOptions, MAX_MANIFEST_SIZE};
use crate::types::Descriptor;

pub use creds::{credentials_identity, AUTH_ENV};
use endpoint::{host_failure, Endpoint};
pub use image::{RegistrySink, RegistrySource};
pub use referrers::{fallback_tag, Listed};

/// Reads the system's trusted root certificates now rather than at the
/// first TLS handshake: a daemon calls it at start (~15 ms here, once per
/// process).
pub fn load_trust_store() {
    transport::system_verifier().verifier();
}

/// Retries after the first attempt, for connection errors and 5xx answers,
/// on the last host to try (earlier ones are left for the next at once).
const MAX_RETRIES: u32 = 3;
/// Default per-request timeout (headers, and each body read).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Environment variable overriding the request timeout, in seconds.
pub const TIMEOUT_ENV: &str = "LAMINA_REGISTRY_TIMEOUT";
/// Range answers remembered, so that a retry after a corrupt one can tell
/// which host sent it.
const SERVED_MEMORY: usize = 256;

const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.manifest.v1+json, \
    application/vnd.oci.image.index.v1+json, \
    application/vnd.docker.distribution.manifest.v2+json, \
    application/vnd.docker.distribution.manifest.list.v2+json";

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

/// A blocking registry client for one registry host, reached through the
/// hosts its `hosts.toml` names (mirrors first, then the registry) or the
/// registry alone. Cloning shares the connection pools, token caches and
/// host health.
#[derive(Debug, Clone)]
pub struct RegistryClient {
    host: String,
    timeout: Duration,
    /// In configuration order; the registry (`server`) last.
    endpoints: Arc<[Endpoint]>,
    /// Recent range answers and who sent them (only with several hosts).
    served: Arc<Mutex<VecDeque<Served>>>,
    /// Which of the configured hosts this client asks.
    hosts: HostSet,
}

/// The hosts a client asks, by their `bulk_only` mark in hosts.toml.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HostSet {
    /// All of them.
    All,
    /// All but those marked `bulk_only` ([`RegistryClient::for_misses`]).
    NotBulkOnly,
    /// Only those ([`RegistryClient::for_whole_blobs`]).
    BulkOnly,
}

impl HostSet {
    fn asks(self, e: &Endpoint) -> bool {
        match self {
            HostSet::All => true,
            HostSet::NotBulkOnly => !e.bulk_only,
            HostSet::BulkOnly => e.bulk_only,
        }
    }
}

/// A range answer: which endpoint sent bytes `start..end` of `digest`.
#[derive(Debug)]
struct Served {
    digest: Digest,
    start: u64,
    end: u64,
    endpoint: usize,
}

/// What a request does, deciding which hosts may serve it.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// Blobs and manifests by digest (verified by their digest).
    Pull,
    /// Manifests by tag (trusted).
    Resolve,
    /// Uploads.
    Push,
}

impl Op {
    fn allowed(self, caps: &Capabilities) -> bool {
        match self {
            Op::Pull => caps.pull,
            Op::Resolve => caps.resolve,
            Op::Push => caps.push,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Op::Pull => "pull",
            Op::Resolve => "resolve",
            Op::Push => "push",
        }
    }
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
    /// A client for `host` (`host[:port]`): through the hosts that
    /// `opts.hosts` names for it, else directly. The registry itself is
    /// reached over plain HTTP when loopback (by resolved address) or in
    /// `opts.insecure_hosts`, HTTPS otherwise (and for `opts.tls_hosts`),
    /// trusting the system roots and `opts.ca_file`; a configured host says
    /// its scheme. Credentials are each host's own: `LAMINA_REGISTRY_AUTH`
    /// when it names the host, else the docker config file. The request
    /// timeout is [`DEFAULT_TIMEOUT`] unless `LAMINA_REGISTRY_TIMEOUT`
    /// (seconds) says otherwise.
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
        let endpoints = opts
            .hosts
            .hosts(host)?
            .iter()
            .map(|entry| Endpoint::new(host, entry, opts, timeout))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(RegistryClient {
            host: host.to_string(),
            timeout,
            endpoints: endpoints.into(),
            served: Arc::new(Mutex::new(VecDeque::new())),
            hosts: HostSet::All,
        })
    }

    /// This client for the reads a reader waits on (a lazy mount's misses):
    /// hosts marked `bulk_only` in hosts.toml are left out. Shares the
    /// connection pools, tokens and host health.
    pub fn for_misses(&self) -> RegistryClient {
        RegistryClient {
            hosts: HostSet::NotBulkOnly,
            ..self.clone()
        }
    }

    /// This client for whole blobs worth fetching only through a P2P
    /// daemon (a lazy mount's streamed blobs): only the hosts marked
    /// `bulk_only`; without them, or when they fail, the caller fetches
    /// ranges instead (through the registry, a whole blob per node would be
    /// more than a lazy mount fetches). Shares pools, tokens and health.
    pub fn for_whole_blobs(&self) -> RegistryClient {
        RegistryClient {
            hosts: HostSet::BulkOnly,
            ..self.clone()
        }
    }

    /// Whether some host is marked `bulk_only`: misses and bulk reads go
    /// different ways.
    pub fn has_bulk_only_hosts(&self) -> bool {
        self.endpoints.iter().any(|e| e.bulk_only)
    }

    /// The registry host this client talks to.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The hosts that may do `op`, in the order to try them: those that
    /// have not failed lately first, each group in configuration order.
    fn candidates(&self, op: Op) -> Result<Vec<usize>, OciError> {
        let allowed = || {
            (0..self.endpoints.len()).filter(|&i| {
                let e = &self.endpoints[i];
                op.allowed(&e.caps) && self.hosts.asks(e)
            })
        };
        let (mut order, sick): (Vec<usize>, Vec<usize>) =
            allowed().partition(|&i| self.endpoints[i].healthy());
        order.extend(sick);
        if order.is_empty() {
            return Err(OciError::Registry {
                host: self.host.clone(),
                message: format!(
                    "no host in its registry host configuration (hosts.toml) may {}",
                    op.name()
                ),
            });
        }
        // An upload goes to one host: spreading it over mirrors would
        // leave half an image on each.
        if let Op::Push = op {
            order.sort_unstable();
            order.truncate(1);
        }
        Ok(order)
    }

    /// Runs `attempt(endpoint, retries)` on the hosts for `op` until one
    /// succeeds, and says which one did. Any failure moves on to the next
    /// host at once (a host that is in trouble is marked so); the last
    /// host gets the retries and its error is the answer.
    fn on_hosts<T>(
        &self,
        op: Op,
        attempt: impl Fn(&Endpoint, u32) -> Result<T, OciError>,
    ) -> Result<(T, usize), OciError> {
        let order = self.candidates(op)?;
        let last = order.len() - 1;
        let mut tried = order.into_iter().enumerate().peekable();
        while let Some((k, i)) = tried.next() {
            let endpoint = &self.endpoints[i];
            let retries = if k == last { MAX_RETRIES } else { 0 };
            match attempt(endpoint, retries) {
                Ok(v) => {
                    endpoint.note_success();
                    return Ok((v, i));
                }
                Err(e) => {
                    let next = tried.peek().map(|&(_, n)| &self.endpoints[n].host);
                    let others = next.map_or("the other hosts", String::as_str);
                    if self.endpoints.len() > 1 && endpoint.note_failure(&e) {
                        // Once per outage: a mirror that is down (a node's
                        // dfdaemon, say) is tried last until it recovers.
                        tracing::warn!(
                            host = %endpoint.host,
                            "{e}; {others} asked first for the next {} s",
                            endpoint::UNHEALTHY_FOR.as_secs()
                        );
                    } else if next.is_some() && host_failure(&e) {
                        tracing::info!(host = %endpoint.host, "{e}; this request goes to {others}");
                    }
                    if next.is_none() {
                        return Err(e);
                    }
                }
            }
        }
        unreachable!("candidates() is never empty")
    }

    /// Fetch a manifest or index by tag (from hosts that may resolve) or
    /// by digest (from hosts that may pull). A digest reference is verified
    /// against the content.
    pub fn get_manifest(
        &self,
        repo: &str,
        reference: &RegistryReference,
    ) -> Result<FetchedManifest, OciError> {
        let repo = effective_repository(&self.host, repo);
        let op = match reference {
            RegistryReference::Digest(_) => Op::Pull,
            RegistryReference::Tag(_) => Op::Resolve,
        };
        self.on_hosts(op, |ep, retries| manifest_on(ep, retries, &repo, reference))
            .map(|(m, _)| m)
    }

    fn blob_response(&self, repo: &str, digest: &Digest) -> Result<Deadlined<Response>, OciError> {
        let repo = effective_repository(&self.host, repo);
        let (resp, _) = self.on_hosts(Op::Pull, |ep, retries| {
            let url = ep.url(&format!("{repo}/blobs/{digest}"))?;
            let resp = ep.send(
                false,
                retries,
                Method::GET,
                &url,
                &pull_scope(&repo),
                &|r| Ok(r),
            )?;
            if resp.status() == StatusCode::NOT_FOUND {
                return Err(blob_not_found(ep, &repo, digest));
            }
            let resp = expect_status(resp, "GET", &url, &[StatusCode::OK])?;
            let size = resp.content_length().unwrap_or(u64::MAX);
            Ok(ep.budget.reader(resp, size))
        })?;
        Ok(resp)
    }

    /// Stream a blob. The content is verified against `digest` when the
    /// stream reaches its end (an `InvalidData` error on mismatch).
    pub fn get_blob(
        &self,
        repo: &str,
        digest: &Digest,
    ) -> Result<VerifyingReader<Deadlined<Response>>, OciError> {
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
        self.blob_range(false, true, repo, digest, offset, len)
    }

    /// One try of [`get_blob_range`](Self::get_blob_range) per host,
    /// without the backoff and retries on a 5xx or a failed connect: for a
    /// caller that retries on its own terms (the lazy fetcher retries at
    /// once on a fresh connection, and hedges). With `fresh`, on a new
    /// connection: the retry after a reset, truncated or corrupt answer.
    /// When the answer being retried came from a host of several, that host
    /// is tried last for a while: a mirror that sent bad bytes is not asked
    /// again first.
    pub fn get_blob_range_once(
        &self,
        repo: &str,
        digest: &Digest,
        (offset, len): (u64, u64),
        fresh: bool,
    ) -> Result<Vec<u8>, OciError> {
        if fresh {
            self.distrust_sender(digest, offset, len);
        }
        self.blob_range(fresh, false, repo, digest, offset, len)
    }

    /// Bytes `offset..offset + len` of a blob as a stream, read as they
    /// arrive: one try per host, like
    /// [`get_blob_range_once`](Self::get_blob_range_once), for a caller
    /// that verifies what it reads piece by piece and asks again for what
    /// did not come. The stream ends after at most `len` bytes (sooner when
    /// the blob does); each read has the request's deadline.
    pub fn get_blob_range_stream(
        &self,
        repo: &str,
        digest: &Digest,
        (offset, len): (u64, u64),
    ) -> Result<Box<dyn Read + Send>, OciError> {
        if len == 0 {
            return Ok(Box::new(io::empty()));
        }
        let body = self.on_range_hosts(false, false, repo, digest, (offset, len), |req, ep| {
            req.open(ep)
        })?;
        Ok(Box::new(body.body.take(len)))
    }

    /// A copy of a range request still in flight (a hedge): on a fresh
    /// connection, and unlike [`get_blob_range_once`](Self::get_blob_range_once)
    /// with `fresh`, without distrusting whoever answered the range before:
    /// a slow answer is no bad answer, and a P2P mirror is slow on its first
    /// request for a blob.
    pub fn get_blob_range_beside(
        &self,
        repo: &str,
        digest: &Digest,
        (offset, len): (u64, u64),
    ) -> Result<Vec<u8>, OciError> {
        self.blob_range(true, false, repo, digest, offset, len)
    }

    fn blob_range(
        &self,
        fresh: bool,
        retry: bool,
        repo: &str,
        digest: &Digest,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, OciError> {
        if len == 0 {
            return Ok(Vec::new());
        }
        self.on_range_hosts(fresh, retry, repo, digest, (offset, len), |req, ep| {
            req.send_to(ep)
        })
    }

    /// `answer` to a request for bytes `offset..offset + len` of a blob
    /// (not empty) from the hosts that may pull, in their order; who sent
    /// it is noted. With `retry`, the last host's answer is retried after a
    /// 5xx or a failed connect; with `fresh`, on a new connection.
    fn on_range_hosts<T>(
        &self,
        fresh: bool,
        retry: bool,
        repo: &str,
        digest: &Digest,
        (offset, len): (u64, u64),
        answer: impl Fn(&RangeRequest, &Endpoint) -> Result<T, OciError>,
    ) -> Result<T, OciError> {
        let repo = effective_repository(&self.host, repo);
        let (value, endpoint) = self.on_hosts(Op::Pull, |ep, retries| {
            let req = RangeRequest {
                fresh,
                retries: if retry { retries } else { 0 },
                repo: &repo,
                digest,
                offset,
                len,
            };
            answer(&req, ep)
        })?;
        self.remember_sender(digest, offset, len, endpoint);
        Ok(value)
    }

    /// Notes who sent a range answer, when there is a choice of hosts.
    fn remember_sender(&self, digest: &Digest, start: u64, len: u64, endpoint: usize) {
        if self.endpoints.len() < 2 {
            return;
        }
        let mut served = self.served.lock().unwrap_or_else(|p| p.into_inner());
        if served.len() >= SERVED_MEMORY {
            served.pop_front();
        }
        served.push_back(Served {
            digest: digest.clone(),
            start,
            end: start.saturating_add(len),
            endpoint,
        });
    }

    /// The range `offset..offset+len` of `digest` is asked for again: the
    /// last answer that covered part of it was unusable, so its host is
    /// marked unhealthy.
    fn distrust_sender(&self, digest: &Digest, offset: u64, len: u64) {
        if self.endpoints.len() < 2 {
            return;
        }
        let end = offset.saturating_add(len);
        let mut served = self.served.lock().unwrap_or_else(|p| p.into_inner());
        // Only a host this client asks can have sent the answer it retries:
        // a miss retried never blames the bulk_only host (a P2P daemon)
        // that sent bulk reads of the same bytes.
        let usable = |i: usize| self.hosts.asks(&self.endpoints[i]);
        let found = served.iter().rposition(|s| {
            s.digest == *digest && s.start < end && offset < s.end && usable(s.endpoint)
        });
        if let Some(s) = found.and_then(|i| served.remove(i)) {
            let endpoint = &self.endpoints[s.endpoint];
            if endpoint.mark_unhealthy() {
                tracing::info!(
                    host = %endpoint.host,
                    "{digest} bytes {offset}+{len} asked for again after its answer: the host that sent it is asked last for the next {} s",
                    endpoint::UNHEALTHY_FOR.as_secs()
                );
            }
        }
    }

    /// The first host that may push.
    fn push_endpoint(&self) -> Result<&Endpoint, OciError> {
        let order = self.candidates(Op::Push)?;
        Ok(&self.endpoints[order[0]])
    }

    /// The size of a blob if the registry has it (HEAD request).
    pub fn blob_exists(&self, repo: &str, digest: &Digest) -> Result<Option<u64>, OciError> {
        let repo = effective_repository(&self.host, repo);
        let ep = self.push_endpoint()?;
        let url = ep.url(&format!("{repo}/blobs/{digest}"))?;
        let resp = ep.send(
            false,
            MAX_RETRIES,
            Method::HEAD,
            &url,
            &push_scope(&repo),
            &|r| Ok(r),
        )?;
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
        let ep = self.push_endpoint()?;
        let scope = push_scope(repo);
        let start = ep.url(&format!("{repo}/blobs/uploads/"))?;
        let resp = ep.send(false, MAX_RETRIES, Method::POST, &start, &scope, &|r| {
            Ok(r.header(CONTENT_LENGTH, "0"))
        })?;
        let resp = expect_status(resp, "POST", &start, &[StatusCode::ACCEPTED])?;
        let location = resp
            .headers()
            .get(LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| OciError::Registry {
                host: ep.host.clone(),
                message: format!("POST {start}: upload started without a Location header"),
            })?;
        let mut put_url = start.join(location).map_err(|e| OciError::Registry {
            host: ep.host.clone(),
            message: format!("POST {start}: invalid upload Location {location:?}: {e}"),
        })?;
        put_url
            .query_pairs_mut()
            .append_pair("digest", desc.digest.as_str());
        ep.add_ns(&mut put_url);
        // Allow about 1 MiB/s on top of the normal timeout.
        let upload_timeout = self.timeout + Duration::from_secs(desc.size >> 20);
        let size = desc.size;
        let resp = ep.send(false, MAX_RETRIES, Method::PUT, &put_url, &scope, &|r| {
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
        let ep = self.push_endpoint()?;
        let url = ep.url(&format!("{repo}/manifests/{reference}"))?;
        let resp = ep.send(
            false,
            MAX_RETRIES,
            Method::PUT,
            &url,
            &push_scope(repo),
            &|r| Ok(r.header(CONTENT_TYPE, media_type).body(bytes.to_vec())),
        )?;
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
                    host: ep.host.clone(),
                    message: format!(
                        "PUT {url}: registry stored the manifest as {h}, expected {digest}"
                    ),
                });
            }
        }
        Ok(digest)
    }
}

fn blob_not_found(ep: &Endpoint, repo: &str, digest: &Digest) -> OciError {
    OciError::BlobNotFound {
        location: format!("registry {}/{repo}", ep.host),
        digest: digest.clone(),
    }
}

/// A manifest from one host.
fn manifest_on(
    ep: &Endpoint,
    retries: u32,
    repo: &str,
    reference: &RegistryReference,
) -> Result<FetchedManifest, OciError> {
    let url = ep.url(&format!("{repo}/manifests/{reference}"))?;
    let resp = ep.send(false, retries, Method::GET, &url, &pull_scope(repo), &|r| {
        Ok(r.header(ACCEPT, MANIFEST_ACCEPT))
    })?;
    if resp.status() == StatusCode::NOT_FOUND {
        return Err(OciError::NotFound {
            location: format!("registry {}/{repo}", ep.host),
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
    let bytes = read_limited(resp, MAX_MANIFEST_SIZE, &url, ep.budget)?;
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
                host: ep.host.clone(),
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

/// Sent with a range read to a `bulk_only` host (a node's dfdaemon): the
/// bytes its P2P task is named by, instead of the blob's digest alone. A
/// Dragonfly task's seed peer fetches what the task was first asked for
/// (a range: those pieces only), and is not asked again for the rest, so a
/// whole-blob prefetch of a blob that was first read in ranges would go to
/// the registry from every node. Ranges and whole blobs are two tasks.
const P2P_TASK_HEADER: &str = "X-Dragonfly-Content-For-Calculating-Task-ID";

/// One range read of a blob, as sent to one host.
struct RangeRequest<'a> {
    fresh: bool,
    retries: u32,
    repo: &'a str,
    digest: &'a Digest,
    offset: u64,
    len: u64,
}

impl RangeRequest<'_> {
    /// The bytes from `ep`, read whole: at most `len`, fewer only when the
    /// blob ends first.
    fn send_to(&self, ep: &Endpoint) -> Result<Vec<u8>, OciError> {
        let len = self.len;
        let RangeBody { mut body, partial } = self.open(ep)?;
        let mut buf = Vec::with_capacity(usize::try_from(len.min(64 << 20)).unwrap_or(0));
        (&mut body)
            .take(len.saturating_add(1))
            .read_to_end(&mut buf)
            .map_err(|e| self.read_error(ep, e))?;
        if buf.len() as u64 > len {
            if partial {
                return Err(self.protocol(ep, format!("got more than {len} bytes")));
            }
            // A 200 answer carries the rest of the blob: cut it.
            buf.truncate(usize::try_from(len).unwrap_or(usize::MAX));
        }
        Ok(buf)
    }

    /// The answer from `ep`, positioned at the offset: a 206 answer must
    /// start there; a 200 answer (range ignored, as a pull-through cache
    /// does on a miss) is the whole blob, skipped to the offset here (an
    /// empty body when the blob ends first).
    fn open(&self, ep: &Endpoint) -> Result<RangeBody, OciError> {
        let (digest, offset, len) = (self.digest, self.offset, self.len);
        let last = offset
            .checked_add(len - 1)
            .ok_or_else(|| self.protocol(ep, "overflows".into()))?;
        let url = ep.url(&format!("{}/blobs/{digest}", self.repo))?;
        let range = format!("bytes={offset}-{last}");
        let task = ep.bulk_only.then(|| format!("{digest} ranges"));
        let resp = ep.send(
            self.fresh,
            self.retries,
            Method::GET,
            &url,
            &pull_scope(self.repo),
            &|r| {
                let r = r.header(RANGE, range.as_str());
                Ok(match &task {
                    Some(task) => r.header(P2P_TASK_HEADER, task.as_str()),
                    None => r,
                })
            },
        )?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Err(blob_not_found(ep, self.repo, digest));
        }
        let resp = expect_status(
            resp,
            "GET",
            &url,
            &[StatusCode::PARTIAL_CONTENT, StatusCode::OK],
        )?;
        let partial = resp.status() == StatusCode::PARTIAL_CONTENT;
        // A 200 answer sends the blob up to the range's end.
        let sent = if partial { len } else { last.saturating_add(1) };
        let mut resp = ep.budget.reader(resp, sent);
        if partial {
            let content_range = resp
                .get_ref()
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
                return Err(self.protocol(ep, format!("got Content-Range {content_range:?}")));
            }
        } else {
            let skipped = io::copy(&mut (&mut resp).take(offset), &mut io::sink())
                .map_err(|e| self.read_error(ep, e))?;
            if skipped < offset {
                let body: Box<dyn Read + Send> = Box::new(io::empty());
                return Ok(RangeBody { body, partial });
            }
        }
        Ok(RangeBody {
            body: Box::new(resp),
            partial,
        })
    }

    fn protocol(&self, ep: &Endpoint, message: String) -> OciError {
        let (digest, offset, len) = (self.digest, self.offset, self.len);
        OciError::Registry {
            host: ep.host.clone(),
            message: format!("blob {digest}: range {offset}+{len}: {message}"),
        }
    }

    fn read_error(&self, ep: &Endpoint, e: io::Error) -> OciError {
        let path = format!("{}/blobs/{}", self.repo, self.digest);
        let url = ep.url(&path).map_or(path, |u| u.to_string());
        OciError::io("read", url, e)
    }
}

/// An answer to a range request, positioned at the range's start.
struct RangeBody {
    body: Box<dyn Read + Send>,
    /// A 206 answer (else a 200 answer: the whole blob, cut here).
    partial: bool,
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

fn read_limited(
    resp: Response,
    limit: u64,
    url: &Url,
    budget: budget::Budget,
) -> Result<Vec<u8>, OciError> {
    let mut buf = Vec::new();
    let size = resp.content_length().unwrap_or(limit).min(limit);
    budget
        .reader(resp, size)
        .take(limit + 1)
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

    /// A client for `ns` with `hosts_toml` as its configuration.
    fn try_client_with(
        ns: &str,
        hosts_toml: &str,
    ) -> (tempfile::TempDir, Result<RegistryClient, OciError>) {
        let root = tempfile::tempdir().expect("tmp");
        let dir = root
            .path()
            .join(crate::hosts::namespace_dirs(ns)[0].as_str());
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("hosts.toml"), hosts_toml).expect("write");
        let opts = SourceOptions {
            hosts: crate::hosts::HostsConfig::new(root.path()),
            ..SourceOptions::default()
        };
        let client = RegistryClient::with_timeout(ns, &opts, Duration::from_secs(5));
        (root, client)
    }

    fn client_with(ns: &str, hosts_toml: &str) -> (tempfile::TempDir, RegistryClient) {
        let (root, client) = try_client_with(ns, hosts_toml);
        (root, client.expect("client"))
    }

    #[test]
    fn unusable_tls_files_of_a_host_are_errors_naming_them() {
        let (_dir, r) = try_client_with(
            "127.0.0.1:5000",
            "[host.\"https://mirror.example\"]\nca = \"missing-ca.pem\"\n",
        );
        let err = r.expect_err("missing CA").to_string();
        assert!(
            err.contains("missing-ca.pem") && err.contains("read CA file"),
            "{err}"
        );
        let (_dir, r) = try_client_with(
            "127.0.0.1:5000",
            "[host.\"https://mirror.example\"]\nclient = [[\"c.cert\", \"c.key\"]]\n",
        );
        let err = r.expect_err("missing client cert").to_string();
        assert!(
            err.contains("c.cert") && err.contains("client certificate"),
            "{err}"
        );
        // Headers, skip_verify and a dial timeout build a client.
        let (_dir, r) = try_client_with(
            "127.0.0.1:5000",
            "[host.\"https://mirror.example\"]\nskip_verify = true\ndial_timeout = \"1s\"\n\
             [host.\"https://mirror.example\".header]\nx-token = [\"a\", \"b\"]\n",
        );
        let c = r.expect("client");
        assert_eq!(c.endpoints.len(), 2);
    }

    fn hosts_of(c: &RegistryClient, order: &[usize]) -> Vec<String> {
        order.iter().map(|&i| c.endpoints[i].host.clone()).collect()
    }

    const MIRRORS: &str = r#"
[host."http://127.0.0.1:1"]
  capabilities = ["pull"]
[host."https://mirror.example/base"]
  capabilities = ["pull", "resolve"]
  override_path = true
[host."http://127.0.0.1:3"]
"#;

    /// A `bulk_only` mirror (a P2P daemon) serves bulk reads and is left
    /// out of the client for misses, which go to the other hosts.
    #[test]
    fn bulk_only_hosts_are_left_out_of_misses() {
        let (_dir, c) = client_with(
            "127.0.0.1:5000",
            "[host.\"http://127.0.0.1:4001\"]\n  capabilities = [\"pull\"]\n  bulk_only = true\n",
        );
        assert!(c.has_bulk_only_hosts());
        let bulk = c.candidates(Op::Pull).expect("bulk");
        assert_eq!(hosts_of(&c, &bulk), ["127.0.0.1:4001", "127.0.0.1:5000"]);
        let misses = c.for_misses();
        let pull = misses.candidates(Op::Pull).expect("misses");
        assert_eq!(hosts_of(&misses, &pull), ["127.0.0.1:5000"]);
        // Streamed whole blobs: the mirror only, even when it failed lately.
        let whole = c.for_whole_blobs();
        c.endpoints[0].mark_unhealthy();
        let pull = whole.candidates(Op::Pull).expect("whole blobs");
        assert_eq!(hosts_of(&whole, &pull), ["127.0.0.1:4001"]);
        let (_dir, plain) = client_with("127.0.0.1:5000", MIRRORS);
        let none = plain.for_whole_blobs().candidates(Op::Pull);
        assert!(none.is_err(), "no bulk_only host, yet {none:?}");
        let (_dir, plain) = client_with("127.0.0.1:5000", MIRRORS);
        assert!(!plain.has_bulk_only_hosts());
    }

    #[test]
    fn hosts_by_capability_then_health() {
        let (_dir, c) = client_with("127.0.0.1:5000", MIRRORS);
        let pull = c.candidates(Op::Pull).expect("pull");
        assert_eq!(
            hosts_of(&c, &pull),
            [
                "127.0.0.1:1",
                "mirror.example",
                "127.0.0.1:3",
                "127.0.0.1:5000"
            ]
        );
        let resolve = c.candidates(Op::Resolve).expect("resolve");
        assert_eq!(
            hosts_of(&c, &resolve),
            ["mirror.example", "127.0.0.1:3", "127.0.0.1:5000"]
        );
        // Uploads go to the first host that may push, and only there.
        let push = c.candidates(Op::Push).expect("push");
        assert_eq!(hosts_of(&c, &push), ["127.0.0.1:3"]);
        // A host that failed goes last, the others keep their order.
        c.endpoints[0].mark_unhealthy();
        let pull = c.candidates(Op::Pull).expect("pull");
        assert_eq!(
            hosts_of(&c, &pull),
            [
                "mirror.example",
                "127.0.0.1:3",
                "127.0.0.1:5000",
                "127.0.0.1:1"
            ]
        );
    }

    #[test]
    fn mirror_urls_carry_ns_and_their_own_path() {
        let (_dir, c) = client_with("127.0.0.1:5000", MIRRORS);
        let url = |i: usize| {
            c.endpoints[i]
                .url("app/blobs/sha256:ab")
                .expect("url")
                .to_string()
        };
        assert_eq!(
            url(0),
            "http://127.0.0.1:1/v2/app/blobs/sha256:ab?ns=127.0.0.1%3A5000"
        );
        assert_eq!(
            url(1),
            "https://mirror.example/base/app/blobs/sha256:ab?ns=127.0.0.1%3A5000"
        );
        // The registry itself: no ns, plain HTTP because it is loopback.
        assert_eq!(url(3), "http://127.0.0.1:5000/v2/app/blobs/sha256:ab");
    }

    #[test]
    fn no_host_may_push_is_an_error_naming_it() {
        let (_dir, c) = client_with(
            "127.0.0.1:5000",
            "server = \"http://127.0.0.1:5000\"\ncapabilities = [\"pull\", \"resolve\"]\n",
        );
        let err = c.candidates(Op::Push).expect_err("no push host");
        assert!(err.to_string().contains("may push"), "{err}");
        assert!(c.candidates(Op::Pull).is_ok());
    }

    #[test]
    fn a_host_that_answers_is_demoted_only_after_failures_in_a_row() {
        let (_dir, c) = client_with("127.0.0.1:5000", MIRRORS);
        let status = |status| OciError::HttpStatus {
            method: "GET".into(),
            url: "http://127.0.0.1:1/v2/app/blobs/sha256:ab".into(),
            status,
            body: String::new(),
        };
        let mirror = &c.endpoints[0];
        // A missing object says nothing about the host.
        for _ in 0..endpoint::FAILURES_BEFORE_UNHEALTHY {
            assert!(!mirror.note_failure(&status(404)));
        }
        assert!(mirror.healthy());
        // Failed requests with a success between them: still first.
        for _ in 1..endpoint::FAILURES_BEFORE_UNHEALTHY {
            assert!(!mirror.note_failure(&status(500)));
        }
        mirror.note_success();
        for _ in 1..endpoint::FAILURES_BEFORE_UNHEALTHY {
            assert!(!mirror.note_failure(&status(500)));
        }
        assert!(mirror.healthy());
        // The last one in a row demotes it, and says so once.
        assert!(mirror.note_failure(&status(503)));
        assert!(!mirror.healthy());
        assert!(!mirror.note_failure(&status(500)));
        // A host that cannot be reached is demoted at once.
        let tls = OciError::Tls {
            url: "https://mirror.example/v2/".into(),
            detail: "unknown issuer".into(),
        };
        assert!(c.endpoints[1].note_failure(&tls));
        assert!(!c.endpoints[1].healthy());
    }

    #[test]
    fn a_range_asked_for_again_demotes_the_host_that_sent_it() {
        let (_dir, c) = client_with("127.0.0.1:5000", MIRRORS);
        let d = Digest::of_bytes(b"blob");
        c.remember_sender(&d, 100, 50, 1);
        c.remember_sender(&d, 1000, 50, 0);
        // A retry of part of the first range: host 1 sent it.
        c.distrust_sender(&d, 120, 10);
        assert!(!c.endpoints[1].healthy());
        assert!(c.endpoints[0].healthy());
        // Another blob's range says nothing about host 0.
        c.distrust_sender(&Digest::of_bytes(b"other"), 1000, 50);
        assert!(c.endpoints[0].healthy());
    }

    /// Misses and bulk reads share what was served. A miss retried on
    /// bytes a bulk_only mirror (a node's P2P daemon) sent for a bulk read
    /// earlier did not come from it: the mirror stays first for bulk reads
    /// (demoted, a whole-image prefetch would go to the registry).
    #[test]
    fn a_retried_miss_does_not_demote_a_host_misses_never_ask() {
        let (_dir, c) = client_with(
            "127.0.0.1:5000",
            "[host.\"http://127.0.0.1:4001\"]\n  capabilities = [\"pull\"]\n  bulk_only = true\n",
        );
        let d = Digest::of_bytes(b"blob");
        c.remember_sender(&d, 0, 4 << 20, 0);
        let misses = c.for_misses();
        misses.distrust_sender(&d, 4096, 4096);
        assert!(c.endpoints[0].healthy(), "the mirror was demoted by a miss");
        // A bulk read retried on them does blame it.
        c.distrust_sender(&d, 4096, 4096);
        assert!(!c.endpoints[0].healthy());
    }
}
