//! Servers on 127.0.0.1: the throw-away [`Registry`], the [`FaultProxy`] in
//! front of it, and scraping a Prometheus `/metrics` endpoint.

use std::ffi::OsStr;
use std::fs;
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::{
    command, oci_ref, repo_file, run, tool, try_run, wait_port_file, Background, TestDir, SHORT,
    TIMEOUT,
};
use serde_json::Value;

// ---------------------------------------------------------------------------
// registry

/// A throw-away registry (`tests/tools/registry.sh`), stopped on drop.
#[derive(Debug)]
pub struct Registry {
    dir: TestDir,
    /// Port on 127.0.0.1.
    pub port: u16,
}

impl Registry {
    /// Starts one; the script waits at most 20 s for it to answer, and the
    /// call itself is bounded by [`SHORT`].
    #[track_caller]
    pub fn start() -> Registry {
        Registry::start_in(TestDir::new("registry"))
    }

    /// Starts one serving a copy of `data`, the storage directory
    /// (`DIR/data`) of an earlier registry: images pushed once can be served
    /// by a fresh registry per test.
    #[track_caller]
    pub fn start_with_data(data: &Path) -> Registry {
        let dir = TestDir::new("registry");
        let mut c = command(
            "cp",
            [
                OsStr::new("-a"),
                data.as_os_str(),
                dir.join("data").as_os_str(),
            ],
        );
        run(&mut c, TIMEOUT).ok();
        Registry::start_in(dir)
    }

    /// Starts a pull-through cache of `remote` (distribution's proxy mode),
    /// with its access log in `registry.log`.
    #[track_caller]
    pub fn start_pull_through(remote: &Registry) -> Registry {
        let dir = TestDir::new("registry-mirror");
        let mut c = Registry::script("start", dir.path());
        c.env("PULL_THROUGH_OF", format!("http://{}", remote.host()));
        Registry::start_with(dir, c)
    }

    #[track_caller]
    fn start_in(dir: TestDir) -> Registry {
        let c = Registry::script("start", dir.path());
        Registry::start_with(dir, c)
    }

    #[track_caller]
    fn start_with(dir: TestDir, mut c: Command) -> Registry {
        let out = run(&mut c, SHORT);
        // Constructed before asserting so a half-started registry is stopped.
        let mut reg = Registry { dir, port: 0 };
        let out = out.ok();
        reg.port = out
            .stdout
            .trim()
            .lines()
            .last()
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or_else(|| panic!("registry.sh start printed no port:\n{}", out.describe()));
        reg
    }

    fn script(cmd: &str, dir: &Path) -> Command {
        command(
            "bash",
            [
                repo_file("tests/tools/registry.sh").as_os_str(),
                OsStr::new(cmd),
                dir.as_os_str(),
            ],
        )
    }

    /// The registry's directory (`data/` is its storage, `registry.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Stops the registry process (storage kept; [`Registry::restart`]
    /// brings it back on the same port).
    #[track_caller]
    pub fn stop(&self) {
        run(&mut Registry::script("stop", self.dir.path()), SHORT).ok();
    }

    /// Starts the registry again on its port and storage, e.g. after
    /// [`Registry::stop`]; waits until it answers.
    #[track_caller]
    pub fn restart(&self) {
        let mut c = Registry::script("start", self.dir.path());
        c.arg(self.port.to_string());
        let out = run(&mut c, SHORT).ok();
        assert_eq!(
            out.stdout.trim().lines().last(),
            Some(self.port.to_string().as_str()),
            "registry.sh did not restart on port {}:\n{}",
            self.port,
            out.describe()
        );
    }

    /// `127.0.0.1:PORT`.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `docker://127.0.0.1:PORT/REPO_TAG`.
    pub fn reference(&self, repo_tag: &str) -> String {
        format!("docker://{}/{repo_tag}", self.host())
    }

    /// Copies `layout:tag` in as `repo_tag` with skopeo, digests kept.
    pub fn push(&self, layout: &Path, tag: &str, repo_tag: &str) {
        let mut c = command(
            tool("skopeo"),
            [
                "copy".to_string(),
                "--quiet".to_string(),
                "--dest-tls-verify=false".to_string(),
                "--preserve-digests".to_string(),
                oci_ref(layout, tag),
                self.reference(repo_tag),
            ],
        );
        run(&mut c, TIMEOUT).ok();
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let mut c = command(
            "bash",
            [
                repo_file("tests/tools/registry.sh").as_os_str(),
                OsStr::new("stop"),
                self.dir.path().as_os_str(),
            ],
        );
        match try_run(&mut c, SHORT) {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!("warning: registry stop failed:\n{}", o.describe()),
            Err(e) => eprintln!("warning: registry stop: {e}"),
        }
    }
}

// ---------------------------------------------------------------------------
// the fault proxy

/// A port on 127.0.0.1 that nothing listened on a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// `tests/tools/faultproxy.py`, killed on drop (and bounded by its own
/// --lifetime and parent watchdog).
#[derive(Debug)]
pub struct FaultProxy {
    /// The proxy process.
    pub bg: Background,
    /// Its port on 127.0.0.1.
    pub port: u16,
    stats: PathBuf,
}

impl FaultProxy {
    /// Starts it on `listen` (0: any port) in front of `upstream`.
    #[track_caller]
    pub fn start(
        dir: &Path,
        label: &str,
        listen: u16,
        upstream: u16,
        mode: &str,
        extra: &[&str],
    ) -> FaultProxy {
        let port_file = dir.join(format!("{label}.port"));
        let stats = dir.join(format!("{label}.stats.json"));
        let _ = fs::remove_file(&port_file);
        let mut c = command(tool("python3"), [repo_file("tests/tools/faultproxy.py")]);
        c.args([listen.to_string(), upstream.to_string(), mode.to_string()])
            .arg("--port-file")
            .arg(&port_file)
            .arg("--stats")
            .arg(&stats)
            .args(["--lifetime", "600"])
            .args(extra);
        let mut bg = Background::spawn(label, &mut c, dir);
        let port = wait_port_file(&mut bg, &port_file, "faultproxy");
        FaultProxy { bg, port, stats }
    }

    /// Its counters (`requests`, `eligible`, `faults`), `null` before the first request.
    pub fn stats(&self) -> Value {
        fs::read(&self.stats)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(Value::Null)
    }
}

/// `GET /metrics` over HTTP/1.1 on `addr`: the body.
pub fn scrape(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("{addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    std::io::Write::write_all(
        &mut s,
        format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "scrape of {addr}:\n{out}");
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

/// The value of the sample `series` (name and labels, exactly) in `text`.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}
