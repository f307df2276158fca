//! Section 1, the reference workload: python3, redis and nginx run from a
//! lazy mount (kernel and FUSE) whose tree equals umoci's unpack.

use std::ffi::OsStr;
use std::fs;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::daemon::{
    finish_with_logs, fully_cached, mib, num, settled_status, start, wait_status, Lazy,
};
use crate::readers::{chroot_python, tcp_exchange, wait_tcp};
use crate::IMAGE;
use serde_json::Value;

// ---------------------------------------------------------------------------
// 1. the reference workload

/// Mount returns quickly with nothing fetched; python3 runs fetching a small
/// part of the image; redis answers PING; nginx (chrooted into an overlay
/// over the mount) serves a file of the image byte for byte; then the whole
/// tree equals umoci's and everything is cached.
// Over 100 lines: one scenario end to end (mount, python3, redis, nginx, the whole tree), each
// step on the mount the one before left.
#[test]
fn lazy_debian_runs_python_redis_nginx_and_equals_umoci() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "lazy_debian_runs_python_redis_nginx_and_equals_umoci",
        "lazy-debian",
    ) else {
        return;
    };
    let total_compressed = deb.compressed_bytes();

    let started = Instant::now();
    // No fill-ahead: the tree read below in path order would fetch the
    // chunks of replaced layer files too, and the exact chunk count checked
    // against the model would not hold (fill-ahead has a test of its own).
    let m = Mount::with_args(
        &reg.reference(IMAGE),
        &t.join("mnt"),
        &t.join("cache"),
        &["--fill-ahead", "0"],
    );
    let mount_secs = started.elapsed().as_secs_f64();
    assert!(
        mount_secs < 20.0,
        "a lazy mount fetches only manifest, index and metadata, yet took {mount_secs:.1} s"
    );
    let s0 = wait_status(&m, "first status", Duration::from_secs(10), |_| true);
    assert_eq!(
        num(&s0, "fetched_bytes"),
        0,
        "data fetched before any read: {s0}"
    );

    let started = Instant::now();
    chroot_python(&m.path);
    let python_secs = started.elapsed().as_secs_f64();
    let s1 = settled_status(&m);
    let python_bytes = num(&s1, "fetched_bytes");
    eprintln!(
        "figures: mount {mount_secs:.2} s; python3 {python_secs:.2} s, fetched {python_bytes} bytes ({}) of {total_compressed} ({:.1} %), {} requests, {} misses",
        mib(python_bytes),
        100.0 * python_bytes as f64 / total_compressed as f64,
        num(&s1, "requests"),
        num(&s1, "misses")
    );
    assert!(
        python_bytes > 0,
        "python3 ran but nothing was fetched: {s1}"
    );
    assert!(
        python_bytes * 2 < total_compressed,
        "python3 fetched {python_bytes} of {total_compressed} compressed bytes (>= 50 %): not lazy"
    );

    // redis-server straight from the read-only lazy mount.
    let port = free_port();
    let mut c = command(
        tool("chroot"),
        [
            m.path.as_os_str(),
            OsStr::new("/usr/bin/redis-server"),
            OsStr::new("--port"),
            OsStr::new(&port.to_string()),
            OsStr::new("--bind"),
            OsStr::new("127.0.0.1"),
            OsStr::new("--save"),
            OsStr::new(""),
            OsStr::new("--appendonly"),
            OsStr::new("no"),
            OsStr::new("--daemonize"),
            OsStr::new("no"),
        ],
    );
    c.env_clear().env("PATH", "/usr/bin:/bin");
    let started = Instant::now();
    let mut redis = Background::spawn("redis", &mut c, t.path());
    wait_tcp(port, &mut redis, Duration::from_secs(60));
    let pong = tcp_exchange(port, b"PING\r\n", false)
        .unwrap_or_else(|e| panic!("PING: {e}\n{}", redis.describe()));
    assert_eq!(
        String::from_utf8_lossy(&pong),
        "+PONG\r\n",
        "redis answered PING with something else:\n{}",
        redis.describe()
    );
    let redis_secs = started.elapsed().as_secs_f64();
    redis.stop();

    // nginx needs writable paths: chroot into an overlay over the mount.
    let ovl = Overlay::mount(&m.path, &t.mkdir("ovl"));
    let conf_dir = ovl.merged.join("tmp/lamina-nginx");
    fs::create_dir_all(&conf_dir).unwrap();
    let port = free_port();
    fs::write(
        conf_dir.join("nginx.conf"),
        format!(
            "daemon off;\nmaster_process off;\npid /tmp/lamina-nginx/nginx.pid;\nerror_log stderr;\n\
             events {{ worker_connections 16; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path /tmp/lamina-nginx/body;\n\
             proxy_temp_path /tmp/lamina-nginx/proxy;\n  fastcgi_temp_path /tmp/lamina-nginx/fastcgi;\n\
             uwsgi_temp_path /tmp/lamina-nginx/uwsgi;\n  scgi_temp_path /tmp/lamina-nginx/scgi;\n\
             server {{ listen 127.0.0.1:{port}; root /var/www/html; }}\n}}\n"
        ),
    )
    .unwrap();
    let mut c = command(
        tool("chroot"),
        [
            ovl.merged.as_os_str(),
            OsStr::new("/usr/sbin/nginx"),
            OsStr::new("-e"),
            OsStr::new("stderr"),
            OsStr::new("-p"),
            OsStr::new("/tmp/lamina-nginx/"),
            OsStr::new("-c"),
            OsStr::new("/tmp/lamina-nginx/nginx.conf"),
        ],
    );
    c.env_clear().env("PATH", "/usr/sbin:/usr/bin:/bin");
    let started = Instant::now();
    let mut nginx = Background::spawn("nginx", &mut c, t.path());
    wait_tcp(port, &mut nginx, Duration::from_secs(60));
    let answer = tcp_exchange(
        port,
        b"GET /index.nginx-debian.html HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        true,
    )
    .unwrap_or_else(|e| panic!("GET from nginx: {e}\n{}", nginx.describe()));
    let nginx_secs = started.elapsed().as_secs_f64();
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| {
            panic!(
                "no HTTP header end in {:?}",
                String::from_utf8_lossy(&answer)
            )
        });
    let head = String::from_utf8_lossy(&answer[..split]).to_string();
    let body = &answer[split + 4..];
    assert!(
        head.starts_with("HTTP/1.1 200"),
        "nginx answered:\n{head}\n{}",
        nginx.describe()
    );
    let want = fs::read(deb.rootfs.join("var/www/html/index.nginx-debian.html")).unwrap();
    assert!(
        body == want.as_slice(),
        "nginx served {} bytes that differ from the image's index.nginx-debian.html ({} bytes)",
        body.len(),
        want.len()
    );
    nginx.stop();
    ovl.unmount();
    eprintln!("figures: redis PONG after {redis_secs:.2} s, nginx 200 after {nginx_secs:.2} s");

    // The whole tree, every byte.
    let started = Instant::now();
    let n = treecmp(&[], &deb.rootfs, &m.path);
    eprintln!(
        "figures: treecmp of {n} entries over the lazy mount in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // Every chunk a file of the tree uses is cached now. Chunks of layer
    // files that a later layer replaced are in the blobs too, but nothing
    // reads them (no fill window by default, no fill-ahead here): the
    // model says how many.
    let expect_filled: Vec<u64> = deb.model.iter().map(|b| b.chunks - b.dead).collect();
    let dead_bytes: u64 = deb.model.iter().map(|b| b.dead_bytes).sum();
    let filled = |s: &Value| -> Vec<u64> {
        s["blobs"]
            .as_array()
            .map(|b| {
                b.iter()
                    .map(|b| b["filled_chunks"].as_u64().unwrap_or(0))
                    .collect()
            })
            .unwrap_or_default()
    };
    let s = wait_status(
        &m,
        "every chunk of the tree cached after reading it",
        Duration::from_secs(15),
        |s| filled(s) == expect_filled,
    );
    let mut f = Failures::default();
    f.check(
        num(&s, "cached_bytes") + dead_bytes == num(&s, "total_bytes"),
        || format!("cached_bytes + {dead_bytes} unreferenced bytes != total_bytes: {s}"),
    );
    f.check((dead_bytes == 0) == fully_cached(&s), || {
        format!(
            "{dead_bytes} unreferenced bytes, yet fully cached = {}: {s}",
            fully_cached(&s)
        )
    });
    eprintln!(
        "figures: chunk model {:?}; after the whole tree: filled {:?}",
        deb.model,
        filled(&s)
    );
    f.check(num(&s, "failed_misses") == 0, || {
        format!("failed misses: {s}")
    });
    f.check(num(&s, "bad_chunks") == 0, || {
        format!("bad chunks without faults: {s}")
    });
    f.check(num(&s, "fetched_bytes") <= total_compressed, || {
        format!("fetched more than the image's {total_compressed} compressed bytes: {s}")
    });
    eprintln!(
        "figures: whole tree: fetched {} ({} bytes) in {} requests, {} misses; cached {} of {}",
        mib(num(&s, "fetched_bytes")),
        num(&s, "fetched_bytes"),
        num(&s, "requests"),
        num(&s, "misses"),
        num(&s, "cached_bytes"),
        num(&s, "total_bytes")
    );
    f.finish("lazy Debian");
    m.unmount();
}

/// Issue 9: the same image lazily through FUSE. The mount fetches no data;
/// python3 runs in it fetching a fraction of the image; an overlay on top
/// takes writes (and leaves the image as it was); the whole tree then
/// equals umoci's unpack, with no failed miss and no bad chunk.
#[test]
fn fuse_lazy_debian_runs_python_takes_an_overlay_and_equals_umoci() {
    let Some(Lazy { _time, deb, reg, t }) = start(
        "fuse_lazy_debian_runs_python_takes_an_overlay_and_equals_umoci",
        "lazy-fuse-debian",
    ) else {
        return;
    };
    let total_compressed = deb.compressed_bytes();
    let started = Instant::now();
    let m = Mount::with_args(
        &reg.reference(IMAGE),
        &t.join("mnt"),
        &t.join("cache"),
        &["--mode", "fuse", "--fill-ahead", "0"],
    );
    let mount_secs = started.elapsed().as_secs_f64();
    assert_eq!(m.info["mode"], "fuse", "{}", m.info);
    let s0 = wait_status(&m, "first status", Duration::from_secs(10), |_| true);
    // `fetched_bytes` may already hold the lookup table, which the worker
    // fetches after a FUSE mount (docs/fuse.md); no data chunk is fetched.
    for key in ["cached_bytes", "miss_fetched_bytes", "ahead_fetched_bytes"] {
        assert_eq!(num(&s0, key), 0, "data fetched before any read: {s0}");
    }

    let started = Instant::now();
    chroot_python(&m.path);
    let python_secs = started.elapsed().as_secs_f64();
    let s1 = settled_status(&m);
    let python_bytes = num(&s1, "fetched_bytes");
    eprintln!(
        "figures: fuse: mount {mount_secs:.2} s; python3 {python_secs:.2} s, fetched {python_bytes} bytes of {total_compressed}, {} requests, {} misses",
        num(&s1, "requests"),
        num(&s1, "misses")
    );
    let mut f = Failures::default();
    f.check(python_bytes > 0 && num(&s1, "misses") > 0, || {
        format!("python3 ran but nothing was fetched: {s1}")
    });
    f.check(python_bytes * 2 < total_compressed, || {
        format!("python3 fetched {python_bytes} of {total_compressed} compressed bytes (>= 50 %): not lazy")
    });

    // A container's writable layer: an overlay over the FUSE mount.
    let ovl = Overlay::mount(&m.path, &t.mkdir("ovl"));
    let written = ovl.merged.join("etc/lamina-written");
    fs::write(&written, b"upper\n").unwrap();
    fs::write(ovl.merged.join("etc/hostname"), b"changed\n").unwrap();
    f.check(
        fs::read(&written).ok().as_deref() == Some(b"upper\n".as_slice()),
        || "a file written into the overlay does not read back".into(),
    );
    f.check(
        fs::read(t.path().join("ovl/upper/etc/hostname"))
            .ok()
            .as_deref()
            == Some(b"changed\n".as_slice()),
        || "the overlay's copy-up of etc/hostname is not in its upper dir".into(),
    );
    ovl.unmount();

    let n = treecmp(&[], &deb.rootfs, &m.path);
    let s = settled_status(&m);
    f.check(num(&s, "failed_misses") == 0, || {
        format!("failed misses: {s}")
    });
    f.check(num(&s, "bad_chunks") == 0, || {
        format!("bad chunks without faults: {s}")
    });
    f.check(num(&s, "fetched_bytes") <= total_compressed, || {
        format!("fetched more than the image's {total_compressed} compressed bytes: {s}")
    });
    eprintln!(
        "figures: fuse: treecmp of {n} entries; fetched {} in {} requests, {} misses",
        mib(num(&s, "fetched_bytes")),
        num(&s, "requests"),
        num(&s, "misses")
    );
    finish_with_logs(f, &run_dir(&m), String::new, "lazy FUSE Debian");
    m.unmount();
}
