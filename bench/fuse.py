"""lamina's FUSE path side by side with the kernel's EROFS, lamina's kernel
path, squashfuse and ext4, in one run:

1. Debian tree: kernel EROFS (mkfs.erofs image of ROOTFS, file-backed
   mount(2), the reference), lamina's kernel path (`--mode kernel`, eager),
   lamina FUSE (`--mode fuse`, eager, so the cache is complete), squashfuse
   of a mksquashfs (zstd) image, the ext4 ROOTFS (nydusd when on PATH is
   recorded as not measured). `ls -lR MNT` warm and cold (drop_caches
   before every cold run; "lamina-fuse-fresh" also starts a new daemon).
2. stat+open+close of the deepest regular files of the tree, in-process,
   warm (stat_repeat passes per run) and cold (one pass): paths per second.
3. fio, 4 KiB buffered reads (psync), sequential and random, of one file of
   fio_mib MiB of random bytes on ext4 (the reference), through lamina FUSE
   and lamina's kernel path (eager, complete caches); drop_caches first. Then
   the same through a read-write overlayfs over each (as a container reads
   its rootfs), with libaio and 16 requests in flight.
4. lookup_bench (the perfect-hash build) at each of mphf_keys, under
   /usr/bin/time -v: build s per million keys, bits per key, peak RSS.
5. Images of small_files and files small files (synthetic, cached in
   /var/cache/lamina-test/bench-fuse): `lamina convert`, then FUSE mounts,
   eager (timed once the cache is full) and lazy (fresh cache), and the
   daemon's RSS after the mount, after `ls -lR` and 2 s later.

Options (--set): runs (3), warm_runs (5*runs), cold_runs (3*runs),
fio_runs (max(runs, 5)), fio_mib (512), fio_rand_mib (128), stat_paths
(300), stat_repeat (20), mphf_keys (1000000,10000000), files (1000000),
small_files (10000), and parts=debian,fio,mphf,big (all). --quick: one run,
3 warm / 2 cold, 100,000 files, a 128 MiB fio file, 1M keys. Moved from
scripts/bench_fuse.sh; docs/bench-fuse.md carries its tables and plot.

Each part's figures (every run, with their medians) are one entry of the
results file's `runs`; the ratios and targets are derived from them.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

from .fuse_tables import plot, tables
from .harness.core import ROOT, log
from .harness.measure import (
    ANOMALIES, MachineWatch, cleanup, count_entries, dir_bytes, drop_caches, file_size, image_info, is_mountpoint,
    judge, lamina_mount, machine_info, procs_of, ratio, round_robin, rss, summary, sys_mount, time_v,
)
from .harness.measure import lamina_umount as lamina_umount_wait
from .harness.measure import median_of as med
from .harness.measure import run_quiet as run, timed_cmd as timed
from .harness.registry import DEBIAN_LAYOUT, DEBIAN_TAG, debian_layout

HARNESS_DIR = str(ROOT / "bench" / "harness")
IMAGES_DIR = "/var/cache/lamina-test/bench-fuse"
PARTS = ("debian", "fio", "mphf", "big")
# fio's libaio runs (through an overlay, as a container reads): requests in flight
FIO_AIO_DEPTH = 16
# fio's cases: key -> (rw, through an overlayfs, engine)
FIO_CASES = {"seq": ("read", False, "psync"), "rand": ("randread", False, "psync"),
             "seq_overlay": ("read", True, "libaio"), "rand_overlay": ("randread", True, "libaio")}


# name -> (comparison, bound): "<=" for times, ratios and sizes, ">=" for throughput ratios.
TARGETS = {
    "ls_warm_lamina-fuse_vs_erofs": ("<=", 1.2),
    "ls_cold_lamina-fuse_vs_erofs": ("<=", 1.5),
    "ls_cold_lamina-fuse-fresh_vs_erofs": ("<=", 1.5),
    "fio_seq_lamina-fuse_vs_ext4": (">=", 0.95),
    "fio_seq_lamina-kernel_vs_ext4": (">=", 0.95),
    "fio_rand_lamina-fuse_vs_ext4": (">=", 0.95),
    "fio_rand_lamina-kernel_vs_ext4": (">=", 0.95),
    "fio_seq_overlay_lamina-fuse_vs_ext4": (">=", 0.95),
    "fio_seq_overlay_lamina-kernel_vs_ext4": (">=", 0.95),
    "fio_rand_overlay_lamina-fuse_vs_ext4": (">=", 0.95),
    "fio_rand_overlay_lamina-kernel_vs_ext4": (">=", 0.95),
    "mphf_build_s_per_million_keys": ("<=", 0.15),
    "mphf_bits_per_key": ("<=", 3.5),
    "big_fuse_mount_ms": ("<=", 50.0),
    "big_fuse_lazy_mount_ms": ("<=", 50.0),
    # "RSS flat": this script's reading is at most 1.25 x the RSS at --small-files.
    "big_fuse_rss_after_mount_vs_small": ("<=", 1.25),
    "big_fuse_rss_after_ls_vs_small": ("<=", 1.25),
    "big_fuse_rss_at_rest_after_ls_vs_small": ("<=", 1.25),
    "big_fuse_rss_anon_after_mount_vs_small": ("<=", 1.25),
    "big_fuse_rss_anon_after_ls_vs_small": ("<=", 1.25),
}

SQUASHFUSE_MOUNTS = []  # fuse mounts of squashfuse/nydusd, unmounted with umount(2)


def daemon_pids(cache, what="internal-fuse"):
    """Pids of lamina daemons (`lamina internal-fuse CACHE/...`) serving from `cache`."""
    needle = f"{what}\0{os.path.realpath(cache)}/".encode()
    pids = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                with open(f"/proc/{e}/cmdline", "rb") as f:
                    if needle in f.read():
                        pids.append(int(e))
            except OSError:
                pass
    return pids


def fuse_logs(cache):
    """Text of every fuse.log under CACHE/mounts/."""
    text = ""
    mounts = os.path.join(cache, "mounts")
    for d in sorted(os.listdir(mounts)) if os.path.isdir(mounts) else []:
        p = os.path.join(mounts, d, "fuse.log")
        if os.path.exists(p):
            with open(p, errors="replace") as f:
                text += f.read()
    return text


def deepest_files(rootfs, n):
    """The `n` regular files of `rootfs` with the most path components (ties by path), as relative paths."""
    files = []
    for root, _dirs, names in os.walk(rootfs):
        rel = os.path.relpath(root, rootfs)
        depth = 0 if rel == "." else rel.count("/") + 1
        for name in names:
            p = os.path.join(root, name)
            if os.path.isfile(p) and not os.path.islink(p) and os.access(p, os.R_OK):
                files.append((-depth, os.path.join(rel, name) if rel != "." else name))
    files.sort()
    return [p for _d, p in files[:n]]


def stat_open_pass(mnt, paths, repeat):
    """stat + open(O_RDONLY) + close of every path, `repeat` times; returns seconds."""
    full = [os.path.join(mnt, p) for p in paths]
    t0 = time.perf_counter()
    for _ in range(repeat):
        for p in full:
            os.stat(p)
            os.close(os.open(p, os.O_RDONLY | os.O_NOFOLLOW))
    return time.perf_counter() - t0


def disk_read_bytes(path):
    """Bytes read so far from the block device holding `path` (/sys/dev/block/M:m/stat; every
    process's reads, so a noisy figure on a shared machine), None if unknown."""
    st = os.stat(path).st_dev
    try:
        with open(f"/sys/dev/block/{os.major(st)}:{os.minor(st)}/stat") as f:
            return int(f.read().split()[2]) * 512
    except (OSError, ValueError, IndexError):
        return None


def fio(path, rw, size_mib, io_mib, disk_of, engine="psync"):
    """One cold fio run; `engine` psync, or libaio (queue depth FIO_AIO_DEPTH)."""
    depth = [f"--iodepth={FIO_AIO_DEPTH}"] if engine == "libaio" else []
    cmd = ["fio", "--name=bench", f"--filename={path}", f"--rw={rw}", "--bs=4k", f"--ioengine={engine}", *depth,
           "--direct=0", "--readonly", "--invalidate=1", "--randrepeat=1", f"--size={size_mib}m",
           f"--io_size={io_mib}m", "--output-format=json"]
    d0 = disk_read_bytes(disk_of)
    dt, cpu, out = timed(cmd, capture=True)
    d1 = disk_read_bytes(disk_of)
    j = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return {"mb_s": j["bw_bytes"] / 1e6, "iops": j["iops"], "bytes": j["io_bytes"],
            "runtime_ms": j["runtime"], "clat_mean_us": j["clat_ns"]["mean"] / 1000,
            "wall_s": dt, "cpu_s": cpu, "disk_read_bytes": d1 - d0 if d0 is not None and d1 is not None else None}


def fuse_status(cache):
    """The FUSE daemon's counters (fuse-status.json in the mount's run dir), {} if none."""
    runs = os.path.join(cache, "mounts")
    for e in sorted(os.listdir(runs)) if os.path.isdir(runs) else []:
        try:
            with open(os.path.join(runs, e, "fuse-status.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
    return {}


def wait_for_objects(cache, n, timeout=120):
    """Waits until the FUSE daemon under `cache` made or checked `n` passthrough objects and is
    idle (its counters unchanged for a second); returns its counters. Raises after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        s = fuse_status(cache)
        if s.get("objects_created", 0) >= n and s == last:
            return s
        last = s
        time.sleep(1)
    raise RuntimeError(f"no {n} passthrough objects under {cache} after {timeout} s: {last}")


# ------------------------------------------------------------------ part 1-2
def part_debian(a, lamina, work, result):
    layout, tag = a.image.rsplit(":", 1)
    rootfs = os.path.abspath(a.rootfs)
    conv = os.path.join(work, "debian")
    os.makedirs(conv, exist_ok=True)
    P = lambda *x: os.path.join(conv, *x)  # noqa: E731
    log("debian: lamina convert, mkfs.erofs, mksquashfs (untimed set-up)")
    run([lamina, "convert", f"oci:{layout}:{tag}", f"oci:{P('lamina-oci')}:x"])
    run(["mkfs.erofs", P("erofs.img"), rootfs])
    run(["mksquashfs", rootfs, P("squashfs.img"), "-comp", "zstd", "-noappend", "-quiet"])
    ref = f"oci:{P('lamina-oci')}:x"
    mnt = os.path.join(work, "mnt")
    targets = {n: os.path.join(mnt, n) for n in ("erofs", "lamina-kernel", "lamina-fuse", "squashfuse")}
    for p in targets.values():
        os.makedirs(p, exist_ok=True)
    sys_mount(P("erofs.img"), targets["erofs"])
    modes = {}
    for n, mode in (("lamina-kernel", "kernel"), ("lamina-fuse", "fuse")):
        dt, _cpu, j = lamina_mount(lamina, ref, targets[n], P(f"cache-{mode}"), mode)
        modes[n] = {"mode": j.get("mode"), "mode_reason": j.get("mode_reason"), "mount_s": round(dt, 4),
                    "cmd": f"lamina mount --mode {mode} oci:$WORK/debian/lamina-oci:x MNT --cache-dir C"}
        log(f"debian: {n} mounted in {dt:.3f}s (mode {j.get('mode')})")
    run(["squashfuse", P("squashfs.img"), targets["squashfuse"]])
    SQUASHFUSE_MOUNTS.append(targets["squashfuse"])
    # nydusd would need nydus-image, a bootstrap and a daemon config; neither is on this
    # machine, so it is not wired up: the result says which of the two applies.
    result["nydusd"] = ("on PATH, but this script does not measure it yet" if shutil.which("nydusd")
                        else "not on PATH")
    targets["ext4"] = rootfs
    result["debian"] = {
        "image": image_info(layout, tag),
        "lamina_mounts": modes,
        "entries": {n: count_entries(p) for n, p in targets.items()},
        "sizes": {"erofs_image_bytes": file_size(P("erofs.img")),
                  "squashfs_image_bytes": file_size(P("squashfs.img")),
                  "lamina_cache_bytes": dir_bytes(P("cache-fuse"))},
        "mounts": [],
    }
    with open("/proc/self/mounts") as f:
        for line in f:
            m = line.split()[:4]
            if m[1].startswith(mnt + "/"):
                result["debian"]["mounts"].append([x.replace(work, "$WORK") for x in m])
    ents = result["debian"]["entries"]
    if len(set(ents.values())) != 1:
        log(f"warning: entry counts differ between filesystems: {ents}")
    result["debian"]["fuse_log_lookup_table"] = "lookups through the lookup table" in fuse_logs(P("cache-fuse"))

    env_c = dict(os.environ, LC_ALL="C")
    names = list(targets)
    ls = lambda p: ["ls", "-lR", p]  # noqa: E731
    res = {"cmd": "ls -lR MNT > /dev/null"}
    for n in names:
        run(ls(targets[n]), env=env_c)
    res["warm"] = round_robin(names, a.warm_runs, lambda n: timed(ls(targets[n]), env=env_c)[:2], "ls -lR warm")

    fuse_cache = P("cache-fuse")

    def fresh_fuse_mount():
        """lamina-fuse-fresh: a new FUSE daemon (umount, drop_caches, eager mount of the complete
        cache): drop_caches cannot evict pages a running daemon has mapped (its metadata image),
        so the plain cold figure of lamina-fuse is cold for the kernel but not for the daemon."""
        lamina_umount_wait(lamina, targets["lamina-fuse"], fuse_cache)
        drop_caches()
        lamina_mount(lamina, ref, targets["lamina-fuse"], fuse_cache, "fuse")

    def ensure_fuse_mounted(n):
        """A FUSE mount that is gone (seen once: an old daemon exiting late after a remount)
        would make an empty directory's listing look like a fast run: remount, and record it."""
        if n.startswith("lamina-fuse") and not is_mountpoint(targets[n]):
            log(f"warning: {targets[n]} is not mounted before a {n} run; mounting again")
            ANOMALIES.append(f"{n}: mountpoint found unmounted before a cold run; mounted again (untimed)")
            lamina_mount(lamina, ref, targets["lamina-fuse"], fuse_cache, "fuse")

    def cold(n):
        ensure_fuse_mounted(n)
        if n == "lamina-fuse-fresh":
            fresh_fuse_mount()
        else:
            drop_caches()
        return timed(ls(targets[n]), env=env_c)[:2]
    targets["lamina-fuse-fresh"] = targets["lamina-fuse"]
    cold_names = names[:3] + ["lamina-fuse-fresh"] + names[3:]
    res["cold"] = round_robin(cold_names, a.cold_runs, cold, "ls -lR cold")
    result["ls_lR"] = res

    # stat + open of the deepest files
    paths = deepest_files(rootfs, a.stat_paths)
    depths = [p.count("/") + 1 for p in paths]
    so = {"paths": len(paths), "repeat_warm": a.stat_repeat, "depth_min": min(depths), "depth_max": max(depths),
          "depth_mean": round(sum(depths) / len(depths), 2), "sample": paths[:3],
          "op": "os.stat(p); os.close(os.open(p, O_RDONLY|O_NOFOLLOW))"}
    for n in names:
        stat_open_pass(targets[n], paths, 1)

    def warm_so(n):
        dt = stat_open_pass(targets[n], paths, a.stat_repeat)
        return dt, 0.0

    def cold_so(n):
        ensure_fuse_mounted(n)
        if n == "lamina-fuse-fresh":
            fresh_fuse_mount()
        else:
            drop_caches()
        return stat_open_pass(targets[n], paths, 1), 0.0
    for kind, fn, reps, ns in (("warm", warm_so, a.stat_repeat, names), ("cold", cold_so, 1, cold_names)):
        r = round_robin(ns, a.warm_runs if kind == "warm" else a.cold_runs, fn, f"stat+open {kind}")
        so[kind] = {n: {"paths_per_s": len(paths) * reps / v["median_s"], "median_s": v["median_s"],
                        "runs_s": v["runs_s"]} for n, v in r.items()}
    result["stat_open"] = so
    return targets


# -------------------------------------------------------------------- part 3
def part_fio(a, lamina, work, result):
    layout = os.path.join(a.images_dir, f"big-file-{a.fio_mib}m")
    run([sys.executable, os.path.join(HARNESS_DIR, "synthetic.py"), "big-file",
         "--mib", str(a.fio_mib), "--out", layout], stdout=None)
    d = os.path.join(work, "fio")
    os.makedirs(d, exist_ok=True)
    run([lamina, "convert", f"oci:{layout}:bench", f"oci:{d}/lamina-oci:x"])
    ref = f"oci:{d}/lamina-oci:x"
    mnts = {"lamina-fuse": os.path.join(d, "mnt-fuse"), "lamina-kernel": os.path.join(d, "mnt-kernel")}
    caches = {"lamina-fuse": os.path.join(d, "cache-fuse"), "lamina-kernel": os.path.join(d, "cache-kernel")}
    for n, mode in (("lamina-fuse", "fuse"), ("lamina-kernel", "kernel")):
        os.makedirs(mnts[n], exist_ok=True)
        lamina_mount(lamina, ref, mnts[n], caches[n], mode)
    rel = "data/random.bin"
    os.makedirs(os.path.join(d, "ext4"), exist_ok=True)
    ext4 = os.path.join(d, "ext4", "random.bin")
    shutil.copyfile(os.path.join(mnts["lamina-kernel"], rel), ext4)
    os.sync()
    files = {"ext4": ext4, **{n: os.path.join(m, rel) for n, m in mnts.items()}}
    # Each file again through a read-write overlayfs whose lower is its
    # directory tree, as a container's rootfs reads it.
    lowers = {"ext4": (os.path.join(d, "ext4"), "random.bin"), **{n: (m, rel) for n, m in mnts.items()}}
    overlaid = {}
    for n, (lower, path) in lowers.items():
        o = os.path.join(d, f"overlay-{n}")
        for sub in ("upper", "work", "merged"):
            os.makedirs(os.path.join(o, sub), exist_ok=True)
        run(["mount", "-t", "overlay", "overlay", "-o",
             f"lowerdir={lower},upperdir={o}/upper,workdir={o}/work", f"{o}/merged"])
        overlaid[n] = os.path.join(o, "merged", path)
    size = file_size(ext4)
    for n, p in files.items():
        if file_size(p) != size:
            raise RuntimeError(f"{p}: size {file_size(p)} != {size}")
    names = list(files)
    res = {"file_bytes": size, "bs": "4k", "ioengine": "psync", "direct": 0,
           "cold": "sync; echo 3 > /proc/sys/vm/drop_caches before every run",
           "cmd": f"fio --rw=read|randread --bs=4k --ioengine=psync --direct=0 --readonly --invalidate=1 "
                  f"--size={a.fio_mib}m --io_size=IO",
           "overlay_cmd": f"fio --rw=read|randread --bs=4k --ioengine=libaio --iodepth={FIO_AIO_DEPTH} --direct=0 "
                          f"--readonly --invalidate=1 --size={a.fio_mib}m --io_size=IO, on the file through a "
                          "read-write overlayfs (lowerdir: the file's tree)"}
    # The first open of a complete file is served by the daemon while its
    # passthrough object is made: measured on its own, then the timed runs
    # start once the object is there (the state every later open sees).
    drop_caches()
    res["fuse_first_open"] = fio(files["lamina-fuse"], "read", a.fio_mib, a.fio_mib, work)
    log(f"fio seq: lamina-fuse first open {res['fuse_first_open']['mb_s']:.1f} MB/s")
    res["fuse_objects_before_runs"] = wait_for_objects(caches["lamina-fuse"], 1)
    for key, (rw, through_overlay, engine) in FIO_CASES.items():
        io = a.fio_rand_mib if rw == "randread" else a.fio_mib
        paths = overlaid if through_overlay else files
        out = {n: [] for n in names}
        for i in range(a.fio_runs):
            k = i % len(names)
            for n in names[k:] + names[:k]:
                drop_caches()
                out[n].append(fio(paths[n], rw, a.fio_mib, io, work, engine))
            log(f"fio {key}: run {i + 1}/{a.fio_runs}: " + ", ".join(f"{n} {out[n][-1]['mb_s']:.1f} MB/s"
                                                                      for n in names))
        res[key] = {"io_mib": io, **{n: {"mb_s": med([r["mb_s"] for r in v]),
                                         "runs_mb_s": [round(r["mb_s"], 2) for r in v],
                                         "disk_read_mib": med([r["disk_read_bytes"] / 2**20 for r in v
                                                               if r["disk_read_bytes"] is not None]),
                                         "runs": v}
                                     for n, v in out.items()}}
    log_text = fuse_logs(caches["lamina-fuse"])
    res["fuse_log_passthrough_lines"] = sum(1 for line in log_text.splitlines() if "passthrough" in line.lower())
    res["fuse_log_passthrough_sample"] = [line for line in log_text.splitlines()
                                          if "passthrough" in line.lower()][:3]
    for n in lowers:
        run(["umount", os.path.join(d, f"overlay-{n}", "merged")])
    for n in mnts:
        lamina_umount_wait(lamina, mnts[n], caches[n])
    os.unlink(ext4)
    result["fio"] = res


# -------------------------------------------------------------------- part 4
def part_mphf(a, result):
    out = {}
    for keys in a.mphf_keys:
        runs = []
        for i in range(a.mphf_runs if keys <= 1_000_000 else max(1, a.mphf_runs - 1)):
            dt, stdout, peak = time_v([a.lookup_bench, "--keys", str(keys)])
            lines = {j["what"]: j for j in (json.loads(x) for x in stdout.splitlines() if x.strip())}
            runs.append({"wall_s": dt, "peak_rss_kib": peak, **lines})
            h = lines["hash function"]
            log(f"lookup_bench {keys:,} keys: run {i + 1}: build {h['build_s']:.3f}s, "
                f"{h['bits_per_key']:.3f} bits/key, peak RSS {peak} KiB")
        h = [r["hash function"] for r in runs]
        out[str(keys)] = {
            "keys": keys, "threads": h[0]["threads"],
            "build_s": med([x["build_s"] for x in h]),
            "build_s_per_million_keys": med([x["build_s"] for x in h]) / (keys / 1e6),
            "bits_per_key": med([x["bits_per_key"] for x in h]),
            "table_build_s": med([r["table"]["build_s"] for r in runs]),
            "table_bytes_per_key": med([r["table"]["bytes_per_key"] for r in runs]),
            "lookup_hit_ns": med([r["lookups"]["hit_ns"] for r in runs]),
            "path_lookup_hit_ns": med([r["lookups"]["path_hit_ns"] for r in runs]),
            "peak_rss_kib": med([r["peak_rss_kib"] for r in runs]),
            "runs": runs,
        }
    result["mphf"] = {"cmd": "lookup_bench --keys K (crates/lamina-format/examples/lookup_bench.rs), "
                             "under /usr/bin/time -v", "by_keys": out}


# -------------------------------------------------------------------- part 5
def part_big(a, lamina, work, result):
    out = {}
    env_c = dict(os.environ, LC_ALL="C")
    for n_files in dict.fromkeys([a.small_files, a.files]):
        layout = os.path.join(a.images_dir, f"small-files-{n_files}")
        log(f"{n_files:,} files: image {layout}")
        run([sys.executable, os.path.join(HARNESS_DIR, "synthetic.py"), "small-files",
             "--files", str(n_files), "--out", layout], stdout=None)
        d = os.path.join(work, f"files-{n_files}")
        os.makedirs(d, exist_ok=True)
        dst = os.path.join(d, "lamina-oci")
        os.sync()
        dt, stdout, peak = time_v([lamina, "convert", "--json", f"oci:{layout}:bench", f"oci:{dst}:x"])
        cj = json.loads(stdout)
        r = {"files": n_files, "source_layer_bytes": image_info(layout, "bench")["layer_bytes"],
             "convert": {"wall_s": dt, "peak_rss_kib": peak, "metadata_bytes": cj.get("metadata_bytes"),
                         "entries": cj.get("stats", {}).get("entries")}}
        log(f"{n_files:,} files: convert {dt:.1f}s, peak RSS {peak} KiB")
        ref = f"oci:{dst}:x"
        mnt = os.path.join(d, "mnt")
        os.makedirs(mnt, exist_ok=True)
        cache = os.path.join(d, "cache")
        dt, _c, _j = lamina_mount(lamina, ref, mnt, cache, "fuse")
        r["first_mount_fill_s"] = dt
        log(f"{n_files:,} files: first eager FUSE mount (fills the cache) {dt:.2f}s")
        mounts = []
        for i in range(a.runs):
            lamina_umount_wait(lamina, mnt, cache)
            os.sync()
            dt, cpu, _j = lamina_mount(lamina, ref, mnt, cache, "fuse")
            mounts.append((dt, cpu))
            log(f"{n_files:,} files: eager FUSE mount, filled cache: run {i + 1}/{a.runs}: {dt * 1000:.1f} ms")
        r["fuse_mount"] = summary(mounts)
        pids = daemon_pids(cache)
        r["daemon_pids_found"] = len(pids)
        r["rss_after_mount"] = rss(pids[0]) if pids else None
        ls_dt = timed(["ls", "-lR", mnt], env=env_c)[0]
        r["ls_lR_s"] = ls_dt
        r["rss_after_ls"] = rss(pids[0]) if pids else None
        # and once at rest: the daemon releases mapped pages after a second idle
        time.sleep(2)
        r["rss_at_rest_after_ls"] = rss(pids[0]) if pids else None
        r["fuse_log_lookup_table"] = "lookups through the lookup table" in fuse_logs(cache)
        log(f"{n_files:,} files: ls -lR {ls_dt:.2f}s, daemon RSS {r['rss_after_mount']} -> {r['rss_after_ls']}")
        lamina_umount_wait(lamina, mnt, cache)
        r["cache_bytes"] = dir_bytes(cache)
        shutil.rmtree(cache)

        lazy = []
        lcache = os.path.join(d, "cache-lazy")
        for i in range(a.runs):
            if os.path.exists(lcache):
                lamina_umount_wait(lamina, mnt, lcache)
                shutil.rmtree(lcache)
            os.sync()
            dt, cpu, _j = lamina_mount(lamina, ref, mnt, lcache, "fuse", lazy=True)
            lazy.append((dt, cpu))
            log(f"{n_files:,} files: lazy FUSE mount, fresh cache: run {i + 1}/{a.runs}: {dt * 1000:.1f} ms")
        r["fuse_lazy_mount"] = summary(lazy)
        r["lazy_procs_after_mount"] = list(procs_of(lcache).values())
        lamina_umount_wait(lamina, mnt, lcache)
        shutil.rmtree(d)
        out[str(n_files)] = r
    result["big"] = {"small": str(a.small_files), "big": str(a.files), "by_files": out,
                     "mount_cmd": "lamina mount --mode fuse [--lazy] oci:LAYOUT:x MNT --cache-dir C"}




def options(quick, given):
    """The run's options: defaults, --quick, then --set KEY=VALUE."""
    o = types.SimpleNamespace(runs=1 if quick else 3, stat_paths=300, stat_repeat=20, fio_mib=128 if quick else 512,
                              fio_rand_mib=32 if quick else 128, mphf_keys="1000000" if quick else "1000000,10000000",
                              files=100_000 if quick else 1_000_000, small_files=10_000, parts=",".join(PARTS),
                              warm_runs=None, cold_runs=None, fio_runs=None, mphf_runs=None)
    for key, value in given.items():
        if not hasattr(o, key):
            raise SystemExit(f"bench fuse: no option {key} (see python3 -m bench fuse --help)")
        setattr(o, key, value if key in ("mphf_keys", "parts") else int(value))
    o.warm_runs = o.warm_runs or (3 if quick else 5 * o.runs)
    o.cold_runs = o.cold_runs or (2 if quick else 3 * o.runs)
    o.fio_runs = o.fio_runs or (1 if quick else max(o.runs, 5))
    o.mphf_runs = o.mphf_runs or o.runs
    o.mphf_keys = [int(k) for k in str(o.mphf_keys).split(",") if k]
    o.parts = [p for p in str(o.parts).split(",") if p]
    return o


def lookup_bench():
    """The perfect-hash build example, built through cargo (release)."""
    log("building the lookup_bench example (release)")
    cargo_env = Path.home() / ".cargo" / "env"
    prefix = f". {cargo_env} && " if cargo_env.exists() else ""
    subprocess.run(["bash", "-c", f"{prefix}cargo build --release -q -p lamina-format --example lookup_bench"],
                   cwd=ROOT, check=True)
    return str(Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "examples" / "lookup_bench")


def measure(results, lamina, work, quick, given):
    a = options(quick, given)
    a.image = f"{DEBIAN_LAYOUT}:{DEBIAN_TAG}"
    a.images_dir = IMAGES_DIR
    a.no_big = "big" not in a.parts
    a.lookup_bench = lookup_bench() if "mphf" in a.parts else None
    os.makedirs(a.images_dir, exist_ok=True)
    debian_layout()
    log("umoci unpack (the tree of mkfs.erofs, mksquashfs and the ext4 reference)")
    run(["umoci", "unpack", "--image", a.image, str(work / "bundle")])
    a.rootfs = str(work / "bundle" / "rootfs")
    lamina, work = str(lamina.path), str(work)
    doc = results.doc
    doc["machine"] = machine_info(lamina, packages=("erofs-utils", "squashfs-tools", "squashfuse", "fio", "fuse3"))
    doc["config"].update(runs=a.runs, warm_runs=a.warm_runs, cold_runs=a.cold_runs, fio_runs=a.fio_runs,
                         fio_mib=a.fio_mib, fio_rand_mib=a.fio_rand_mib, stat_paths=a.stat_paths,
                         stat_repeat=a.stat_repeat, mphf_keys=a.mphf_keys, mphf_runs=a.mphf_runs,
                         files=None if a.no_big else a.files, small_files=None if a.no_big else a.small_files,
                         statistic="median")
    watch = MachineWatch()
    result = {}
    doc["not_measured"] = {"nydusd": "nydusd not on PATH" if shutil.which("nydusd") is None
                           else "on PATH, but this benchmark does not measure it yet"}
    try:
        run_parts(a, lamina, work, result)
    finally:
        cleanup(SQUASHFUSE_MOUNTS)
    for part in PARTS:
        if part not in a.parts:
            doc["not_measured"][part] = "not asked for (--set parts=...)"
    doc["runs"] = [{"part": name, "figures": result[name]}
                   for name in ("debian", "ls_lR", "stat_open", "fio", "mphf", "big") if name in result]
    doc["anomalies"] = list(ANOMALIES)
    watch.note_end(doc["machine"])
    derive(doc)


def run_parts(a, lamina, work, result):
    if "debian" in a.parts:
        part_debian(a, lamina, work, result)
        cleanup(SQUASHFUSE_MOUNTS)
    if "fio" in a.parts:
        part_fio(a, lamina, work, result)
    if "mphf" in a.parts:
        part_mphf(a, result)
    if "big" in a.parts:
        part_big(a, lamina, work, result)


def view(doc):
    """The results as one dict by part (what the tables and plot read)."""
    r = {run["part"]: run["figures"] for run in doc["runs"]}
    r.update(machine=doc["machine"], config=doc["config"], not_measured=doc.get("not_measured") or {},
             anomalies=doc.get("anomalies") or [], bench_seconds=doc.get("seconds", 0),
             ratios=doc["summary"].get("ratios", {}))
    return r


def derive(doc):
    """Ratios (judged against TARGETS) and the targets, from the parts' figures."""
    result = view(dict(doc, summary={}))
    v = {}
    if "ls_lR" in result:  # the debian part (parts= may leave it out)
        ls = result["ls_lR"]
        so = result["stat_open"]
        for fs in ("lamina-fuse", "lamina-fuse-fresh", "lamina-kernel", "squashfuse", "ext4"):
            for t in ("warm", "cold") if fs != "lamina-fuse-fresh" else ("cold",):
                v[f"ls_{t}_{fs}_vs_erofs"] = ratio(ls[t][fs]["median_s"], ls[t]["erofs"]["median_s"])
                v[f"stat_open_{t}_{fs}_vs_erofs"] = ratio(so[t][fs]["paths_per_s"],
                                                          so[t]["erofs"]["paths_per_s"])
    if "fio" in result:
        for k in (k for k in FIO_CASES if k in result["fio"]):
            for fs in ("lamina-fuse", "lamina-kernel"):
                v[f"fio_{k}_{fs}_vs_ext4"] = ratio(result["fio"][k][fs]["mb_s"], result["fio"][k]["ext4"]["mb_s"])
    if "mphf" in result:
        by = result["mphf"]["by_keys"]
        for k, x in by.items():
            v[f"mphf_build_s_per_million_keys@{k}"] = x["build_s_per_million_keys"]
            v[f"mphf_bits_per_key@{k}"] = x["bits_per_key"]
    if "big" in result:
        b = result["big"]["by_files"]
        big, small = b[result["big"]["big"]], b[result["big"]["small"]]
        for k, x in b.items():
            v[f"big_fuse_mount_ms@{k}"] = x["fuse_mount"]["median_s"] * 1000
            v[f"big_fuse_lazy_mount_ms@{k}"] = x["fuse_lazy_mount"]["median_s"] * 1000
        if big is not small and big["rss_after_mount"] and small["rss_after_mount"]:
            v["big_fuse_rss_after_mount_vs_small"] = ratio(big["rss_after_mount"]["VmRSS_kib"],
                                                           small["rss_after_mount"]["VmRSS_kib"])
            v["big_fuse_rss_after_ls_vs_small"] = ratio(big["rss_after_ls"]["VmRSS_kib"],
                                                        small["rss_after_ls"]["VmRSS_kib"])
            if big.get("rss_at_rest_after_ls") and small.get("rss_at_rest_after_ls"):
                v["big_fuse_rss_at_rest_after_ls_vs_small"] = ratio(big["rss_at_rest_after_ls"]["VmRSS_kib"],
                                                                    small["rss_at_rest_after_ls"]["VmRSS_kib"])
            # RssAnon: the daemon's own memory, without the pages of the metadata image it maps
            v["big_fuse_rss_anon_after_mount_vs_small"] = ratio(big["rss_after_mount"]["RssAnon_kib"],
                                                                small["rss_after_mount"]["RssAnon_kib"])
            v["big_fuse_rss_anon_after_ls_vs_small"] = ratio(big["rss_after_ls"]["RssAnon_kib"],
                                                             small["rss_after_ls"]["RssAnon_kib"])
    judge(doc, v, TARGETS)


def render(doc, plot_path):
    r = view(doc)
    plot(r, plot_path)
    return tables(r)


BENCHMARK = {
    "out": ROOT / "docs" / "bench-fuse-results.json",
    "plot": ROOT / "docs" / "bench-fuse.png",
    "tables_in": "docs/bench-fuse.md",
    "needs": ["umoci", "mksquashfs", "mkfs.erofs", "findmnt", "fio", "squashfuse", "/usr/bin/time"],
    "measure": measure,
    "derive": derive,
    "render": render,
}
