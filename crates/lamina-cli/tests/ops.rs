//! Operations: the config file, Prometheus metrics and structured logs, as
//! the binary honours them. No registry, no mount and no root needed: the
//! snapshotter runs on a temp root and is called over its gRPC socket
//! directly; `lamina status` reads a run directory written here.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use lamina_snapshotter::proto::snapshots_client::SnapshotsClient;
use lamina_snapshotter::proto::{PrepareSnapshotRequest, StatSnapshotRequest};
use serde_json::Value;

/// A lamina command that sees no config or log settings of the caller.
fn lamina_clean<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut c = lamina_cmd(args);
    for var in [
        "LAMINA_CONFIG",
        "LAMINA_LOG",
        "LAMINA_LOG_FORMAT",
        "LAMINA_STATE_DIR",
    ] {
        c.env_remove(var);
    }
    c
}

/// The address the snapshotter logged for its metrics (JSON log lines).
fn metrics_address(bg: &mut Background) -> String {
    let started = Instant::now();
    loop {
        let log = std::fs::read_to_string(&bg.stderr_path).unwrap_or_default();
        let found = log.lines().find_map(|l| {
            let v: Value = serde_json::from_str(l).ok()?;
            let fields = &v["fields"];
            (fields["message"] == "metrics serving at /metrics")
                .then(|| fields["address"].as_str().map(String::from))?
        });
        if let Some(addr) = found {
            return addr;
        }
        assert!(
            bg.running() && started.elapsed() < Duration::from_secs(30),
            "no JSON log line with the metrics address:\n{}",
            bg.describe()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Calls the snapshotter on `sock`: a Stat of a missing key (NotFound), then
/// a Prepare of an active snapshot.
fn call_snapshotter(sock: &Path) {
    let sock = sock.to_path_buf();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        // The URI is a placeholder: the connector dials the unix socket.
        let channel = tonic::transport::Endpoint::from_static("http://[::]:50051")
            .connect_with_connector(tower::service_fn(move |_| {
                let sock = sock.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(sock).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                }
            }))
            .await
            .expect("connecting to the snapshotter");
        let mut client = SnapshotsClient::new(channel);
        let missing = client
            .stat(StatSnapshotRequest {
                snapshotter: "lamina".into(),
                key: "no-such-key".into(),
            })
            .await
            .expect_err("stat of a missing key");
        assert_eq!(missing.code(), tonic::Code::NotFound, "{missing:?}");
        let prepared = client
            .prepare(PrepareSnapshotRequest {
                snapshotter: "lamina".into(),
                key: "ops-active".into(),
                ..Default::default()
            })
            .await
            .expect("prepare");
        assert!(!prepared.into_inner().mounts.is_empty());
    });
}

/// `lamina snapshotter` with every setting from `--config`: its socket, its
/// root, JSON logs and a metrics endpoint; the scrape has every family, and
/// the gRPC and snapshot figures move after calls.
#[test]
fn snapshotter_takes_its_settings_from_the_config_file_and_serves_metrics() {
    let t = TestDir::new("ops-snapshotter");
    let (root, sock, config) = (t.join("root"), t.join("snap.sock"), t.join("config.toml"));
    std::fs::write(
        &config,
        format!(
            "log_format = \"json\"\n[snapshotter]\nroot = \"{}\"\naddress = \"{}\"\n\
             metrics_address = \"127.0.0.1:0\"\n",
            root.display(),
            sock.display()
        ),
    )
    .unwrap();
    let mut c = lamina_clean([
        std::ffi::OsStr::new("--config"),
        config.as_os_str(),
        std::ffi::OsStr::new("snapshotter"),
    ]);
    let mut bg = Background::spawn("snapshotter", &mut c, t.path());
    let addr = metrics_address(&mut bg);
    let started = Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(
            bg.running() && started.elapsed() < Duration::from_secs(30),
            "no gRPC socket at the config file's address:\n{}",
            bg.describe()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        root.join("state.json").exists() || root.join("snapshots").is_dir(),
        "root from the file"
    );

    let before = scrape(&addr);
    for family in [
        "# TYPE lamina_snapshotter_grpc_requests counter",
        "# TYPE lamina_snapshotter_snapshots gauge",
        "# TYPE lamina_mounts_live gauge",
        "# TYPE lamina_fetched_bytes counter",
        "# TYPE lamina_range_requests counter",
        "# TYPE lamina_misses counter",
        "# TYPE lamina_miss_errors counter",
        "# TYPE lamina_bad_chunks counter",
        "# TYPE lamina_cache_bytes gauge",
        "# TYPE lamina_image_bytes gauge",
        "# TYPE lamina_miss_latency_seconds histogram",
        "# EOF",
    ] {
        assert!(
            before.lines().any(|l| l == family),
            "no {family:?} in:\n{before}"
        );
    }
    let active = r#"lamina_snapshotter_snapshots{kind="active",backing="overlay"}"#;
    assert_eq!(sample(&before, active), Some(0.0), "{before}");
    assert_eq!(sample(&before, "lamina_mounts_live"), Some(0.0), "{before}");
    let stat = r#"lamina_snapshotter_grpc_requests_total{method="stat"}"#;
    assert_eq!(sample(&before, stat), Some(0.0), "{before}");

    call_snapshotter(&sock);
    let after = scrape(&addr);
    let not_found = r#"lamina_snapshotter_grpc_errors_total{method="stat",code="NotFound"}"#;
    let prepare = r#"lamina_snapshotter_grpc_requests_total{method="prepare"}"#;
    assert_eq!(sample(&after, stat), Some(1.0), "{after}");
    assert_eq!(sample(&after, not_found), Some(1.0), "{after}");
    assert_eq!(sample(&after, prepare), Some(1.0), "{after}");
    assert_eq!(sample(&after, active), Some(1.0), "{after}");
    assert!(bg.running(), "{}", bg.describe());
}

/// `lamina status --prometheus` with the cache dir from the file: a live
/// mount's figures (the run directory of one, with this test as its holder).
#[test]
fn status_prints_prometheus_figures_of_the_config_files_cache_dir() {
    let t = TestDir::new("ops-status");
    let run_dir = t.mkdir("cache/mounts/0123456789abcdef");
    let write = |name: &str, v: Value| std::fs::write(run_dir.join(name), v.to_string()).unwrap();
    write(
        "config.json",
        serde_json::json!({"image": "reg.lan/app@sha256:ab"}),
    );
    write(
        "ready",
        serde_json::json!({"pid": std::process::id(), "error": null}),
    );
    write(
        "status.json",
        serde_json::json!({
            "pid": 1, "image": "reg.lan/app@sha256:ab", "mountpoint": "/mnt",
            "fetched_bytes": 4096, "requests": 3, "misses": 2, "failed_misses": 1,
            "bad_chunks": 0, "cached_bytes": 8192, "total_bytes": 65536,
            "prefetch_done": 0, "prefetch_total": 0, "blobs": [],
            "miss_latency": {"bounds": [0.01, 1.0], "counts": [1, 1, 0], "sum": 0.5}
        }),
    );
    let config = t.join("lamina.toml");
    std::fs::write(
        &config,
        format!("cache_dir = \"{}\"\n", t.join("cache").display()),
    )
    .unwrap();
    let mut c = lamina_clean(["status", "--prometheus"]);
    c.env("LAMINA_CONFIG", &config);
    let out = run(&mut c, SHORT).ok();
    let image = r#"{image="reg.lan/app@sha256:ab"}"#;
    for (series, value) in [
        ("lamina_mounts_live".to_string(), 1.0),
        (format!("lamina_fetched_bytes_total{image}"), 4096.0),
        (format!("lamina_miss_errors_total{image}"), 1.0),
        (format!("lamina_cache_bytes{image}"), 8192.0),
        (format!("lamina_miss_latency_seconds_count{image}"), 2.0),
        (
            r#"lamina_miss_latency_seconds_bucket{le="0.01",image="reg.lan/app@sha256:ab"}"#.into(),
            1.0,
        ),
    ] {
        assert_eq!(
            sample(&out.stdout, &series),
            Some(value),
            "{series}:\n{}",
            out.describe()
        );
    }
    assert!(
        !out.stdout.contains("# EOF"),
        "a textfile collector concatenates files"
    );
}

/// A config file with an unknown key, or one named but missing, is a usage
/// error that names the file, the key and the line.
#[test]
fn a_bad_config_file_is_a_usage_error_naming_key_file_and_line() {
    let t = TestDir::new("ops-badconfig");
    let config = t.join("bad.toml");
    std::fs::write(&config, "cache_dir = \"/x\"\n[gc]\nmax_sise = \"1G\"\n").unwrap();
    let cfg = config.to_str().unwrap();
    let out = run(&mut lamina_clean(["--config", cfg, "status"]), SHORT).code_is(2);
    for needle in [cfg, "max_sise", "line 3"] {
        assert!(out.stderr.contains(needle), "{needle}:\n{}", out.describe());
    }
    let missing = t.join("missing.toml");
    let out = run(
        &mut lamina_clean(["--config", missing.to_str().unwrap(), "status"]),
        SHORT,
    )
    .code_is(2);
    assert!(out.stderr.contains("missing.toml"), "{}", out.describe());
}

/// The first non-empty regular file below `root`, read whole.
fn read_one_file(root: &Path) -> usize {
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                dirs.push(e.path());
            } else if m.is_file() && m.len() > 0 {
                return std::fs::read(e.path()).unwrap().len();
            }
        }
    }
    panic!("no non-empty file below {}", root.display());
}

/// The lines of a daemon's log, each parsed as JSON (asserting they are).
fn json_lines(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| {
                panic!("{}: not a JSON line ({e}): {l}\n{text}", path.display())
            })
        })
        .collect()
}

/// A lazy mount given `--log-format json` and, from its config file,
/// `log = "debug"`: both daemons log JSON lines with levels (the holder's
/// lifecycle at info, the worker's per-miss detail at debug), and the
/// reader's wait lands in the miss-latency histogram that `lamina status
/// --prometheus` shows.
#[test]
fn lazy_mount_daemons_log_json_at_the_configured_level_and_time_misses() {
    if !require(&["zstd"]) {
        return;
    }
    let t = TestDir::new("ops-lazy-logs");
    let image = oci_ref(&t.join("out"), "edge");
    lamina(["convert", &oci_ref(&edge_layout(), "edge"), &image]).ok();
    let config = t.join("config.toml");
    std::fs::write(&config, "log = \"debug\"\n").unwrap();
    let cache = t.join("cache");
    let args = [
        "--lazy",
        "--prefetch",
        "none",
        "--log-format",
        "json",
        "--config",
    ];
    let mut extra = args.to_vec();
    extra.push(config.to_str().unwrap());
    let m = Mount::with_args(&image, &t.join("mnt"), &cache, &extra);
    assert!(read_one_file(&m.path) > 0);

    let runs: Vec<_> = std::fs::read_dir(cache.join("mounts"))
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(runs.len(), 1, "one run dir");
    let rd = runs[0].path();
    let started = Instant::now();
    let latency_count = |s: &Value| {
        s["miss_latency"]["counts"]
            .as_array()
            .map(|c| c.iter().map(|n| n.as_u64().unwrap_or(0)).sum::<u64>())
    };
    loop {
        let status: Value = std::fs::read(rd.join("status.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(Value::Null);
        let misses = status["misses"].as_u64().unwrap_or(0);
        if misses > 0 && latency_count(&status) == Some(misses) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no miss timed in status.json: {status}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let holder = json_lines(&rd.join("holder.log"));
    let worker = json_lines(&rd.join("worker.log"));
    let has = |lines: &[Value], level: &str, message: &str| {
        lines
            .iter()
            .any(|v| v["level"] == level && v["fields"]["message"] == message)
    };
    assert!(has(&holder, "INFO", "mounted; serving"), "{holder:#?}");
    assert!(
        has(&holder, "DEBUG", "miss"),
        "holder at debug: {holder:#?}"
    );
    assert!(has(&worker, "INFO", "serving misses"), "{worker:#?}");
    let answered = worker
        .iter()
        .find(|v| v["level"] == "DEBUG" && v["fields"]["message"] == "miss answered")
        .unwrap_or_else(|| panic!("no per-miss debug line: {worker:#?}"));
    assert!(
        answered["fields"]["waited_ms"].as_f64().is_some(),
        "{answered}"
    );

    let out = lamina([
        "status".as_ref(),
        "--prometheus".as_ref(),
        "--cache-dir".as_ref(),
        cache.as_os_str(),
    ])
    .ok();
    let count = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("lamina_miss_latency_seconds_count{"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok());
    assert!(count.is_some_and(|c| c > 0), "{}", out.describe());
    m.unmount();
}
