#!/usr/bin/env python3
"""The work of scripts/big_image.sh (issue 10): a big image end to end.

Usage (normally through scripts/big_image.sh, which makes the work dir and
copies the binary):
    big_image_run.py --lamina BIN --work DIR --size BYTES --out FILE

1. Writes an OCI image layout (WORK/src, tag big) with one uncompressed tar
   layer (application/vnd.oci.image.layer.v1.tar), streamed to disk: four
   large files of distinct pseudo-random data (AES-128-CTR keystreams from
   `openssl enc`, one key per file) totalling --size bytes, none a multiple
   of 4 KiB (so none of the 16 MiB chunk size), plus a few small files and a
   symlink. Each file's sha256 and the tar's are computed while streaming;
   the bytes of a few check regions per file are kept (a few MB), and
   checked against the keystream regenerated at their offset (the CTR
   counter block set to offset / 16).
2. Starts a registry (tests/tools/registry.sh) with its storage in WORK.
3. `lamina convert --json --chunk-size 16M oci:SRC:big docker://.../big:1`
   under /usr/bin/time -v (wall time, peak RSS); `lamina inspect --json` for
   the data blobs; asserts that one blob is larger than 4 GiB (when --size
   is at least 5 GiB, so a blob can be). Deletes the source layout.
4. For --mode kernel, then fuse: a lazy mount (--prefetch none, own cache
   dir), pread checks of every region, reads at and past the end, every
   file read whole and its sha256 compared, `lamina status --json`, the
   daemons' peak RSS, fsck.erofs of the metadata image with the cache files
   as devices, an overlay on top (a write next to the big files, a read of
   a region past 4 GiB through it, no copy-up of the big file), `lamina
   umount`; the mode's cache dir is then deleted.
5. Writes the results JSON (only when every check passed) and a summary.

Any mismatch raises: exit status 1, a message naming the check, no results
file. Standard library only.
"""

import argparse
import datetime
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures"))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)  # bench.harness
from mkimage import MT_CONFIG, MT_INDEX, MT_MANIFEST, MT_TAR, REF_NAME, T0, dumps  # noqa: E402
from bench.harness.measure import drop_caches, machine_info, procs_of  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
CHUNK = 16 * MiB
BLOCK = 512
USTAR_MAX_SIZE = 8 ** 11 - 1  # 11 octal digits; beyond it the GNU base-256 size
REGISTRY_SH = os.path.join(ROOT, "tests", "tools", "registry.sh")
F_SETPIPE_SZ = 1031
BUF = 8 * MiB


def log(msg):
    ts = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[big-image {ts}] {msg}", file=sys.stderr, flush=True)


class Failure(Exception):
    pass


CHECKS = {}  # name -> True (a failed check raises)


def check(cond, name, msg):
    """Records check `name`; a false `cond` fails the whole run with `msg`."""
    CHECKS[name] = bool(cond)
    if not cond:
        raise Failure(f"check {name} failed: {msg}")


def parse_size(s):
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", s, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r} (BYTES, or N with K/M/G/T, e.g. 20GiB)")
    return int(m.group(1)) << (10 * " KMGT".index((m.group(2) or " ").upper()))


class DiskWatch:
    """The least free space seen under `path`, sampled every second in a thread."""

    def __init__(self, path):
        import threading
        self.path = path
        self.least = df_avail(path)
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.loop, daemon=True)
        self.t.start()

    def loop(self):
        while not self.stop.wait(1.0):
            self.least = min(self.least, df_avail(self.path))


def df_avail(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def now_iso():
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


# ---------------------------------------------------------------------------
# 1. the image


def plan_files(total):
    """The large files: (name, size, mode, mtime), tar order; sizes sum to `total`.

    15/45/30/10 % of it (rounded down to MiB, plus an odd remainder): for
    20 GiB, 3 GiB+4097, 9 GiB+12345 (past 8 GiB: a GNU base-256 size in
    its header), 6 GiB+1 and 2 GiB-16443."""
    if total < 64 * MiB:
        raise Failure(f"--size {total} is too small (at least 64 MiB)")
    sizes = []
    for pct, extra in ((15, 4097), (45, 12345), (30, 1)):
        s = total * pct // 100
        sizes.append(s - s % MiB + extra)
    sizes.append(total - sum(sizes))
    if sizes[-1] % 4096 == 0:
        sizes[0] += 1
        sizes[-1] -= 1
    assert sum(sizes) == total and all(s > 0 and s % 4096 for s in sizes), sizes
    return [(f"data/file-{i}.bin", s, 0o640, T0 + 100 + i) for i, s in enumerate(sizes)]


def key_of(name):
    """AES-128 key (hex) of a large file: distinct per file."""
    return hashlib.sha256(b"lamina big image/" + name.encode()).hexdigest()[:32]


def keystream_cmd(key, block):
    """openssl's AES-128-CTR keystream starting at counter block `block` (offset 16*block)."""
    return ["openssl", "enc", "-aes-128-ctr", "-nosalt", "-K", key, "-iv", "%032x" % block]


def keystream_at(key, offset, length):
    """`length` bytes of the file with key `key` at `offset`, regenerated by openssl."""
    skip = offset % 16
    with open("/dev/zero", "rb") as zero:
        p = subprocess.Popen(keystream_cmd(key, offset // 16), stdin=zero,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            data = read_exactly(p.stdout, skip + length)
        finally:
            p.stdout.close()
            p.kill()
            p.wait()
    return data[skip:]


def read_exactly(f, n):
    out = bytearray(n)
    mv = memoryview(out)
    got = 0
    while got < n:
        k = f.readinto(mv[got:])
        if not k:
            raise Failure(f"short read: {got} of {n} bytes")
        got += k
    return bytes(out)


def check_regions(size):
    """(offset, length) of the regions a mount's reads are checked on, for a file of `size`."""
    want = [
        (0, 64 * KiB),                             # the head
        (CHUNK - 3000, 6000),                      # across the first chunk boundary
        (size // 2 - 777, 100000),                 # the middle
        ((1 << 32) - 3000, 6000),                  # across 2^32
        ((1 << 32) + 3 * CHUNK + 12345, MiB + 7),  # past 2^32, odd offset and length
        ((1 << 32) + 17 * CHUNK - 1, 2),           # a chunk boundary past 2^32, by the byte
        ((1 << 33) - 4096, 8192),                  # across 2^33
        (size - 100001, 100001),                   # the tail, through the last byte
    ]
    out = []
    for off, n in want:
        if off >= 0 and off + n <= size and (off, n) not in out:
            out.append((off, n))
    return sorted(out)


def small_files():
    """(name, bytes, mode) of the small files before the large ones."""
    def prng(seed, n):
        out = bytearray()
        i = 0
        while len(out) < n:
            out += hashlib.sha256(b"%s/%d" % (seed, i)).digest()
            i += 1
        return bytes(out[:n])
    return [
        ("data/README", b"large files live here\n", 0o644),
        ("data/neighbour.txt", b"the big files' neighbour\n", 0o600),
        ("data/empty", b"", 0o644),
        ("data/small-5000.bin", prng(b"small", 5000), 0o644),        # packed (<= 16 KiB)
        ("data/medium-40000.bin", prng(b"medium", 40000), 0o644),    # a chunk of its own
        ("etc/hostname", b"big-image\n", 0o644),
    ]


LAST_FILE = ("data/zz-after.txt", b"after the large files: packed at the end of the last blob\n", 0o644)


class Tar:
    """A tar stream written to an unbuffered file, hashed and counted."""

    def __init__(self, f):
        self.f = f
        self.h = hashlib.sha256()
        self.n = 0

    def w(self, b):
        mv = memoryview(b)
        self.h.update(mv)
        while len(mv):
            k = self.f.write(mv)
            mv = mv[k:]
        self.n += len(b)

    def header(self, name, typ=tarfile.REGTYPE, size=0, mode=0o644, mtime=T0, linkname=""):
        ti = tarfile.TarInfo(name)
        ti.type = typ
        ti.size = size
        ti.mode = mode
        ti.mtime = mtime
        ti.linkname = linkname
        ti.uname = ti.gname = ""
        fmt = tarfile.GNU_FORMAT if size > USTAR_MAX_SIZE else tarfile.USTAR_FORMAT
        self.w(ti.tobuf(fmt, "utf-8", "strict"))
        return "gnu" if fmt == tarfile.GNU_FORMAT else "ustar"

    def pad(self, size):
        if size % BLOCK:
            self.w(bytes(BLOCK - size % BLOCK))

    def small(self, name, data, mode):
        self.header(name, size=len(data), mode=mode)
        self.w(data)
        self.pad(len(data))


def stream_large(tar, name, size, mode, mtime, regions):
    """Writes one large file's entry; returns its sha256 and the bytes of `regions`."""
    fmt = tar.header(name, size=size, mode=mode, mtime=mtime)
    h = hashlib.sha256()
    captured = {r: bytearray() for r in regions}
    buf = bytearray(BUF)
    mv = memoryview(buf)
    pos = 0
    t0 = time.monotonic()
    next_log = GiB
    with open("/dev/zero", "rb") as zero:
        p = subprocess.Popen(keystream_cmd(key_of(name), 0), stdin=zero, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        try:
            try:
                fcntl.fcntl(p.stdout.fileno(), F_SETPIPE_SZ, MiB)
            except OSError:
                pass
            while pos < size:
                want = min(BUF, size - pos)
                got = 0
                while got < want:
                    k = p.stdout.readinto(mv[got:want])
                    if not k:
                        raise Failure(f"openssl stopped after {pos + got} bytes of {name}: "
                                      f"{p.stderr.read().decode(errors='replace')}")
                    got += k
                piece = mv[:want]
                h.update(piece)
                for (off, n), out in captured.items():
                    lo, hi = max(off, pos), min(off + n, pos + want)
                    if lo < hi:
                        out += piece[lo - pos:hi - pos]
                tar.w(piece)
                pos += want
                if pos >= next_log:
                    dt = time.monotonic() - t0
                    log(f"  {name}: {pos / GiB:.1f} of {size / GiB:.1f} GiB, {pos / dt / 1e6:.0f} MB/s")
                    next_log += 2 * GiB
        finally:
            p.stdout.close()
            p.kill()
            p.wait()
    tar.pad(size)
    for (off, n), out in captured.items():
        assert len(out) == n, (name, off, n, len(out))
    return h.hexdigest(), {r: bytes(b) for r, b in captured.items()}, fmt


def write_blob(blobs, data):
    hexd = hashlib.sha256(data).hexdigest()
    with open(os.path.join(blobs, hexd), "wb") as f:
        f.write(data)
    return "sha256:" + hexd, len(data)


def generate(src, total):
    """The OCI layout at `src`; returns its description (files, expected regions)."""
    blobs = os.path.join(src, "blobs", "sha256")
    os.makedirs(blobs)
    large = plan_files(total)
    files = {}
    tmp = os.path.join(blobs, "layer.tmp")
    t0 = time.monotonic()
    with open(tmp, "wb", buffering=0) as f:
        tar = Tar(f)
        tar.header("data/", typ=tarfile.DIRTYPE, mode=0o755, mtime=T0 + 5)
        tar.header("etc/", typ=tarfile.DIRTYPE, mode=0o755)
        for name, data, mode in small_files():
            tar.small(name, data, mode)
            files[name] = {"size": len(data), "mode": mode, "mtime": T0,
                           "sha256": hashlib.sha256(data).hexdigest(), "large": False, "content": data}
        tar.header("data/big.link", typ=tarfile.SYMTYPE, mode=0o777, linkname="file-1.bin")
        for name, size, mode, mtime in large:
            log(f"writing {name}: {size} bytes")
            regions = check_regions(size)
            sha, captured, fmt = stream_large(tar, name, size, mode, mtime, regions)
            files[name] = {"size": size, "mode": mode, "mtime": mtime, "sha256": sha, "large": True,
                           "tar_header": fmt, "key": key_of(name), "regions": captured}
        name, data, mode = LAST_FILE
        tar.small(name, data, mode)
        files[name] = {"size": len(data), "mode": mode, "mtime": T0,
                       "sha256": hashlib.sha256(data).hexdigest(), "large": False, "content": data}
        tar.w(bytes(2 * BLOCK))
        os.fsync(f.fileno())
    gen_s = time.monotonic() - t0
    layer_hex = tar.h.hexdigest()
    os.rename(tmp, os.path.join(blobs, layer_hex))
    layer_digest = "sha256:" + layer_hex
    config = {
        "architecture": "amd64", "os": "linux", "created": "2023-11-14T22:13:20Z",
        "config": {"Cmd": ["/bin/sh"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created": "2023-11-14T22:13:20Z", "created_by": "big_image_run.py"}],
    }
    cdigest, csize = write_blob(blobs, dumps(config))
    manifest = {
        "schemaVersion": 2, "mediaType": MT_MANIFEST,
        "config": {"mediaType": MT_CONFIG, "digest": cdigest, "size": csize},
        "layers": [{"mediaType": MT_TAR, "digest": layer_digest, "size": tar.n}],
    }
    mdigest, msize = write_blob(blobs, dumps(manifest))
    with open(os.path.join(src, "oci-layout"), "wb") as f:
        f.write(dumps({"imageLayoutVersion": "1.0.0"}))
    with open(os.path.join(src, "index.json"), "wb") as f:
        f.write(dumps({"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": [{
            "mediaType": MT_MANIFEST, "digest": mdigest, "size": msize,
            "annotations": {REF_NAME: "big"}, "platform": {"architecture": "amd64", "os": "linux"}}]}))
    # The regeneration the mount checks rely on: the keystream at any
    # offset equals what was streamed there.
    n = 0
    for name, d in files.items():
        if d["large"]:
            for (off, length), data in d["regions"].items():
                again = keystream_at(d["key"], off, length)
                check(again == data, "generator_regions_regenerate",
                      f"{name}: the keystream regenerated at {off} (+{length}) differs from the streamed bytes")
                n += 1
    log(f"generated {tar.n} bytes of tar in {gen_s:.1f} s ({tar.n / gen_s / 1e6:.0f} MB/s); "
        f"{n} check regions regenerate exactly")
    return {"layer_digest": layer_digest, "tar_bytes": tar.n, "manifest_digest": mdigest,
            "wall_s": round(gen_s, 3), "files": files}


# ---------------------------------------------------------------------------
# helpers


def run(cmd, timeout=None, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if p.returncode != 0:
        raise Failure(f"command failed ({p.returncode}): {' '.join(cmd)}\n"
                      f"stdout: {p.stdout[-3000:]}\nstderr: {p.stderr[-3000:]}")
    return p


def time_v(cmd):
    """cmd under /usr/bin/time -v: (wall s, stdout, {peak_rss_kib, user_s, sys_s}, stderr)."""
    t0 = time.monotonic()
    p = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True)
    dt = time.monotonic() - t0
    if p.returncode != 0:
        raise Failure(f"command failed ({p.returncode}): {' '.join(cmd)}\nstdout: {p.stdout[-3000:]}\n"
                      f"stderr: {p.stderr[-5000:]}")

    def field(label, conv):
        m = re.search(re.escape(label) + r": (\S+)", p.stderr)
        return conv(m.group(1)) if m else None
    return dt, p.stdout, {"peak_rss_kib": field("Maximum resident set size (kbytes)", int),
                          "user_s": field("User time (seconds)", float),
                          "sys_s": field("System time (seconds)", float)}, p.stderr


def is_mountpoint(path):
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


def mount_fstype(path):
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if parts[1] == path:
                return parts[2]
    return None


def lamina_status(lamina, cache, mnt):
    """This mount's entry of `lamina status --json` (None if absent), once it stops changing."""
    prev = None
    for _ in range(40):
        p = run([lamina, "status", "--json", "--cache-dir", cache])
        cur = None
        for m in json.loads(p.stdout or "[]"):
            if m.get("mountpoint") == os.path.realpath(mnt):
                cur = m
        if cur is not None and cur == prev:
            return cur
        prev = cur
        time.sleep(0.1)
    return prev


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


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


def hash_file(path):
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


def hash_ceiling():
    """This machine's sha256 speed on memory (MB/s): the ceiling of the read figures."""
    data = os.urandom(64 * MiB)
    h = hashlib.sha256()
    t0 = time.monotonic()
    for _ in range(8):
        h.update(data)
    return round(8 * len(data) / (time.monotonic() - t0) / 1e6, 1)


# ---------------------------------------------------------------------------
# 4. one mode


def check_mode(lamina, work, image, gen, mode, res):
    label = mode
    mnt = os.path.join(work, f"mnt-{mode}")
    cache = os.path.join(work, f"cache-{mode}")
    os.makedirs(mnt)
    files = gen["files"]
    large = [n for n, d in files.items() if d["large"]]
    biggest = max(large, key=lambda n: files[n]["size"])
    out = res["modes"][mode] = {"checks": {}}
    drop_caches()

    t0 = time.monotonic()
    p = run([lamina, "mount", "--json", "--mode", mode, "--prefetch", "none", image, mnt, "--cache-dir", cache])
    out["mount_s"] = round(time.monotonic() - t0, 3)
    info = json.loads(p.stdout)
    out["mount_report"] = info
    check(is_mountpoint(mnt), f"{label}.mounted", f"{mnt} is not a mountpoint after lamina mount")
    check(info.get("mode") == mode, f"{label}.mode", f"mount report says mode {info.get('mode')!r}")
    out["fstype"] = mount_fstype(mnt)
    st0 = lamina_status(lamina, cache, mnt)
    check(st0 is not None, f"{label}.in_status", "the lazy mount is not in lamina status")
    out["status_after_mount"] = st0
    log(f"{mode}: mounted in {out['mount_s']:.2f} s ({out['fstype']})")

    # stat of every file, the small files' bytes, the symlink
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

    # pread regions (cold: first reads of the file), including past 4 GiB
    t0 = time.monotonic()
    for name in large:
        pread_checks(os.path.join(mnt, name), files[name], label)
    out["pread_regions"] = sum(len(files[n]["regions"]) for n in large)
    out["pread_s"] = round(time.monotonic() - t0, 3)
    log(f"{mode}: {out['pread_regions']} pread regions right in {out['pread_s']:.2f} s")

    # every file whole
    out["reads"] = {}
    total_bytes = 0
    t_all = time.monotonic()
    for name in large:
        t0 = time.monotonic()
        sha, n = hash_file(os.path.join(mnt, name))
        dt = time.monotonic() - t0
        out["reads"][name] = {"bytes": n, "s": round(dt, 3), "mb_s": round(n / dt / 1e6, 1)}
        log(f"{mode}: read {name} whole: {n} bytes in {dt:.1f} s ({n / dt / 1e6:.0f} MB/s)")
        check(n == files[name]["size"], f"{label}.whole_size", f"{name}: read {n} bytes, expected {files[name]['size']}")
        check(sha == files[name]["sha256"], f"{label}.whole_sha256",
              f"{name}: sha256 {sha} read through the mount, generator's {files[name]['sha256']}")
        total_bytes += n
    dt = time.monotonic() - t_all
    out["read_all"] = {"bytes": total_bytes, "s": round(dt, 3), "mb_s": round(total_bytes / dt / 1e6, 1)}
    st1 = lamina_status(lamina, cache, mnt)
    out["status_after_reads"] = st1
    out["daemons"] = list(procs_of(cache).values())
    out["daemons_peak_rss_kib"] = sum(p.get("VmHWM_kib", 0) for p in out["daemons"])
    out["daemons_rss_anon_kib"] = sum(p.get("RssAnon_kib", 0) for p in out["daemons"])
    blobs = info.get("blob_paths") or []
    out["cache_files"] = []
    for b in blobs:
        try:
            st = os.stat(b)
            out["cache_files"].append({"path": os.path.basename(b), "size": st.st_size,
                                       "allocated": st.st_blocks * 512})
        except OSError as e:
            out["cache_files"].append({"path": os.path.basename(b), "error": str(e)})

    # fsck.erofs: the metadata image with the (now complete) cache files as devices
    meta = info.get("metadata_path")
    if meta and os.path.isfile(meta) and blobs and all(os.path.isfile(b) for b in blobs):
        devs = [f"--device={b}" for b in blobs]
        out["fsck"] = {}
        extras = [[], ["--extract"]] if mode == "kernel" else [[]]
        for extra in extras:
            t0 = time.monotonic()
            p = subprocess.run(["fsck.erofs"] + extra + devs + [meta], capture_output=True, text=True)
            key = "extract" if extra else "plain"
            out["fsck"][key] = {"rc": p.returncode, "s": round(time.monotonic() - t0, 1),
                                "output": (p.stdout + p.stderr)[-1500:]}
            check(p.returncode == 0, f"{label}.fsck_erofs{'_extract' if extra else ''}",
                  f"fsck.erofs {' '.join(extra)} exit {p.returncode}: {(p.stdout + p.stderr)[-1500:]}")
            log(f"{mode}: fsck.erofs {' '.join(extra)} passed in {out['fsck'][key]['s']} s")
    else:
        out["fsck"] = None
        log(f"{mode}: no metadata image / cache files in the mount report: fsck.erofs not run")

    # an overlay on top
    ovl = os.path.join(work, f"ovl-{mode}")
    upper, wdir, merged = (os.path.join(ovl, x) for x in ("upper", "work", "merged"))
    for x in (upper, wdir, merged):
        os.makedirs(x)
    run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={mnt},upperdir={upper},workdir={wdir}", merged])
    try:
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
    finally:
        subprocess.run(["umount", merged], capture_output=True)
    check(not is_mountpoint(merged), f"{label}.overlay_unmounted", "the overlay is still mounted")
    check(not os.path.exists(os.path.join(mnt, "data/new.txt")), f"{label}.lower_unchanged",
          "data/new.txt appeared in the lamina mount")
    with open(os.path.join(mnt, "data/neighbour.txt"), "rb") as f:
        check(f.read() == files["data/neighbour.txt"]["content"], f"{label}.lower_unchanged",
              "data/neighbour.txt changed in the lamina mount")
    log(f"{mode}: overlay: write, copy-up of a small file, {len(out['overlay_regions_read'])} far regions "
        f"of {biggest} right, big file not copied up ({up_bytes} bytes in upper)")

    st2 = lamina_status(lamina, cache, mnt)
    out["status_at_end"] = st2
    s = (st2 or {}).get("status") or {}
    for k in ("failed_misses", "misses_failed", "failed"):
        if isinstance(s.get(k), int):
            check(s[k] == 0, f"{label}.no_failed_misses", f"status {k} = {s[k]}")
    pids = list(procs_of(cache))
    p = run([lamina, "umount", "--json", mnt, "--cache-dir", cache])
    check(not is_mountpoint(mnt), f"{label}.unmounted", f"{mnt} still mounted after lamina umount")
    deadline = time.monotonic() + 30
    while pids and time.monotonic() < deadline:
        pids = [x for x in pids if os.path.exists(f"/proc/{x}")]
        time.sleep(0.05)
    check(not pids, f"{label}.daemons_exit", f"daemons {pids} still running 30 s after lamina umount")
    out["checks"] = {k.split(".", 1)[1]: v for k, v in CHECKS.items() if k.startswith(label + ".")}
    shutil.rmtree(cache)
    shutil.rmtree(ovl)
    os.rmdir(mnt)
    log(f"{mode}: unmounted; cache dir removed ({df_avail(work) / GiB:.1f} GiB free)")


# ---------------------------------------------------------------------------


def summary_table(res):
    lines = []
    g, c = res["generate"], res["convert"]
    lines.append(f"image:    {res['size']} bytes of file data in {len(res['files'])} files, tar {g['tar_bytes']} bytes")
    lines.append(f"generate: {g['wall_s']} s")
    lines.append(f"convert:  {c['wall_s']} s, peak RSS {c['peak_rss_kib']} KiB, "
                 f"{len(c['blobs'])} data blobs, largest {c['largest_blob_bytes']} bytes")
    for mode, m in res["modes"].items():
        s = ((m.get("status_after_reads") or {}).get("status") or {})
        lines.append(f"{mode:7s}:  mount {m['mount_s']} s, read {m['read_all']['bytes']} bytes in "
                     f"{m['read_all']['s']} s ({m['read_all']['mb_s']} MB/s), fetched {s.get('fetched_bytes')} "
                     f"bytes in {s.get('requests')} requests, daemons' peak RSS {m['daemons_peak_rss_kib']} KiB")
    lines.append(f"checks:   {sum(res['checks'].values())} of {len(res['checks'])} passed")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lamina", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--size", type=parse_size, default=20 * GiB)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    lamina = os.path.abspath(a.lamina)
    work = os.path.abspath(a.work)
    t_start = time.monotonic()
    res = {"schema": "lamina-big-image/1", "date": now_iso(), "size": a.size, "chunk_size": CHUNK}
    p = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    res["lamina_commit"] = p.stdout.strip() or None
    d = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no", "--",
                        "crates", "Cargo.toml", "Cargo.lock"], capture_output=True, text=True)
    res["lamina_tree_dirty"] = bool(d.stdout.strip())
    res["machine"] = machine_info(lamina, packages=("erofs-utils", "docker-registry", "openssl"))
    res["sha256_ceiling_mb_s"] = hash_ceiling()
    res["disk_free"] = {"start": df_avail(work)}
    disk = DiskWatch(work)
    reg_dir = os.path.join(work, "registry")
    registry_started = False
    try:
        # 1. generate
        src = os.path.join(work, "src")
        log(f"generating the image: {a.size} bytes of file data in {src}")
        gen = generate(src, a.size)
        res["generate"] = {"wall_s": gen["wall_s"], "tar_bytes": gen["tar_bytes"],
                           "mb_s": round(gen["tar_bytes"] / gen["wall_s"] / 1e6, 1),
                           "layer_digest": gen["layer_digest"], "manifest_digest": gen["manifest_digest"],
                           "media_type": MT_TAR}
        res["files"] = {n: {k: d[k] for k in ("size", "mode", "mtime", "sha256", "large")}
                        | ({"tar_header": d["tar_header"],
                            "check_regions": [list(r) for r in d["regions"]]} if d["large"] else {})
                        for n, d in gen["files"].items()}
        large = {n: d["size"] for n, d in gen["files"].items() if d["large"]}
        res["largest_file_bytes"] = max(large.values())
        res["files_over_4gib"] = sum(s > 4 * GiB for s in large.values())
        check(all(s % CHUNK and s % 4096 for s in large.values()), "sizes_not_chunk_multiples", str(large))
        if a.size >= 10 * GiB:
            check(res["files_over_4gib"] >= 1, "file_over_4gib", f"no file over 4 GiB: {large}")
        res["disk_free"]["after_generate"] = df_avail(work)

        # 2. registry
        port = run(["bash", REGISTRY_SH, "start", reg_dir]).stdout.strip()
        registry_started = True
        image = f"docker://127.0.0.1:{port}/big:1"
        log(f"registry on 127.0.0.1:{port}")

        # 3. convert
        conv_tmp = os.path.join(work, "convert-tmp")
        os.makedirs(conv_tmp)
        log(f"lamina convert --chunk-size 16M oci:{src}:big {image}")
        drop_caches()
        dt, stdout, tv, _ = time_v([lamina, "convert", "--json", "--chunk-size", "16M", "--work-dir", conv_tmp,
                                    f"oci:{src}:big", image])
        report = json.loads(stdout)
        left = sum(len(fs) for _, _, fs in os.walk(conv_tmp))
        res["disk_free"]["after_convert"] = df_avail(work)
        insp = json.loads(run([lamina, "inspect", "--json", image]).stdout)
        blobs = insp.get("blobs") or []
        check(blobs, "inspect_blobs", f"no blobs in lamina inspect: {insp}")
        largest = max(b["compressed_bytes"] for b in blobs)
        res["convert"] = {"wall_s": round(dt, 3), **tv, "mb_s": round(gen["tar_bytes"] / dt / 1e6, 1),
                          "report": report, "inspect": insp, "blobs": blobs,
                          "largest_blob_bytes": largest,
                          "largest_blob_cache_bytes": max(b["cache_bytes"] for b in blobs),
                          "work_dir_files_left": left}
        log(f"converted in {dt:.1f} s, peak RSS {tv['peak_rss_kib']} KiB; data blobs (compressed, cache, chunks): "
            + ", ".join(f"({b['compressed_bytes']}, {b['cache_bytes']}, {b['chunks']})" for b in blobs))
        check(sum(b["chunks"] for b in blobs) >= sum(-(-s // CHUNK) for s in large.values()), "chunk_count",
              f"fewer chunks than the large files need: {blobs}")
        check(all(b["chunks"] <= 1024 for b in blobs), "chunks_per_blob", f"a blob has over 1,024 chunks: {blobs}")
        if a.size >= 5 * GiB:
            check(largest > 4 * GiB, "blob_over_4gib", f"no data blob over 4 GiB: {blobs}")
        else:
            log(f"--size below 5 GiB: no blob over 4 GiB expected (largest {largest})")
        res["registry_bytes"] = sum(os.lstat(os.path.join(r, f)).st_size
                                    for r, _, fs in os.walk(os.path.join(reg_dir, "data")) for f in fs)
        shutil.rmtree(src)
        shutil.rmtree(conv_tmp)
        res["disk_free"]["after_source_removed"] = df_avail(work)
        log(f"source layout removed ({df_avail(work) / GiB:.1f} GiB free; registry holds "
            f"{res['registry_bytes']} bytes)")

        # 4. the mounts
        res["modes"] = {}
        for mode in ("kernel", "fuse"):
            check_mode(lamina, work, image, gen, mode, res)
    except Failure as e:
        log(f"FAILED: {e}")
        log(f"checks so far: {json.dumps(CHECKS)}")
        return 1
    finally:
        if registry_started:
            subprocess.run(["bash", REGISTRY_SH, "stop", reg_dir], capture_output=True)

    res["checks"] = dict(CHECKS)
    res["ok"] = all(CHECKS.values())
    res["total_s"] = round(time.monotonic() - t_start, 1)
    disk.stop.set()
    res["disk_free"]["least_during_run"] = disk.least
    res["machine"]["loadavg_at_end"] = open("/proc/loadavg").read().split()[:3]
    if not res["ok"]:
        log("FAILED: a check is false (not reached)")
        return 1
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1, sort_keys=False)
        f.write("\n")
    os.rename(tmp, a.out)
    print(summary_table(res))
    log(f"all {len(CHECKS)} checks passed; results in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
