//! How a registry host is reached: loopback by resolved address, the HTTP
//! client with its trusted roots (system store plus `--ca-file`; the system
//! store read at the first TLS handshake), and which request failures are
//! certificate failures.

use std::error::Error as _;
use std::fs::File;
use std::io::{self, Read};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use reqwest::blocking::Client;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Certificate, Identity};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::error::OciError;
use crate::source::SourceOptions;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A CA bundle larger than this is not a CA bundle.
const MAX_CA_FILE: u64 = 16 << 20;

/// The host without its port (`[v6]` brackets kept).
pub(crate) fn host_name(host: &str) -> &str {
    if host.starts_with('[') {
        match host.find(']') {
            Some(i) => host.get(..=i).unwrap_or(host),
            None => host,
        }
    } else {
        host.split_once(':').map_or(host, |(h, _)| h)
    }
}

/// The host name without port and without IPv6 brackets.
fn bare_name(host: &str) -> &str {
    let name = host_name(host);
    name.strip_prefix('[')
        .and_then(|n| n.strip_suffix(']'))
        .unwrap_or(name)
}

/// Whether an IP literal (`127.0.0.1`, `::1`, no brackets) is loopback.
/// IPv4-mapped IPv6 counts as its IPv4 address.
pub(crate) fn ip_is_loopback(literal: &str) -> Option<bool> {
    literal
        .parse::<IpAddr>()
        .ok()
        .map(|ip| ip.to_canonical().is_loopback())
}

/// The addresses to pin when `host` (`host[:port]`) is loopback, or `None`
/// when it is not. IP literals and `localhost` count without a lookup (empty
/// list). Any other name counts only if it resolves and every address is
/// loopback: the name alone (`127.example.com`) proves nothing.
pub(crate) fn loopback_addrs(host: &str) -> Option<Vec<SocketAddr>> {
    let name = bare_name(host);
    if let Some(loopback) = ip_is_loopback(name) {
        return loopback.then(Vec::new);
    }
    if name.eq_ignore_ascii_case("localhost") {
        return Some(Vec::new());
    }
    let addrs: Vec<SocketAddr> = (name, 0).to_socket_addrs().ok()?.collect();
    let all_loopback = !addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback());
    all_loopback.then_some(addrs)
}

/// Whether `host` is loopback by its text alone (an IP literal or
/// `localhost`), without a lookup: for hosts whose URL is configured.
pub(crate) fn literal_loopback(host: &str) -> bool {
    let name = bare_name(host);
    ip_is_loopback(name).unwrap_or_else(|| name.eq_ignore_ascii_case("localhost"))
}

/// How a registry host is reached.
pub(crate) struct Reach {
    /// Plain HTTP (loopback or `insecure_hosts`, unless in `tls_hosts`).
    pub(crate) plain: bool,
    /// Loopback addresses when the host is loopback (see [`loopback_addrs`]).
    pub(crate) loopback: Option<Vec<SocketAddr>>,
}

/// Plain HTTP for loopback hosts and `opts.insecure_hosts`, TLS otherwise
/// and for `opts.tls_hosts`.
pub(crate) fn reach(host: &str, opts: &SourceOptions) -> Reach {
    let listed = |hosts: &[String]| hosts.iter().any(|h| h == host || h == host_name(host));
    let loopback = loopback_addrs(host);
    let plain = !listed(&opts.tls_hosts) && (loopback.is_some() || listed(&opts.insecure_hosts));
    Reach { plain, loopback }
}

/// Whether `host` is loopback (see [`loopback_addrs`]).
#[cfg(test)]
pub(crate) fn is_loopback(host: &str) -> bool {
    loopback_addrs(host).is_some()
}

/// What one host's HTTP client is built from.
#[derive(Debug, Clone)]
pub(crate) struct ClientSpec<'a> {
    /// `host[:port]`, for messages and pinning.
    pub(crate) host: &'a str,
    /// Per-request timeout (see [`build_client`]).
    pub(crate) timeout: Duration,
    /// Bound on establishing a connection (`dial_timeout`), else the default.
    pub(crate) connect_timeout: Option<Duration>,
    /// Addresses a loopback name resolved to (see [`loopback_addrs`]).
    pub(crate) pin: &'a [SocketAddr],
    /// A loopback host: never sent through an HTTP proxy.
    pub(crate) loopback: bool,
    /// Trusted CA files besides the system store (`--ca-file`, `ca`).
    pub(crate) ca_files: Vec<&'a Path>,
    /// The client certificate offered (PEM cert, PEM key if separate).
    pub(crate) identity: Option<(&'a Path, Option<&'a Path>)>,
    /// Accept any server certificate (`skip_verify`).
    pub(crate) skip_verify: bool,
    /// Headers sent with every request.
    pub(crate) headers: &'a [(String, String)],
}

impl<'a> ClientSpec<'a> {
    /// The plain spec for `host`: system roots plus `opts.ca_file`.
    pub(crate) fn new(host: &'a str, opts: &'a SourceOptions, timeout: Duration) -> Self {
        ClientSpec {
            host,
            timeout,
            connect_timeout: None,
            pin: &[],
            loopback: false,
            ca_files: opts.ca_file.as_deref().into_iter().collect(),
            identity: None,
            skip_verify: false,
            headers: &[],
        }
    }
}

/// The HTTP client for one registry host. `spec.pin` fixes the addresses a
/// loopback name resolved to, so a later lookup cannot move plain-HTTP
/// traffic off the machine.
///
/// `timeout` bounds the wait for the response headers and for each read of
/// the body (progress), so a stalled connection is given up on. A client
/// without `pooled` connections opens a fresh one for every request: what a
/// retry after a reset, truncated or corrupt response uses.
///
/// `HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY` and `NO_PROXY` are honoured
/// (reqwest reads them), except for loopback hosts, which are always
/// reached directly as Go's and so containerd's clients do: a proxy cannot
/// reach the machine's own loopback registry.
pub(crate) fn build_client(spec: &ClientSpec<'_>, pooled: bool) -> Result<Client, OciError> {
    let connect = spec.connect_timeout.unwrap_or(CONNECT_TIMEOUT);
    let mut builder = Client::builder()
        .connect_timeout(connect.min(spec.timeout))
        .timeout(spec.timeout)
        .user_agent(concat!("lamina/", env!("CARGO_PKG_VERSION")));
    let system_only = spec.ca_files.is_empty() && spec.identity.is_none() && !spec.skip_verify;
    match system_tls() {
        Some(tls) if system_only => builder = builder.use_preconfigured_tls(tls.clone()),
        _ => builder = with_tls_settings(builder, spec)?,
    }
    if !pooled {
        builder = builder.pool_max_idle_per_host(0);
    }
    if !spec.pin.is_empty() {
        builder = builder.resolve_to_addrs(bare_name(spec.host), spec.pin);
    }
    if spec.loopback {
        builder = builder.no_proxy();
    }
    builder = builder.default_headers(header_map(spec.headers));
    builder.build().map_err(|source| OciError::Http {
        method: "INIT".to_string(),
        url: format!("registry {}", spec.host),
        source,
    })
}

/// A host's own TLS settings (`--ca-file`, `ca`, a client certificate,
/// `skip_verify`), built by reqwest: the system store (read now) and
/// reqwest's built-in roots, as for [`system_tls`], plus these.
fn with_tls_settings(
    mut builder: reqwest::blocking::ClientBuilder,
    spec: &ClientSpec<'_>,
) -> Result<reqwest::blocking::ClientBuilder, OciError> {
    // The system store, read once per process (reqwest would read and parse
    // it again for every client: ~5 ms each, several per mount).
    builder = builder.tls_built_in_native_certs(false);
    for der in system_roots() {
        if let Ok(cert) = Certificate::from_der(der) {
            builder = builder.add_root_certificate(cert);
        }
    }
    for path in &spec.ca_files {
        for cert in ca_certificates(path)? {
            builder = builder.add_root_certificate(cert);
        }
    }
    if let Some((cert, key)) = spec.identity {
        builder = builder.identity(identity(cert, key)?);
    }
    if spec.skip_verify {
        builder = builder.danger_accept_invalid_certs(true);
    }
    Ok(builder)
}

/// The system's trusted roots (`SSL_CERT_FILE`, `SSL_CERT_DIR` or the
/// platform's store), loaded on first use.
pub(crate) fn system_roots() -> &'static [CertificateDer<'static>] {
    static ROOTS: OnceLock<Vec<CertificateDer<'static>>> = OnceLock::new();
    ROOTS.get_or_init(|| rustls_native_certs::load_native_certs().certs)
}

/// What a client trusts without settings of its own: the system store and
/// the roots built into reqwest (webpki-roots), as reqwest's own builder
/// would have it. Unparsable entries are skipped, as reqwest does.
fn system_root_store() -> RootCertStore {
    let mut store = RootCertStore::empty();
    store.add_parsable_certificates(system_roots().iter().cloned());
    store.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    store
}

/// The verifier of every client without TLS settings of its own, one per
/// process.
pub(crate) fn system_verifier() -> &'static Arc<RootsAtFirstUse> {
    static VERIFIER: OnceLock<Arc<RootsAtFirstUse>> = OnceLock::new();
    VERIFIER.get_or_init(|| Arc::new(RootsAtFirstUse::new(system_root_store)))
}

/// The TLS settings of every client without settings of its own. Its roots
/// are read at the first handshake, not when a client is made: a mount of
/// a plain-HTTP registry (a node's loopback registry or mirror) never reads
/// the system store, about 150 files on Debian (25 ms of a mount's 85 ms
/// with a cold page cache, 7 ms with a warm one, in its CLI and again in
/// its worker).
///
/// None if the process's crypto provider offers neither TLS version (a
/// default provider installed by something else); reqwest then builds.
fn system_tls() -> Option<&'static rustls::ClientConfig> {
    static CONFIG: OnceLock<Option<rustls::ClientConfig>> = OnceLock::new();
    CONFIG
        .get_or_init(|| tls_config(system_verifier().clone()))
        .as_ref()
}

/// The crypto reqwest uses: the process's default provider, else ring.
fn crypto_provider() -> Arc<CryptoProvider> {
    CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()))
}

/// A rustls client configuration as reqwest builds one (TLS 1.2 and 1.3,
/// HTTP/1.1 by ALPN, no client certificate), with `verifier`.
fn tls_config(verifier: Arc<RootsAtFirstUse>) -> Option<rustls::ClientConfig> {
    let mut config = rustls::ClientConfig::builder_with_provider(verifier.provider.clone())
        .with_protocol_versions(rustls::ALL_VERSIONS)
        .ok()?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Some(config)
}

/// The web PKI verification reqwest does (rustls's, against the roots
/// `load` returns), with the roots loaded at the first certificate to
/// check. Without any root no certificate is trusted.
#[derive(Debug)]
pub(crate) struct RootsAtFirstUse {
    load: fn() -> RootCertStore,
    provider: Arc<CryptoProvider>,
    verifier: OnceLock<Option<Arc<WebPkiServerVerifier>>>,
}

impl RootsAtFirstUse {
    fn new(load: fn() -> RootCertStore) -> Self {
        RootsAtFirstUse {
            load,
            provider: crypto_provider(),
            verifier: OnceLock::new(),
        }
    }

    /// The verifier over the roots, built on first use.
    pub(crate) fn verifier(&self) -> Option<&Arc<WebPkiServerVerifier>> {
        self.verifier
            .get_or_init(|| {
                let roots = Arc::new((self.load)());
                WebPkiServerVerifier::builder_with_provider(roots, self.provider.clone())
                    .build()
                    .ok()
            })
            .as_ref()
    }
}

impl ServerCertVerifier for RootsAtFirstUse {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.verifier() {
            Some(v) => {
                v.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
            }
            None => Err(rustls::Error::InvalidCertificate(
                CertificateError::UnknownIssuer,
            )),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The headers of a hosts file (validated when it was parsed), marked
/// sensitive: they may carry tokens, which no debug output of a request
/// should show.
fn header_map(headers: &[(String, String)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        if let (Ok(n), Ok(mut v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            v.set_sensitive(true);
            map.append(n, v);
        }
    }
    map
}

/// A client identity: certificate and key in one PEM file, or in two.
fn identity(cert: &Path, key: Option<&Path>) -> Result<Identity, OciError> {
    let mut pem = read_pem(cert, "read client certificate")?;
    if let Some(key) = key {
        pem.push(b'\n');
        pem.extend(read_pem(key, "read client key")?);
    }
    Identity::from_pem(&pem).map_err(|e| {
        OciError::io(
            "read client certificate",
            cert,
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("not a PEM certificate and private key: {e}"),
            ),
        )
    })
}

fn read_pem(path: &Path, action: &'static str) -> Result<Vec<u8>, OciError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|f| f.take(MAX_CA_FILE + 1).read_to_end(&mut bytes))
        .map_err(|e| OciError::io(action, path, e))?;
    if bytes.len() as u64 > MAX_CA_FILE {
        let e = io::Error::new(
            io::ErrorKind::InvalidData,
            format!("larger than {MAX_CA_FILE} bytes"),
        );
        return Err(OciError::io(action, path, e));
    }
    Ok(bytes)
}

/// The certificates of a PEM bundle (one or more `CERTIFICATE` blocks).
fn ca_certificates(path: &Path) -> Result<Vec<Certificate>, OciError> {
    let bad = |message: String| {
        OciError::io(
            "read CA file",
            path,
            io::Error::new(io::ErrorKind::InvalidData, message),
        )
    };
    let bytes = read_pem(path, "read CA file")?;
    let certs = Certificate::from_pem_bundle(&bytes)
        .map_err(|e| bad(format!("not a PEM certificate bundle: {e}")))?;
    if certs.is_empty() {
        return Err(bad("no PEM CERTIFICATE block in it".to_string()));
    }
    Ok(certs)
}

/// The innermost complaint about a certificate in `err`'s cause chain, when
/// the request failed because the server's certificate was not trusted.
pub(crate) fn certificate_failure(err: &reqwest::Error) -> Option<String> {
    let mut found = None;
    let mut cause = err.source();
    while let Some(e) = cause {
        let text = e.to_string();
        if text.contains("certificate") {
            found = Some(text);
        }
        cause = e.source();
    }
    found
}

/// A request error as an [`OciError`]: certificate failures get their own
/// variant so the message says what to do.
pub(crate) fn http_error(method: &str, url: &str, source: reqwest::Error) -> OciError {
    match certificate_failure(&source) {
        Some(detail) => OciError::Tls {
            url: url.to_string(),
            detail,
        },
        None => OciError::Http {
            method: method.to_string(),
            url: url.to_string(),
            source,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_by_address_not_by_name() {
        assert!(is_loopback("127.0.0.1"));
        assert!(is_loopback("127.0.0.1:5000"));
        assert!(is_loopback("127.9.8.7"));
        assert!(is_loopback("[::1]:5000"));
        assert!(is_loopback("[::ffff:127.0.0.1]:5000"));
        assert!(is_loopback("localhost:5000"));
        assert!(is_loopback("LOCALHOST"));
        assert!(!is_loopback("10.0.0.1:5000"));
        assert!(!is_loopback("[::2]:5000"));
        // Looks like 127.x but is a name: only its addresses could make it
        // loopback, and it does not resolve to loopback.
        assert!(!is_loopback("127.example.com"));
        assert!(!is_loopback("127.example.com:5000"));
        assert!(!is_loopback("127.0.0.1.example.com"));
        assert_eq!(host_name("[::1]:5000"), "[::1]");
        assert_eq!(host_name("h:1"), "h");
        assert_eq!(bare_name("[::1]:5000"), "::1");
    }

    #[test]
    fn plain_http_only_for_loopback_and_insecure_hosts() {
        let plain = |host: &str, opts: &SourceOptions| {
            let r = reach(host, opts);
            (r.plain, r.loopback.is_some())
        };
        let default = SourceOptions::default();
        assert_eq!(plain("127.0.0.1:5000", &default), (true, true));
        assert_eq!(plain("[::1]:5000", &default), (true, true));
        assert_eq!(plain("localhost:5000", &default), (true, true));
        assert_eq!(plain("127.example.com", &default), (false, false));
        assert_eq!(plain("127.example.com:5000", &default), (false, false));
        let opts = SourceOptions {
            insecure_hosts: vec!["10.1.2.3".into()],
            tls_hosts: vec!["127.0.0.1:5001".into()],
            ..SourceOptions::default()
        };
        assert_eq!(plain("10.1.2.3:5000", &opts), (true, false));
        assert_eq!(plain("10.1.2.4:5000", &opts), (false, false));
        assert_eq!(plain("127.0.0.1:5001", &opts), (false, true));
        assert_eq!(plain("127.0.0.1:5002", &opts), (true, true));
    }

    /// Making clients reads no root; the first certificate to check reads
    /// them, once; with none, nothing is trusted.
    #[test]
    fn roots_are_read_at_the_first_certificate() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static LOADS: AtomicUsize = AtomicUsize::new(0);
        fn no_roots() -> RootCertStore {
            LOADS.fetch_add(1, Ordering::SeqCst);
            RootCertStore::empty()
        }
        let verifier = Arc::new(RootsAtFirstUse::new(no_roots));
        let config = tls_config(verifier.clone()).expect("TLS config");
        for _ in 0..2 {
            Client::builder()
                .use_preconfigured_tls(config.clone())
                .build()
                .expect("client");
        }
        assert_eq!(LOADS.load(Ordering::SeqCst), 0, "a client read the roots");
        let cert = CertificateDer::from(vec![0x30, 0x03, 0x02, 0x01, 0x01]);
        let name = ServerName::try_from("registry.example").expect("name");
        for _ in 0..2 {
            let err = verifier
                .verify_server_cert(&cert, &[], &name, &[], UnixTime::now())
                .expect_err("nothing is trusted without roots");
            assert_eq!(
                err,
                rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer)
            );
        }
        assert_eq!(LOADS.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn ca_file_must_hold_certificates() {
        let dir = tempfile::tempdir().expect("tmp");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").expect("write");
        let err = ca_certificates(&empty).expect_err("no certs");
        assert!(
            err.to_string().contains("no PEM CERTIFICATE block"),
            "{err}"
        );
        let missing = dir.path().join("missing.pem");
        let err = ca_certificates(&missing).expect_err("missing");
        assert!(matches!(err, OciError::Io { .. }), "{err}");
    }
}
