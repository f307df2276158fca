//! The snapshotter's Prometheus endpoint: `GET /metrics` over HTTP/1.1 on
//! a TCP address or a unix socket, in the OpenMetrics text format (which
//! Prometheus reads).
//!
//! A scrape never takes the snapshotter's lock (a lazy mount may hold it
//! while it fetches an image's metadata): gRPC counts and the snapshot
//! census are kept up to date by the calls themselves, and the mounts'
//! figures are read from their status files (`lamina_mount::metrics`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use lamina_mount::metrics::MountsCollector;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::state::{Backing, Kind};

/// Where metrics are served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricsAddress {
    /// `HOST:PORT` (port 0 picks a free one, logged at start).
    Tcp(SocketAddr),
    /// `unix:/path.sock` (created 0600).
    Unix(PathBuf),
}

impl FromStr for MetricsAddress {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if !path.starts_with('/') {
                return Err(format!("{s:?}: a unix socket path must be absolute"));
            }
            return Ok(MetricsAddress::Unix(PathBuf::from(path)));
        }
        s.parse::<SocketAddr>()
            .map(MetricsAddress::Tcp)
            .map_err(|_| format!("{s:?}: expected IP:PORT (e.g. 127.0.0.1:9464) or unix:/PATH"))
    }
}

impl std::fmt::Display for MetricsAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MetricsAddress::Tcp(a) => write!(f, "{a}"),
            MetricsAddress::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

type MethodLabel = [(&'static str, &'static str); 1];
type ErrorLabels = [(&'static str, String); 2];
type SnapshotLabels = [(&'static str, &'static str); 2];

/// The snapshotter's own metrics, plus the mounts' read at each scrape.
#[derive(Debug)]
pub struct Metrics {
    images: ImageKinds,
    grpc_requests: Family<MethodLabel, Counter>,
    grpc_errors: Family<ErrorLabels, Counter>,
    snapshots: Family<SnapshotLabels, Gauge>,
    remounts: Counter,
    gc_runs: Counter,
    gc_freed_bytes: Counter,
    cache_bytes: Gauge,
    registry: Registry,
}

/// Images the snapshotter was asked about, by how they are served: `lamina`
/// (a lamina image, lazily), `tar_index` (an unmodified image through its
/// tar index, lazily) or `plain` (neither: containerd pulls and unpacks it
/// into overlayfs snapshots). Counted once per reference resolved; a plain
/// image whose tar index the node's policy refused is also counted as
/// `index_refused`.
#[derive(Debug, Clone, Default)]
pub struct ImageKinds(Family<[(&'static str, &'static str); 1], Counter>);

/// The kinds [`ImageKinds`] counts.
pub const IMAGE_KINDS: [&str; 4] = ["lamina", "tar_index", "plain", "index_refused"];

impl ImageKinds {
    /// Counts an image of `kind` (one of [`IMAGE_KINDS`]).
    pub fn count(&self, kind: &'static str) {
        self.0.get_or_create(&[("kind", kind)]).inc();
    }
}

/// The methods of containerd's snapshots service, as `record_call` names them.
pub const METHODS: [&str; 10] = [
    "prepare", "view", "mounts", "commit", "remove", "stat", "update", "list", "usage", "cleanup",
];

const KINDS: [Kind; 3] = [Kind::View, Kind::Active, Kind::Committed];
const BACKINGS: [&str; 3] = ["overlay", "lamina_layer", "lamina_image"];

/// The `backing` label of a snapshot.
pub fn backing_label(b: &Backing) -> &'static str {
    match b {
        Backing::Overlay => BACKINGS[0],
        Backing::LaminaLayer { .. } => BACKINGS[1],
        Backing::LaminaImage { .. } => BACKINGS[2],
    }
}

impl Metrics {
    /// Metrics for a snapshotter whose lamina mounts use `cache_dir`.
    pub fn new(cache_dir: PathBuf) -> Self {
        Metrics::of_dirs(vec![cache_dir])
    }

    /// Metrics for a snapshotter whose lamina mounts use `cache_dirs` (its
    /// own and its tenants').
    pub fn of_dirs(cache_dirs: Vec<PathBuf>) -> Self {
        let mut registry = Registry::default();
        let grpc_requests = Family::<MethodLabel, Counter>::default();
        let grpc_errors = Family::<ErrorLabels, Counter>::default();
        let snapshots = Family::<SnapshotLabels, Gauge>::default();
        let images = ImageKinds::default();
        registry.register(
            "lamina_snapshotter_images",
            "Images resolved, by how they are served (plain: pulled into overlayfs)",
            images.0.clone(),
        );
        registry.register(
            "lamina_snapshotter_grpc_requests",
            "Snapshots gRPC calls, by method",
            grpc_requests.clone(),
        );
        registry.register(
            "lamina_snapshotter_grpc_errors",
            "Snapshots gRPC calls that failed, by method and gRPC code",
            grpc_errors.clone(),
        );
        registry.register(
            "lamina_snapshotter_snapshots",
            "Snapshots, by kind and by what backs them",
            snapshots.clone(),
        );
        let (remounts, gc_runs, gc_freed_bytes) = Default::default();
        let cache_bytes = Gauge::default();
        registry.register(
            "lamina_snapshotter_remounts",
            "Lamina images mounted again because their mount was gone or its daemon dead",
            Counter::clone(&remounts),
        );
        registry.register(
            "lamina_snapshotter_gc_runs",
            "Background collections of the shared cache (--cache-max-size)",
            Counter::clone(&gc_runs),
        );
        registry.register(
            "lamina_snapshotter_gc_freed_bytes",
            "Bytes the background collections freed",
            Counter::clone(&gc_freed_bytes),
        );
        registry.register(
            "lamina_snapshotter_cache_bytes",
            "The shared cache's allocated bytes after the last collection",
            Gauge::clone(&cache_bytes),
        );
        registry.register_collector(Box::new(MountsCollector::of_dirs(cache_dirs)));
        let metrics = Metrics {
            images,
            grpc_requests,
            grpc_errors,
            snapshots,
            remounts,
            gc_runs,
            gc_freed_bytes,
            cache_bytes,
            registry,
        };
        // Every series from the start, at 0 (errors appear with the first:
        // their codes are not known in advance).
        for method in METHODS {
            metrics
                .grpc_requests
                .get_or_create(&[("method", method)])
                .inc_by(0);
        }
        metrics.set_snapshots(std::iter::empty());
        for kind in IMAGE_KINDS {
            metrics.images.0.get_or_create(&[("kind", kind)]).inc_by(0);
        }
        metrics
    }

    /// The counter of images resolved, for the side that resolves them.
    pub fn image_kinds(&self) -> ImageKinds {
        self.images.clone()
    }

    /// Counts a lamina image mounted again (`Snapshotter::reconcile`).
    pub fn count_remount(&self) {
        self.remounts.inc();
    }

    /// Records a background collection of the cache.
    pub fn record_gc(&self, freed: u64, kept: u64) {
        self.gc_runs.inc();
        self.gc_freed_bytes.inc_by(freed);
        self.cache_bytes
            .set(i64::try_from(kept).unwrap_or(i64::MAX));
    }

    /// Counts a gRPC call of `method` and, if it failed, its code.
    pub fn record_call(&self, method: &'static str, error: Option<tonic::Code>) {
        self.grpc_requests
            .get_or_create(&[("method", method)])
            .inc();
        if let Some(code) = error {
            let labels = [
                ("method", method.to_string()),
                ("code", format!("{code:?}")),
            ];
            self.grpc_errors.get_or_create(&labels).inc();
        }
    }

    /// Sets the snapshot census from every snapshot's (kind, backing); the
    /// combinations not seen are set to 0.
    pub fn set_snapshots<'a>(&self, snapshots: impl Iterator<Item = (Kind, &'a Backing)>) {
        let mut counts = [[0i64; BACKINGS.len()]; KINDS.len()];
        for (kind, backing) in snapshots {
            let k = KINDS.iter().position(|x| *x == kind).unwrap_or(0);
            let b = BACKINGS
                .iter()
                .position(|x| *x == backing_label(backing))
                .unwrap_or(0);
            counts[k][b] += 1;
        }
        for (k, kind) in KINDS.iter().enumerate() {
            for (b, backing) in BACKINGS.iter().enumerate() {
                let labels = [("kind", kind.as_str()), ("backing", *backing)];
                self.snapshots.get_or_create(&labels).set(counts[k][b]);
            }
        }
    }

    /// The exposition, as a scrape gets it.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail; an encoder error would be a bug.
        if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::error!("encoding metrics: {e}");
        }
        text
    }
}

/// A bound metrics listener.
#[derive(Debug)]
pub enum Listener {
    /// TCP.
    Tcp(tokio::net::TcpListener),
    /// A unix socket.
    Unix(tokio::net::UnixListener),
}

/// Binds `address` (inside a tokio runtime); a unix socket's stale file is
/// replaced. Returns the listener and the address it got (the port that
/// port 0 picked).
pub async fn bind(address: &MetricsAddress) -> anyhow::Result<(Listener, String)> {
    match address {
        MetricsAddress::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("metrics: listening on {addr}"))?;
            let local = listener.local_addr()?.to_string();
            Ok((Listener::Tcp(listener), local))
        }
        MetricsAddress::Unix(path) => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            let listener = bind_private(path)
                .with_context(|| format!("metrics: listening on {}", path.display()))?;
            Ok((Listener::Unix(listener), address.to_string()))
        }
    }
}

/// A unix socket at `path` that nobody else can ever connect to: bound in
/// a fresh 0700 directory beside it, made 0600, then renamed into place (a
/// socket chmodded after `bind` is open to everyone in between). A stale
/// socket at `path` is replaced.
fn bind_private(path: &std::path::Path) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let dir = path.with_extension(format!("bind-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    let staged = dir.join("sock");
    let bound = tokio::net::UnixListener::bind(&staged).and_then(|listener| {
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&staged, path)?;
        Ok(listener)
    });
    let _ = std::fs::remove_dir_all(&dir);
    bound
}

/// Serves scrapes on `listener` until the runtime stops.
pub async fn serve(listener: Listener, metrics: Arc<Metrics>) {
    loop {
        let accepted = match &listener {
            Listener::Tcp(l) => l
                .accept()
                .await
                .map(|(s, _)| connection(s, metrics.clone())),
            Listener::Unix(l) => l
                .accept()
                .await
                .map(|(s, _)| connection(s, metrics.clone())),
        };
        if let Err(e) = accepted {
            // Out of fds, say: breathe rather than spin.
            tracing::warn!("metrics: accepting a connection: {e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Serves one HTTP/1.1 connection in its own task.
fn connection<S>(stream: S, metrics: Arc<Metrics>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let service = hyper::service::service_fn(move |req| respond(req, metrics.clone()));
        let served = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(Duration::from_secs(10))
            .serve_connection(TokioIo::new(stream), service)
            .await;
        if let Err(e) = served {
            tracing::debug!("metrics: connection: {e}");
        }
    });
}

async fn respond(
    req: Request<hyper::body::Incoming>,
    metrics: Arc<Metrics>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let reply = |status: StatusCode, body: String| {
        let mut resp = Response::new(Full::new(Bytes::from(body)));
        *resp.status_mut() = status;
        resp
    };
    if req.uri().path() != "/metrics" {
        return Ok(reply(StatusCode::NOT_FOUND, "try /metrics\n".into()));
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return Ok(reply(StatusCode::METHOD_NOT_ALLOWED, String::new()));
    }
    // Reading the mounts' status files is file I/O: off the async threads.
    let text = tokio::task::spawn_blocking(move || metrics.encode())
        .await
        .unwrap_or_default();
    let mut resp = reply(StatusCode::OK, text);
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
    );
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn addresses_parse_and_print_back() {
        for s in ["127.0.0.1:9464", "[::1]:0", "unix:/run/lamina/metrics.sock"] {
            assert_eq!(s.parse::<MetricsAddress>().unwrap().to_string(), s);
        }
        for bad in ["localhost:9464", "unix:relative.sock", "9464", ""] {
            assert!(bad.parse::<MetricsAddress>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn calls_and_snapshots_are_counted() {
        let cache = tempfile::tempdir().unwrap();
        let m = Metrics::new(cache.path().to_path_buf());
        m.record_call("stat", None);
        m.record_call("stat", Some(tonic::Code::NotFound));
        m.record_call("prepare", None);
        let image = Backing::LaminaImage { image: "i".into() };
        m.set_snapshots(
            [
                (Kind::Committed, &Backing::Overlay),
                (Kind::Committed, &image),
                (Kind::Committed, &image),
            ]
            .into_iter(),
        );
        let text = m.encode();
        for line in [
            r#"lamina_snapshotter_grpc_requests_total{method="stat"} 2"#,
            r#"lamina_snapshotter_grpc_requests_total{method="prepare"} 1"#,
            r#"lamina_snapshotter_grpc_requests_total{method="cleanup"} 0"#,
            r#"lamina_snapshotter_grpc_errors_total{method="stat",code="NotFound"} 1"#,
            r#"lamina_snapshotter_snapshots{kind="committed",backing="lamina_image"} 2"#,
            r#"lamina_snapshotter_snapshots{kind="committed",backing="overlay"} 1"#,
            r#"lamina_snapshotter_snapshots{kind="active",backing="overlay"} 0"#,
            "lamina_mounts_live 0",
            "# EOF",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
        }
    }

    #[test]
    fn scrapes_are_served_over_a_unix_socket() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("m.sock");
        let metrics = Arc::new(Metrics::new(dir.path().join("cache")));
        metrics.record_call("list", None);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let addr = MetricsAddress::Unix(sock.clone());
        let (listener, shown) = rt.block_on(bind(&addr)).unwrap();
        assert_eq!(shown, format!("unix:{}", sock.display()));
        // Private from the start: bound elsewhere, renamed into place.
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&sock).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        let leftovers = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(leftovers, 1, "the socket alone, no staging dir");
        let client_sock = sock.clone();
        let get = move |path: &str| {
            let mut s = std::os::unix::net::UnixStream::connect(&client_sock).unwrap();
            write!(
                s,
                "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).unwrap();
            out
        };
        let (ok, missing) = rt.block_on(async {
            tokio::spawn(serve(listener, metrics));
            tokio::task::spawn_blocking(move || (get("/metrics"), get("/other")))
                .await
                .unwrap()
        });
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        assert!(ok.contains("application/openmetrics-text"), "{ok}");
        assert!(
            ok.contains(r#"lamina_snapshotter_grpc_requests_total{method="list"} 1"#),
            "{ok}"
        );
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
    }
}
