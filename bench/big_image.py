"""A 20 GiB image end to end (issue 10: "A 20 GB image (files > 4 GiB,
blobs > 4 GiB, offsets beyond 32 bits everywhere) converts, mounts lazily,
and reads correctly; overlay on top works"), in one run:

1. An OCI image layout (WORK/src, tag big) with one uncompressed tar layer
   (application/vnd.oci.image.layer.v1.tar, so the source blob is bigger
   than 4 GiB), streamed to disk: four large files of distinct pseudo-random
   data (AES-128-CTR keystreams from `openssl enc`, one key per file)
   totalling `size` bytes, one over 8 GiB at the default size (a GNU
   base-256 size field), none a multiple of 4 KiB (so none of the 16 MiB
   chunk size), plus a few small files and a symlink. Each file's sha256 and
   the tar's are computed while streaming; the bytes of a few check regions
   per file are kept (a few MB), and checked against the keystream
   regenerated at their offset (the CTR counter block set to offset / 16).
2. A registry (tests/tools/registry.sh) with its storage in WORK.
3. `lamina convert --json --chunk-size 16M oci:SRC:big docker://.../big:1`
   under /usr/bin/time -v (wall time, CPU, peak RSS); `lamina inspect
   --json` for the data blobs (1,024 chunks at most per blob: a blob of up
   to 16 GiB, so cache and compressed offsets past 2^32); one blob must be
   over 4 GiB when `size` is at least 5 GiB. The source layout is deleted.
4. For --mode kernel, then fuse: a lazy mount (--prefetch none, own cache
   dir, after drop_caches), checked through (bench/big_image_mounts.py):
   pread checks past 4 GiB, every file read whole against its sha256,
   `lamina status`, the daemons' peak RSS, fsck.erofs, an overlay on top (a
   write, a read, no copy-up); the mode's cache dir is then deleted.

Every mismatch fails the run (exit status 1, the check named) and no results
file is written. Needs about 3.2 x `size` bytes free where the work dir
lives (the source tar, convert's staged blobs and the registry's copy exist
at once), checked before anything is written.

Options (--set): size (BYTES, or N with K/M/G/T[iB], e.g. 20GiB; at least
64 MiB; default 20 GiB, --quick 1 GiB: a trial whose blobs stay under
4 GiB). The chunk size is 16 MiB. Moved from scripts/big_image.sh; its
tables go to docs/big-image.md, between its big-image-tables markers (no
plot). Each step's raw figures are one entry of the results file's `runs`,
and every check's outcome is one more; the summary is derived from them.
"""

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time

from . import big_image_tables
from .big_image_mounts import BUF, CHECKS, GiB, KiB, MiB, Failure, check, check_mode, df_avail
from .harness import workdir
from .harness.core import ROOT, log, run
from .harness.measure import MachineWatch, cleanup, drop_caches, machine_info, time_v_usage
from .harness.registry import Registry

sys.path.insert(0, str(ROOT / "tests" / "fixtures"))  # the scale fixture's tar and OCI layout writers
from mkimage import MT_TAR, T0  # noqa: E402
from mkscale import Layout, TarStream, prng  # noqa: E402

CHUNK = 16 * MiB
F_SETPIPE_SZ = 1031
# What the benchmark makes in its work dir (all removed at the end, even when a check fails).
MADE = ("src", "convert-tmp", "registry") + tuple(f"{x}-{m}" for x in ("mnt", "cache", "ovl")
                                                    for m in ("kernel", "fuse"))


def parse_size(s):
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", str(s), re.I)
    if not m:
        raise SystemExit(f"bench big_image: bad size {s!r} (BYTES, or N with K/M/G/T, e.g. 20GiB)")
    return int(m.group(1)) << (10 * " KMGT".index((m.group(2) or " ").upper()))


def settings(quick, given):
    """The image size in bytes: --set size=..., else 1 GiB with --quick, else 20 GiB."""
    unknown = set(given) - {"size"}
    if unknown:
        raise SystemExit(f"bench big_image: no option {', '.join(sorted(unknown))} (the one option is size)")
    size = parse_size(given.get("size", "1GiB" if quick else "20GiB"))
    if size < 64 * MiB:
        raise SystemExit(f"bench big_image: size {size} is too small (at least 64 MiB)")
    return size


class DiskWatch:
    """The least free space seen under `path`, sampled every second in a thread."""

    def __init__(self, path):
        self.path = path
        self.least = df_avail(path)
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.loop, daemon=True)
        self.t.start()

    def loop(self):
        while not self.stop.wait(1.0):
            self.least = min(self.least, df_avail(self.path))


def hash_ceiling():
    """This machine's sha256 speed on memory (MB/s): the ceiling of the read figures."""
    data = os.urandom(64 * MiB)
    h = hashlib.sha256()
    t0 = time.monotonic()
    for _ in range(8):
        h.update(data)
    return round(8 * len(data) / (time.monotonic() - t0) / 1e6, 1)


# ---------------------------------------------------------------------------
# 1. the image


def plan_files(total):
    """The large files: (name, size, mode, mtime), tar order; sizes sum to `total`.

    15/45/30/10 % of it (rounded down to MiB, plus an odd remainder): for
    20 GiB, 3 GiB+4097, 9 GiB+12345 (past 8 GiB: a GNU base-256 size in
    its header), 6 GiB+1 and 2 GiB-16443."""
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


def keystream(key, offset):
    """openssl writing the AES-128-CTR keystream of `key` from the counter
    block of `offset` (offset // 16) on its stdout."""
    with open("/dev/zero", "rb") as zero:
        return subprocess.Popen(["openssl", "enc", "-aes-128-ctr", "-nosalt", "-K", key, "-iv", "%032x" % (offset // 16)],
                                stdin=zero, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def read_into(p, mv, done_before, name):
    """Fills `mv` from openssl's stdout."""
    got = 0
    while got < len(mv):
        k = p.stdout.readinto(mv[got:])
        if not k:
            raise Failure(f"openssl stopped after {done_before + got} bytes of {name}: "
                          f"{p.stderr.read().decode(errors='replace')}")
        got += k


def stop(p):
    p.stdout.close()
    p.kill()
    p.wait()
    p.stderr.close()


def keystream_at(key, offset, length):
    """`length` bytes of the file with key `key` at `offset`, regenerated by openssl."""
    skip = offset % 16
    p = keystream(key, offset)
    try:
        data = bytearray(skip + length)
        read_into(p, memoryview(data), 0, f"the keystream at {offset}")
    finally:
        stop(p)
    return bytes(data[skip:])


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


# (name, bytes, mode) of the small files before the large ones
SMALL_FILES = [
    ("data/README", b"large files live here\n", 0o644),
    ("data/neighbour.txt", b"the big files' neighbour\n", 0o600),
    ("data/empty", b"", 0o644),
    ("data/small-5000.bin", prng(b"small", 5000), 0o644),        # packed (<= 16 KiB)
    ("data/medium-40000.bin", prng(b"medium", 40000), 0o644),    # a chunk of its own
    ("etc/hostname", b"big-image\n", 0o644),
]
LAST_FILE = ("data/zz-after.txt", b"after the large files: packed at the end of the last blob\n", 0o644)


def stream_large(tar, name, size, mode, mtime, regions):
    """Writes one large file's entry; returns its sha256, the bytes of
    `regions` and its header's format ("ustar" or "gnu")."""
    fmt = tar.entry(name, size=size, mode=mode, mtime=mtime)
    h = hashlib.sha256()
    captured = {r: bytearray() for r in regions}
    mv = memoryview(bytearray(BUF))
    pos = 0
    t0 = time.monotonic()
    next_log = GiB
    p = keystream(key_of(name), 0)
    try:
        try:
            fcntl.fcntl(p.stdout.fileno(), F_SETPIPE_SZ, MiB)
        except OSError:
            pass
        while pos < size:
            piece = mv[:min(BUF, size - pos)]
            read_into(p, piece, pos, name)
            h.update(piece)
            for (off, n), out in captured.items():
                lo, hi = max(off, pos), min(off + n, pos + len(piece))
                if lo < hi:
                    out += piece[lo - pos:hi - pos]
            tar.data(piece)
            pos += len(piece)
            if pos >= next_log:
                dt = time.monotonic() - t0
                log(f"  {name}: {pos / GiB:.1f} of {size / GiB:.1f} GiB, {pos / dt / 1e6:.0f} MB/s")
                next_log += 2 * GiB
    finally:
        stop(p)
    tar.pad(size)
    for (off, n), out in captured.items():
        assert len(out) == n, (name, off, n, len(out))
    return h.hexdigest(), {r: bytes(b) for r, b in captured.items()}, "gnu" if fmt == tarfile.GNU_FORMAT else "ustar"


def small_file(data, mode):
    return {"size": len(data), "mode": mode, "mtime": T0, "sha256": hashlib.sha256(data).hexdigest(),
            "large": False, "content": data}


def write_layer(path, total):
    """The tar layer at `path`; (its files' descriptions, the TarStream)."""
    files = {}
    with open(path, "wb") as f:
        tar = TarStream(f)
        tar.dir("data", mtime=T0 + 5)
        tar.dir("etc")
        for name, data, mode in SMALL_FILES:
            tar.file(name, data, mode)
            files[name] = small_file(data, mode)
        tar.symlink("data/big.link", "file-1.bin")
        for name, size, mode, mtime in plan_files(total):
            log(f"writing {name}: {size} bytes")
            sha, captured, fmt = stream_large(tar, name, size, mode, mtime, check_regions(size))
            files[name] = {"size": size, "mode": mode, "mtime": mtime, "sha256": sha, "large": True,
                           "tar_header": fmt, "key": key_of(name), "regions": captured}
        name, data, mode = LAST_FILE
        tar.file(name, data, mode)
        files[name] = small_file(data, mode)
        tar.finish()
        f.flush()
        os.fsync(f.fileno())
    return files, tar


def generate(src, total):
    """The OCI layout at `src`; its description (files, expected regions) and figures."""
    layout = Layout(src)
    tmp = os.path.join(layout.blobs, "layer.tmp")
    t0 = time.monotonic()
    files, tar = write_layer(tmp, total)
    gen_s = time.monotonic() - t0
    layer_digest = "sha256:" + tar.h.hexdigest()
    layout.adopt(tmp, tar.h.hexdigest())
    manifest_digest = layout.add_image("big", [(MT_TAR, layer_digest, tar.n, layer_digest)],
                                       created_by="bench/big_image.py")
    layout.finish()
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
    return {"layer_digest": layer_digest, "tar_bytes": tar.n, "manifest_digest": manifest_digest,
            "wall_s": round(gen_s, 3), "files": files}


def generate_step(work, size, disk_free):
    """Step 1 and its checks: (the generator's description, its figures)."""
    src = os.path.join(work, "src")
    log(f"generating the image: {size} bytes of file data in {src}")
    gen = generate(src, size)
    large = {n: d["size"] for n, d in gen["files"].items() if d["large"]}
    figures = {"wall_s": gen["wall_s"], "tar_bytes": gen["tar_bytes"],
               "mb_s": round(gen["tar_bytes"] / gen["wall_s"] / 1e6, 1),
               "layer_digest": gen["layer_digest"], "manifest_digest": gen["manifest_digest"], "media_type": MT_TAR,
               "files": {n: {k: d[k] for k in ("size", "mode", "mtime", "sha256", "large")}
                         | ({"tar_header": d["tar_header"],
                             "check_regions": [list(r) for r in d["regions"]]} if d["large"] else {})
                         for n, d in gen["files"].items()},
               "largest_file_bytes": max(large.values()),
               "files_over_4gib": sum(s > 4 * GiB for s in large.values())}
    check(all(s % CHUNK and s % 4096 for s in large.values()), "sizes_not_chunk_multiples", str(large))
    if size >= 10 * GiB:
        check(figures["files_over_4gib"] >= 1, "file_over_4gib", f"no file over 4 GiB: {large}")
    disk_free["after_generate"] = df_avail(work)
    return gen, figures


# ---------------------------------------------------------------------------
# 3. convert


def convert_step(lamina, work, image, gen, size, registry, disk_free):
    """Step 3 and its checks: the figures of `lamina convert` into `image`."""
    src = os.path.join(work, "src")
    conv_tmp = os.path.join(work, "convert-tmp")
    os.makedirs(conv_tmp)
    log(f"lamina convert --chunk-size 16M oci:{src}:big {image}")
    drop_caches()
    dt, stdout, usage = time_v_usage([lamina, "convert", "--json", "--chunk-size", "16M", "--work-dir", conv_tmp,
                                      f"oci:{src}:big", image])
    report = json.loads(stdout)
    left = sum(len(fs) for _, _, fs in os.walk(conv_tmp))
    disk_free["after_convert"] = df_avail(work)
    insp = json.loads(run([lamina, "inspect", "--json", image], timeout=None).stdout)
    blobs = insp.get("blobs") or []
    check(blobs, "inspect_blobs", f"no blobs in lamina inspect: {insp}")
    largest = max(b["compressed_bytes"] for b in blobs)
    figures = {"wall_s": round(dt, 3), **usage, "mb_s": round(gen["tar_bytes"] / dt / 1e6, 1),
               "report": report, "inspect": insp, "blobs": blobs, "largest_blob_bytes": largest,
               "largest_blob_cache_bytes": max(b["cache_bytes"] for b in blobs), "work_dir_files_left": left}
    log(f"converted in {dt:.1f} s, peak RSS {usage['peak_rss_kib']} KiB; data blobs (compressed, cache, chunks): "
        + ", ".join(f"({b['compressed_bytes']}, {b['cache_bytes']}, {b['chunks']})" for b in blobs))
    large = [d["size"] for d in gen["files"].values() if d["large"]]
    check(sum(b["chunks"] for b in blobs) >= sum(-(-s // CHUNK) for s in large), "chunk_count",
          f"fewer chunks than the large files need: {blobs}")
    check(all(b["chunks"] <= 1024 for b in blobs), "chunks_per_blob", f"a blob has over 1,024 chunks: {blobs}")
    if size >= 5 * GiB:
        check(largest > 4 * GiB, "blob_over_4gib", f"no data blob over 4 GiB: {blobs}")
    else:
        log(f"size below 5 GiB: no blob over 4 GiB expected (largest {largest})")
    figures["registry_bytes"] = sum(os.lstat(os.path.join(r, f)).st_size
                                    for r, _, fs in os.walk(registry.data) for f in fs)
    shutil.rmtree(src)
    shutil.rmtree(conv_tmp)
    disk_free["after_source_removed"] = df_avail(work)
    log(f"source layout removed ({df_avail(work) / GiB:.1f} GiB free; registry holds "
        f"{figures['registry_bytes']} bytes)")
    return figures


# ---------------------------------------------------------------------------


def check_disk(work, size):
    """Refuses to start when the work dir's filesystem cannot hold the run."""
    need, avail = size * 32 // 10, df_avail(work)
    if avail < need:
        raise SystemExit(f"bench big_image: {work} has {avail} bytes free; size {size} needs about {need} "
                         "(3.2 x: the source tar, convert's staged blobs and the registry's copy exist at once)")
    log(f"work dir {work} ({avail} bytes free, {need} needed)")


def remove_made(work):
    """Removes what the run made in `work` (tens of GB: even a --work dir
    keeps none of it), unless something is still mounted there."""
    if workdir.mounts_under(work):
        log(f"warning: something is still mounted under {work}; left in place")
        return
    for name in MADE:
        shutil.rmtree(os.path.join(work, name), ignore_errors=True)


def measure(results, lamina, work, quick, options):
    size = settings(quick, options)
    lamina, work = str(lamina.path), str(work)
    check_disk(work, size)
    CHECKS.clear()
    doc = results.doc
    doc["config"].update(size=size, chunk_size=CHUNK)
    doc["machine"] = machine_info(lamina, packages=("erofs-utils", "docker-registry", "openssl"))
    watch = MachineWatch()
    host = {"sha256_ceiling_mb_s": hash_ceiling(), "disk_free": {"start": df_avail(work)}}
    disk = DiskWatch(work)
    registry = None
    try:
        gen, figures = generate_step(work, size, host["disk_free"])
        results.add_run(part="generate", figures=figures)
        registry = Registry(os.path.join(work, "registry"))
        image = registry.ref("big:1")
        log(f"registry on 127.0.0.1:{registry.port}")
        results.add_run(part="convert", figures=convert_step(lamina, work, image, gen, size, registry,
                                                             host["disk_free"]))
        for mode in ("kernel", "fuse"):
            results.add_run(part="mount", mode=mode, figures=check_mode(lamina, work, image, gen["files"], mode))
    except (Failure, RuntimeError) as e:
        log(f"FAILED: {e}")
        log(f"checks so far: {json.dumps(CHECKS)}")
        raise SystemExit(1)
    finally:
        disk.stop.set()
        cleanup()
        if registry:
            registry.stop()
        remove_made(work)
    host["disk_free"]["least_during_run"] = disk.least
    results.add_run(part="host", figures=host)
    results.add_run(part="checks", figures=dict(CHECKS))
    watch.note_end(doc["machine"])
    derive(doc)
    if not doc["summary"]["ok"]:
        raise SystemExit("bench big_image: FAILED: a check is false (not reached)")
    log(f"all {len(CHECKS)} checks passed")


def derive(doc):
    """The summary (every check passed, the headline figures) from the raw
    runs; a scripts/big_image.sh results file is lifted into this shape first."""
    lifted = big_image_tables.current(doc)
    if lifted is not doc:
        doc.clear()
        doc.update(lifted)
    doc["summary"] = big_image_tables.summary(big_image_tables.view(doc))
    doc["targets"] = []


def render(doc, plot_path):
    """The tables (this benchmark has no plot: `plot_path` is not written)."""
    return big_image_tables.tables(big_image_tables.view(big_image_tables.current(doc)))


BENCHMARK = {
    "out": ROOT / "docs" / "big-image-results.json",
    "plot": None,
    "tables_in": "docs/big-image.md",
    "markers": (big_image_tables.BEGIN, big_image_tables.END),
    "needs": ["openssl", "fsck.erofs", "docker-registry", "findmnt", "mount", "umount", "curl", "/usr/bin/time"],
    "measure": measure,
    "derive": derive,
    "render": render,
}

