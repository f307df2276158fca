#!/usr/bin/env python3
"""Measurement engine of scripts/coldstart.sh (standard library only).

coldstart.sh sets up the network namespace (with a docker-registry in it) and a
private containerd, then runs:

  coldstart_run.py --lamina BIN --image LAYOUT:TAG --work DIR --id PREFIX
                   --netns /run/netns/NAME --registry 127.0.0.1:PORT --registry-pid PID
                   --containerd-sock SOCK --containerd-root DIR --snapshotter-sock SOCK
                   [--links 1gbit,100mbit,10mbit] [--runs N] [--slow-runs M]
                   [--workloads python,nginx,redis] [--variants V,...] [--idle-images N]
                   [--max-seconds S] --out FILE.json

What it does, in this order:

1. Unshaped link: pushes the source image into the registry (skopeo), converts
   it there with `lamina convert` (tag `lamina`), and per workload records a
   boot set (`lamina mount --record-trace` of `lamina`, the workload run to its
   first useful output) and converts again with `--prefetch TRACE` (tag
   `lamina-boot-WORKLOAD`).
2. Per link: `tc qdisc replace dev lo root tbf rate RATE burst 64kb latency
   50ms` in the namespace, a throughput check (a Range GET of RATE x 1 s of a
   layer blob with curl) and the latency of a 1-byte Range GET.
   Then (with a snapshotter variant) the idle footprint: N images (the source
   plus a one-file layer each, converted) pulled through lamina snapshotter,
   10 s of quiet, then the RSS of the snapshotter and the RSS and PSS of the
   mount daemons.
3. Per link, run and workload, the variants in a rotating order, each
   after `sync; echo 3 > /proc/sys/vm/drop_caches`:
   - containerd: `ctr image pull --plain-http` (in the namespace) into a fresh
     containerd namespace whose content store is checked to be empty, then
     `ctr run --rm --net-host`; afterwards the image, content and namespace are
     deleted (`images rm --sync`);
   - lamina / lamina-boot: `lamina mount` (in the namespace) with a fresh cache
     directory, overlayfs (lowerdir = the mount), `runc run` of a bundle from
     `runc spec` without a network namespace.
   - snapshotter / snapshotter-boot: a fresh `lamina snapshotter` (in the
     namespace, so its mounts fetch through the shaped link) behind
     containerd's proxy plugin, `ctr-remote image rpull --plain-http
     --snapshotter lamina` (in the namespace; containerd 1.6's client with
     the remote-snapshot labels), then `ctr-remote run --rm --net-host
     --snapshotter lamina` (ctr's `run`; the client that pulled runs, as
     with containerd's `ctr pull` + `ctr run`);
   - run / run-boot: `lamina run --rm --net host` with a fresh cache dir (in
     the namespace, so the container is too: the servers' probe connects from
     inside it, across the shaped lo).
   Time = start (pull / mount / lamina run) -> first useful output: "hello" on stdout
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
import ctypes
import glob
import gzip
import hashlib
import io
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
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench.harness
from bench.harness.measure import cpu_stat, drop_caches, fault_proxy, machine_info, own_cpu  # noqa: E402

# containerd / lamina-boot time ratios wanted for python3, per link
TIME_TARGETS = {"python": {"1gbit": 18.0, "100mbit": 24.0, "10mbit": 32.0}}
# bytes fetched for a cold start, % of the image's compressed size (source layers)
BYTES_TARGET_PCT = 3.0
TBF = ["burst", "64kb", "latency", "50ms"]
VARIANTS = ["containerd", "lamina", "lamina-boot", "snapshotter", "snapshotter-boot", "run", "run-boot",
            "proxy", "faults", "faults-nohedge", "local", "index", "index-boot", "docker-index"]
# docker-index: Docker Engine (dockerd with the containerd image store and
# `lamina` as its storage driver, on the same containerd and a fresh lamina
# snapshotter) pulls and runs the unmodified tag, found through its index:
# `docker pull` + `docker run`, python3 only. dockerd and docker from
# DOCKER_DIR (scripts/setup.sh), else from PATH.
DOCKER_DIR = "/var/cache/lamina-test/go/dockerd-v28.5.2"
# index: the unmodified image through its tar index (`lamina index`, issue
# 30), `lamina mount` of the source tag itself; index-boot: through an index
# with boot pages from a trace recorded through the plain index's mount
# (`lamina index --prefetch`, stored as tag index-boot-WORKLOAD of the same
# repository and named with --index).
# The fault runs: `lamina mount` (no boot set) through tests/tools/faultproxy.py
# with the demo's mix: every 5th range answer spoilt (flip, truncate, reset,
# 500, 503, a 3 s stall in turn); with hedging and with --no-hedge. Their
# baseline is `proxy`, the same proxy spoiling nothing: it runs in the
# namespace, so every byte crosses the shaped link twice (registry to proxy,
# proxy to lamina), and it forwards an answer only once it has all of it.
FAULT_MIX = ["mix", "--every", "5", "--stall", "3"]
FAULTS_OVER_CLEAN_MAX = 2.0
LAMINA_VARIANTS = [v for v in VARIANTS if v not in ("containerd", "local")]
# Through containerd with a boot set: its time at most this many times `lamina run`'s (issue 8)
SNAPSHOTTER_OVER_RUN_MAX = 1.3
# containerd / snapshotter-boot for python3 at 100mbit (issue 8)
SNAPSHOTTER_TARGETS = {"python": {"100mbit": 20.0}}
IDLE_IMAGES = 20
IDLE_RSS_TARGET_MIB = 32
READY_TIMEOUT = 300
# workloads whose first useful output is "hello" on stdout
STDOUT_WORKLOADS = ("python", "readall", "datasci", "node")
# Heavy workloads (issue 29), each on its own image: a tag of the layout that
# scripts/heavy-image.sh builds (--heavy). They run with these variants only;
# "local" is the limit: the same start from the source image unpacked on
# local disk (umoci), page cache dropped.
HEAVY = ("datasci", "node")
HEAVY_VARIANTS = ("containerd", "lamina", "lamina-boot", "local")
DATASCI_IMPORTS = "numpy, pandas, scipy.stats, sklearn.linear_model, pyarrow, statsmodels.api, matplotlib.pyplot"
NODE_REQUIRES = ["express", "lodash", "moment", "axios", "@babel/core", "rxjs", "date-fns", "typescript"]
# Heavy starts with a boot set: at most this times the limit; without: HEAVY_NO_BOOT_OVER_LIMIT_MAX,
# and at least HEAVY_VS_CONTAINERD_MIN times faster than containerd's full pull at 100mbit.
HEAVY_BOOT_OVER_LIMIT_MAX = 1.3
HEAVY_NO_BOOT_OVER_LIMIT_MAX = 2.0
HEAVY_VS_CONTAINERD_MIN = 10.0
# readall (every file of the image read once) has no boot set of its own and
# runs only on links of 100mbit and more: at 10mbit each start is minutes
READALL_MIN_BPS = 100 * 10**6
CLONE_NEWNET = 0x40000000
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


def terminate(proc, timeout=30):
    """SIGTERM, then SIGKILL after `timeout` seconds; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
    return proc_status_kib(pid, "VmHWM")


def proc_status_kib(pid, field):
    """A kB field of /proc/PID/status (VmRSS, VmHWM)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, TypeError):
        pass
    return None


def pss_kib(pid):
    """Proportional set size: shared pages (the one lamina binary's text) split
    between the processes mapping them, so a sum over processes is fair."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
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


def enter_netns(path):
    """Moves the calling thread (only it) into the network namespace at path."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {path}")
    finally:
        os.close(fd)


def probe_in_netns(netns, probe, port):
    """probe(port), run on a short-lived thread inside netns (a server there is
    not reachable from this namespace's 127.0.0.1)."""
    out = []

    def body():
        try:
            enter_netns(netns)
            out.append(probe(port))
        except OSError as e:
            out.append(e)
    t = threading.Thread(target=body)
    t.start()
    t.join()
    if isinstance(out[0], OSError):
        raise out[0]
    return out[0]


def wait_ready(workload, proc, port, timeout=READY_TIMEOUT, netns=None):
    """Blocks until the workload's first useful output; returns time.perf_counter() then.
    With netns, the servers' probe connects from inside that network namespace."""
    deadline = time.monotonic() + timeout
    if workload in STDOUT_WORKLOADS:
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
        if (probe_in_netns(netns, probe, port) if netns else probe(port)):
            return time.perf_counter()
        if proc.poll() is not None:
            raise RuntimeError(f"container exited before it answered (rc {proc.returncode})")
        time.sleep(0.01)
    raise TimeoutError(f"no answer within {timeout} s")


def workload_args(workload, port):
    if workload == "python":
        return ["python3", "-c", 'print("hello")']
    if workload == "datasci":
        return ["python3", "-c", f'import matplotlib; matplotlib.use("Agg"); import {DATASCI_IMPORTS}; print("hello")']
    if workload == "node":
        requires = "".join(f"require({json.dumps(m)});" for m in NODE_REQUIRES)
        return ["sh", "-c", f"cd /opt/app && LD_LIBRARY_PATH=/opt/node/lib exec /opt/node/bin/node -e "
                            f"'{requires} console.log(\"hello\")'"]
    if workload == "readall":
        return ["sh", "-c", "find / -xdev -type f -exec cat {} + >/dev/null; echo hello"]
    if workload == "nginx":
        return ["nginx", "-c", NGINX_CONF_IN]
    return ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--protected-mode", "no"]


class MountWatch:
    """Samples the one lazy mount of a cache dir every 50 ms from a thread: its
    status.json (which `lamina status` reads) and its daemons' VmHWM. `lamina run`
    unmounts when the container exits, python3 exits right after its output, so
    the figures of such a start are the last ones seen before the unmount."""

    def __init__(self, cache):
        self.mounts = os.path.join(cache, "mounts")
        self.samples = []  # (perf_counter, status with holder_pid)
        self.hwm = {"holder": None, "worker": None}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def read(self):
        try:
            dirs = os.listdir(self.mounts)
        except OSError:
            return None
        for n in dirs:
            try:
                with open(os.path.join(self.mounts, n, "status.json")) as f:
                    st = json.load(f)
                with open(os.path.join(self.mounts, n, "ready")) as f:
                    st["holder_pid"] = json.load(f).get("pid")
                return st
            except (OSError, ValueError):
                continue
        return None

    def loop(self):
        while not self.stop.is_set():
            st = self.read()
            if st:
                self.samples.append((time.perf_counter(), st))
                for k, pid in (("holder", st.get("holder_pid")), ("worker", st.get("pid"))):
                    v = vm_hwm_kib(pid)
                    if v and (self.hwm[k] or 0) < v:
                        self.hwm[k] = v
            self.stop.wait(0.05)

    def at(self, t_ready):
        """The status of the first sample taken at least 100 ms after t_ready (the
        worker rewrites status.json every 200 ms or sooner), else the last one."""
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline and not any(t >= t_ready + 0.1 for t, _ in self.samples):
            if not self.thread.is_alive():
                break
            time.sleep(0.05)
        later = [st for t, st in self.samples if t >= t_ready + 0.1]
        if later:
            return later[0]
        return self.samples[-1][1] if self.samples else {}

    def rss(self):
        h, w = self.hwm["holder"], self.hwm["worker"]
        return {"holder": h, "worker": w, "sum": h + w if h and w else None}


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

    @staticmethod
    def tags(workload):
        """(source, lamina, lamina with the workload's boot set) tags of a workload's image."""
        if workload in HEAVY:
            return workload, f"{workload}-lamina", f"{workload}-lamina-boot"
        return "bookworm", "lamina", f"lamina-boot-{workload}"

    def convert(self, dst_tag, prefetch=None, src_tag="bookworm"):
        t = time.perf_counter()
        # COLDSTART_CONVERT_ARGS: more `lamina convert` options (to try a setting)
        args = ["convert"] + (["--prefetch", prefetch] if prefetch else []) + \
            os.environ.get("COLDSTART_CONVERT_ARGS", "").split() + [
            f"docker://{self.reg}/debian:{src_tag}", f"docker://{self.reg}/debian:{dst_tag}"]
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
        out = subprocess.PIPE if workload in STDOUT_WORKLOADS else open(os.path.join(d, "stdout.log"), "wb")
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

    def lamina_faults(self, workload, hedge, mode=FAULT_MIX):
        """`lamina_run` of the plain image through a fault proxy in the namespace."""
        d = os.path.join(self.work, "proxies", f"{self.next_seq():03d}")
        reg_port = self.reg.rsplit(":", 1)[1]
        with fault_proxy(d, reg_port, mode, prefix=self.ns) as (port, stats):
            rec = self.lamina_run("lamina", workload,
                                  ref=f"docker://127.0.0.1:{port}/debian:lamina",
                                  mount_args=[] if hedge else ["--no-hedge"])
            with open(stats) as f:
                st = json.load(f)
        rec["proxy"] = {k: st.get(k) for k in ("eligible", "faulted", "faults")}
        return rec

    def lamina_run(self, tag, workload, record_trace=None, second=True, ref=None, mount_args=()):
        seq = self.next_seq()
        rd = os.path.join(self.work, "runs", f"{seq:03d}-{tag}-{workload}")
        cache, mnt = os.path.join(rd, "cache"), os.path.join(rd, "mnt")
        os.makedirs(mnt)
        port = free_port()
        c1 = self.bundle(os.path.join(rd, "c1"), workload, port)
        cid = f"{self.a.id}-{seq}"
        ref = ref or f"docker://{self.reg}/debian:{tag}"
        # COLDSTART_MOUNT_ARGS: more `lamina mount` options for every lamina_run (to try a setting)
        extra = ((["--record-trace", record_trace] if record_trace else []) + list(mount_args)
                 + os.environ.get("COLDSTART_MOUNT_ARGS", "").split())
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
                                                 "bad_chunks", "cached_bytes", "prefetch_done", "prefetch_total",
                                                 "hedges", "hedge_wins", "boot_frames", "ahead_chunk_bytes",
                                                 "ahead_used_bytes", "predictions", "predicted_requests",
                                                 "predicted_fetched_bytes")})
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

    def local_run(self, workload, rootfs):
        """The limit: the same start from the source image unpacked on local disk (`rootfs`), page cache
        dropped, through the same overlay + runc as `lamina_run`; then a second, warm one."""
        seq = self.next_seq()
        rd = os.path.join(self.work, "runs", f"{seq:03d}-local-{workload}")
        cid = f"{self.a.id}-{seq}"
        rec = {}
        try:
            port = free_port()
            c1 = self.bundle(os.path.join(rd, "c1"), workload, port)
            drop_caches()
            tx0 = self.tx_bytes()
            t0 = time.perf_counter()
            self.overlay(rootfs, c1)
            t_ready = self.runc_container(c1, cid, workload, port)
            rec.update(time_s=t_ready - t0, wire_bytes=self.tx_bytes() - tx0)
            port2 = free_port()
            c2 = self.bundle(os.path.join(rd, "c2"), workload, port2)
            self.overlay(rootfs, c2)
            t1 = time.perf_counter()
            t2 = self.runc_container(c2, f"{cid}b", workload, port2)
            rec["second"] = {"time_s": t2 - t1, "wire_bytes": 0}
            return rec
        finally:
            for sub in ("c2", "c1"):
                umount(os.path.join(rd, sub, "rootfs"))
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

    def ctr_container(self, ns, cid, ref, workload, port, d, snapshotter=None):
        # The client that pulled runs the container too (as with containerd's
        # `ctr pull` + `ctr run`): ctr-remote is ctr with `rpull` added, and
        # a second, cold binary would cost the snapshotter variants alone.
        client = ["ctr-remote", "--address", self.a.containerd_sock] if snapshotter else self.ctr
        cmd = client + ["-n", ns, "run", "--rm", "--net-host"]
        if snapshotter:
            cmd += ["--snapshotter", snapshotter]
        if workload == "nginx":
            conf = os.path.join(d, "nginx.conf")
            with open(conf, "w") as f:
                f.write(NGINX_CONF.format(port=port))
            cmd += ["--mount", f"type=bind,src={conf},dst={NGINX_CONF_IN},options=rbind:ro"]
        cmd += [ref, cid] + workload_args(workload, port)
        out = subprocess.PIPE if workload in STDOUT_WORKLOADS else open(os.path.join(d, f"{cid}.out"), "wb")
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
        ref = f"{self.reg}/debian:{self.tags(workload)[0]}"
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
            self.containerd_forget(ns, [ref])
            shutil.rmtree(d, ignore_errors=True)

    def containerd_forget(self, ns, refs, snapshotter=None):
        """Removes the images (their content and snapshots with them) and the namespace."""
        snap = ["--snapshotter", snapshotter] if snapshotter else []
        for ref in refs:
            run(self.ctr + ["-n", ns, "images", "rm", "--sync", ref], check=False, timeout=300)
        p = run(self.ctr + ["-n", ns, "content", "ls", "-q"], capture=True, check=False)
        for dg in p.stdout.split():
            run(self.ctr + ["-n", ns, "content", "rm", dg], check=False)
        # children before parents: the newest first
        p = run(self.ctr + ["-n", ns, "snapshots"] + snap + ["ls"], capture=True, check=False)
        for line in reversed(p.stdout.splitlines()[1:]):
            if line.split():
                run(self.ctr + ["-n", ns, "snapshots"] + snap + ["rm", line.split()[0]], check=False)
        run(self.ctr + ["namespaces", "rm", ns], check=False)

    # -- lamina snapshotter under containerd -------------------------------------------------
    def start_snapshotter(self, root):
        """A fresh `lamina snapshotter` (in the namespace: its mounts' daemons fetch
        through the shaped link) on the socket containerd's proxy plugin names."""
        sock = self.a.snapshotter_sock
        if os.path.exists(sock):
            os.unlink(sock)
        os.makedirs(root, exist_ok=True)
        log_f = open(os.path.join(os.path.dirname(root), "snapshotter.log"), "ab")
        env = dict(os.environ, LAMINA_LOG="debug") if self.a.keep_logs else None
        proc = subprocess.Popen(self.ns + [self.lamina, "snapshotter", "--root", root, "--address", sock],
                                stdin=subprocess.DEVNULL, stdout=log_f, stderr=log_f, start_new_session=True,
                                env=env)
        log_f.close()
        end = time.monotonic() + 30
        while True:
            try:
                with socket.socket(socket.AF_UNIX) as c:
                    c.connect(sock)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"lamina snapshotter did not listen on {sock} (rc {proc.poll()})")
                time.sleep(0.05)
        # containerd's proxy client fails calls fast while it backs off from
        # the previous snapshotter's socket (up to 3 s in 1.6): one call that
        # reaches the snapshotter (`ls` is answered from containerd's own
        # metadata), untimed, so the measured pull does not meet that backoff
        snap = self.ctr + ["-n", "warmup", "snapshots", "--snapshotter", "lamina"]
        key = f"warmup-{self.next_seq()}"
        while run(snap + ["prepare", key], check=False, timeout=60).returncode != 0:
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"containerd did not reach lamina snapshotter on {sock}")
            time.sleep(0.2)
        run(snap + ["rm", key], timeout=60)
        return proc

    def stop_snapshotter(self, proc, root):
        """Stops the snapshotter, then unmounts whatever lamina mounts it left."""
        terminate(proc)
        snaps = os.path.join(root, "snapshots")
        for name in os.listdir(snaps) if os.path.isdir(snaps) else []:
            for sub in ("merged", "lamina"):
                mnt = os.path.join(snaps, name, sub)
                if is_mountpoint(mnt):
                    log(f"warning: {mnt} still mounted after the snapshots were removed")
                    self.lamina_umount(os.path.join(root, "cache"), mnt) if sub == "lamina" else umount(mnt)

    def snapshotter_status(self, root):
        """lamina status of the snapshotter's mounts: the one mount's figures."""
        p = run([self.lamina, "status", "--json", "--cache-dir", os.path.join(root, "cache")], capture=True,
                check=False)
        mounts = json.loads(p.stdout or "[]") if p.returncode == 0 else []
        if len(mounts) != 1:
            return {"mounts": len(mounts)}
        m = mounts[0]
        return dict(m.get("status") or {}, holder_pid=m.get("holder_pid"), mounts=1)

    def rpull(self, ns, ref):
        """`ctr-remote image rpull`: containerd 1.6's client with stargz's
        remote-snapshot labels, which lamina snapshotter recognises."""
        run(self.ns + ["ctr-remote", "-a", self.a.containerd_sock, "-n", ns, "image", "rpull", "--plain-http",
                       "--snapshotter", "lamina", ref], timeout=600)

    def snapshotter_run(self, tag, workload):
        seq = self.next_seq()
        ns = f"cs{seq}"
        ref = f"{self.reg}/debian:{tag}"
        cid = f"{self.a.id}-{seq}"
        d = os.path.join(self.work, "runs", f"{seq:03d}-snapshotter-{tag}-{workload}")
        root = os.path.join(d, "root")
        port = free_port()
        proc = self.start_snapshotter(root)
        rec = {"tag": tag}
        try:
            drop_caches()
            tx0 = self.tx_bytes()
            t0 = time.perf_counter()
            self.rpull(ns, ref)
            t_pull = time.perf_counter()
            tx_pull = self.tx_bytes()
            t_ready = self.ctr_container(ns, cid, ref, workload, port, d, snapshotter="lamina")
            tx_ready = self.tx_bytes()
            time.sleep(0.25)  # the worker rewrites status.json every 200 ms
            st = self.snapshotter_status(root)
            if st.get("mounts") != 1:
                raise RuntimeError(f"expected one lamina mount under the snapshotter, found {st.get('mounts')}")
            rec.update(time_s=t_ready - t0, pull_s=t_pull - t0, container_s=t_ready - t_pull,
                       wire_bytes_pull=tx_pull - tx0, wire_bytes_ready=tx_ready - tx0,
                       fetched_bytes_ready=st.get("fetched_bytes"), requests_ready=st.get("requests"),
                       misses_ready=st.get("misses"), content_blobs=self.content_blobs())
            st = self.wait_prefetch(lambda: self.snapshotter_status(root), st)
            rec.update(wire_bytes=self.tx_bytes() - tx0,
                       **{k: st.get(k) for k in ("fetched_bytes", "requests", "misses", "failed_misses",
                                                 "bad_chunks", "cached_bytes", "prefetch_done", "prefetch_total")})
            f0, tx1 = st.get("fetched_bytes") or 0, self.tx_bytes()
            t1 = time.perf_counter()
            t2 = self.ctr_container(ns, f"{cid}b", ref, workload, free_port(), d, snapshotter="lamina")
            time.sleep(0.25)
            st2 = self.snapshotter_status(root)
            rec["second"] = {"time_s": t2 - t1, "fetched_bytes": (st2.get("fetched_bytes") or 0) - f0,
                             "wire_bytes": self.tx_bytes() - tx1,
                             "misses": (st2.get("misses") or 0) - (st.get("misses") or 0)}
            hw, ww, sw = vm_hwm_kib(st2.get("holder_pid")), vm_hwm_kib(st2.get("pid")), vm_hwm_kib(proc.pid)
            rec["rss_kib"] = {"holder": hw, "worker": ww, "snapshotter": sw,
                              "sum": (hw or 0) + (ww or 0) if hw and ww else None}
            return rec
        finally:
            # before the mount goes: its daemons' logs go with it
            self.keep_logs(d, os.path.basename(d))
            self.containerd_forget(ns, [ref], snapshotter="lamina")
            self.stop_snapshotter(proc, root)
            self.rmtree_unmounted(d)

    def docker_bins(self):
        """dockerd and docker: setup.sh's build, else PATH; None when there are none."""
        for d in (DOCKER_DIR, None):
            bins = [os.path.join(d, b) if d else shutil.which(b) for b in ("dockerd", "docker")]
            if all(b and os.access(b, os.X_OK) for b in bins):
                return bins
        return None

    def start_dockerd(self, d, seq):
        """dockerd in the namespace (it fetches manifests itself) on our containerd."""
        dockerd, docker = self.docker_bins()
        sock = os.path.join(d, "docker.sock")
        log_f = open(os.path.join(d, "dockerd.log"), "ab")
        proc = subprocess.Popen(
            self.ns + [dockerd, "--containerd", self.a.containerd_sock, "--data-root", os.path.join(d, "docker"),
                       "--exec-root", f"/run/lcs-docker-{self.a.id}-{seq}", "--pidfile", os.path.join(d, "docker.pid"),
                       "-H", f"unix://{sock}", "--iptables=false", "--ip6tables=false", "--bridge=none",
                       "--userland-proxy=false", "--storage-driver", "lamina",
                       "--feature", "containerd-snapshotter=true", "--insecure-registry", self.reg],
            stdin=subprocess.DEVNULL, stdout=log_f, stderr=log_f, start_new_session=True)
        log_f.close()
        client = [docker, "-H", f"unix://{sock}"]
        end = time.monotonic() + 60
        while run(client + ["info"], check=False, capture=True).returncode != 0:
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"dockerd did not answer (rc {proc.poll()})")
            time.sleep(0.2)
        return proc, client

    def docker_container(self, client, ref, workload):
        """`docker run --rm` of the workload; returns when its first output came."""
        proc = subprocess.Popen(self.ns + client + ["run", "--rm", "--network", "host", ref]
                                + workload_args(workload, 0), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            return wait_ready(workload, proc, 0)
        finally:
            proc.wait(timeout=60)
            proc.stdout.close()

    def docker_run(self, workload):
        if workload != "python" or not self.docker_bins():
            raise RuntimeError("docker-index: python only, and needs dockerd and docker")
        seq = self.next_seq()
        ref = f"{self.reg}/debian:bookworm"
        d = os.path.join(self.work, "runs", f"{seq:03d}-docker-{workload}")
        root = os.path.join(d, "root")
        os.makedirs(d)
        snap = self.start_snapshotter(root)
        dockerd, client = None, None
        rec = {"tag": "bookworm"}
        try:
            dockerd, client = self.start_dockerd(d, seq)
            drop_caches()
            tx0 = self.tx_bytes()
            t0 = time.perf_counter()
            run(self.ns + client + ["pull", "-q", ref], timeout=600)
            t_pull = time.perf_counter()
            tx_pull = self.tx_bytes()
            t_ready = self.docker_container(client, ref, workload)
            tx_ready = self.tx_bytes()
            time.sleep(0.25)  # the worker rewrites status.json every 200 ms
            st = self.snapshotter_status(root)
            rec.update(time_s=t_ready - t0, pull_s=t_pull - t0, container_s=t_ready - t_pull,
                       wire_bytes_pull=tx_pull - tx0, wire_bytes_ready=tx_ready - tx0, wire_bytes=tx_ready - tx0,
                       fetched_bytes_ready=st.get("fetched_bytes"), requests_ready=st.get("requests"),
                       misses_ready=st.get("misses"), content_blobs=self.content_blobs(),
                       **{k: st.get(k) for k in ("fetched_bytes", "requests", "misses", "failed_misses",
                                                 "bad_chunks", "cached_bytes")})
            f0, tx1 = st.get("fetched_bytes") or 0, self.tx_bytes()
            t1 = time.perf_counter()
            t2 = self.docker_container(client, ref, workload)
            time.sleep(0.25)
            st2 = self.snapshotter_status(root)
            rec["second"] = {"time_s": t2 - t1, "fetched_bytes": (st2.get("fetched_bytes") or 0) - f0,
                             "wire_bytes": self.tx_bytes() - tx1,
                             "misses": (st2.get("misses") or 0) - (st.get("misses") or 0)}
            return rec
        finally:
            if dockerd is not None:
                terminate(dockerd)
            self.containerd_forget("moby", [f"docker.io/{ref}", ref], snapshotter="lamina")
            self.stop_snapshotter(snap, root)
            self.rmtree_unmounted(d)

    def wait_prefetch(self, status, st):
        """Waits (at most 180 s) for the boot set's background fetch; the last status."""
        if st.get("prefetch_total"):
            end = time.monotonic() + 180
            while st.get("prefetch_done", 0) < st["prefetch_total"] and time.monotonic() < end:
                time.sleep(0.1)
                st = status()
            time.sleep(0.25)
            st = status()
        return st

    def keep_logs(self, d, name):
        """With --keep-logs: the snapshotter's log in `d` and its mounts' daemon
        logs (ROOT/cache/mounts/*/) to KEEP/name."""
        if not self.a.keep_logs:
            return
        dst = os.path.join(self.a.keep_logs, name)
        os.makedirs(dst, exist_ok=True)
        logs = glob.glob(os.path.join(d, "*.log")) + glob.glob(os.path.join(d, "root", "cache", "mounts", "*", "*.log"))
        for src in logs:
            shutil.copy(src, os.path.join(dst, os.path.basename(src)))

    def rmtree_unmounted(self, d):
        with open("/proc/self/mounts") as f:
            busy = [line.split()[1] for line in f if line.split()[1].startswith(d + "/")]
        if busy:
            log(f"warning: left {d} in place, still mounted: {busy}")
        else:
            shutil.rmtree(d, ignore_errors=True)

    # -- lamina run --------------------------------------------------------------------------
    def run_container(self, d, name, ref, workload, port, cache, state):
        """`lamina run --rm` (in the namespace, for its mount's fetches) until the first
        useful output; then the container is killed and lamina run cleans up. Returns
        t_ready."""
        cmd = self.ns + [self.lamina, "run", "--rm", "--name", name, "--cache-dir", cache, "--state-dir", state,
                         "--net", "host"]
        if workload == "nginx":
            conf = os.path.join(d, f"{name}-nginx.conf")
            with open(conf, "w") as f:
                f.write(NGINX_CONF.format(port=port))
            cmd += ["-v", f"{conf}:{NGINX_CONF_IN}:ro"]
        cmd += [ref, "--"] + workload_args(workload, port)
        out = subprocess.PIPE if workload in STDOUT_WORKLOADS else open(os.path.join(d, f"{name}.out"), "wb")
        err = open(os.path.join(d, f"{name}.err"), "wb")
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        try:
            # `--net host` is the namespace's network: the probe connects from there
            return wait_ready(workload, proc, port, netns=self.a.netns)
        except Exception:
            with open(os.path.join(d, f"{name}.err"), "rb") as f:
                log(f"lamina run {name} stderr: {f.read()[-1500:].decode(errors='replace')}")
            raise
        finally:
            subprocess.run(["runc", "--root", os.path.join(state, "runc"), "kill", name, "KILL"],
                           stderr=subprocess.DEVNULL)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
            if out is not subprocess.PIPE:
                out.close()
            err.close()

    def lamina_run_cmd(self, tag, workload):
        """Two `lamina run --rm` of one image on one cache dir: cold, then warm."""
        seq = self.next_seq()
        d = os.path.join(self.work, "runs", f"{seq:03d}-run-{tag}-{workload}")
        cache, state = os.path.join(d, "cache"), os.path.join(d, "state")
        os.makedirs(d)
        ref = f"docker://{self.reg}/debian:{tag}"
        name = f"{self.a.id}-{seq}"
        rec = {"tag": tag}
        try:
            drop_caches()
            tx0 = self.tx_bytes()
            with MountWatch(cache) as watch:
                t0 = time.perf_counter()
                t_ready = self.run_container(d, name, ref, workload, free_port(), cache, state)
                tx_ready = self.tx_bytes()
                st = watch.at(t_ready)
            rec.update(time_s=t_ready - t0, wire_bytes_ready=tx_ready - tx0, wire_bytes=tx_ready - tx0,
                       fetched_bytes_ready=st.get("fetched_bytes"), requests_ready=st.get("requests"),
                       misses_ready=st.get("misses"), rss_kib=watch.rss(),
                       **{k: st.get(k) for k in ("fetched_bytes", "requests", "misses", "failed_misses",
                                                 "bad_chunks", "cached_bytes", "prefetch_done", "prefetch_total")})
            tx1 = self.tx_bytes()
            with MountWatch(cache) as watch:
                t1 = time.perf_counter()
                t2 = self.run_container(d, f"{name}b", ref, workload, free_port(), cache, state)
                st2 = watch.at(t2)
            rec["second"] = {"time_s": t2 - t1, "fetched_bytes": st2.get("fetched_bytes"),
                             "wire_bytes": self.tx_bytes() - tx1, "misses": st2.get("misses")}
            return rec
        finally:
            self.rmtree_unmounted(d)

    # -- idle footprint ----------------------------------------------------------------------
    def idle_images(self, layout, tag, n):
        """n distinct images: the source image plus a one-file layer naming each,
        pushed and converted (tags idleI:lamina). Returns their references."""
        src = os.path.join(self.work, "idle-oci")
        blobs = os.path.join(src, "blobs", "sha256")
        os.makedirs(blobs, exist_ok=True)
        with open(os.path.join(src, "oci-layout"), "w") as f:
            json.dump({"imageLayoutVersion": "1.0.0"}, f)
        img = source_image(layout, tag)
        with open(os.path.join(layout, "blobs", *img["manifest_digest"].split(":", 1))) as f:
            manifest = json.load(f)
        with open(os.path.join(layout, "blobs", *manifest["config"]["digest"].split(":", 1))) as f:
            config = json.load(f)
        for layer in manifest["layers"]:
            link = os.path.join(blobs, layer["digest"].split(":", 1)[1])
            if not os.path.exists(link):
                os.symlink(os.path.join(layout, "blobs", *layer["digest"].split(":", 1)), link)

        def put(data):
            dg = hashlib.sha256(data).hexdigest()
            with open(os.path.join(blobs, dg), "wb") as f:
                f.write(data)
            return f"sha256:{dg}", len(data)
        index = {"schemaVersion": 2, "manifests": []}
        for i in range(n):
            tar_bytes = io.BytesIO()
            with tarfile.open(fileobj=tar_bytes, mode="w") as t:
                body = f"idle image {i}\n".encode()
                info = tarfile.TarInfo("etc/lamina-idle-id")
                info.size, info.mtime = len(body), 0
                t.addfile(info, io.BytesIO(body))
            raw = tar_bytes.getvalue()
            layer_dg, layer_size = put(gzip.compress(raw, mtime=0))
            cfg = json.loads(json.dumps(config))
            cfg["rootfs"]["diff_ids"].append("sha256:" + hashlib.sha256(raw).hexdigest())
            cfg.setdefault("history", []).append({"created_by": f"coldstart idle image {i}"})
            cfg_dg, cfg_size = put(json.dumps(cfg).encode())
            man = json.loads(json.dumps(manifest))
            man["config"].update(digest=cfg_dg, size=cfg_size)
            man["layers"].append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                                  "digest": layer_dg, "size": layer_size})
            man_dg, man_size = put(json.dumps(man).encode())
            index["manifests"].append({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                       "digest": man_dg, "size": man_size,
                                       "annotations": {"org.opencontainers.image.ref.name": f"idle{i}"}})
        with open(os.path.join(src, "index.json"), "w") as f:
            json.dump(index, f)
        refs = []
        for i in range(n):
            run(self.ns + ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{src}:idle{i}",
                           f"docker://{self.reg}/idle{i}:src"])
            self.lamina_json("convert", f"docker://{self.reg}/idle{i}:src", f"docker://{self.reg}/idle{i}:lamina")
            refs.append(f"{self.reg}/idle{i}:lamina")
        return refs

    def idle_footprint(self, layout, tag, n, settle_s=10):
        """Memory of the snapshotter and of the mount daemons with n images
        pulled (each a lazy mount) and nothing reading."""
        t = time.perf_counter()
        refs = self.idle_images(layout, tag, n)
        log(f"idle: {n} images pushed and converted in {time.perf_counter() - t:.0f} s")
        d = os.path.join(self.work, "idle")
        root = os.path.join(d, "root")
        proc = self.start_snapshotter(root)
        ns = "idle"
        try:
            for ref in refs:
                self.rpull(ns, ref)
            time.sleep(settle_s)
            p = run([self.lamina, "status", "--json", "--cache-dir", os.path.join(root, "cache")], capture=True)
            mounts = json.loads(p.stdout)
            pids = [x for m in mounts for x in (m.get("holder_pid"), (m.get("status") or {}).get("pid")) if x]
            out = {"images": n, "settle_s": settle_s, "mounts": len(mounts),
                   "snapshotter_rss_kib": proc_status_kib(proc.pid, "VmRSS"),
                   "snapshotter_hwm_kib": proc_status_kib(proc.pid, "VmHWM"),
                   "snapshotter_pss_kib": pss_kib(proc.pid),
                   "daemons": len(pids),
                   "daemons_rss_kib": sum(proc_status_kib(x, "VmRSS") or 0 for x in pids),
                   "daemons_pss_kib": sum(pss_kib(x) or 0 for x in pids),
                   "content_blobs": self.content_blobs()}
            log(f"idle: {out['mounts']} mounts; snapshotter RSS {out['snapshotter_rss_kib'] / 1024:.1f} MiB; "
                f"{out['daemons']} daemons RSS {out['daemons_rss_kib'] / 1024:.1f} MiB, "
                f"PSS {out['daemons_pss_kib'] / 1024:.1f} MiB")
            if out["mounts"] != n:
                raise RuntimeError(f"idle: {n} images pulled but {out['mounts']} lamina mounts")
            return out
        finally:
            self.containerd_forget(ns, refs, snapshotter="lamina")
            self.stop_snapshotter(proc, root)
            self.rmtree_unmounted(d)


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


def peer_snapshotters():
    """Other lazy-pulling snapshotters found on PATH. None has a variant here
    yet; the results say which were there to be compared."""
    names = ("containerd-stargz-grpc", "containerd-nydus-grpc", "nydusd")
    return {n: shutil.which(n) for n in names}


def mount_default(lamina, flag):
    """The [default: N] of a `lamina mount` option, from its --help."""
    text = subprocess.run([lamina, "mount", "--help"], capture_output=True, text=True).stdout
    at = text.find(flag)
    if at < 0:
        return None
    part = text[at:].split("[default: ", 1)
    return part[1].split("]", 1)[0] if len(part) == 2 else None


# per-variant figures summarised over runs, when the runs have them
SUMMARY_KEYS = ("pull_s", "mount_s", "overlay_s", "container_s", "wire_bytes_pull", "wire_bytes_mount",
                "wire_bytes_ready", "fetched_bytes", "requests", "misses", "prefetch_total", "fetched_bytes_ready",
                "requests_ready", "misses_ready", "content_blobs", "ahead_chunk_bytes", "ahead_used_bytes",
                "predictions", "predicted_requests")


def summarise(rs, variant, img_bytes):
    s = {"runs": len(rs), "time_s": summary([r["time_s"] for r in rs]),
         "runs_s": [round(r["time_s"], 4) for r in rs],
         "wire_bytes": summary([r["wire_bytes"] for r in rs]),
         "second_time_s": summary([r["second"]["time_s"] for r in rs]),
         "second_wire_bytes": summary([r["second"]["wire_bytes"] for r in rs])}
    for k in SUMMARY_KEYS:
        if any(r.get(k) is not None for r in rs):
            s[k] = summary([r.get(k) for r in rs])
    if variant != "containerd":
        s["second_fetched_bytes"] = summary([r["second"].get("fetched_bytes") for r in rs])
        for part in ("sum", "holder", "worker", "snapshotter"):
            vals = summary([(r.get("rss_kib") or {}).get(part) for r in rs])
            if vals:
                s[f"rss_kib_{part}"] = vals
        if s.get("fetched_bytes"):
            s["fetched_pct"] = 100 * s["fetched_bytes"]["median"] / img_bytes
    s["wire_pct"] = 100 * s["wire_bytes"]["median"] / img_bytes
    return s


def time_targets(ratios, agg):
    """Start-time targets: issue 2's (containerd / lamina mount) and issue 8's
    (through containerd: against the full pull and against `lamina run`)."""
    targets = []
    for w, per_link in TIME_TARGETS.items():
        for link, want in per_link.items():
            for v in ("lamina", "lamina-boot"):
                got = ratios.get(link, {}).get(w, {}).get(v)
                if got is not None:
                    targets.append({"what": f"time containerd / {v}", "workload": w, "link": link, "value": got,
                                    "target_min": want, "met": got >= want})
    for w, per_link in SNAPSHOTTER_TARGETS.items():
        for link, want in per_link.items():
            got = ratios.get(link, {}).get(w, {}).get("snapshotter-boot")
            if got is not None:
                targets.append({"what": "time containerd / snapshotter-boot", "workload": w, "link": link,
                                "value": got, "target_min": want, "met": got >= want})
    for link, per_w in agg.items():
        for w, per_v in per_w.items():
            for snap, own in (("snapshotter-boot", "run-boot"), ("snapshotter", "run")):
                if snap in per_v and own in per_v:
                    got = per_v[snap]["time_s"]["median"] / per_v[own]["time_s"]["median"]
                    targets.append({"what": f"time {snap} / {own}", "workload": w, "link": link, "value": got,
                                    "target_max": SNAPSHOTTER_OVER_RUN_MAX, "unit": "x",
                                    "met": got <= SNAPSHOTTER_OVER_RUN_MAX})
            if "faults" in per_v and "proxy" in per_v:
                got = per_v["faults"]["time_s"]["median"] / per_v["proxy"]["time_s"]["median"]
                targets.append({"what": "time through the fault mix / through the same proxy, clean", "workload": w,
                                "link": link, "value": got, "target_max": FAULTS_OVER_CLEAN_MAX, "unit": "x",
                                "met": got <= FAULTS_OVER_CLEAN_MAX})
            for v in LAMINA_VARIANTS:
                got = ratios.get(link, {}).get(w, {}).get(v)
                if got is not None:
                    # "never slower than overlayfs' full pull"
                    targets.append({"what": f"time containerd / {v} (never slower)", "workload": w, "link": link,
                                    "value": got, "target_min": 1.0, "met": got >= 1.0})
    return targets


def heavy_targets(result, agg):
    """Issue 29: heavy starts against their limit, the larger of the same start from local disk (cold page
    cache) and the boot set's bytes (fetched to first output) at the link's measured rate."""
    targets = []
    for link, per_w in agg.items():
        rate = (result["links"].get(link) or {}).get("MBps")
        for w in HEAVY:
            per_v = per_w.get(w) or {}
            loc, boot, plain = per_v.get("local"), per_v.get("lamina-boot"), per_v.get("lamina")
            if not (loc and boot and rate):
                continue
            boot_bytes = (boot.get("fetched_bytes_ready") or {}).get("median") or 0
            limit = max(loc["time_s"]["median"], boot_bytes / 1e6 / rate)
            result.setdefault("limits", {}).setdefault(link, {})[w] = limit
            for v, bound in (("lamina-boot", HEAVY_BOOT_OVER_LIMIT_MAX), ("lamina", HEAVY_NO_BOOT_OVER_LIMIT_MAX)):
                if per_v.get(v):
                    got = per_v[v]["time_s"]["median"] / limit
                    targets.append({"what": f"time {v} / limit (local disk, or boot set bytes at link rate)",
                                    "workload": w, "link": link, "value": got, "target_max": bound, "unit": "x",
                                    "met": got <= bound})
            cd = per_v.get("containerd")
            if cd and plain and link == "100mbit":
                got = cd["time_s"]["median"] / plain["time_s"]["median"]
                targets.append({"what": "time containerd / lamina (no boot set)", "workload": w, "link": link,
                                "value": got, "target_min": HEAVY_VS_CONTAINERD_MIN, "met": got >= HEAVY_VS_CONTAINERD_MIN})
    return targets


def aggregate(result):
    """Medians per link / workload / variant, ratios, targets."""
    cfg = result["config"]
    agg, ratios = {}, {}
    for link in cfg["links"]:
        agg[link], ratios[link] = {}, {}
        for w in cfg["workloads"]:
            agg[link][w] = {}
            img_bytes = (result.get("images") or {}).get(w, result["image"])["layer_bytes"]
            for v in cfg["variants"]:
                rs = [r for r in result["runs"] if r["link"] == link and r["workload"] == w and r["variant"] == v]
                if rs:
                    agg[link][w][v] = summarise(rs, v, img_bytes)
            cd = agg[link][w].get("containerd")
            ratios[link][w] = {}
            for v in LAMINA_VARIANTS:
                la = agg[link][w].get(v)
                if cd and la:
                    ratios[link][w][v] = cd["time_s"]["median"] / la["time_s"]["median"]
    targets = time_targets(ratios, agg) + heavy_targets(result, agg)
    img_bytes = result["image"]["layer_bytes"]
    # issue 2's bytes target is for starts; reading the whole image needs every byte
    for w in [w for w in cfg["workloads"] if w not in ("readall",) + HEAVY]:
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
    idle = result.get("idle")
    if idle and idle.get("snapshotter_rss_kib"):
        mib = idle["snapshotter_rss_kib"] / 1024
        targets.append({"what": f"snapshotter idle RSS (MiB) with {idle['images']} images mounted",
                        "workload": "-", "link": "-", "value": mib, "target_max": IDLE_RSS_TARGET_MIB, "unit": "MiB",
                        "met": mib <= IDLE_RSS_TARGET_MIB})
    result["medians"] = agg
    result["ratios"] = ratios
    result["targets"] = targets


SHORT = {"containerd": "containerd", "lamina": "mount", "lamina-boot": "mount+b", "snapshotter": "snap",
         "snapshotter-boot": "snap+b", "run": "run", "run-boot": "run+b", "proxy": "proxy", "faults": "faults",
         "faults-nohedge": "faults-nh", "local": "local", "index": "index", "index-boot": "index+b",
         "docker-index": "docker"}


def print_table(r):
    m = r["machine"]
    variants = r["config"]["variants"]
    print(f"\nlamina cold start  {m['date']}  kernel {m['kernel']}  nproc {m['nproc']}  "
          f"image {r['image']['layer_bytes'] / 1e6:.1f} MB compressed; median seconds to first output "
          f"(containerd / variant in brackets); MB fetched by lamina to first output")
    print(f"{'link':<8}{'workload':<9}" + "".join(f"{SHORT[v]:>16}" for v in variants))
    for link, per_w in r["medians"].items():
        for w, per_v in per_w.items():
            cells = []
            for v in variants:
                if v not in per_v:
                    cells.append("-")
                    continue
                x = r["ratios"][link][w].get(v)
                cells.append(f"{per_v[v]['time_s']['median']:.3f}" + (f" ({x:.1f}x)" if x else ""))
            print(f"{link:<8}{w:<9}" + "".join(f"{c:>16}" for c in cells))
            mbs = [f"{per_v[v]['fetched_bytes_ready']['median'] / 1e6:.2f}"
                   if v in per_v and per_v[v].get("fetched_bytes_ready") else "-" for v in variants]
            print(f"{'':<8}{'  MB':<9}" + "".join(f"{c:>16}" for c in mbs))
    idle = r.get("idle")
    if idle:
        print(f"\nidle, {idle['images']} images mounted through the snapshotter: snapshotter RSS "
              f"{idle['snapshotter_rss_kib'] / 1024:.1f} MiB; mount daemons RSS {idle['daemons_rss_kib'] / 1024:.1f} "
              f"MiB, PSS {idle['daemons_pss_kib'] / 1024:.1f} MiB ({idle['daemons']} processes)")
    print("\ntargets")
    for t in r["targets"]:
        bound = f">= {t['target_min']}" if "target_min" in t else f"<= {t['target_max']}"
        print(f"  {t['what']:<62} {t['workload']:<7}{t['link']:<8}{t['value']:8.2f} {bound:>8}  "
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
    ap.add_argument("--workloads", default="python,nginx,redis,readall")
    ap.add_argument("--heavy", help="the layout of scripts/heavy-image.sh (tags datasci, node): needed by "
                                    "the heavy workloads")
    ap.add_argument("--readall-runs", type=int, default=1, help="runs of the readall workload per link")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--snapshotter-sock", required=True, help="the address of containerd's lamina proxy plugin")
    ap.add_argument("--idle-images", type=int, default=IDLE_IMAGES, help="0: no idle footprint phase")
    ap.add_argument("--max-seconds", type=int, default=2700)
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep-logs", help="copy the snapshotter runs' logs here")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    links = a.links.split(",")
    workloads = a.workloads.split(",")
    variants = [v for v in VARIANTS if v in a.variants.split(",")]
    unknown = set(a.variants.split(",")) - set(VARIANTS)
    if unknown or not variants:
        ap.error(f"--variants: choose from {','.join(VARIANTS)}")
    layout, tag = a.image.rsplit(":", 1)

    t_start = time.perf_counter()
    busy0, steal0 = cpu_stat()
    own0 = own_cpu()
    b = Bench(a)
    img = source_image(layout, tag)
    cd_runs = {link: (a.runs if rate_bps(link) >= 100 * 10**6 else min(a.slow_runs, a.runs)) for link in links}
    result = {
        "schema": 1,
        "machine": machine_info(b.lamina, ("containerd", "runc", "docker-registry", "skopeo", "iproute2", "curl",
                                           "stargz-snapshotter")),
        "image": img,
        "config": {"links": links, "runs": a.runs, "containerd_runs": cd_runs, "workloads": workloads,
                   "variants": variants, "peers": peer_snapshotters(),
                   "containerd": run(["containerd", "--version"], capture=True).stdout.strip(), "tbf": " ".join(["tbf", "rate", "RATE"] + TBF), "lo_mtu": 1500,
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
    if "docker-index" in variants and not b.docker_bins():
        log(f"docker-index: no dockerd and docker in {DOCKER_DIR} or on PATH: not measured")
    if {"index", "index-boot", "docker-index"} & set(variants):
        t = time.perf_counter()
        report = b.lamina_json("index", f"docker://{a.registry}/debian:bookworm")
        result["setup"]["index"] = dict(report[0], wall_s=time.perf_counter() - t)
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
    chunk_size = int(insp.get("chunk_size") or 1 << 18)
    owners = {w: chunk_owners(img, chunk_size) for w in workloads if w not in HEAVY}
    result["images"] = {}
    local = {}
    for w in [w for w in workloads if w in HEAVY]:
        if not a.heavy:
            ap.error(f"workload {w} needs --heavy LAYOUT (scripts/heavy-image.sh)")
        himg = result["images"][w] = source_image(a.heavy, w)
        run(b.ns + ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--preserve-digests",
                    f"oci:{a.heavy}:{w}", f"docker://{a.registry}/debian:{w}"])
        result["setup"]["convert"][b.tags(w)[1]] = b.convert(b.tags(w)[1], src_tag=w)
        owners[w] = chunk_owners(himg, chunk_size)
        if "local" in variants:
            local[w] = os.path.join(b.work, f"local-{w}")
            run(["umoci", "unpack", "--image", f"{a.heavy}:{w}", local[w]], timeout=1200)
            local[w] = os.path.join(local[w], "rootfs")
    for w in [w for w in workloads if w != "readall"]:
        trace = os.path.join(b.work, f"trace-{w}.txt")
        _, plain_tag, boot_tag = b.tags(w)
        # Two recorded starts, appended to one trace: a start under runc can
        # read a few pages another start did not; the boot pages get both.
        rec = b.lamina_run(plain_tag, w, record_trace=trace, second=False)
        b.lamina_run(plain_tag, w, record_trace=trace, second=False)
        # lines: CHUNK_DIGEST OFFSET LEN, one per read of data not yet local
        with open(trace) as f:
            reads = [x.split() for x in f.read().splitlines() if x.strip()]
        lines = [r[0] for r in reads]
        files = trace_files(lines, owners[w])
        result["setup"]["traces"][w] = {"reads": len(lines), "distinct_chunks": len(set(lines)),
                                        "bytes_read": sum(int(r[2]) for r in reads if len(r) == 3),
                                        "bytes": sum(e["bytes"] for e in files), "files": files,
                                        "record_run": rec}
        log(f"boot set {w}: {len(lines)} reads in {len(set(lines))} chunks recorded ({rec['fetched_bytes']:,} bytes fetched, "
            f"{rec['time_s']:.2f} s unshaped)")
        result["setup"]["convert"][boot_tag] = b.convert(boot_tag, prefetch=trace, src_tag=b.tags(w)[0])
        if "index-boot" in variants and w not in HEAVY:
            orig = f"docker://{a.registry}/debian:bookworm"
            itrace = os.path.join(b.work, f"trace-index-{w}.txt")
            for _ in range(2):
                b.lamina_run("index", w, record_trace=itrace, second=False, ref=orig)
            report = b.lamina_json("index", "--prefetch", itrace, orig,
                                   f"docker://{a.registry}/debian:index-boot-{w}")
            result["setup"].setdefault("index_boot", {})[w] = report[0]

    if a.idle_images and any(v.startswith("snapshotter") for v in variants):
        result["idle"] = b.idle_footprint(layout, tag, a.idle_images)

    # ---- 2./3. per link ---------------------------------------------------------------------------
    incomplete = None
    try:
        for link in links:
            b.set_link(link)
            big = max(img["layers"], key=lambda x: x["size"])
            result["links"][link] = b.calibrate(link, big["digest"], big["size"])
            for i in range(a.runs):
                for wi, w in enumerate(workloads):
                    k = (i + wi) % len(variants)
                    for v in variants[k:] + variants[:k]:
                        if v == "containerd" and i >= cd_runs[link]:
                            continue
                        if w == "readall" and (v.endswith("-boot") or i >= a.readall_runs
                                               or rate_bps(link) < READALL_MIN_BPS):
                            continue
                        if w in HEAVY and v not in HEAVY_VARIANTS:
                            continue  # the heavy images run with HEAVY_VARIANTS only
                        if v == "local" and w not in HEAVY:
                            continue
                        if v == "docker-index" and (w != "python" or not b.docker_bins()):
                            continue  # python only; without dockerd, said at the start
                        b.check_deadline()
                        with open("/proc/loadavg") as f:
                            load = float(f.read().split()[0])
                        tag = b.tags(w)[2] if v.endswith("-boot") else b.tags(w)[1]
                        if v == "local":
                            rec = b.local_run(w, local[w])
                        elif v == "containerd":
                            rec = b.containerd_run(w)
                        elif v.startswith("snapshotter"):
                            rec = b.snapshotter_run(tag, w)
                        elif v.startswith("run"):
                            rec = b.lamina_run_cmd(tag, w)
                        elif v == "proxy":
                            rec = b.lamina_faults(w, hedge=True, mode=["none"])
                        elif v.startswith("faults"):
                            rec = b.lamina_faults(w, hedge=v == "faults")
                        elif v == "index":
                            rec = b.lamina_run(v, w, ref=f"docker://{b.reg}/debian:bookworm")
                        elif v == "docker-index":
                            rec = b.docker_run(w)
                        elif v == "index-boot":
                            rec = b.lamina_run(v, w, ref=f"docker://{b.reg}/debian:bookworm",
                                               mount_args=["--index", f"docker://{b.reg}/debian:index-boot-{w}"])
                        else:
                            rec = b.lamina_run(tag, w)
                        rec.update(link=link, workload=w, variant=v, run=i + 1, loadavg_1min_before=load)
                        result["runs"].append(rec)
                        extra = "" if v == "containerd" else (
                            f", fetched {rec.get('fetched_bytes') or 0:,} B in "
                            f"{rec.get('requests')} requests / {rec.get('misses')} misses")
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
