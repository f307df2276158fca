"""Cold starts on lamina without containerd: `lamina mount` (in the
namespace) with a fresh cache dir, overlayfs on it and `runc run` of a
bundle from `runc spec` without a network namespace (variants lamina,
lamina-boot, proxy, faults, faults-nohedge, index, index-boot); the same
from the image unpacked on local disk (local); and `lamina run --rm --net
host` (run, run-boot). Each start is timed from its first command to the
workload's first useful output, then a second container of the same image
is started on the same mount and cache (no drop_caches) and timed alike."""

import json
import os
import subprocess
import threading
import time

from ..harness import workdir
from ..harness.core import log
from ..harness.measure import (
    drop_caches, fault_proxy, is_mountpoint, lamina_status, lamina_umount, proc_kib, run_quiet, sys_umount,
)
from . import workloads
from .workloads import NGINX_CONF_IN, STDOUT_WORKLOADS, free_port, wait_ready

# containerd 1.6's default capability set for `ctr run` (the same as Docker's);
# given to the runc bundles too, so both run the workload with the same privileges
DEFAULT_CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
                "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
                "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE"]
# The fault runs: `lamina mount` (no boot set) through tests/tools/faultproxy.py
# with the demo's mix: every 5th range answer spoilt (flip, truncate, reset,
# 500, 503, a 3 s stall in turn); with hedging and with --no-hedge. Their
# baseline is `proxy`, the same proxy spoiling nothing: it runs in the
# namespace, so every byte crosses the shaped link twice (registry to proxy,
# proxy to lamina), and it forwards an answer only once it has all of it.
FAULT_MIX = ["mix", "--every", "5", "--stall", "3"]
# the figures of `lamina status` a start records once its background fetching is done
FETCH_KEYS = ("fetched_bytes", "requests", "misses", "failed_misses", "bad_chunks", "cached_bytes")
STATUS_KEYS = FETCH_KEYS + ("prefetch_done", "prefetch_total")
MOUNT_STATUS_KEYS = STATUS_KEYS + ("hedges", "hedge_wins", "boot_frames", "ahead_chunk_bytes", "ahead_used_bytes",
                                   "predictions", "predicted_requests", "predicted_fetched_bytes", "ready_events",
                                   "worker_events", "warmed_bytes", "miss_rate_bps", "rests", "rest_fetched_bytes", "link_rate_bps")


def rss_of(st):
    """VmHWM of a mount's holder and worker (from its status) and their sum."""
    hw, ww = proc_kib(st.get("holder_pid"), "VmHWM"), proc_kib(st.get("pid"), "VmHWM")
    return {"holder": hw, "worker": ww, "sum": (hw or 0) + (ww or 0) if hw and ww else None}


def events(st):
    """A mount's pre-content events so far: those its worker answered
    (misses) and those its holder answered within boot pages."""
    if st.get("misses") is None:
        return None
    return st["misses"] + (st.get("ready_events") or 0)


def fresh_status(b, cache, mnt):
    """Status after the worker's next write (it rewrites status.json every 200 ms)."""
    time.sleep(0.25)
    return lamina_status(b.lamina, cache, mnt)


def bundle(b, d, workload, port):
    """Overlay dirs and a runc bundle under d (its rootfs: an overlay mounted later)."""
    for sub in ("upper", "work", "rootfs"):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    spec = json.loads(json.dumps(b.spec))
    spec["root"] = {"path": os.path.join(d, "rootfs"), "readonly": False}
    proc = spec["process"]
    proc["terminal"] = False
    proc["args"] = workloads.args(workload, port)
    proc["cwd"] = "/"
    proc["capabilities"] = {k: list(DEFAULT_CAPS) for k in ("bounding", "effective", "permitted")}
    # the host's network namespace: the probe reaches the servers on 127.0.0.1
    spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"]
    if workload == "nginx":
        conf = workloads.nginx_conf(os.path.join(d, "nginx.conf"), port)
        spec["mounts"].append({"destination": NGINX_CONF_IN, "type": "bind", "source": conf,
                               "options": ["rbind", "ro"]})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(spec, f)
    return d


def overlay(lower, d):
    run_quiet(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={lower},upperdir={d}/upper,workdir={d}/work",
               f"{d}/rootfs"], stdin=subprocess.DEVNULL, timeout=600)


def umount_rootfs(rd):
    for sub in ("c2", "c1"):
        if is_mountpoint(os.path.join(rd, sub, "rootfs")):
            sys_umount(os.path.join(rd, sub, "rootfs"))


def stop_container(proc, out, err, kill, timeout):
    """Kills a started container (`kill`: the command that does), reaps its
    client and closes its files."""
    subprocess.run(kill, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout:
        proc.stdout.close()
    if out is not subprocess.PIPE:
        out.close()
    err.close()


def started(cmd, workload, out_path, err_path):
    """Popen of a container's client: stdout a pipe for the workloads that
    print, else `out_path`; stderr to `err_path`."""
    out = subprocess.PIPE if workload in STDOUT_WORKLOADS else open(out_path, "wb")
    err = open(err_path, "wb")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
    return proc, out, err


def tail_of(path):
    with open(path, "rb") as f:
        return f.read()[-1500:].decode(errors="replace")


def runc_container(d, cid, workload, port, linger=0.0):
    """Starts the container, waits for its first useful output, stops it (after `linger`
    seconds more). Returns t_ready."""
    proc, out, err = started(["runc", "run", "--bundle", d, cid], workload, os.path.join(d, "stdout.log"),
                             os.path.join(d, "stderr.log"))
    try:
        t_ready = wait_ready(workload, proc, port)
        if linger:
            try:
                proc.wait(timeout=linger)  # python3 exits by itself
            except subprocess.TimeoutExpired:
                pass
        return t_ready
    except Exception:
        log(f"container {cid} stderr: {tail_of(os.path.join(d, 'stderr.log'))}")
        raise
    finally:
        stop_container(proc, out, err, ["runc", "kill", cid, "KILL"], 30)
        subprocess.run(["runc", "delete", "--force", cid], stderr=subprocess.DEVNULL)


def lamina_faults(b, workload, hedge, mode=FAULT_MIX):
    """`lamina_run` of the workload's lamina image (no boot set) through a fault proxy in the namespace."""
    d = os.path.join(b.work, "proxies", f"{b.next_seq():03d}")
    reg_port = b.reg.rsplit(":", 1)[1]
    with fault_proxy(d, reg_port, mode, prefix=b.ns.argv([])) as (port, stats):
        rec = lamina_run(b, "lamina", workload, ref=f"docker://127.0.0.1:{port}/debian:{b.tags(workload)[1]}",
                         mount_args=[] if hedge else ["--no-hedge"])
        with open(stats) as f:
            st = json.load(f)
    rec["proxy"] = {k: st.get(k) for k in ("eligible", "faulted", "faults")}
    return rec


def wait_prefetch(status, st):
    """Waits (at most 180 s) for the boot set's background fetch; the last status."""
    if st.get("prefetch_total"):
        end = time.monotonic() + 180
        while st.get("prefetch_done", 0) < st["prefetch_total"] and time.monotonic() < end:
            time.sleep(0.1)
            st = status()
        time.sleep(0.25)
        st = status()
    return st


def lamina_run(b, tag, workload, record_trace=None, second=True, ref=None, mount_args=(), binary=None):
    """`lamina mount` + overlay + runc, cold; then (second) a warm container on the same mount.
    `binary`: another lamina build mounts (variant lamina-base)."""
    seq = b.next_seq()
    rd = b.run_dir(seq, f"{tag}-{workload}")
    cache, mnt = os.path.join(rd, "cache"), os.path.join(rd, "mnt")
    os.makedirs(mnt)
    port = free_port()
    c1 = bundle(b, os.path.join(rd, "c1"), workload, port)
    cid = f"{b.id}-{seq}"
    ref = ref or b.ref(tag)
    # mount_args (COLDSTART_MOUNT_ARGS): more `lamina mount` options for every lamina_run (to try a setting)
    extra = (["--record-trace", record_trace] if record_trace else []) + list(mount_args) + b.mount_args
    rec = {"tag": tag}
    try:
        drop_caches()
        # keep_logs: the mount's daemons at debug level, their logs kept (below)
        log_env = ["env", "LAMINA_LOG=debug"] if b.keep else []
        tx0 = b.tx_bytes()
        t0 = time.perf_counter()
        if b.keep:
            rec["started_unix"] = time.time()
        run_quiet(b.ns.argv(log_env + [binary or b.lamina, "mount", ref, mnt, "--cache-dir", cache] + extra),
                  stdin=subprocess.DEVNULL, timeout=120)
        t_mount = time.perf_counter()
        tx_mount = b.tx_bytes()
        overlay(mnt, c1)
        t_ovl = time.perf_counter()
        # A recorded start runs on for a second after its first output, so
        # the trace also has what it reads next (python3's exit path): a
        # later start that lives a little longer must not miss on it.
        t_ready = runc_container(c1, cid, workload, port, linger=1.0 if record_trace else 0.0)
        tx_ready = b.tx_bytes()
        rec.update(time_s=t_ready - t0, mount_s=t_mount - t0, overlay_s=t_ovl - t_mount,
                   container_s=t_ready - t_ovl, wire_bytes_mount=tx_mount - tx0,
                   wire_bytes_ready=tx_ready - tx0)
        st = fresh_status(b, cache, mnt)
        # The start's own bytes: at its first output (+ the status lag).
        # With boot pages the boot set's whole chunks follow in the
        # background once misses stop; those count only in the totals.
        rec.update(fetched_bytes_ready=st.get("fetched_bytes"), requests_ready=st.get("requests"),
                   misses_ready=st.get("misses"), events_ready=events(st))
        st = wait_prefetch(lambda: lamina_status(b.lamina, cache, mnt), st)
        rec.update(wire_bytes=b.tx_bytes() - tx0, **{k: st.get(k) for k in MOUNT_STATUS_KEYS})
        if second:
            st = second_mount_start(b, rd, mnt, cache, cid, workload, st, rec)
        rec["rss_kib"] = rss_of(st)
        if st.get("failed_misses") or st.get("bad_chunks"):
            rec["daemon_logs"] = worker_log(cache)
        b.keep_logs(rd, f"{seq}-{tag}-{workload}")
        return rec
    finally:
        umount_rootfs(rd)
        lamina_umount(b.lamina, mnt, cache)
        workdir.remove(rd)


def second_mount_start(b, rd, mnt, cache, cid, workload, st, rec):
    """A second container on the mount of a start that is over: its figures
    in rec["second"]; the status after it."""
    port2 = free_port()
    c2 = bundle(b, os.path.join(rd, "c2"), workload, port2)
    overlay(mnt, c2)
    f0, tx1 = st.get("fetched_bytes") or 0, b.tx_bytes()
    t1 = time.perf_counter()
    t2 = runc_container(c2, f"{cid}b", workload, port2)
    st2 = fresh_status(b, cache, mnt)
    rec["second"] = {"time_s": t2 - t1, "fetched_bytes": (st2.get("fetched_bytes") or 0) - f0,
                     "wire_bytes": b.tx_bytes() - tx1,
                     "misses": (st2.get("misses") or 0) - (st.get("misses") or 0)}
    return st2


def local_run(b, workload, rootfs):
    """The limit: the same start from the source image unpacked on local disk (`rootfs`), page cache
    dropped, through the same overlay + runc as `lamina_run`; then a second, warm one."""
    seq = b.next_seq()
    rd = b.run_dir(seq, f"local-{workload}")
    cid = f"{b.id}-{seq}"
    rec = {}
    try:
        port = free_port()
        c1 = bundle(b, os.path.join(rd, "c1"), workload, port)
        drop_caches()
        tx0 = b.tx_bytes()
        t0 = time.perf_counter()
        overlay(rootfs, c1)
        t_ready = runc_container(c1, cid, workload, port)
        rec.update(time_s=t_ready - t0, wire_bytes=b.tx_bytes() - tx0)
        port2 = free_port()
        c2 = bundle(b, os.path.join(rd, "c2"), workload, port2)
        overlay(rootfs, c2)
        t1 = time.perf_counter()
        t2 = runc_container(c2, f"{cid}b", workload, port2)
        rec["second"] = {"time_s": t2 - t1, "wire_bytes": 0}
        return rec
    finally:
        umount_rootfs(rd)
        workdir.remove(rd)


def worker_log(cache):
    out = []
    for root, _dirs, files in os.walk(os.path.join(cache, "mounts")):
        for n in files:
            if n.endswith(".log"):
                with open(os.path.join(root, n), errors="replace") as f:
                    out.append(f"{n}: {f.read()[-1000:]}")
    return out


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
                    v = proc_kib(pid, "VmHWM")
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


def run_container(b, d, name, ref, workload, port, cache, state):
    """`lamina run --rm` (in the namespace, for its mount's fetches) until the first
    useful output; then the container is killed and lamina run cleans up. Returns
    t_ready."""
    cmd = [b.lamina, "run", "--rm", "--name", name, "--cache-dir", cache, "--state-dir", state, "--net", "host"]
    if workload == "nginx":
        conf = workloads.nginx_conf(os.path.join(d, f"{name}-nginx.conf"), port)
        cmd += ["-v", f"{conf}:{NGINX_CONF_IN}:ro"]
    cmd += [ref, "--"] + workloads.args(workload, port)
    proc, out, err = started(b.ns.argv(cmd), workload, os.path.join(d, f"{name}.out"),
                             os.path.join(d, f"{name}.err"))
    try:
        # `--net host` is the namespace's network: the probe connects from there
        return wait_ready(workload, proc, port, netns=b.ns)
    except Exception:
        log(f"lamina run {name} stderr: {tail_of(os.path.join(d, f'{name}.err'))}")
        raise
    finally:
        stop_container(proc, out, err, ["runc", "--root", os.path.join(state, "runc"), "kill", name, "KILL"], 60)


def lamina_run_cmd(b, tag, workload):
    """Two `lamina run --rm` of one image on one cache dir: cold, then warm."""
    seq = b.next_seq()
    d = b.run_dir(seq, f"run-{tag}-{workload}")
    cache, state = os.path.join(d, "cache"), os.path.join(d, "state")
    os.makedirs(d)
    ref = b.ref(tag)
    name = f"{b.id}-{seq}"
    rec = {"tag": tag}
    try:
        drop_caches()
        tx0 = b.tx_bytes()
        with MountWatch(cache) as watch:
            t0 = time.perf_counter()
            t_ready = run_container(b, d, name, ref, workload, free_port(), cache, state)
            tx_ready = b.tx_bytes()
            st = watch.at(t_ready)
        rec.update(time_s=t_ready - t0, wire_bytes_ready=tx_ready - tx0, wire_bytes=tx_ready - tx0,
                   fetched_bytes_ready=st.get("fetched_bytes"), requests_ready=st.get("requests"),
                   misses_ready=st.get("misses"), events_ready=events(st), rss_kib=watch.rss(), **{k: st.get(k) for k in STATUS_KEYS})
        tx1 = b.tx_bytes()
        with MountWatch(cache) as watch:
            t1 = time.perf_counter()
            t2 = run_container(b, d, f"{name}b", ref, workload, free_port(), cache, state)
            st2 = watch.at(t2)
        rec["second"] = {"time_s": t2 - t1, "fetched_bytes": st2.get("fetched_bytes"),
                         "wire_bytes": b.tx_bytes() - tx1, "misses": st2.get("misses")}
        return rec
    finally:
        workdir.remove(d)
