"""The checks of bench/big_image.py and its step 4: one lazy mount of the
big image (--mode kernel or fuse, --prefetch none, its own cache dir) read
and checked: stat of every file, pread of every check region (past 4 GiB
too), reads at and past the end, every large file read whole against its
sha256, `lamina status`, the daemons' RSS, fsck.erofs of the metadata image
with the cache files as devices, an overlay on top, `lamina umount`.

Every check is recorded in CHECKS by `check`; a false one raises Failure,
naming it, and the run ends without a results file."""

import hashlib
import json
import os
import shutil
import subprocess
import time

from .harness.core import log, run
from .harness.measure import LAMINA_MOUNTS, drop_caches, is_mountpoint, procs_of

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
BUF = 8 * MiB  # read and write size of the large files

CHECKS = {}  # name -> True (a failed check raises)


class Failure(Exception):
    pass


def check(cond, name, msg):
    """Records check `name`; a false `cond` fails the whole run with `msg`."""
    CHECKS[name] = bool(cond)
    if not cond:
        raise Failure(f"check {name} failed: {msg}")


def df_avail(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def hash_file(path):
    """(sha256 hex, bytes) of the file at `path`, read in BUF pieces."""
    h = hashlib.sha256()
    buf = bytearray(BUF)
    mv = memoryview(buf)
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(mv)
            if not k:
                break
            h.update(mv[:k])
            n += k
    return h.hexdigest(), n


def mount_fstype(path):
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if parts[1] == path:
                return parts[2]
    return None


def settled_status(lamina, cache, mnt):
    """This mount's entry of `lamina status --json` (None if absent), once it
    stops changing (up to 4 s)."""
    prev = None
    for _ in range(40):
        p = run([lamina, "status", "--json", "--cache-dir", cache], timeout=None)
        cur = None
        for m in json.loads(p.stdout or "[]"):
            if m.get("mountpoint") == os.path.realpath(mnt):
                cur = m
        if cur is not None and cur == prev:
            return cur
        prev = cur
        time.sleep(0.1)
    return prev


def check_mode(lamina, work, image, files, mode):
    """Mounts `image` lazily in `mode`, checks it through and unmounts it;
    the mode's figures. `files`: the generator's description."""
    mnt = os.path.join(work, f"mnt-{mode}")
    cache = os.path.join(work, f"cache-{mode}")
    os.makedirs(mnt)
    large = [n for n, d in files.items() if d["large"]]
    out = {}
    drop_caches()
    info = mount(lamina, image, mnt, cache, mode, out)
    check_tree(mnt, files, mode)
    read_regions(mnt, files, large, mode, out)
    read_whole(mnt, files, large, mode, out)
    out["status_after_reads"] = settled_status(lamina, cache, mnt)
    daemons_and_cache(cache, info, out)
    out["fsck"] = fsck(info, mode)
    overlay(work, mnt, files, max(large, key=lambda n: files[n]["size"]), mode, out)
    unmount(lamina, mnt, cache, mode, out)
    shutil.rmtree(cache)
    shutil.rmtree(os.path.join(work, f"ovl-{mode}"))
    os.rmdir(mnt)
    log(f"{mode}: unmounted; cache dir removed ({df_avail(work) / GiB:.1f} GiB free)")
    return out


def mount(lamina, image, mnt, cache, mode, out):
    """`lamina mount --prefetch none`, timed; its report."""
    t0 = time.monotonic()
    p = run([lamina, "mount", "--json", "--mode", mode, "--prefetch", "none", image, mnt, "--cache-dir", cache],
            timeout=None)
    out["mount_s"] = round(time.monotonic() - t0, 3)
    LAMINA_MOUNTS.append((lamina, mnt, cache))  # unmounted by cleanup() should a check fail
    info = json.loads(p.stdout)
    out["mount_report"] = info
    check(is_mountpoint(mnt), f"{mode}.mounted", f"{mnt} is not a mountpoint after lamina mount")
    check(info.get("mode") == mode, f"{mode}.mode", f"mount report says mode {info.get('mode')!r}")
    out["fstype"] = mount_fstype(mnt)
    st0 = settled_status(lamina, cache, mnt)
    check(st0 is not None, f"{mode}.in_status", "the lazy mount is not in lamina status")
    out["status_after_mount"] = st0
    log(f"{mode}: mounted in {out['mount_s']:.2f} s ({out['fstype']})")
    return info


def check_tree(mnt, files, label):
    """stat of every file, the small files' bytes, the symlink."""
    for name, d in files.items():
        st = os.lstat(os.path.join(mnt, name))
        check((st.st_size, st.st_mode & 0o7777, int(st.st_mtime)) == (d["size"], d["mode"], d["mtime"]),
              f"{label}.stat", f"{name}: size/mode/mtime {(st.st_size, oct(st.st_mode), st.st_mtime)} "
              f"!= {(d['size'], oct(d['mode']), d['mtime'])}")
        if not d["large"]:
            with open(os.path.join(mnt, name), "rb") as f:
                check(f.read() == d["content"], f"{label}.small_files", f"{name}: content differs")
    check(os.readlink(os.path.join(mnt, "data/big.link")) == "file-1.bin", f"{label}.symlink",
          "data/big.link does not point at file-1.bin")


def read_regions(mnt, files, large, label, out):
    """pread of every check region (cold: the files' first reads), including past 4 GiB."""
    t0 = time.monotonic()
    for name in large:
        pread_checks(os.path.join(mnt, name), files[name], label)
    out["pread_regions"] = sum(len(files[n]["regions"]) for n in large)
    out["pread_s"] = round(time.monotonic() - t0, 3)
    log(f"{label}: {out['pread_regions']} pread regions right in {out['pread_s']:.2f} s")


def pread_checks(path, d, label):
    """Every check region of a large file by pread, and reads at, past and over its end."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for (off, n), want in d["regions"].items():
            got = os.pread(fd, n, off)
            if got != want:
                i = first_difference(got, want)
                check(False, f"{label}.pread", f"{path}: pread of {n} bytes at {off} returned {len(got)} "
                      f"bytes, first difference at file offset {off + i}")
        size = d["size"]
        check(os.pread(fd, 16, size) == b"", f"{label}.read_at_end", f"{path}: a read at the end returned bytes")
        check(os.pread(fd, 16, size + GiB) == b"", f"{label}.read_past_end",
              f"{path}: a read past the end returned bytes")
        tail = os.pread(fd, 16, size - 5)
        check(tail == d["regions"][max(d["regions"])][-5:], f"{label}.read_over_end",
              f"{path}: a read over the end returned {tail!r}")
    finally:
        os.close(fd)
    CHECKS[f"{label}.pread"] = True


def read_whole(mnt, files, large, label, out):
    """Every large file read whole, its sha256 against the generator's."""
    out["reads"] = {}
    total_bytes = 0
    t_all = time.monotonic()
    for name in large:
        t0 = time.monotonic()
        sha, n = hash_file(os.path.join(mnt, name))
        dt = time.monotonic() - t0
        out["reads"][name] = {"bytes": n, "s": round(dt, 3), "mb_s": round(n / dt / 1e6, 1)}
        log(f"{label}: read {name} whole: {n} bytes in {dt:.1f} s ({n / dt / 1e6:.0f} MB/s)")
        check(n == files[name]["size"], f"{label}.whole_size", f"{name}: read {n} bytes, expected {files[name]['size']}")
        check(sha == files[name]["sha256"], f"{label}.whole_sha256",
              f"{name}: sha256 {sha} read through the mount, generator's {files[name]['sha256']}")
        total_bytes += n
    dt = time.monotonic() - t_all
    out["read_all"] = {"bytes": total_bytes, "s": round(dt, 3), "mb_s": round(total_bytes / dt / 1e6, 1)}


def daemons_and_cache(cache, info, out):
    """The daemons' memory after the reads and the cache files' sizes."""
    out["daemons"] = list(procs_of(cache).values())
    out["daemons_peak_rss_kib"] = sum(p.get("VmHWM_kib", 0) for p in out["daemons"])
    out["daemons_rss_anon_kib"] = sum(p.get("RssAnon_kib", 0) for p in out["daemons"])
    out["cache_files"] = []
    for b in info.get("blob_paths") or []:
        try:
            st = os.stat(b)
            out["cache_files"].append({"path": os.path.basename(b), "size": st.st_size,
                                       "allocated": st.st_blocks * 512})
        except OSError as e:
            out["cache_files"].append({"path": os.path.basename(b), "error": str(e)})


def fsck(info, mode):
    """fsck.erofs of the metadata image with the (now complete) cache files
    as devices, plain, and --extract too in kernel mode; None when the mount
    report names no metadata image or cache files."""
    meta = info.get("metadata_path")
    blobs = info.get("blob_paths") or []
    if not (meta and os.path.isfile(meta) and blobs and all(os.path.isfile(b) for b in blobs)):
        log(f"{mode}: no metadata image / cache files in the mount report: fsck.erofs not run")
        return None
    devs = [f"--device={b}" for b in blobs]
    out = {}
    for extra in [[], ["--extract"]] if mode == "kernel" else [[]]:
        t0 = time.monotonic()
        p = subprocess.run(["fsck.erofs"] + extra + devs + [meta], capture_output=True, text=True)
        key = "extract" if extra else "plain"
        out[key] = {"rc": p.returncode, "s": round(time.monotonic() - t0, 1),
                    "output": (p.stdout + p.stderr)[-1500:]}
        check(p.returncode == 0, f"{mode}.fsck_erofs{'_extract' if extra else ''}",
              f"fsck.erofs {' '.join(extra)} exit {p.returncode}: {(p.stdout + p.stderr)[-1500:]}")
        log(f"{mode}: fsck.erofs {' '.join(extra)} passed in {out[key]['s']} s")
    return out


def overlay(work, mnt, files, biggest, label, out):
    """An overlay on top: a write, a copy-up of a small file, regions of the
    biggest file past 4 GiB read through it, no copy-up of that file; the
    lamina mount unchanged after."""
    ovl = os.path.join(work, f"ovl-{label}")
    upper, wdir, merged = (os.path.join(ovl, x) for x in ("upper", "work", "merged"))
    for x in (upper, wdir, merged):
        os.makedirs(x)
    run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={mnt},upperdir={upper},workdir={wdir}", merged],
        timeout=None)
    try:
        overlay_checks(merged, upper, files, biggest, label, out)
    finally:
        subprocess.run(["umount", merged], capture_output=True)
    check(not is_mountpoint(merged), f"{label}.overlay_unmounted", "the overlay is still mounted")
    check(not os.path.exists(os.path.join(mnt, "data/new.txt")), f"{label}.lower_unchanged",
          "data/new.txt appeared in the lamina mount")
    with open(os.path.join(mnt, "data/neighbour.txt"), "rb") as f:
        check(f.read() == files["data/neighbour.txt"]["content"], f"{label}.lower_unchanged",
              "data/neighbour.txt changed in the lamina mount")
    log(f"{label}: overlay: write, copy-up of a small file, {len(out['overlay_regions_read'])} far regions "
        f"of {biggest} right, big file not copied up ({out['overlay_upper_bytes']} bytes in upper)")


def overlay_checks(merged, upper, files, biggest, label, out):
    new = b"written through the overlay\n"
    with open(os.path.join(merged, "data/new.txt"), "wb") as f:
        f.write(new)
    with open(os.path.join(merged, "data/neighbour.txt"), "ab") as f:
        f.write(new)
    with open(os.path.join(merged, "data/new.txt"), "rb") as f:
        check(f.read() == new, f"{label}.overlay_write", "data/new.txt reads back wrong through the overlay")
    with open(os.path.join(merged, "data/neighbour.txt"), "rb") as f:
        check(f.read() == files["data/neighbour.txt"]["content"] + new, f"{label}.overlay_write",
              "data/neighbour.txt (copied up) reads back wrong")
    d = files[biggest]
    st = os.stat(os.path.join(merged, biggest))
    check(st.st_size == d["size"], f"{label}.overlay_read", f"{biggest}: size {st.st_size} in the overlay")
    fd = os.open(os.path.join(merged, biggest), os.O_RDONLY)
    try:
        far = [r for r in d["regions"] if r[0] >= 1 << 32] or list(d["regions"])
        for off, n in far:
            got = os.pread(fd, n, off)
            check(got == d["regions"][(off, n)], f"{label}.overlay_read",
                  f"{biggest}: pread of {n} at {off} through the overlay differs "
                  f"(first at {off + first_difference(got, d['regions'][(off, n)])})")
        out["overlay_regions_read"] = [list(r) for r in far]
    finally:
        os.close(fd)
    copied = sorted(os.listdir(os.path.join(upper, "data")))
    check(copied == ["neighbour.txt", "new.txt"], f"{label}.overlay_no_copy_up",
          f"upper/data holds {copied}, expected only neighbour.txt and new.txt")
    up_bytes = sum(os.lstat(os.path.join(r, f)).st_blocks * 512
                   for r, _, fs in os.walk(upper) for f in fs)
    out["overlay_upper_bytes"] = up_bytes
    check(up_bytes < MiB, f"{label}.overlay_no_copy_up", f"the upper dir takes {up_bytes} bytes")


def unmount(lamina, mnt, cache, label, out):
    """`lamina umount`; its daemons must be gone within 30 s."""
    st2 = settled_status(lamina, cache, mnt)
    out["status_at_end"] = st2
    s = (st2 or {}).get("status") or {}
    for k in ("failed_misses", "misses_failed", "failed"):
        if isinstance(s.get(k), int):
            check(s[k] == 0, f"{label}.no_failed_misses", f"status {k} = {s[k]}")
    pids = list(procs_of(cache))
    run([lamina, "umount", "--json", mnt, "--cache-dir", cache], timeout=None)
    LAMINA_MOUNTS.remove((lamina, mnt, cache))
    check(not is_mountpoint(mnt), f"{label}.unmounted", f"{mnt} still mounted after lamina umount")
    deadline = time.monotonic() + 30
    while pids and time.monotonic() < deadline:
        pids = [x for x in pids if os.path.exists(f"/proc/{x}")]
        time.sleep(0.05)
    check(not pids, f"{label}.daemons_exit", f"daemons {pids} still running 30 s after lamina umount")
