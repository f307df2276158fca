#!/usr/bin/env python3
"""Measurement engine of scripts/coldstart.sh (standard library only).

coldstart.sh sets up the network namespace (with a docker-registry in it) and a
private containerd, then runs:

  coldstart_run.py --lamina BIN --image LAYOUT:TAG --work DIR --id PREFIX
                   --netns /run/netns/NAME --registry 127.0.0.1:PORT --registry-pid PID
                   --containerd-sock SOCK --containerd-root DIR
                   [--links 1gbit,100mbit,10mbit] [--runs N] [--slow-runs M]
                   [--workloads python,nginx,redis] [--max-seconds S] --out FILE.json

What it does, in this order:

1. Unshaped link: pushes the source image into the registry (skopeo), converts
   it there with `lamina convert` (tag `lamina`), and per workload records a
   boot set (`lamina mount --record-trace` of `lamina`, the workload run to its
   first useful output) and converts again with `--prefetch TRACE` (tag
   `lamina-boot-WORKLOAD`).
2. Per link: `tc qdisc replace dev lo root tbf rate RATE burst 64kb latency
   50ms` in the namespace, a throughput check (a Range GET of RATE x 1 s of a
   layer blob with curl) and the latency of a 1-byte Range GET.
3. Per link, run and workload, the three variants in a rotating order, each
   after `sync; echo 3 > /proc/sys/vm/drop_caches`:
   - containerd: `ctr image pull --plain-http` (in the namespace) into a fresh
     containerd namespace whose content store is checked to be empty, then
     `ctr run --rm --net-host`; afterwards the image, content and namespace are
     deleted (`images rm --sync`);
   - lamina / lamina-boot: `lamina mount` (in the namespace) with a fresh cache
     directory, overlayfs (lowerdir = the mount), `runc run` of a bundle from
     `runc spec` without a network namespace.
   Time = start (pull / mount) -> first useful output: "hello" on stdout
   (python), the first HTTP 200 (nginx) or +PONG (redis) of a probe polling
   every 10 ms on the host's 127.0.0.1. Then the container is stopped, and a
   second container of the same image is started (no drop_caches; lamina: same
   mount and cache, new overlay) and timed the same way.
   Bytes: the delta of the namespace's lo tx_bytes (read from
   /proc/REGISTRY_PID/net/dev: /sys/class/net shows the host's lo to any
   process that did not remount /sys) and lamina's fetched_bytes; lamina
   daemon VmHWM (holder + worker) at the end of the run.
4. Writes the JSON (raw runs, medians, ratios containerd / lamina, targets)
   and prints a table.
"""

import argparse
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_run import cpu_stat, drop_caches, machine_info, own_cpu  # noqa: E402

# containerd / lamina-boot time ratios wanted for python3, per link
TIME_TARGETS = {"python": {"1gbit": 18.0, "100mbit": 24.0, "10mbit": 32.0}}
# bytes fetched for a cold start, % of the image's compressed size (source layers)
BYTES_TARGET_PCT = 3.0
TBF = ["burst", "64kb", "latency", "50ms"]
VARIANTS = ["containerd", "lamina", "lamina-boot"]
READY_TIMEOUT = 300
# containerd 1.6's default capability set for `ctr run` (the same as Docker's);
# given to the runc bundles too, so both run the workload with the same privileges
DEFAULT_CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
                "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
                "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE"]
NGINX_CONF_IN = "/etc/nginx/coldstart.conf"
NGINX_CONF = """daemon off;
worker_processes 1;
pid /run/nginx-coldstart.pid;
error_log stderr warn;
events {{ worker_connections 64; }}
http {{
    include /etc/nginx/mime.types;
    access_log off;
    server {{
        listen 127.0.0.1:{port};
        root /var/www/html;
        index index.nginx-debian.html;
    }}
}}
"""


def log(msg):
    print(f"[coldstart] {msg}", file=sys.stderr, flush=True)


class Deadline(Exception):
    pass


def on_term(signum, _frame):
    raise SystemExit(128 + signum)


def run(cmd, timeout=600, capture=False, check=True):
    p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return p


def rate_bps(rate):
    n, unit = rate[:-4], rate[-4:]
    return int(n) * {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}[unit]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_mountpoint(path):
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


def umount(path):
    if is_mountpoint(path):
        if subprocess.run(["umount", path], stderr=subprocess.DEVNULL).returncode != 0:
            subprocess.run(["umount", "-l", path], stderr=subprocess.DEVNULL)


def vm_hwm_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, TypeError):
        pass
    return None


def summary(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# ---- readiness --------------------------------------------------------------------------

def probe_http(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def probe_redis(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def wait_ready(workload, proc, port, timeout=READY_TIMEOUT):
    """Blocks until the workload's first useful output; returns time.perf_counter() then."""
    deadline = time.monotonic() + timeout
    if workload == "python":
        buf = b""
        fd = proc.stdout.fileno()
        while time.monotonic() < deadline:
            r, _, _ = select.select([fd], [], [], 0.5)
            if r:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise RuntimeError(f"container exited without output (rc {proc.wait()})")
                buf += chunk
                if b"hello\n" in buf:
                    return time.perf_counter()
        raise TimeoutError(f"no output within {timeout} s")
    probe = probe_http if workload == "nginx" else probe_redis
    while time.monotonic() < deadline:
        if probe(port):
            return time.perf_counter()
        if proc.poll() is not None:
            raise RuntimeError(f"container exited before it answered (rc {proc.returncode})")
        time.sleep(0.01)
    raise TimeoutError(f"no answer within {timeout} s")


def workload_args(workload, port):
    if workload == "python":
        return ["python3", "-c", 'print("hello")']
    if workload == "nginx":
        return ["nginx", "-c", NGINX_CONF_IN]
    return ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--protected-mode", "no"]


class Bench:
    def __init__(self, a):
        self.a = a
        self.lamina = os.path.abspath(a.lamina)
        self.work = os.path.abspath(a.work)
        self.ns = ["nsenter", f"--net={a.netns}"]
        self.reg = a.registry
        self.seq = 0
        self.deadline = time.monotonic() + a.max_seconds
        self.ctr = ["ctr", "--address", a.containerd_sock]
        spec_dir = os.path.join(self.work, "spec")
        os.makedirs(spec_dir, exist_ok=True)
        subprocess.run(["runc", "spec"], cwd=spec_dir, check=True)
        with open(os.path.join(spec_dir, "config.json")) as f:
            self.spec = json.load(f)

    def next_seq(self):
        self.seq += 1
        return self.seq

    def check_deadline(self):
        if time.monotonic() > self.deadline:
            raise Deadline(f"--max-seconds {self.a.max_seconds} reached")

    # -- network ---------------------------------------------------------------------------
    def tx_bytes(self):
        """Bytes sent on the namespace's lo (requests and responses both cross it)."""
        with open(f"/proc/{self.a.registry_pid}/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[8])
        raise RuntimeError("no lo in the namespace's /proc/net/dev")

    def set_link(self, rate):
        if rate is None:
            subprocess.run(self.ns + ["tc", "qdisc", "del", "dev", "lo", "root"], stderr=subprocess.DEVNULL)
        else:
            run(self.ns + ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate] + TBF)

    def calibrate(self, rate, blob_digest, blob_size):
        n = min(int(rate_bps(rate) / 8 * 1.0), blob_size)
        url = f"http://{self.reg}/v2/debian/blobs/{blob_digest}"
        tx0 = self.tx_bytes()
        p = run(self.ns + ["curl", "-fsS", "-o", "/dev/null", "-r", f"0-{n - 1}", "-w",
                           "%{size_download} %{time_total}", url], capture=True)
        size, secs = p.stdout.split()
        wire = self.tx_bytes() - tx0
        lat = []
        for _ in range(5):
            p = run(self.ns + ["curl", "-fsS", "-o", "/dev/null", "-r", "0-0", "-w", "%{time_total}", url],
                    capture=True)
            lat.append(float(p.stdout) * 1000)
        out = {"bytes": int(size), "seconds": float(secs), "MBps": int(size) / float(secs) / 1e6,
               "nominal_MBps": rate_bps(rate) / 8 / 1e6, "wire_bytes": wire,
               "range_request_1byte_ms": statistics.median(lat), "range_request_1byte_ms_runs": lat}
        log(f"link {rate}: {out['MBps']:.2f} MB/s payload ({out['bytes']:,} B in {out['seconds']:.2f} s; "
            f"nominal {out['nominal_MBps']:.2f} MB/s), 1-byte Range GET {out['range_request_1byte_ms']:.1f} ms")
        return out

    # -- images ----------------------------------------------------------------------------
    def lamina_json(self, *args, timeout=600):
        p = run(self.ns + [self.lamina, "--json", *args], capture=True, timeout=timeout)
        return json.loads(p.stdout)

    def convert(self, dst_tag, prefetch=None):
        t = time.perf_counter()
        args = ["convert"] + (["--prefetch", prefetch] if prefetch else []) + [
            f"docker://{self.reg}/debian:bookworm", f"docker://{self.reg}/debian:{dst_tag}"]
        doc = self.lamina_json(*args)
        secs = time.perf_counter() - t
        blobs = doc.get("blobs") or []
        log(f"convert -> debian:{dst_tag}: {secs:.1f} s, {doc['stats']['chunks_stored']} chunks, "
            f"boot set {doc['stats'].get('boot_set_chunks', 0)} chunks")
        return {"tag": dst_tag, "seconds": secs, "manifest_digest": doc.get("manifest_digest"),
                "metadata_bytes": doc.get("metadata_bytes"),
                "metadata_compressed_bytes": doc.get("metadata_compressed_bytes"),
                "index_bytes": doc.get("index_bytes"), "blob_bytes": sum(b.get("size", 0) for b in blobs),
                "boot_pages": doc.get("boot_pages"), "stats": doc.get("stats")}

    # -- lamina ----------------------------------------------------------------------------
    def lamina_status(self, cache, mnt):
        p = run([self.lamina, "status", "--json", "--cache-dir", cache], capture=True, check=False)
        for m in json.loads(p.stdout or "[]") if p.returncode == 0 else []:
            if m.get("mountpoint") == mnt:
                return dict(m.get("status") or {}, holder_pid=m.get("holder_pid"))
        return {}

    def fresh_status(self, cache, mnt):
        """Status after the worker's next write (it rewrites status.json every 200 ms)."""
        time.sleep(0.25)
        return self.lamina_status(cache, mnt)

    def lamina_umount(self, cache, mnt):
        if not is_mountpoint(mnt):
            return
        st = self.lamina_status(cache, mnt)
        pids = [p for p in (st.get("holder_pid"), st.get("pid")) if p]
        p = run([self.lamina, "umount", mnt, "--cache-dir", cache], check=False, timeout=60)
        if p.returncode != 0:
            log(f"warning: lamina umount {mnt}: {p.stderr.strip()}")
            umount(mnt)
        end = time.monotonic() + 10
        while pids and time.monotonic() < end:
            pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
            time.sleep(0.05)
        if pids:
            log(f"warning: lamina daemon(s) {pids} still running after umount of {mnt}")

    def bundle(self, d, workload, port):
        """Overlay dirs and a runc bundle under d (its rootfs: an overlay mounted later)."""
        for sub in ("upper", "work", "rootfs"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        spec = json.loads(json.dumps(self.spec))
        spec["root"] = {"path": os.path.join(d, "rootfs"), "readonly": False}
        proc = spec["process"]
        proc["terminal"] = False
        proc["args"] = workload_args(workload, port)
        proc["cwd"] = "/"
        proc["capabilities"] = {k: list(DEFAULT_CAPS) for k in ("bounding", "effective", "permitted")}
        # the host's network namespace: the probe reaches the servers on 127.0.0.1
        spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"]
        if workload == "nginx":
            conf = os.path.join(d, "nginx.conf")
            with open(conf, "w") as f:
                f.write(NGINX_CONF.format(port=port))
            spec["mounts"].append({"destination": NGINX_CONF_IN, "type": "bind", "source": conf,
                                   "options": ["rbind", "ro"]})
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(spec, f)
        return d

    def overlay(self, lower, d):
        run(["mount", "-t", "overlay", "overlay", "-o",
             f"lowerdir={lower},upperdir={d}/upper,workdir={d}/work", f"{d}/rootfs"])

    def runc_container(self, d, cid, workload, port, linger=0.0):
        """Starts the container, waits for its first useful output, stops it (after `linger`
        seconds more). Returns t_ready."""
        out = subprocess.PIPE if workload == "python" else open(os.path.join(d, "stdout.log"), "wb")
        err = open(os.path.join(d, "stderr.log"), "wb")
        proc = subprocess.Popen(["runc", "run", "--bundle", d, cid], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err, start_new_session=True)
        try:
            t_ready = wait_ready(workload, proc, port)
            if linger:
                try:
                    proc.wait(timeout=linger)  # python3 exits by itself
                except subprocess.TimeoutExpired:
                    pass
            return t_ready
        except Exception:
            with open(os.path.join(d, "stderr.log"), "rb") as f:
                log(f"container {cid} stderr: {f.read()[-1500:].decode(errors='replace')}")
            raise
        finally:
            subprocess.run(["runc", "kill", cid, "KILL"], stderr=subprocess.DEVNULL)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            subprocess.run(["runc", "delete", "--force", cid], stderr=subprocess.DEVNULL)
            if proc.stdout:
                proc.stdout.close()
            if out is not subprocess.PIPE:
                out.close()
            err.close()

    def lamina_run(self, tag, workload, record_trace=None, second=True):
        seq = self.next_seq()
        rd = os.path.join(self.work, "runs", f"{seq:03d}-{tag}-{workload}")
        cache, mnt = os.path.join(rd, "cache"), os.path.join(rd, "mnt")
        os.makedirs(mnt)
        port = free_port()
        c1 = self.bundle(os.path.join(rd, "c1"), workload, port)
        cid = f"{self.a.id}-{seq}"
        ref = f"docker://{self.reg}/debian:{tag}"
        extra = ["--record-trace", record_trace] if record_trace else []
        rec = {"tag": tag}
        try:
            drop_caches()
            tx0 = self.tx_bytes()
            t0 = time.perf_counter()
            run(self.ns + [self.lamina, "mount", ref, mnt, "--cache-dir", cache] + extra, timeout=120)
            t_mount = time.perf_counter()
            tx_mount = self.tx_bytes()
            self.overlay(mnt, c1)
            t_ovl = time.perf_counter()
            # A recorded start runs on for a second after its first output, so
            # the trace also has what it reads next (python3's exit path): a
            # later start that lives a little longer must not miss on it.
            t_ready = self.runc_container(c1, cid, workload, port, linger=1.0 if record_trace else 0.0)
            tx_ready = self.tx_bytes()
            rec.update(time_s=t_ready - t0, mount_s=t_mount - t0, overlay_s=t_ovl - t_mount,
                       container_s=t_ready - t_ovl, wire_bytes_mount=tx_mount - tx0,
                       wire_bytes_ready=tx_ready - tx0)
            st = self.fresh_status(cache, mnt)
            # The start's own bytes: at its first output (+ the status lag).
            # With boot pages the boot set's whole chunks follow in the
            # background once misses stop; those count only in the totals.
            rec.update(fetched_bytes_ready=st.get("fetched_bytes"), requests_ready=st.get("requests"),
                       misses_ready=st.get("misses"))
            if st.get("prefetch_total"):
                end = time.monotonic() + 180
                while st.get("prefetch_done", 0) < st["prefetch_total"] and time.monotonic() < end:
                    time.sleep(0.1)
                    st = self.lamina_status(cache, mnt)
                st = self.fresh_status(cache, mnt)
            rec.update(wire_bytes=self.tx_bytes() - tx0,
                       **{k: st.get(k) for k in ("fetched_bytes", "requests", "misses", "failed_misses",
                                                 "bad_chunks", "cached_bytes", "prefetch_done", "prefetch_total")})
            if second:
                port2 = free_port()
                c2 = self.bundle(os.path.join(rd, "c2"), workload, port2)
                self.overlay(mnt, c2)
                f0, tx1 = st.get("fetched_bytes") or 0, self.tx_bytes()
                t1 = time.perf_counter()
                t2 = self.runc_container(c2, f"{cid}b", workload, port2)
                st2 = self.fresh_status(cache, mnt)
                rec["second"] = {"time_s": t2 - t1, "fetched_bytes": (st2.get("fetched_bytes") or 0) - f0,
                                 "wire_bytes": self.tx_bytes() - tx1,
                                 "misses": (st2.get("misses") or 0) - (st.get("misses") or 0)}
                st = st2
            hw, ww = vm_hwm_kib(st.get("holder_pid")), vm_hwm_kib(st.get("pid"))
            rec["rss_kib"] = {"holder": hw, "worker": ww, "sum": (hw or 0) + (ww or 0) if hw and ww else None}
            if st.get("failed_misses") or st.get("bad_chunks"):
                rec["daemon_logs"] = self.worker_log(cache)
            return rec
        finally:
            for sub in ("c2", "c1"):
                umount(os.path.join(rd, sub, "rootfs"))
            self.lamina_umount(cache, mnt)
            with open("/proc/self/mounts") as f:
                busy = any(line.split()[1].startswith(rd + "/") for line in f)
            if not busy:
                shutil.rmtree(rd, ignore_errors=True)

    def worker_log(self, cache):
        out = []
        for root, _dirs, files in os.walk(os.path.join(cache, "mounts")):
            for n in files:
                if n.endswith(".log"):
                    with open(os.path.join(root, n), errors="replace") as f:
                        out.append(f"{n}: {f.read()[-1000:]}")
        return out

    # -- containerd ------------------------------------------------------------------------
    def content_blobs(self):
        d = os.path.join(self.a.containerd_root, "io.containerd.content.v1.content", "blobs", "sha256")
        return len(os.listdir(d)) if os.path.isdir(d) else 0

    def ctr_container(self, ns, cid, ref, workload, port, d):
        cmd = self.ctr + ["-n", ns, "run", "--rm", "--net-host"]
        if workload == "nginx":
            conf = os.path.join(d, "nginx.conf")
            with open(conf, "w") as f:
                f.write(NGINX_CONF.format(port=port))
            cmd += ["--mount", f"type=bind,src={conf},dst={NGINX_CONF_IN},options=rbind:ro"]
        cmd += [ref, cid] + workload_args(workload, port)
        out = subprocess.PIPE if workload == "python" else open(os.path.join(d, f"{cid}.out"), "wb")
        err = open(os.path.join(d, f"{cid}.err"), "wb")
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        try:
            return wait_ready(workload, proc, port)
        except Exception:
            with open(os.path.join(d, f"{cid}.err"), "rb") as f:
                log(f"ctr run {cid} stderr: {f.read()[-1500:].decode(errors='replace')}")
            raise
        finally:
            subprocess.run(self.ctr + ["-n", ns, "tasks", "kill", "-s", "SIGKILL", cid],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            p = subprocess.run(self.ctr + ["-n", ns, "containers", "ls", "-q"], capture_output=True, text=True)
            if cid in p.stdout.split():
                subprocess.run(self.ctr + ["-n", ns, "tasks", "delete", "-f", cid], capture_output=True)
                subprocess.run(self.ctr + ["-n", ns, "containers", "rm", cid], capture_output=True)
            if proc.stdout:
                proc.stdout.close()
            if out is not subprocess.PIPE:
                out.close()
            err.close()

    def containerd_run(self, workload):
        seq = self.next_seq()
        ns = f"cs{seq}"
        ref = f"{self.reg}/debian:bookworm"
        cid = f"{self.a.id}-{seq}"
        d = os.path.join(self.work, "runs", f"{seq:03d}-containerd-{workload}")
        os.makedirs(d)
        port = free_port()
        left = self.content_blobs()
        if left:
            raise RuntimeError(f"containerd content store not empty before a cold run ({left} blobs)")
        rec = {}
        try:
            drop_caches()
            tx0 = self.tx_bytes()
            t0 = time.perf_counter()
            run(self.ns + self.ctr + ["-n", ns, "images", "pull", "--plain-http", ref], timeout=1200)
            t_pull = time.perf_counter()
            tx_pull = self.tx_bytes()
            t_ready = self.ctr_container(ns, cid, ref, workload, port, d)
            rec.update(time_s=t_ready - t0, pull_s=t_pull - t0, container_s=t_ready - t_pull,
                       wire_bytes=self.tx_bytes() - tx0, wire_bytes_pull=tx_pull - tx0)
            tx1 = self.tx_bytes()
            t1 = time.perf_counter()
            t2 = self.ctr_container(ns, f"{cid}b", ref, workload, free_port(), d)
            rec["second"] = {"time_s": t2 - t1, "wire_bytes": self.tx_bytes() - tx1}
            return rec
        finally:
            run(self.ctr + ["-n", ns, "images", "rm", "--sync", ref], check=False, timeout=300)
            p = run(self.ctr + ["-n", ns, "content", "ls", "-q"], capture=True, check=False)
            for dg in p.stdout.split():
                run(self.ctr + ["-n", ns, "content", "rm", dg], check=False)
            p = run(self.ctr + ["-n", ns, "snapshots", "ls"], capture=True, check=False)
            for line in p.stdout.splitlines()[1:]:
                if line.split():
                    run(self.ctr + ["-n", ns, "snapshots", "rm", line.split()[0]], check=False)
            run(self.ctr + ["namespaces", "rm", ns], check=False)
            shutil.rmtree(d, ignore_errors=True)


def source_image(layout, tag):
    with open(os.path.join(layout, "index.json")) as f:
        index = json.load(f)
    digest = next(m["digest"] for m in index["manifests"]
                  if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag)
    with open(os.path.join(layout, "blobs", *digest.split(":", 1))) as f:
        manifest = json.load(f)
    layers = [{"digest": x["digest"], "size": x["size"], "mediaType": x["mediaType"]} for x in manifest["layers"]]
    return {"ref": f"oci:{layout}:{tag}", "manifest_digest": digest, "layers": layers,
            "layer_bytes": sum(x["size"] for x in layers)}


def chunk_owners(image, chunk_size):
    """sha256 of every chunk of every regular file of the merged source image ->
    [(path, chunk number, bytes)], chunked the way lamina chunks (each file
    starts a new chunk). For reading traces: which files a boot set holds."""
    owners, files = {}, {}
    for layer in image["layers"]:
        path = os.path.join(image["ref"][4:].rsplit(":", 1)[0], "blobs", *layer["digest"].split(":", 1))
        with tarfile.open(path, "r|*") as tar:
            for m in tar:
                name = "/" + os.path.normpath(m.name).lstrip("./")
                base = os.path.basename(name)
                if base.startswith(".wh."):
                    gone = os.path.join(os.path.dirname(name), base[4:])
                    for k in [k for k in files if k == gone or k.startswith(gone + "/")]:
                        del files[k]
                    continue
                if not m.isreg():
                    continue
                f = tar.extractfile(m)
                chunks = []
                while True:
                    data = f.read(chunk_size)
                    if not data:
                        break
                    chunks.append((hashlib.sha256(data).hexdigest(), len(data)))
                files[name] = chunks
    for name, chunks in files.items():
        for i, (dg, n) in enumerate(chunks):
            owners.setdefault(dg, []).append((name, i, n))
    return owners


def trace_files(digests, owners):
    """Files of a trace: [{path, chunks, bytes}], largest first."""
    per = {}
    for dg in dict.fromkeys(digests):
        found = owners.get(dg, [("?", 0, 0)])
        # one chunk can belong to several files (hardlinks, equal files): name them all
        name = " = ".join(sorted({o[0] for o in found}))
        e = per.setdefault(name, {"path": name, "chunks": 0, "bytes": 0})
        e["chunks"] += 1
        e["bytes"] += found[0][2]
    return sorted(per.values(), key=lambda e: -e["bytes"])


def mount_default(lamina, flag):
    """The [default: N] of a `lamina mount` option, from its --help."""
    text = subprocess.run([lamina, "mount", "--help"], capture_output=True, text=True).stdout
    at = text.find(flag)
    if at < 0:
        return None
    part = text[at:].split("[default: ", 1)
    return part[1].split("]", 1)[0] if len(part) == 2 else None


def aggregate(result):
    """Medians per link / workload / variant, ratios, targets."""
    img_bytes = result["image"]["layer_bytes"]
    cfg = result["config"]
    agg, ratios = {}, {}
    for link in cfg["links"]:
        agg[link], ratios[link] = {}, {}
        for w in cfg["workloads"]:
            agg[link][w] = {}
            for v in VARIANTS:
                rs = [r for r in result["runs"] if r["link"] == link and r["workload"] == w and r["variant"] == v]
                if not rs:
                    continue
                s = {"runs": len(rs), "time_s": summary([r["time_s"] for r in rs]),
                     "runs_s": [round(r["time_s"], 4) for r in rs],
                     "wire_bytes": summary([r["wire_bytes"] for r in rs]),
                     "second_time_s": summary([r["second"]["time_s"] for r in rs]),
                     "second_wire_bytes": summary([r["second"]["wire_bytes"] for r in rs])}
                if v == "containerd":
                    s["pull_s"] = summary([r["pull_s"] for r in rs])
                    s["container_s"] = summary([r["container_s"] for r in rs])
                else:
                    for k in ("mount_s", "overlay_s", "container_s", "wire_bytes_mount", "wire_bytes_ready",
                              "fetched_bytes", "requests", "misses", "prefetch_total", "fetched_bytes_ready",
                              "requests_ready", "misses_ready"):
                        s[k] = summary([r.get(k) for r in rs])
                    s["second_fetched_bytes"] = summary([r["second"]["fetched_bytes"] for r in rs])
                    s["rss_kib_sum"] = summary([r["rss_kib"]["sum"] for r in rs])
                    s["rss_kib_holder"] = summary([r["rss_kib"]["holder"] for r in rs])
                    s["rss_kib_worker"] = summary([r["rss_kib"]["worker"] for r in rs])
                    s["fetched_pct"] = 100 * s["fetched_bytes"]["median"] / img_bytes
                s["wire_pct"] = 100 * s["wire_bytes"]["median"] / img_bytes
                agg[link][w][v] = s
            cd = agg[link][w].get("containerd")
            ratios[link][w] = {}
            for v in ("lamina", "lamina-boot"):
                la = agg[link][w].get(v)
                if cd and la:
                    ratios[link][w][v] = cd["time_s"]["median"] / la["time_s"]["median"]
    targets = []
    for w, per_link in TIME_TARGETS.items():
        for link, want in per_link.items():
            for v in ("lamina", "lamina-boot"):
                got = ratios.get(link, {}).get(w, {}).get(v)
                if got is not None:
                    targets.append({"what": f"time containerd / {v}", "workload": w, "link": link, "value": got,
                                    "target_min": want, "met": got >= want})
    for w in cfg["workloads"]:
        for v in ("lamina", "lamina-boot"):
            # The target is the bytes *for that start*: counted to its first output.
            fetched = [r["fetched_bytes_ready"] for r in result["runs"]
                       if r["workload"] == w and r["variant"] == v and r.get("fetched_bytes_ready") is not None]
            wire = [r["wire_bytes_ready"] for r in result["runs"] if r["workload"] == w and r["variant"] == v]
            if fetched:
                pf = 100 * statistics.median(fetched) / img_bytes
                pw = 100 * statistics.median(wire) / img_bytes
                targets.append({"what": f"bytes fetched by {v} to first output (lamina status), % of compressed image",
                                "workload": w, "link": "all", "value": pf, "target_max": BYTES_TARGET_PCT,
                                "met": pf <= BYTES_TARGET_PCT})
                targets.append({"what": f"bytes on the wire for {v} to first output (lo tx), % of compressed image",
                                "workload": w, "link": "all", "value": pw, "target_max": BYTES_TARGET_PCT,
                                "met": pw <= BYTES_TARGET_PCT})
    result["medians"] = agg
    result["ratios"] = ratios
    result["targets"] = targets


def print_table(r):
    def mb(n):
        return f"{n / 1e6:.2f}"
    m = r["machine"]
    print(f"\nlamina cold start  {m['date']}  kernel {m['kernel']}  nproc {m['nproc']}  "
          f"image {r['image']['layer_bytes'] / 1e6:.1f} MB compressed; medians (s)")
    print(f"{'link':<8}{'workload':<9}{'containerd':>11}{'lamina':>9}{'+boot':>9}{'cd/lam':>8}{'cd/boot':>8}"
          f"{'lam MB':>8}{'%':>6}{'boot MB':>8}{'%':>6}{'2nd MB':>8}{'RSS MB':>8}")
    for link, per_w in r["medians"].items():
        for w, per_v in per_w.items():
            def t(v):
                return f"{per_v[v]['time_s']['median']:.3f}" if v in per_v else "-"

            def rt(v):
                x = r["ratios"][link][w].get(v)
                return f"{x:.1f}" if x else "-"

            def by(v):
                if v not in per_v:
                    return "-", "-"
                return mb(per_v[v]["fetched_bytes"]["median"]), f"{per_v[v]['fetched_pct']:.2f}"
            lb, lp = by("lamina")
            bb, bp = by("lamina-boot")
            second = max((per_v[v]["second_fetched_bytes"]["max"] for v in ("lamina", "lamina-boot") if v in per_v),
                         default=None)
            rss = max((per_v[v]["rss_kib_sum"]["max"] for v in ("lamina", "lamina-boot")
                       if v in per_v and per_v[v]["rss_kib_sum"]), default=None)
            print(f"{link:<8}{w:<9}{t('containerd'):>11}{t('lamina'):>9}{t('lamina-boot'):>9}"
                  f"{rt('lamina'):>8}{rt('lamina-boot'):>8}{lb:>8}{lp:>6}{bb:>8}{bp:>6}"
                  f"{(mb(second) if second is not None else '-'):>8}"
                  f"{(f'{rss / 1024:.1f}' if rss else '-'):>8}")
    print("\ntargets")
    for t in r["targets"]:
        bound = f">= {t['target_min']}" if "target_min" in t else f"<= {t['target_max']}"
        print(f"  {t['what']:<58} {t['workload']:<7}{t['link']:<8}{t['value']:8.2f} {bound:>8}  "
              f"{'met' if t['met'] else 'MISSED'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lamina", required=True)
    ap.add_argument("--image", required=True, help="LAYOUT:TAG")
    ap.add_argument("--work", required=True)
    ap.add_argument("--id", required=True, help="prefix of container ids")
    ap.add_argument("--netns", required=True, help="/run/netns/NAME")
    ap.add_argument("--registry", required=True, help="127.0.0.1:PORT (inside the namespace)")
    ap.add_argument("--registry-pid", required=True, type=int)
    ap.add_argument("--containerd-sock", required=True)
    ap.add_argument("--containerd-root", required=True)
    ap.add_argument("--links", default="1gbit,100mbit,10mbit")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--slow-runs", type=int, default=1, help="containerd runs on links below 100mbit")
    ap.add_argument("--workloads", default="python,nginx,redis")
    ap.add_argument("--max-seconds", type=int, default=2700)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    links = a.links.split(",")
    workloads = a.workloads.split(",")
    layout, tag = a.image.rsplit(":", 1)

    t_start = time.perf_counter()
    busy0, steal0 = cpu_stat()
    own0 = own_cpu()
    b = Bench(a)
    img = source_image(layout, tag)
    cd_runs = {link: (a.runs if rate_bps(link) >= 100 * 10**6 else min(a.slow_runs, a.runs)) for link in links}
    result = {
        "schema": 1,
        "machine": machine_info(b.lamina, ("containerd", "runc", "docker-registry", "skopeo", "iproute2", "curl")),
        "image": img,
        "config": {"links": links, "runs": a.runs, "containerd_runs": cd_runs, "workloads": workloads,
                   "variants": VARIANTS, "tbf": " ".join(["tbf", "rate", "RATE"] + TBF), "lo_mtu": 1500,
                   "fill_window": mount_default(b.lamina, "--fill-window"),
                   "ready_probe_interval_s": 0.01},
        "setup": {}, "links": {}, "runs": [],
    }

    # ---- 1. images, unshaped ------------------------------------------------------------------
    b.set_link(None)
    t = time.perf_counter()
    run(b.ns + ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--preserve-digests",
                f"oci:{layout}:{tag}", f"docker://{a.registry}/debian:bookworm"])
    result["setup"]["push_source_s"] = time.perf_counter() - t
    result["setup"]["convert"] = {"lamina": b.convert("lamina")}
    insp = b.lamina_json("inspect", f"docker://{a.registry}/debian:lamina")
    result["config"]["chunk_size"] = insp.get("chunk_size")
    result["lamina_image"] = {k: insp.get(k) for k in ("chunk_size", "chunks", "stored_bytes", "compressed_bytes",
                                                       "referenced_bytes", "dedup_ratio")}
    p = run(b.ns + ["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{a.registry}/debian:lamina"],
            capture=True)
    result["lamina_image"]["manifest_layers"] = [
        {"mediaType": x.get("mediaType"), "size": x.get("size")} for x in json.loads(p.stdout).get("layers", [])]
    result["setup"]["traces"] = {}
    owners = chunk_owners(img, int(insp.get("chunk_size") or 1 << 18))
    for w in workloads:
        trace = os.path.join(b.work, f"trace-{w}.txt")
        # Two recorded starts, appended to one trace: a start under runc can
        # read a few pages another start did not; the boot pages get both.
        rec = b.lamina_run("lamina", w, record_trace=trace, second=False)
        b.lamina_run("lamina", w, record_trace=trace, second=False)
        # lines: CHUNK_DIGEST OFFSET LEN, one per read of data not yet local
        with open(trace) as f:
            reads = [x.split() for x in f.read().splitlines() if x.strip()]
        lines = [r[0] for r in reads]
        files = trace_files(lines, owners)
        result["setup"]["traces"][w] = {"reads": len(lines), "distinct_chunks": len(set(lines)),
                                        "bytes_read": sum(int(r[2]) for r in reads if len(r) == 3),
                                        "bytes": sum(e["bytes"] for e in files), "files": files,
                                        "record_run": rec}
        log(f"boot set {w}: {len(lines)} reads in {len(set(lines))} chunks recorded ({rec['fetched_bytes']:,} bytes fetched, "
            f"{rec['time_s']:.2f} s unshaped)")
        result["setup"]["convert"][f"lamina-boot-{w}"] = b.convert(f"lamina-boot-{w}", prefetch=trace)

    # ---- 2./3. per link ---------------------------------------------------------------------------
    incomplete = None
    try:
        for link in links:
            b.set_link(link)
            big = max(img["layers"], key=lambda x: x["size"])
            result["links"][link] = b.calibrate(link, big["digest"], big["size"])
            for i in range(a.runs):
                for wi, w in enumerate(workloads):
                    k = (i + wi) % len(VARIANTS)
                    for v in VARIANTS[k:] + VARIANTS[:k]:
                        if v == "containerd" and i >= cd_runs[link]:
                            continue
                        b.check_deadline()
                        with open("/proc/loadavg") as f:
                            load = float(f.read().split()[0])
                        if v == "containerd":
                            rec = b.containerd_run(w)
                        else:
                            rec = b.lamina_run("lamina" if v == "lamina" else f"lamina-boot-{w}", w)
                        rec.update(link=link, workload=w, variant=v, run=i + 1, loadavg_1min_before=load)
                        result["runs"].append(rec)
                        extra = "" if v == "containerd" else (
                            f", mount {rec['mount_s']:.3f} s, fetched {rec['fetched_bytes']:,} B in "
                            f"{rec['requests']} requests / {rec['misses']} misses")
                        log(f"{link} {w} {v} run {i + 1}: {rec['time_s']:.3f} s, wire {rec['wire_bytes']:,} B"
                            f"{extra}; 2nd container {rec['second']['time_s']:.3f} s")
    except Deadline as e:
        incomplete = str(e)
        log(f"stopping early: {incomplete}")
    finally:
        b.set_link(None)

    result["incomplete"] = incomplete
    aggregate(result)
    result["bench_seconds"] = time.perf_counter() - t_start
    with open("/proc/loadavg") as f:
        result["machine"]["loadavg_at_end"] = f.read().split()[:3]
    busy1, steal1 = cpu_stat()
    # busy CPU-seconds of the whole machine during the run (containerd, lamina daemons,
    # containers and everything else), and those of this driver and its direct children
    result["machine"]["busy_cpu_s_during_bench"] = round(busy1 - busy0, 1)
    result["machine"]["driver_cpu_s"] = round(own_cpu() - own0, 1)
    result["machine"]["steal_s_during_bench"] = round(steal1 - steal0, 1)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print_table(result)
    if incomplete:
        sys.exit(1)


if __name__ == "__main__":
    main()
