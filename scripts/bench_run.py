#!/usr/bin/env python3
"""Measurement engine of scripts/bench.sh (standard library only).

Usage (bench.sh calls it; it can also be run by hand as root):

  bench_run.py --lamina BIN --image LAYOUT:TAG --rootfs DIR --work DIR
               [--runs N] [--warm-runs M] --out FILE.json

What it does, in this order:

1. convert: times, interleaved run by run, `lamina convert` from the OCI layout
   (includes gzip decompression of the layers) against mksquashfs (zstd),
   mkfs.erofs (uncompressed), mkfs.erofs -zlz4hc and mkfs.erofs chunked
   (--chunksize=1048576 --blobdev) on the unpacked tree, plus nydus-image when
   it is on PATH. Outputs are removed before each run and `sync` runs after
   each run (neither is timed). Caches are warm (the inputs are read first).
2. mount: times `lamina mount` (eager, the default for oci: images: the whole
   image is decompressed into the cache) with a fresh cache directory, N runs,
   keeps the last mount. When lamina has --lazy: times `lamina mount --lazy`
   and the first full read of the fresh lazy mount (data fetched on demand from
   the local OCI layout through the fanotify daemon), N runs, and keeps the
   last (now filled) lazy mount as an extra filesystem "lamina-lazy".
3. mounts the mkfs.erofs images file-backed through mount(2) (no loop device),
   the chunked one with device=BLOB, exactly as lamina mounts its images.
4. `ls -lR MNT > /dev/null` and `find MNT -type f -print0 | xargs -0 cat >
   /dev/null`, warm (after one untimed warm-up) and cold (`sync; echo 3 >
   /proc/sys/vm/drop_caches` before every run), on lamina, the two erofs
   mounts and the plain ext4 directory. Runs are interleaved round-robin with
   a rotating order so slow phases of a shared machine hit all systems alike.
   Convert and mount run --runs times, cold workloads --cold-runs (3*runs),
   warm ones --warm-runs (5*runs) times: they are short.
5. writes the JSON (raw runs, medians, sizes, ratios against the targets,
   machine info) and prints a table.

Every timed command is a single subprocess; wall time is measured with
time.perf_counter() around it. Mounts made here are unmounted on exit.
"""

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time

MS_RDONLY = 1
LIBC = ctypes.CDLL(None, use_errno=True)

# Targets (ratio = lamina / reference, lower is better).
TARGETS = {
    "convert_lamina_vs_mksquashfs": 0.25,
    "ls_warm_lamina_vs_erofs": 1.10,
    "ls_cold_lamina_vs_erofs": 1.25,
}

MOUNTED = []


def log(msg):
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


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


def lamina_supports_lazy(lamina):
    p = subprocess.run([lamina, "mount", "--help"], capture_output=True, text=True)
    return "--lazy" in p.stdout


def lamina_status(lamina, cache, mountpoint):
    """The `lamina status` record of a lazy mount (its "status" object), {} if none."""
    p = subprocess.run([lamina, "status", "--json", "--cache-dir", cache], capture_output=True, text=True)
    if p.returncode != 0:
        return {}
    for m in json.loads(p.stdout or "[]"):
        if m.get("mountpoint") == mountpoint:
            return dict(m.get("status") or {}, holder_pid=m.get("holder_pid"))
    return {}


def lamina_umount(lamina, mountpoint, cache=None):
    """`lamina umount` (stops a lazy mount's daemon) and wait until that daemon is gone."""
    if not is_mountpoint(mountpoint):
        return
    pids = []
    if cache:
        st = lamina_status(lamina, cache, mountpoint)
        pids = [p for p in (st.get("holder_pid"), st.get("pid")) if p]
    p = subprocess.run([lamina, "umount", mountpoint], capture_output=True, text=True)
    if p.returncode != 0:
        log(f"warning: lamina umount {mountpoint}: {p.stderr.strip()}")
        sys_umount(mountpoint)
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
        time.sleep(0.05)
    if pids:
        log(f"warning: lamina daemon(s) {pids} still running after umount of {mountpoint}")


def is_mountpoint(path):
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            if line.split()[1] == path:
                return True
    return False


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def run(cmd, **kw):
    """Run cmd (list), stdout to /dev/null unless capture; raise on failure."""
    kw.setdefault("stdout", subprocess.DEVNULL)
    p = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return p


FAULTPROXY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "tools", "faultproxy.py")


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


def timed(cmd, env=None, capture=False):
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
    """The machine, the lamina binary and the versions of the Debian `packages` a bench compares with."""
    info = {
        "nproc": os.cpu_count(),
        "nproc_online": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_total_kib"] = int(line.split()[1])
                    break
        with open("/proc/loadavg") as f:
            info["loadavg_at_start"] = f.read().split()[:3]
    except OSError:
        pass
    try:
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
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def round_robin(names, runs, body, label):
    """Call body(name) `runs` times for every name, interleaved with a rotating order."""
    out = {n: [] for n in names}
    for i in range(runs):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            out[n].append(body(n))
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


def ratio(a, b):
    return a / b if b else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lamina", required=True)
    ap.add_argument("--image", required=True, help="LAYOUT:TAG")
    ap.add_argument("--rootfs", required=True, help="umoci-unpacked tree of the same image")
    ap.add_argument("--work", required=True, help="scratch directory (same fs as /tmp)")
    ap.add_argument("--runs", type=int, default=3, help="runs of convert and mount")
    ap.add_argument("--cold-runs", type=int, default=None, help="runs of cold workloads (default 3*runs)")
    ap.add_argument("--warm-runs", type=int, default=None, help="runs of warm workloads (default 5*runs)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = args.runs
    warm_runs = args.warm_runs or 5 * runs
    cold_runs = args.cold_runs or 3 * runs
    lamina = os.path.abspath(args.lamina)
    layout, tag = args.image.rsplit(":", 1)
    rootfs = os.path.abspath(args.rootfs)
    work = os.path.abspath(args.work)
    env_c = dict(os.environ, LC_ALL="C")

    t_start = time.perf_counter()
    busy0, steal0 = cpu_stat()
    own0 = own_cpu()
    result = {
        "schema": 1,
        "machine": machine_info(lamina),
        "image": image_info(layout, tag),
        "config": {"runs": runs, "cold_runs": cold_runs, "warm_runs": warm_runs, "chunk_size": 1048576,
                   "lamina_zstd_level": 3, "statistic": "median"},
    }

    # ---------------------------------------------------------------- convert
    conv = os.path.join(work, "convert")
    os.makedirs(conv, exist_ok=True)
    P = lambda *a: os.path.join(conv, *a)  # noqa: E731
    tools = {
        "lamina": {
            "cmd": [lamina, "convert", "--json", f"oci:{layout}:{tag}", f"oci:{P('lamina-oci')}:x"],
            "outputs": [P("lamina-oci")],
            "input": "OCI layout (gzip layers)",
        },
        "mksquashfs": {
            "cmd": ["mksquashfs", rootfs, P("squashfs.img"), "-comp", "zstd", "-noappend"],
            "outputs": [P("squashfs.img")],
            "input": "unpacked tree",
        },
        "mkfs.erofs": {
            "cmd": ["mkfs.erofs", P("erofs.img"), rootfs],
            "outputs": [P("erofs.img")],
            "input": "unpacked tree",
        },
        "mkfs.erofs-lz4hc": {
            "cmd": ["mkfs.erofs", "-zlz4hc", P("erofs-lz4hc.img"), rootfs],
            "outputs": [P("erofs-lz4hc.img")],
            "input": "unpacked tree",
        },
        "mkfs.erofs-chunked": {
            "cmd": ["mkfs.erofs", "--chunksize=1048576", f"--blobdev={P('erofs-chunked.blob')}",
                    P("erofs-chunked.img"), rootfs],
            "outputs": [P("erofs-chunked.img"), P("erofs-chunked.blob")],
            "input": "unpacked tree",
        },
    }
    if shutil.which("nydus-image"):
        tools["nydus-image"] = {
            "cmd": ["nydus-image", "create", "--fs-version", "6", "--bootstrap", P("nydus", "bootstrap"),
                    "--blob-dir", P("nydus", "blobs"), rootfs],
            "outputs": [P("nydus")],
            "mkdirs": [P("nydus", "blobs")],
            "input": "unpacked tree",
        }
    log("warming the page cache with the inputs")
    warm_files([os.path.join(layout, "blobs"), rootfs])
    lamina_json = {}

    def convert_once(name):
        t = tools[name]
        for o in t["outputs"]:
            rm(o)
        for d in t.get("mkdirs", []):
            os.makedirs(d, exist_ok=True)
        os.sync()
        dt, cpu, out = timed(t["cmd"], capture=(name == "lamina"))
        if name == "lamina":
            lamina_json.clear()
            lamina_json.update(json.loads(out))
        os.sync()
        return dt, cpu

    names = list(tools)
    try:
        conv_res = round_robin(names, runs, convert_once, "convert")
    except RuntimeError as e:
        if "nydus-image" in names:
            log(f"nydus-image failed, benchmark without it: {e}")
            del tools["nydus-image"]
            names.remove("nydus-image")
            conv_res = round_robin(names, runs, convert_once, "convert")
        else:
            raise
    for n in names:
        conv_res[n]["cmd"] = " ".join(tools[n]["cmd"]).replace(work, "$WORK").replace(rootfs, "$ROOTFS")
        conv_res[n]["input"] = tools[n]["input"]
    result["convert"] = conv_res

    # ------------------------------------------------------------------ mount
    mnt = os.path.join(work, "mnt")
    targets = {
        "lamina": os.path.join(mnt, "lamina"),
        "erofs": os.path.join(mnt, "erofs"),
        "erofs-chunked": os.path.join(mnt, "erofs-chunked"),
        "ext4": rootfs,
    }
    lazy_ok = lamina_supports_lazy(lamina)
    if lazy_ok:
        targets = dict(list(targets.items())[:1] + [("lamina-lazy", os.path.join(mnt, "lamina-lazy"))]
                       + list(targets.items())[1:])
    for n, p in targets.items():
        if n != "ext4":
            os.makedirs(p, exist_ok=True)
    lamina_ref = f"oci:{P('lamina-oci')}:x"
    read_cmd = lambda p: ["sh", "-c", 'find "$1" -type f -print0 | xargs -0 cat > /dev/null', "sh", p]  # noqa: E731

    # eager (default for oci:): the whole image is decompressed into the cache at mount time
    mount_runs = []
    mount_json = {}
    cache = os.path.join(work, "cache")
    for i in range(runs):
        lamina_umount(lamina, targets["lamina"])
        rm(cache)
        os.sync()
        dt, cpu, out = timed([lamina, "mount", "--json", lamina_ref, targets["lamina"], "--cache-dir", cache],
                             capture=True)
        LAMINA_MOUNTS.append((lamina, targets["lamina"]))
        mount_json = json.loads(out)
        mount_runs.append((dt, cpu))
        log(f"lamina mount (eager, fresh cache): run {i + 1}/{runs}: {dt:.3f}s")
    result["mount"] = {"lamina": dict(summary(mount_runs), fetched_bytes=mount_json.get("fetched_bytes"),
                                      cache_bytes=dir_bytes(cache),
                                      cmd="lamina mount oci:$WORK/convert/lamina-oci:x MNT --cache-dir FRESH")}

    # lazy: mount, then the first full read fetches (and decompresses) on demand
    if lazy_ok:
        lazy_mount_runs, first_read_runs, lazy_status = [], [], {}
        lcache = os.path.join(work, "cache-lazy")
        for i in range(runs):
            lamina_umount(lamina, targets["lamina-lazy"], lcache)
            rm(lcache)
            os.sync()
            dt, cpu, _ = timed([lamina, "mount", "--lazy", lamina_ref, targets["lamina-lazy"],
                                "--cache-dir", lcache])
            LAMINA_MOUNTS.append((lamina, targets["lamina-lazy"], lcache))
            lazy_mount_runs.append((dt, cpu))
            first_read_runs.append(timed(read_cmd(targets["lamina-lazy"]))[:2])
            lazy_status = lamina_status(lamina, lcache, targets["lamina-lazy"])
            log(f"lamina mount --lazy: run {i + 1}/{runs}: mount {dt:.3f}s, first full read "
                f"{first_read_runs[-1][0]:.3f}s, fetched {lazy_status.get('fetched_bytes')} bytes")
        result["mount"]["lamina-lazy"] = dict(
            summary(lazy_mount_runs), cmd="lamina mount --lazy oci:$WORK/convert/lamina-oci:x MNT --cache-dir FRESH",
            first_read_all=dict(summary(first_read_runs),
                                cmd="find MNT -type f -print0 | xargs -0 cat > /dev/null (fresh cache)"),
            status_after_first_read={k: v for k, v in lazy_status.items() if k not in ("blobs", "pid")})

    sys_mount(P("erofs.img"), targets["erofs"])
    sys_mount(P("erofs-chunked.img"), targets["erofs-chunked"], opts=f"device={P('erofs-chunked.blob')}")
    with open("/proc/self/mounts") as f:
        result["mounts"] = [l.split()[:4] for l in f
                            if l.split()[1].startswith(mnt + "/")]
    for m in result["mounts"]:
        m[0] = m[0].replace(work, "$WORK")
        m[1] = m[1].replace(work, "$WORK")
    entries = {n: count_entries(p) for n, p in targets.items()}
    result["entries"] = entries
    if len(set(entries.values())) != 1:
        log(f"warning: entry counts differ between filesystems: {entries}")

    # -------------------------------------------------------------- workloads
    workloads = {
        "ls_lR": lambda p: ["ls", "-lR", p],
        "read_all": read_cmd,
    }
    fs_names = list(targets)
    for wname, mk in workloads.items():
        result[wname] = {"cmd": " ".join(mk("MNT")) if wname == "ls_lR" else
                         "find MNT -type f -print0 | xargs -0 cat > /dev/null"}
        # warm: one untimed pass, then warm_runs timed passes
        for n in fs_names:
            run(mk(targets[n]), env=env_c)
        result[wname]["warm"] = round_robin(
            fs_names, warm_runs, lambda n: timed(mk(targets[n]), env=env_c)[:2], f"{wname} warm")

        def cold(n):
            drop_caches()
            return timed(mk(targets[n]), env=env_c)[:2]
        result[wname]["cold"] = round_robin(fs_names, cold_runs, cold, f"{wname} cold")

    # ------------------------------------------------------------------ sizes
    lj = lamina_json
    st = lj.get("stats", {})
    lamina_layout_bytes = dir_bytes(os.path.join(P("lamina-oci"), "blobs"))
    sizes = {
        "source_layers_bytes": result["image"]["layer_bytes"],
        "tree_file_bytes": st.get("file_bytes"),
        "tree_entries": st.get("entries"),
        "lamina": {
            "metadata_bytes": lj.get("metadata_bytes"),
            "metadata_compressed_bytes": lj.get("metadata_compressed_bytes"),
            "index_bytes": lj.get("index_bytes"),
            "blobs": lj.get("blobs"),
            "blob_bytes": sum(b["size"] for b in lj.get("blobs", [])),
            "cache_bytes": sum(b["cache_size"] for b in lj.get("blobs", [])),
            "oci_layout_blob_bytes": lamina_layout_bytes,
            "dedup_ratio": lj.get("dedup_ratio"),
            "stats": st,
        },
        "mksquashfs_image_bytes": file_size(P("squashfs.img")),
        "erofs_image_bytes": file_size(P("erofs.img")),
        "erofs_lz4hc_image_bytes": file_size(P("erofs-lz4hc.img")),
        "erofs_chunked_meta_bytes": file_size(P("erofs-chunked.img")),
        "erofs_chunked_blob_bytes": file_size(P("erofs-chunked.blob")),
    }
    if "nydus-image" in tools:
        sizes["nydus_bootstrap_bytes"] = file_size(P("nydus", "bootstrap"))
        sizes["nydus_blob_bytes"] = dir_bytes(P("nydus", "blobs"))
    result["sizes"] = sizes

    # ----------------------------------------------------------------- ratios
    med = lambda d, n: d[n]["median_s"]  # noqa: E731
    c = result["convert"]
    ls, rd = result["ls_lR"], result["read_all"]
    ratios = {
        "convert_lamina_vs_mksquashfs": ratio(med(c, "lamina"), med(c, "mksquashfs")),
        "convert_cpu_lamina_vs_mksquashfs": ratio(c["lamina"]["cpu_median_s"], c["mksquashfs"]["cpu_median_s"]),
        "convert_lamina_vs_mkfs.erofs": ratio(med(c, "lamina"), med(c, "mkfs.erofs")),
        "convert_lamina_vs_mkfs.erofs-lz4hc": ratio(med(c, "lamina"), med(c, "mkfs.erofs-lz4hc")),
        "convert_lamina_vs_mkfs.erofs-chunked": ratio(med(c, "lamina"), med(c, "mkfs.erofs-chunked")),
        "ls_warm_lamina_vs_erofs": ratio(med(ls["warm"], "lamina"), med(ls["warm"], "erofs")),
        "ls_cold_lamina_vs_erofs": ratio(med(ls["cold"], "lamina"), med(ls["cold"], "erofs")),
        "ls_warm_lamina_vs_erofs-chunked": ratio(med(ls["warm"], "lamina"), med(ls["warm"], "erofs-chunked")),
        "ls_cold_lamina_vs_erofs-chunked": ratio(med(ls["cold"], "lamina"), med(ls["cold"], "erofs-chunked")),
        "ls_warm_lamina_vs_ext4": ratio(med(ls["warm"], "lamina"), med(ls["warm"], "ext4")),
        "ls_cold_lamina_vs_ext4": ratio(med(ls["cold"], "lamina"), med(ls["cold"], "ext4")),
        "read_warm_lamina_vs_erofs": ratio(med(rd["warm"], "lamina"), med(rd["warm"], "erofs")),
        "read_cold_lamina_vs_erofs": ratio(med(rd["cold"], "lamina"), med(rd["cold"], "erofs")),
        "metadata_lamina_vs_erofs-chunked": ratio(sizes["lamina"]["metadata_bytes"],
                                                  sizes["erofs_chunked_meta_bytes"]),
        "blobs_lamina_vs_source_layers": ratio(sizes["lamina"]["blob_bytes"], sizes["source_layers_bytes"]),
        "blobs_lamina_vs_mksquashfs_image": ratio(sizes["lamina"]["blob_bytes"],
                                                  sizes["mksquashfs_image_bytes"]),
    }
    if "lamina-lazy" in ls["warm"]:
        for w, d in (("ls", ls), ("read", rd)):
            for t in ("warm", "cold"):
                ratios[f"{w}_{t}_lamina-lazy_vs_erofs"] = ratio(med(d[t], "lamina-lazy"), med(d[t], "erofs"))
        ratios["first_read_lamina-lazy_vs_cold_read_erofs"] = ratio(
            result["mount"]["lamina-lazy"]["first_read_all"]["median_s"], med(rd["cold"], "erofs"))
    if "nydus-image" in tools:
        ratios["convert_lamina_vs_nydus-image"] = ratio(med(c, "lamina"), med(c, "nydus-image"))
    result["ratios"] = {k: {"value": v, "target_max": TARGETS.get(k),
                            "met": (v <= TARGETS[k]) if k in TARGETS and v is not None else None}
                        for k, v in ratios.items()}
    with open("/proc/loadavg") as f:
        result["machine"]["loadavg_at_end"] = f.read().split()[:3]
    result["bench_seconds"] = round(time.perf_counter() - t_start, 1)
    busy1, steal1 = cpu_stat()
    # CPU used on this machine by anything but the bench and what it ran (a
    # noise indicator: the machine is shared), and hypervisor steal time.
    result["machine"]["other_cpu_s_during_bench"] = round(busy1 - busy0 - (own_cpu() - own0), 1)
    result["machine"]["steal_s_during_bench"] = round(steal1 - steal0, 1)

    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print_table(result)


def print_table(r):
    def ms(x):
        return f"{x * 1000:8.1f}"
    m = r["machine"]
    print(f"\nlamina benchmark  {m['date']}  kernel {m['kernel']}  nproc {m['nproc']}  "
          f"runs: convert/mount {r['config']['runs']}, cold {r['config']['cold_runs']}, "
          f"warm {r['config']['warm_runs']}; medians")
    print(f"image {r['image']['ref']}  ({r['sizes']['tree_entries']} entries, "
          f"{r['sizes']['tree_file_bytes'] / 1e6:.1f} MB of files, "
          f"{r['image']['layer_bytes'] / 1e6:.1f} MB gzip layers)\n")
    print(f"{'convert (s)':<22}{'median':>10}{'min':>9}{'max':>9}{'CPU':>9}")
    for n, v in r["convert"].items():
        print(f"  {n:<20}{v['median_s']:10.3f}{v['min_s']:9.3f}{v['max_s']:9.3f}{v['cpu_median_s']:9.3f}")
    lm = r["mount"]["lamina"]
    print(f"\nlamina mount (fresh cache): {lm['median_s']:.3f} s (CPU {lm['cpu_median_s']:.3f} s), "
          f"fetched {lm['fetched_bytes']:,} bytes")
    lz = r["mount"].get("lamina-lazy")
    if lz:
        st = lz["status_after_first_read"]
        print(f"lamina mount --lazy: {lz['median_s']:.3f} s; first full read (fetch on demand) "
              f"{lz['first_read_all']['median_s']:.3f} s, fetched {st.get('fetched_bytes', 0):,} bytes in "
              f"{st.get('requests')} requests, {st.get('misses')} misses")
    print()
    for w, title in (("ls_lR", "ls -lR"), ("read_all", "read all files")):
        print(f"{title + ' (ms)':<22}{'warm':>10}{'cold':>10}")
        for n in r[w]["warm"]:
            print(f"  {n:<20}{ms(r[w]['warm'][n]['median_s']):>10}{ms(r[w]['cold'][n]['median_s']):>10}")
        print()
    s = r["sizes"]
    print("sizes (bytes)")
    rows = [
        ("source gzip layers", s["source_layers_bytes"]),
        ("tree file bytes", s["tree_file_bytes"]),
        ("lamina metadata", s["lamina"]["metadata_bytes"]),
        ("lamina metadata (zstd)", s["lamina"]["metadata_compressed_bytes"]),
        ("lamina chunk index", s["lamina"]["index_bytes"]),
        ("lamina blobs (zstd)", s["lamina"]["blob_bytes"]),
        ("lamina blob cache", s["lamina"]["cache_bytes"]),
        ("lamina OCI blobs total", s["lamina"]["oci_layout_blob_bytes"]),
        ("mksquashfs image", s["mksquashfs_image_bytes"]),
        ("mkfs.erofs image", s["erofs_image_bytes"]),
        ("mkfs.erofs lz4hc image", s["erofs_lz4hc_image_bytes"]),
        ("erofs chunked meta", s["erofs_chunked_meta_bytes"]),
        ("erofs chunked blob", s["erofs_chunked_blob_bytes"]),
    ]
    for k, v in rows:
        print(f"  {k:<26}{v:>14,}")
    print(f"  {'lamina dedup ratio':<26}{s['lamina']['dedup_ratio']:>14.4f}\n")
    print(f"{'ratio (lamina / other)':<46}{'value':>8}{'target':>9}  met")
    for k, v in r["ratios"].items():
        t = v["target_max"]
        met = "" if v["met"] is None else ("yes" if v["met"] else "NO")
        print(f"  {k:<44}{v['value']:8.3f}{('<= %.2f' % t) if t else '':>9}  {met}")
    print(f"\nbench took {r['bench_seconds']} s; CPU used by other processes meanwhile "
          f"{m.get('other_cpu_s_during_bench')} s, steal {m.get('steal_s_during_bench')} s, "
          f"load {' '.join(m.get('loadavg_at_start', []))} -> {' '.join(m.get('loadavg_at_end', []))}")


if __name__ == "__main__":
    try:
        main()
    finally:
        for entry in reversed(LAMINA_MOUNTS):
            lamina_umount(*entry)
        for t in reversed(list(MOUNTED)):
            if is_mountpoint(t):
                sys_umount(t)
