//! Registry client, source and sink against a real registry
//! (`/usr/bin/docker-registry`, skipped when absent) and a tiny fake token
//! server for the Bearer auth flow.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{check_layers, drain, TestImage};
use lamina_oci::{
    media_types as mt, open_sink, open_source, Descriptor, Digest, ImageIndex, ImageRef, OciError,
    Platform, RegistryClient, RegistryReference, SourceOptions,
};

const REGISTRY_BIN: &str = "/usr/bin/docker-registry";

struct Registry {
    child: Child,
    host: String,
    _dir: tempfile::TempDir,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

fn start_registry() -> Option<Registry> {
    if !Path::new(REGISTRY_BIN).exists() {
        println!("skipping registry test: {REGISTRY_BIN} not installed");
        return None;
    }
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("client");
    Some(spawn_registry("", "http", &client))
}

/// Start docker-registry on 127.0.0.1, `http_extra` appended to its `http:`
/// section, and wait (bounded) until `scheme://host/v2/` answers `client`.
fn spawn_registry(http_extra: &str, scheme: &str, client: &reqwest::blocking::Client) -> Registry {
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let host = format!("127.0.0.1:{port}");
    let config = format!(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {host}\n{http_extra}",
        dir.path().join("storage").display()
    );
    let config_path = dir.path().join("config.yml");
    std::fs::write(&config_path, config).expect("write config");
    let child = Command::new(REGISTRY_BIN)
        .arg("serve")
        .arg(&config_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn registry");
    let reg = Registry {
        child,
        host,
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(r) = client.get(format!("{scheme}://{}/v2/", reg.host)).send() {
            if r.status().is_success() {
                return reg;
            }
        }
        assert!(Instant::now() < deadline, "registry did not come up");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn reg_ref(host: &str, rest: &str) -> ImageRef {
    format!("docker://{host}/{rest}").parse().expect("ref")
}

// Over 100 lines: one push, pull and range sequence against the same registry.
#[test]
fn push_pull_range_against_real_registry() {
    let Some(reg) = start_registry() else { return };
    let tmp = tempfile::tempdir().expect("tmp");
    let opts = SourceOptions::default();
    let host = reg.host.as_str();

    // Push, pull back, compare.
    let img = TestImage::simple("registry");
    let digest = img.push(
        open_sink(&reg_ref(host, "lamina/test:v1"), &opts).expect("sink"),
        tmp.path(),
    );
    assert_eq!(digest, img.manifest_digest());
    let src = open_source(&reg_ref(host, "lamina/test:v1"), &opts).expect("source");
    assert_eq!(src.image().manifest_digest, digest);
    assert_eq!(src.image().manifest_bytes, img.manifest_bytes);
    assert_eq!(src.image().config_bytes, img.config);
    check_layers(src.as_ref(), &img);
    let blob = drain(&mut src.open_blob(&img.layers[0].descriptor).expect("blob")).expect("read");
    assert_eq!(blob, img.layers[0].blob);

    // By digest.
    let src =
        open_source(&reg_ref(host, &format!("lamina/test@{digest}")), &opts).expect("by digest");
    check_layers(src.as_ref(), &img);

    // Range reads.
    let client = RegistryClient::new(host, &opts).expect("client");
    let layer = &img.layers[0];
    let got = client
        .get_blob_range("lamina/test", &layer.descriptor.digest, 3, 10)
        .expect("range");
    assert_eq!(got, layer.blob[3..13]);
    let size = layer.blob.len() as u64;
    let got = client
        .get_blob_range("lamina/test", &layer.descriptor.digest, size - 5, 100)
        .expect("range at end");
    assert_eq!(got, layer.blob[layer.blob.len() - 5..]);
    assert!(client
        .get_blob_range("lamina/test", &layer.descriptor.digest, 0, 0)
        .expect("empty")
        .is_empty());
    let mut r = client
        .get_blob("lamina/test", &layer.descriptor.digest)
        .expect("get_blob");
    let mut all = Vec::new();
    r.read_to_end(&mut all).expect("read blob");
    assert_eq!(all, layer.blob);
    let missing = Digest::of_bytes(b"missing");
    assert!(matches!(
        client.get_blob_range("lamina/test", &missing, 0, 1),
        Err(OciError::BlobNotFound { .. })
    ));
    assert_eq!(
        client
            .blob_exists("lamina/test", &layer.descriptor.digest)
            .expect("head"),
        Some(size)
    );

    // Missing tag.
    let err = open_source(&reg_ref(host, "lamina/test:nope"), &opts).expect_err("missing tag");
    assert!(matches!(err, OciError::NotFound { .. }), "{err}");

    // Re-push the same blobs under another tag (HEAD says present).
    img.push(
        open_sink(&reg_ref(host, "lamina/test:v2"), &opts).expect("sink"),
        tmp.path(),
    );
    let m = client
        .get_manifest("lamina/test", &RegistryReference::Tag("v2".into()))
        .expect("manifest");
    assert_eq!(m.digest, digest);

    // A bad blob is refused before upload.
    let mut sink = open_sink(&reg_ref(host, "lamina/test:v3"), &opts).expect("sink");
    let mut bad = img.config_desc.clone();
    bad.digest = Digest::of_bytes(b"x");
    assert!(matches!(
        sink.put_blob_bytes(&bad, &img.config),
        Err(OciError::DigestMismatch { .. })
    ));
    drop(sink);

    // Multi-platform index: manifests pushed by digest, index by tag.
    let amd = TestImage::simple("amd");
    let arm = TestImage::simple("arm");
    let mut entries = Vec::new();
    for (i, arch) in [(&amd, "amd64"), (&arm, "arm64")] {
        let r = reg_ref(host, &format!("lamina/multi@{}", i.manifest_digest()));
        i.push(open_sink(&r, &opts).expect("sink"), tmp.path());
        let mut d = Descriptor::of_bytes(mt::OCI_MANIFEST, &i.manifest_bytes);
        d.platform = Some(Platform {
            os: "linux".into(),
            architecture: arch.into(),
            ..Platform::default()
        });
        entries.push(d);
    }
    let index = ImageIndex {
        manifests: entries,
        ..ImageIndex::default()
    };
    let index_bytes = serde_json::to_vec(&index).expect("json");
    let sink = open_sink(&reg_ref(host, "lamina/multi:latest"), &opts).expect("sink");
    sink.commit(&index_bytes, mt::OCI_INDEX)
        .expect("push index");
    for (arch, i) in [("amd64", &amd), ("arm64", &arm)] {
        let o = SourceOptions {
            platform: ("linux".into(), arch.into()),
            ..SourceOptions::default()
        };
        let src = open_source(&reg_ref(host, "lamina/multi"), &o).expect("multi");
        assert_eq!(src.image().manifest_digest, i.manifest_digest());
        check_layers(src.as_ref(), i);
    }
}

/// Minimal HTTP/1.1 request: head, and a small body when announced.
struct Req {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: String,
}

fn read_req(stream: &TcpStream) -> Option<Req> {
    let mut r = BufReader::new(stream.try_clone().ok()?);
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let method = line.split_whitespace().next()?.to_string();
    let path = line.split_whitespace().nth(1)?.to_string();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).ok()?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let len = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse::<u64>().ok())
        .unwrap_or(0);
    let mut body = String::new();
    r.take(len.min(1 << 16)).read_to_string(&mut body).ok()?;
    Some(Req {
        method,
        path,
        headers,
        body,
    })
}

fn respond(mut s: &TcpStream, status: &str, extra: &[(&str, String)], body: &[u8]) {
    let mut head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let _ = s.write_all(head.as_bytes());
    let _ = s.write_all(body);
}

#[test]
fn bearer_token_flow_with_fake_registry() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let manifest = TestImage::simple("auth").manifest_bytes;
    let token_calls = Arc::new(AtomicUsize::new(0));
    let calls = token_calls.clone();
    let body = manifest.clone();
    let server = std::thread::spawn(move || {
        // Bounded: serve at most 10 connections, each with a read timeout.
        for _ in 0..10 {
            let Ok((stream, _)) = listener.accept() else {
                return;
            };
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let Some(req) = read_req(&stream) else {
                continue;
            };
            let auth = req
                .headers
                .iter()
                .find(|(k, _)| k == "authorization")
                .map(|(_, v)| v.clone());
            if req.path.starts_with("/token") {
                calls.fetch_add(1, Ordering::SeqCst);
                assert!(
                    req.path.contains("scope=repository%3Aa%2Fb%3Apull"),
                    "{}",
                    req.path
                );
                assert!(req.path.contains("service=fake"), "{}", req.path);
                respond(&stream, "200 OK", &[], br#"{"token":"tok123"}"#);
            } else if req.path == "/stop" {
                respond(&stream, "200 OK", &[], b"");
                return;
            } else if auth.as_deref() == Some("Bearer tok123") {
                respond(
                    &stream,
                    "200 OK",
                    &[("Content-Type", mt::OCI_MANIFEST.to_string())],
                    &body,
                );
            } else {
                let challenge = format!(
                    r#"Bearer realm="http://127.0.0.1:{port}/token",service="fake",scope="repository:a/b:pull""#
                );
                respond(
                    &stream,
                    "401 Unauthorized",
                    &[("WWW-Authenticate", challenge)],
                    b"{}",
                );
            }
        }
    });
    let host = format!("127.0.0.1:{port}");
    let client =
        RegistryClient::with_timeout(&host, &SourceOptions::default(), Duration::from_secs(10))
            .expect("client");
    for _ in 0..2 {
        let m = client
            .get_manifest("a/b", &RegistryReference::Tag("t".into()))
            .expect("manifest");
        assert_eq!(m.bytes, manifest);
        assert_eq!(m.media_type.as_deref(), Some(mt::OCI_MANIFEST));
    }
    // The token is cached: fetched once for two manifest requests.
    assert_eq!(token_calls.load(Ordering::SeqCst), 1);
    // Digest reference that does not match the content is refused.
    let err = client
        .get_manifest("a/b", &RegistryReference::Digest(Digest::of_bytes(b"x")))
        .expect_err("digest");
    assert!(matches!(err, OciError::DigestMismatch { .. }), "{err}");
    let _ = reqwest::blocking::get(format!("http://{host}/stop"));
    server.join().expect("server thread");
}

#[test]
fn identity_token_is_exchanged_at_the_realm() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let host = format!("127.0.0.1:{port}");
    let manifest = TestImage::simple("idtoken").manifest_bytes;
    let body = manifest.clone();
    let server = std::thread::spawn(move || {
        // Bounded: at most 6 connections, each with a read timeout.
        let mut grants = Vec::new();
        for _ in 0..6 {
            let Ok((stream, _)) = listener.accept() else {
                break;
            };
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let Some(req) = read_req(&stream) else {
                continue;
            };
            let bearer = req
                .headers
                .iter()
                .any(|(k, v)| k == "authorization" && v == "Bearer tok456");
            if req.path == "/token" {
                grants.push(format!("{} {}", req.method, req.body));
                respond(&stream, "200 OK", &[], br#"{"access_token":"tok456"}"#);
            } else if req.path == "/stop" {
                respond(&stream, "200 OK", &[], b"");
                break;
            } else if bearer {
                let ct = [("Content-Type", mt::OCI_MANIFEST.to_string())];
                respond(&stream, "200 OK", &ct, &body);
            } else {
                let challenge = format!(
                    r#"Bearer realm="http://127.0.0.1:{port}/token",service="fake",scope="repository:a/b:pull""#
                );
                let h = [("WWW-Authenticate", challenge)];
                respond(&stream, "401 Unauthorized", &h, b"{}");
            }
        }
        grants
    });
    let dir = tempfile::tempdir().expect("tmp");
    let config = dir.path().join("config.json");
    let json = serde_json::json!({"auths": {host.clone(): {"identitytoken": "refresh-xyz"}}});
    std::fs::write(&config, json.to_string()).expect("write config");
    let opts = SourceOptions {
        docker_config: Some(config),
        ..SourceOptions::default()
    };
    let client =
        RegistryClient::with_timeout(&host, &opts, Duration::from_secs(10)).expect("client");
    let m = client
        .get_manifest("a/b", &RegistryReference::Tag("t".into()))
        .expect("manifest");
    assert_eq!(m.bytes, manifest);
    let _ = reqwest::blocking::get(format!("http://{host}/stop"));
    let grants = server.join().expect("server thread");
    assert_eq!(grants.len(), 1, "{grants:?}");
    let grant = &grants[0];
    assert!(grant.starts_with("POST "), "{grant}");
    for part in [
        "grant_type=refresh_token",
        "refresh_token=refresh-xyz",
        "service=fake",
        "scope=repository%3Aa%2Fb%3Apull",
    ] {
        assert!(grant.contains(part), "{part} missing from {grant}");
    }
}

/// Whether the tools a test needs are present. A missing tool fails the
/// test unless `LAMINA_SKIP_PRIVILEGED=1`, as in lamina-cli's tests.
#[track_caller]
fn require_tools(tools: &[&str]) -> bool {
    let on_path = |t: &str| {
        let path = std::env::var_os("PATH").unwrap_or_default();
        Path::new(t).is_absolute() && Path::new(t).exists()
            || std::env::split_paths(&path).any(|d| d.join(t).is_file())
    };
    let missing: Vec<&str> = tools.iter().copied().filter(|t| !on_path(t)).collect();
    if missing.is_empty() {
        return true;
    }
    if std::env::var("LAMINA_SKIP_PRIVILEGED").as_deref() == Ok("1") {
        println!("skipped: needs {}", missing.join(", "));
        return false;
    }
    panic!(
        "needs {} (run scripts/setup.sh), or set LAMINA_SKIP_PRIVILEGED=1 to skip",
        missing.join(", ")
    );
}

/// Run `openssl ARGS` (split at whitespace) in `dir`, bounded in time;
/// its stderr is shown only when it fails.
fn openssl(dir: &Path, args: &str) {
    let child = Command::new("openssl")
        .args(args.split_whitespace())
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn openssl");
    let Some(out) = wait_bounded(child, Duration::from_secs(60)) else {
        panic!("openssl {args} did not finish within 60 s");
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openssl {args}: {}\n{stderr}",
        out.status
    );
}

const EC_KEY: &str = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";

/// A self-signed CA `NAME.pem`/`NAME.key`, valid two days.
fn make_ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &format!(
            "req -x509 {EC_KEY} -days 2 -keyout {name}.key -out {name}.pem \
             -subj /CN=lamina-test-{name} -addext basicConstraints=critical,CA:TRUE \
             -addext keyUsage=critical,keyCertSign,cRLSign"
        ),
    );
}

/// CA `ca`, an unrelated CA `other`, and `server.pem`/`server.key` for
/// 127.0.0.1 signed by `ca`.
fn make_pki(dir: &Path) {
    make_ca(dir, "ca");
    make_ca(dir, "other");
    let ext = "subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n\
               keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n";
    std::fs::write(dir.join("server.ext"), ext).expect("write ext");
    openssl(
        dir,
        &format!("req -new {EC_KEY} -keyout server.key -out server.csr -subj /CN=127.0.0.1"),
    );
    openssl(
        dir,
        "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -set_serial 2 -days 2 \
         -extfile server.ext -out server.pem",
    );
}

#[test]
fn tls_registry_with_private_ca() {
    if !require_tools(&[REGISTRY_BIN, "openssl"]) {
        return;
    }
    let pki = tempfile::tempdir().expect("tmp");
    let dir = pki.path();
    make_pki(dir);
    let ca = std::fs::read(dir.join("ca.pem")).expect("ca");
    let ca_cert = reqwest::Certificate::from_pem(&ca).expect("ca cert");
    let probe = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(2))
        .add_root_certificate(ca_cert)
        .build()
        .expect("client");
    let tls = format!(
        "  tls:\n    certificate: {}\n    key: {}\n",
        dir.join("server.pem").display(),
        dir.join("server.key").display()
    );
    let reg = spawn_registry(&tls, "https", &probe);
    let host = reg.host.as_str();
    let image = reg_ref(host, "lamina/tls:v1");
    let over_tls = SourceOptions {
        tls_hosts: vec![host.to_string()],
        ..SourceOptions::default()
    };

    // Without the CA, or with an unrelated one: a certificate error, and no
    // fallback to anything else.
    let err = open_source(&image, &over_tls).expect_err("untrusted");
    assert!(matches!(err, OciError::Tls { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("https://127.0.0.1"), "{msg}");
    assert!(msg.contains("certificate not trusted"), "{msg}");
    assert!(msg.contains("--ca-file"), "{msg}");
    let other = SourceOptions {
        ca_file: Some(dir.join("other.pem")),
        ..over_tls.clone()
    };
    let err = open_sink(&image, &other)
        .and_then(|sink| sink.commit(b"{}", mt::OCI_MANIFEST))
        .expect_err("unrelated CA");
    assert!(matches!(err, OciError::Tls { .. }), "{err}");

    // With a bundle holding the unrelated CA and then ours: push, pull.
    let bundle = dir.join("bundle.pem");
    let mut pem = std::fs::read(dir.join("other.pem")).expect("other");
    pem.extend_from_slice(&ca);
    std::fs::write(&bundle, pem).expect("bundle");
    let opts = SourceOptions {
        ca_file: Some(bundle),
        ..over_tls
    };
    let tmp = tempfile::tempdir().expect("tmp");
    let img = TestImage::simple("tls");
    let digest = img.push(open_sink(&image, &opts).expect("sink"), tmp.path());
    let src = open_source(&image, &opts).expect("source over TLS");
    assert_eq!(src.image().manifest_digest, digest);
    check_layers(src.as_ref(), &img);
    let client = RegistryClient::with_timeout(host, &opts, Duration::from_secs(10)).expect("c");
    let layer = &img.layers[0];
    let got = client
        .get_blob_range("lamina/tls", &layer.descriptor.digest, 2, 7)
        .expect("range");
    assert_eq!(got, layer.blob[2..9]);

    // Without --ca-file, the system store (read at the first handshake)
    // decides: with the CA in SSL_CERT_FILE a process of its own (a process
    // reads the store once) pulls the image.
    let child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "system_store_trusts_a_private_ca", "--ignored"])
        .env("SSL_CERT_FILE", dir.join("ca.pem"))
        .env_remove("SSL_CERT_DIR")
        .env(CHILD_REGISTRY_ENV, format!("{host} {digest}"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the child test");
    let out =
        wait_bounded(child, Duration::from_secs(60)).expect("the child test finishes within 60 s");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// "HOST DIGEST" of the image `system_store_trusts_a_private_ca` pulls.
const CHILD_REGISTRY_ENV: &str = "LAMINA_TEST_TLS_CHILD";

/// Run by `tls_registry_with_private_ca` in a process of its own, with
/// the registry's CA as the system store (`SSL_CERT_FILE`).
#[test]
#[ignore = "run by tls_registry_with_private_ca with SSL_CERT_FILE set"]
fn system_store_trusts_a_private_ca() {
    let spec = std::env::var(CHILD_REGISTRY_ENV).expect(CHILD_REGISTRY_ENV);
    let (host, digest) = spec.split_once(' ').expect("HOST DIGEST");
    let opts = SourceOptions {
        tls_hosts: vec![host.to_string()],
        ..SourceOptions::default()
    };
    let image = reg_ref(host, "lamina/tls:v1");
    let src = open_source(&image, &opts).expect("trusted through the system store");
    assert_eq!(src.image().manifest_digest.to_string(), digest);
    check_layers(src.as_ref(), &TestImage::simple("tls"));
}

/// The output of `child`; None if it ran longer than `limit` (then it is
/// killed).
fn wait_bounded(mut child: Child, limit: Duration) -> Option<std::process::Output> {
    let deadline = Instant::now() + limit;
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(child.wait_with_output().expect("output"))
}

/// A manifest is read whole, so a body over 4 MiB is refused (and read no
/// further than the limit).
#[test]
fn oversized_manifest_is_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = std::thread::spawn(move || {
        let Ok((stream, _)) = listener.accept() else {
            return;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        if read_req(&stream).is_some() {
            let body = vec![b' '; (4 << 20) + 1];
            respond(
                &stream,
                "200 OK",
                &[("Content-Type", mt::OCI_MANIFEST.to_string())],
                &body,
            );
        }
    });
    let client = RegistryClient::with_timeout(
        &format!("127.0.0.1:{port}"),
        &SourceOptions::default(),
        Duration::from_secs(10),
    )
    .expect("client");
    let err = client
        .get_manifest("a/b", &RegistryReference::Tag("t".into()))
        .expect_err("too large");
    assert!(matches!(err, OciError::TooLarge { .. }), "{err}");
    server.join().expect("server thread");
}
