"""Measuring filesystems side by side: kernel mounts of reference images,
lamina mounts and their status, dropping the page cache, timing commands
with their CPU time, repeating them round-robin, a fault proxy in front of
a registry, and what the machine was doing meanwhile.

Shared by the benchmarks under bench/ and the older drivers under scripts/
that have not moved yet (they import it by path)."""

import contextlib
import ctypes
import datetime
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time

from .core import ROOT, Results, log, machine

MS_RDONLY = 1
LIBC = ctypes.CDLL(None, use_errno=True)
FAULTPROXY = str(ROOT / "tests" / "tools" / "faultproxy.py")
MOUNTED = []  # kernel mounts made here, unmounted by cleanup


def sys_mount(src, tgt, fstype="erofs", opts=None):
    r = LIBC.mount(src.encode(), tgt.encode(), fstype.encode(), MS_RDONLY,
                   opts.encode() if opts else None)
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {src} on {tgt} ({opts}): {os.strerror(e)}")
    MOUNTED.append(tgt)


def sys_umount(tgt):
    if LIBC.umount2(tgt.encode(), 0) != 0:
        e = ctypes.get_errno()
        if LIBC.umount2(tgt.encode(), 2) != 0:  # MNT_DETACH
            log(f"warning: cannot unmount {tgt}: {os.strerror(e)}")
            return
    if tgt in MOUNTED:
        MOUNTED.remove(tgt)


LAMINA_MOUNTS = []  # (lamina, mountpoint[, cache dir]) to `lamina umount` on exit


def lamina_status(lamina, cache, mountpoint):
    """The `lamina status` record of a lazy mount (its "status" object), {} if none."""
    p = subprocess.run([lamina, "status", "--json", "--cache-dir", cache], capture_output=True, text=True)
    if p.returncode != 0:
        return {}
    for m in json.loads(p.stdout or "[]"):
        if m.get("mountpoint") == mountpoint:
            return dict(m.get("status") or {}, holder_pid=m.get("holder_pid"))
    return {}


def lamina_umount(lamina, mnt, cache=None):
    """`lamina umount` (which stops the mount's daemons), then waits until
    every process naming `cache` has exited."""
    pids = list(procs_of(cache)) if cache else []
    if is_mountpoint(mnt):
        cmd = [lamina, "umount", mnt] + (["--cache-dir", cache] if cache else [])
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            log(f"warning: lamina umount {mnt}: {p.stderr.strip()}")
            sys_umount(mnt)
    for entry in [(lamina, mnt), (lamina, mnt, cache)]:
        if entry in LAMINA_MOUNTS:
            LAMINA_MOUNTS.remove(entry)
    wait_gone(pids)


def lamina_mount(lamina, ref, mnt, cache, mode, lazy=False):
    """`lamina mount --json`; returns (wall s, cpu s, its JSON)."""
    cmd = [lamina, "mount", "--json", "--mode", mode] + (["--lazy"] if lazy else []) + [
        ref, mnt, "--cache-dir", cache]
    dt, cpu, out = timed_cmd(cmd, capture=True)
    LAMINA_MOUNTS.append((lamina, mnt, cache))
    return dt, cpu, json.loads(out)


def procs_of(cache):
    """{pid: {"cmd": argv[1], VmRSS/RssAnon/RssFile KiB}} of every process whose argv names `cache`."""
    needle = os.path.realpath(cache).encode()
    out = {}
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if not any(needle in a for a in argv):
                continue
            out[int(e)] = dict(cmd=argv[1].decode(errors="replace") if len(argv) > 1 else "", **rss(int(e)))
        except OSError:
            pass
    return out


def rss(pid):
    """VmRSS, RssAnon, RssFile, VmHWM of `pid` in KiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k = line.split(":", 1)[0]
            if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[k + "_kib"] = int(line.split()[1])
    return out


ANOMALIES = []  # things that went wrong during the bench and were worked around (kept in the results)


def wait_gone(pids, timeout=30):
    t0 = time.monotonic()
    while pids and time.monotonic() - t0 < timeout:
        pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
        time.sleep(0.02)
    if pids:
        log(f"warning: processes {pids} still running {timeout} s after lamina umount")
        ANOMALIES.append(f"lamina daemon(s) {pids} still running {timeout} s after lamina umount")
    elif time.monotonic() - t0 > 2:
        ANOMALIES.append(f"lamina daemon(s) took {time.monotonic() - t0:.1f} s to exit after lamina umount")


def time_v(cmd):
    """Run cmd under /usr/bin/time -v; returns (wall s, stdout, peak RSS KiB)."""
    dt, stdout, usage = time_v_usage(cmd)
    return dt, stdout, usage["peak_rss_kib"]


def time_v_usage(cmd):
    """Run cmd under /usr/bin/time -v; returns (wall s, stdout,
    {"peak_rss_kib", "user_s", "sys_s"}), each None when time did not say."""
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")

    def field(label, conv):
        m = re.search(re.escape(label) + r": (\S+)", p.stderr)
        return conv(m.group(1)) if m else None
    return dt, p.stdout, {"peak_rss_kib": field("Maximum resident set size (kbytes)", int),
                          "user_s": field("User time (seconds)", float),
                          "sys_s": field("System time (seconds)", float)}


def is_mountpoint(path):
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            if line.split()[1] == path:
                return True
    return False


SYS_CACHESTAT = 451  # x86_64 and arm64 (Linux 6.5+)


class CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def resident_bytes(paths):
    """Bytes of the files `paths` in the page cache, by `cachestat(2)`.
    Not `fincore`: it maps each file, and mapping a lazy mount's cache file
    raises a pre-content event for the whole of it (Linux 6.14+), so the
    worker filled every cache file the measurement looked at."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, IsADirectoryError, OSError):
            continue
        try:
            stat = Cachestat()
            if LIBC.syscall(SYS_CACHESTAT, fd, ctypes.byref(CachestatRange(0, 0)), ctypes.byref(stat), 0) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"cachestat {path}: {os.strerror(e)}")
            total += stat.nr_cache * page
        finally:
            os.close(fd)
    return total


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def run_quiet(cmd, **kw):
    """Run cmd (list), stdout to /dev/null unless capture; raise on failure."""
    kw.setdefault("stdout", subprocess.DEVNULL)
    p = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return p


@contextlib.contextmanager
def fault_proxy(work_dir, upstream_port, mode_args, lifetime=900, prefix=()):
    """tests/tools/faultproxy.py in front of 127.0.0.1:upstream_port (run under `prefix`, e.g. nsenter),
    its files in work_dir; yields (port, stats path) once it listens, and stops it on exit."""
    os.makedirs(work_dir, exist_ok=True)
    port_file, stats = os.path.join(work_dir, "port"), os.path.join(work_dir, "stats.json")
    with open(os.path.join(work_dir, "log"), "wb") as err:
        proxy = subprocess.Popen(list(prefix) + [sys.executable, FAULTPROXY, "0", str(upstream_port)]
                                 + list(mode_args) + ["--port-file", port_file, "--stats", stats,
                                                      "--lifetime", str(lifetime)],
                                 stdout=subprocess.DEVNULL, stderr=err)
    try:
        end = time.monotonic() + 30
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            if time.monotonic() > end or proxy.poll() is not None:
                raise RuntimeError(f"the fault proxy did not start (log: {work_dir}/log)")
            time.sleep(0.05)
        yield open(port_file).read().strip(), stats
    finally:
        proxy.terminate()
        proxy.wait()


def child_cpu():
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def timed_cmd(cmd, env=None, capture=False):
    """Run cmd; return (wall s, CPU s (user+sys of it and the children it waited for), stdout).

    CPU time is the RUSAGE_CHILDREN delta: exact, since one child runs at a time."""
    c0 = child_cpu()
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    cpu = child_cpu() - c0
    if p.returncode != 0:
        raise RuntimeError(f"command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return dt, cpu, (p.stdout if capture else None)


def summary(runs):
    """runs: list of (wall, cpu) pairs."""
    wall = [r[0] for r in runs]
    cpu = [r[1] for r in runs]
    return {"median_s": statistics.median(wall), "min_s": min(wall), "max_s": max(wall),
            "runs_s": [round(r, 6) for r in wall],
            "cpu_median_s": statistics.median(cpu), "cpu_runs_s": [round(r, 6) for r in cpu]}


def rm(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def file_size(path):
    return os.stat(path).st_size


def dir_bytes(path):
    total = 0
    for root, _dirs, files in os.walk(path):
        for n in files:
            total += os.lstat(os.path.join(root, n)).st_size
    return total


def count_entries(path):
    n = 1
    for _root, dirs, files in os.walk(path):
        n += len(dirs) + len(files)
    return n


def warm_files(paths):
    """Read files/trees once so that convert runs start with warm caches."""
    for p in paths:
        subprocess.run(["sh", "-c", 'find "$1" -type f -print0 | xargs -0 -r cat > /dev/null', "sh", p],
                       check=True)


def pkg_version(pkg):
    p = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else None


def machine_info(lamina, packages=("squashfs-tools", "erofs-utils", "umoci")):
    """The machine (core.machine), the lamina binary and the versions of the
    Debian `packages` a bench compares with."""
    info = dict(machine(), nproc_online=len(os.sched_getaffinity(0)),
                date=datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat())
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_total_kib"] = int(line.split()[1])
                    break
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    info["os"] = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    p = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", "/tmp"], capture_output=True, text=True)
    info["work_fs"] = p.stdout.strip() or None
    info["lamina_binary"] = lamina_binary_info(lamina)
    info["versions"] = {
        "lamina": subprocess.run([lamina, "--version"], capture_output=True, text=True).stdout.strip(),
        **{pkg: pkg_version(pkg) for pkg in packages},
        "python3": platform.python_version(),
    }
    if shutil.which("nydus-image"):
        info["versions"]["nydus-image"] = subprocess.run(
            ["nydus-image", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[:1]
    return info


def lamina_binary_info(lamina):
    """sha256 of the binary measured and the git state of the checkout it came from."""
    import hashlib
    h = hashlib.sha256()
    with open(lamina, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    info = {"sha256": h.hexdigest()}
    src = os.environ.get("LAMINA_BENCH_BINARY_SOURCE")
    if src:
        info["built_at"] = datetime.datetime.fromtimestamp(
            os.stat(src).st_mtime, datetime.timezone.utc).replace(microsecond=0).isoformat()
    repo = str(ROOT)
    p = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True)
    if p.returncode == 0:
        info["git_head"] = p.stdout.strip()
        d = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no", "--", "crates",
                            "Cargo.toml", "Cargo.lock"], capture_output=True, text=True)
        info["git_tree_dirty"] = bool(d.stdout.strip())
    return info


def image_info(layout, tag):
    with open(os.path.join(layout, "index.json")) as f:
        index = json.load(f)
    for m in index.get("manifests", []):
        if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag:
            digest = m["digest"]
            break
    else:
        raise RuntimeError(f"tag {tag} not in {layout}")
    with open(os.path.join(layout, "blobs", *digest.split(":", 1))) as f:
        manifest = json.load(f)
    layers = [{"digest": l["digest"], "size": l["size"], "mediaType": l["mediaType"]}
              for l in manifest["layers"]]
    return {"ref": f"oci:{layout}:{tag}", "manifest_digest": digest, "layers": layers,
            "layer_bytes": sum(l["size"] for l in layers)}


def round_robin(names, runs, body, label, record=None):
    """Calls body(name) `runs` times for every name, interleaved with a
    rotating order so slow phases of a shared machine hit all alike; each
    (wall, cpu) result goes to record(name, result) as it comes. The
    summary of each name's runs."""
    out = {n: [] for n in names}
    for i in range(runs):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            out[n].append(body(n))
            if record:
                record(n, out[n][-1])
        log(f"{label}: run {i + 1}/{runs}: " +
            ", ".join(f"{n} {out[n][-1][0]:.3f}s" for n in names))
    return {n: summary(v) for n, v in out.items()}


def cpu_stat():
    """(busy seconds, steal seconds) of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / hz, v[7] / hz


def own_cpu():
    a = resource.getrusage(resource.RUSAGE_SELF)
    return child_cpu() + a.ru_utime + a.ru_stime


class MachineWatch:
    """What else the machine did while a benchmark ran (it is shared: a noise
    indicator for every figure): start one before measuring, `note_end`
    after."""

    def __init__(self):
        self.busy0, self.steal0 = cpu_stat()
        self.own0 = own_cpu()

    def note_end(self, machine):
        """Adds to `machine` the CPU seconds used by anything but the bench
        and what it ran, hypervisor steal time and the load at the end."""
        busy1, steal1 = cpu_stat()
        machine["other_cpu_s_during_bench"] = round(busy1 - self.busy0 - (own_cpu() - self.own0), 1)
        machine["steal_s_during_bench"] = round(steal1 - self.steal0, 1)
        with open("/proc/loadavg") as f:
            machine["loadavg_at_end"] = f.read().split()[:3]


def median_of(xs):
    """The median of the values that are not None (None if there are none)."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b):
    """a / b, None when either is missing or b is 0."""
    return a / b if a is not None and b else None


def judged(values, targets):
    """{name: {value, target, met}} for a benchmark's figures: `targets`
    maps a figure's name (before any `@size`) to (op, bound)."""
    out = {}
    for name, value in values.items():
        op, bound = targets.get(name.split("@")[0], (None, None))
        met = None
        if op and value is not None:
            met = {"<=": value <= bound, "<": value < bound, ">=": value >= bound}[op]
        out[name] = {"value": value, "target": f"{op} {bound}" if op else None, "met": met}
    return out


def judge(doc, values, targets):
    """Judges `values` against `targets` (see judged) into `doc`: its
    summary's "ratios" and its targets (those with a bound)."""
    ratios = judged(values, targets)
    doc["summary"] = {"ratios": ratios}
    results = Results.of(doc)
    doc["targets"] = []
    for name, x in ratios.items():
        if x["target"]:
            op, bound = x["target"].split()
            results.target(name, x["value"], op, float(bound))


def cleanup(fuse_mounts=None):
    """Unmounts what was mounted here, newest first: other FUSE mounts in
    `fuse_mounts` (squashfuse; the list is emptied), lamina's mounts (their
    daemons stop and are waited for), then kernel mounts. Each failure is
    logged and the rest still goes."""
    for t in reversed(list(fuse_mounts or [])):
        sys_umount(t)
        fuse_mounts.remove(t)
    for entry in reversed(list(LAMINA_MOUNTS)):
        try:
            lamina_umount(*entry)
        except Exception as e:  # noqa: BLE001 - cleanup goes on
            log(f"warning: {e}")
    for t in reversed(list(MOUNTED)):
        if is_mountpoint(t):
            sys_umount(t)


def proc_kib(pid, field):
    """One of rss()'s fields (VmRSS, RssAnon, RssFile, VmHWM) of `pid` in
    KiB, None when the process is gone (or pid is None)."""
    try:
        return rss(pid).get(f"{field}_kib")
    except OSError:
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
