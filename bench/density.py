"""Memory density (issue 43): how much page cache images on one base cost,
side by side with overlayfs over the layers unpacked once (containerd's
layer sharing), in one run.

Images: A = the Debian test image (`/var/cache/lamina-test/debian-oci`,
tag bookworm), B = A plus one layer of one 300 KB file (two tenants' images
on one base), R = A rebuilt (one regular file in 50 changed, every layer
written again: new digests, mostly the same files;
`bench/harness/rebuild.py`), all converted by `lamina convert` into one
OCI layout. Scenario `shared_base` mounts A and B, `rebuild` A and R; the
disk figures are the bytes on disk of the cache's blobs (with the chunk
locator and the ranges lists), the images' metadata and indexes, FUSE
passthrough objects, shards and metadata views (lamina) or of the
unpacked trees (overlayfs): the union of their extents (FIEMAP), so a
block two files share (a hard link, a reflink) counts once. The work dir's
filesystem is recorded (`machine.work_fs`); `--work` on an XFS mount
measures a node whose filesystem has reflinks.

Systems, each on a fresh cache after `drop_caches`, A and B mounted:
- `overlayfs`: A's rootfs unpacked by `umoci unpack` as one lower dir
  (layers unpacked once and shared, as containerd's snapshots are); B is an
  overlay of B's top layer over the same dir.
- `lamina-eager`: `lamina mount` of both (kernel path, complete cache
  files, `directio`).
- `lamina-lazy`: `lamina mount --lazy --prefetch none` of both (kernel
  path; the worker fills the cache files from the layout's blobs).
- `lamina-fuse`: the same through FUSE.
- `lamina-fuse-eager`: `lamina mount --mode fuse` of both, each file read
  once through each mount before the measurement (the first open of a
  file is served by the daemon while its passthrough object is made; the
  measured opens are passed through to the objects, kept by content), and
  the objects waited for.
- `lamina-shared`: `lamina mount --eager --mode kernel --share-files` of
  both: each an overlayfs of the image's metadata view over the cache's
  shards of objects named by content, so a file with the same bytes in
  both is read through one shard inode (`docs/density.md`).
- `lamina-shared-lazy`: the same with `--lazy --prefetch none`: each
  image's own shard is mounted by its lazy mount's holder and filled on
  demand.

Every regular file of A is read (`find -type f -exec cat`) by a process in
a memory cgroup of its own, then every file of the second image. Page cache is the rise of
the node's `Cached` (/proc/meminfo) since the mounts were made, less what
`cachestat` finds resident of the layouts' blobs (a lazy mount reads the
converted image's blobs, as it would a registry's answers): what the node
holds for the images. Beside it: what the reader's cgroup was charged (`cache` in its
memory.stat), and what `cachestat` finds of the lamina cache files (the
cache file's own copy of each page).

Options (--set): runs (default 1; each run measures every system in a
rotating order); systems and scenarios (comma-separated subsets of
`SYSTEMS` and `SCENARIOS`; all by default).
"""

import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import struct
import tarfile
import time
from pathlib import Path

from .harness import report
from .harness.core import ROOT, log, run
from .harness.rebuild import rebuild
from .harness.measure import ANOMALIES, drop_caches, resident_bytes, is_mountpoint, machine_info, procs_of, sys_umount, wait_gone

SOURCE = Path("/var/cache/lamina-test/debian-oci")
SYSTEMS = ("overlayfs", "lamina-eager", "lamina-lazy", "lamina-fuse", "lamina-fuse-eager", "lamina-shared",
           "lamina-shared-lazy")
# The second image of each scenario: B (A plus a layer) or R (A rebuilt).
SCENARIOS = {"shared_base": "b", "rebuild": "r"}
REBUILD_EVERY = 50  # one regular file in 50 changed (bench/harness/rebuild.py)
CGROUP = Path("/sys/fs/cgroup/memory")
TOP_FILE_BYTES = 300 * 1000
MiB = 1 << 20


def meminfo(field):
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/meminfo")


def meminfo_cached():
    return meminfo("Cached")


def resident(paths):
    """Bytes of the regular files `paths` in the page cache (`cachestat`)."""
    return resident_bytes([p for p in paths if Path(p).is_file()])


def files_under(d):
    """The files below `d`, not below a mount on it (a shard's or metadata
    view's mount in a lamina cache reads files counted elsewhere)."""
    out = []
    for root, dirs, fs in os.walk(d):
        dirs[:] = [x for x in dirs if not os.path.ismount(os.path.join(root, x))]
        out += [Path(root) / f for f in fs]
    return out


def add_top_layer(layout, tag, new_tag, path="opt/tenant-b/data.bin", body=None, mode=0o644):
    """`new_tag` in `layout`: `tag`'s image plus one gzip layer holding one
    file at `path` of `mode`: `body`, else TOP_FILE_BYTES pseudo-random
    bytes. Returns the layer's tar."""
    blobs = layout / "blobs" / "sha256"

    def put(data):
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return f"sha256:{digest}", len(data)

    if body is None:
        body = b"".join(hashlib.sha256(b"tenant-b %d" % i).digest() for i in range(TOP_FILE_BYTES // 32 + 1))
        body = body[:TOP_FILE_BYTES]
    tar = io.BytesIO()
    parts = path.split("/")[:-1]
    with tarfile.open(fileobj=tar, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name in ("/".join(parts[:i + 1]) for i in range(len(parts))):
            d = tarfile.TarInfo(name)
            d.type, d.mode, d.mtime = tarfile.DIRTYPE, 0o755, 1
            t.addfile(d)
        f = tarfile.TarInfo(path)
        f.size, f.mode, f.mtime = len(body), mode, 1
        t.addfile(f, io.BytesIO(body))
    tar = tar.getvalue()
    layer_digest, layer_size = put(gzip.compress(tar, mtime=1))
    index = json.loads((layout / "index.json").read_text())
    entry = next(m for m in index["manifests"]
                 if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag)
    manifest = json.loads((blobs / entry["digest"].split(":")[1]).read_text())
    config = json.loads((blobs / manifest["config"]["digest"].split(":")[1]).read_text())
    config["rootfs"]["diff_ids"].append(f"sha256:{hashlib.sha256(tar).hexdigest()}")
    config.setdefault("history", []).append({"created_by": f"density bench: {new_tag}'s layer"})
    cdigest, csize = put(json.dumps(config).encode())
    manifest["config"] = dict(manifest["config"], digest=cdigest, size=csize)
    manifest["layers"].append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                               "digest": layer_digest, "size": layer_size})
    mdigest, msize = put(json.dumps(manifest).encode())
    index["manifests"].append({"mediaType": entry["mediaType"], "digest": mdigest, "size": msize,
                               "annotations": {"org.opencontainers.image.ref.name": new_tag}})
    (layout / "index.json").write_text(json.dumps(index))
    return tar


def prepare(work, lamina):
    """The source layout (A, B), both converted, A unpacked for overlayfs
    and B's top layer extracted beside it."""
    src = work / "src"
    shutil.copytree(SOURCE, src)
    top_tar = add_top_layer(src, "bookworm", "b")
    rebuild(src, "bookworm", "rebuilt", every=REBUILD_EVERY)
    conv = work / "converted"
    for src_tag, tag in (("bookworm", "a"), ("b", "b"), ("rebuilt", "r")):
        lamina("convert", f"oci:{src}:{src_tag}", f"oci:{conv}:{tag}", timeout=1800)
    run(["umoci", "unpack", "--image", f"{src}:bookworm", work / "ovl-a"], timeout=1800)
    run(["umoci", "unpack", "--image", f"{src}:rebuilt", work / "ovl-r"], timeout=1800)
    top = work / "ovl-b-top"
    top.mkdir()
    with tarfile.open(fileobj=io.BytesIO(top_tar)) as t:
        t.extractall(top, filter="tar")
    return src, conv


def mount_system(system, lamina, work, conv, second):
    """Mounts A and the `second` image (b or r) for `system`; (mountpoints,
    cache dir or None)."""
    mnts = [work / f"mnt-{system}-a", work / f"mnt-{system}-{second}"]
    for m in mnts:
        m.mkdir(parents=True, exist_ok=True)
    if system == "overlayfs":
        empty = work / "ovl-empty"  # without an upper dir overlayfs wants two lowers
        empty.mkdir(exist_ok=True)
        lower_a = work / "ovl-a" / "rootfs"
        lowers = {"b": f"{work / 'ovl-b-top'}:{lower_a}", "r": f"{empty}:{work / 'ovl-r' / 'rootfs'}"}
        run(["mount", "-t", "overlay", "overlay", "-o", f"ro,lowerdir={empty}:{lower_a}", mnts[0]])
        run(["mount", "-t", "overlay", "overlay", "-o", f"ro,lowerdir={lowers[second]}", mnts[1]])
        return mnts, None
    cache = work / f"cache-{system}"
    how = {"lamina-eager": ["--mode", "kernel"],
           "lamina-lazy": ["--lazy", "--prefetch", "none", "--mode", "kernel"],
           "lamina-fuse": ["--lazy", "--prefetch", "none", "--mode", "fuse"],
           "lamina-fuse-eager": ["--mode", "fuse"],
           "lamina-shared": ["--eager", "--mode", "kernel", "--share-files"],
           "lamina-shared-lazy": ["--lazy", "--prefetch", "none", "--mode", "kernel", "--share-files"]}[system]
    for tag, m in zip("a" + second, mnts):
        lamina("mount", *how, f"oci:{conv}:{tag}", m, "--cache-dir", cache, timeout=600)
    if system == "lamina-fuse-eager":
        make_objects(mnts, cache)
    return mnts, cache


def overlay_trees(work, second, image):
    """The unpacked trees overlayfs serves once `image` (A, or B for the
    second image) is read: A's, then the second image's own."""
    own = {"b": work / "ovl-b-top", "r": work / "ovl-r"}[second]
    return [work / "ovl-a"] + ([own] if image == "B" else [])


def make_objects(mnts, cache):
    """Reads every file of each mount once, then waits (at most 10 min)
    until the passthrough objects stop growing in number for 3 s."""
    for m in mnts:
        run(["sh", "-c", f"find {m} -xdev -type f -exec cat {{}} + > /dev/null"], timeout=1800)
    content, last, still = cache / "objects" / "content", -1, 0
    deadline = time.monotonic() + 600
    while still < 3 and time.monotonic() < deadline:
        time.sleep(1)
        n = len(files_under(content))
        still, last = (still + 1, n) if n == last else (0, n)
    log(f"passthrough objects: {last} files in {content}")


FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 0x1
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_DELALLOC = 0x4
FIEMAP_HEADER = struct.Struct("=QQIIII")  # struct fiemap, without its extents
FIEMAP_EXTENT = struct.Struct("=QQQQQIIII")  # struct fiemap_extent, 56 bytes


def physical_extents(path):
    """`path`'s extents on its device as (start, end) byte ranges, by
    FIEMAP (synced first); None where the filesystem has no FIEMAP."""
    out, start = [], 0
    with open(path, "rb") as f:
        while True:
            count = 256
            buf = bytearray(FIEMAP_HEADER.pack(start, (1 << 64) - 1 - start, FIEMAP_FLAG_SYNC, 0, count, 0))
            buf += bytes(FIEMAP_EXTENT.size * count)
            try:
                fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, buf)
            except OSError:
                return None
            mapped = FIEMAP_HEADER.unpack_from(buf)[3]
            last = None
            for i in range(mapped):
                logical, physical, length, _, _, flags, *_ = FIEMAP_EXTENT.unpack_from(
                    buf, FIEMAP_HEADER.size + i * FIEMAP_EXTENT.size)
                if not flags & FIEMAP_EXTENT_DELALLOC:
                    out.append((physical, physical + length))
                last = (logical + length, flags)
            if last is None or last[1] & FIEMAP_EXTENT_LAST:
                return out
            start = last[0]


def disk_bytes(paths):
    """Bytes the files under `paths` take on disk, each block once: the
    union of their extents (FIEMAP), so that blocks two files share (a
    passthrough object linked from each image, a reflinked chunk) count
    once; a file without FIEMAP counts its allocated blocks."""
    seen, total, ranges = set(), 0, {}
    for f in (f for p in paths for f in files_under(p)):
        try:
            st = os.lstat(f)
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            extents = physical_extents(f) if stat.S_ISREG(st.st_mode) else None
        except FileNotFoundError:  # a temp file of an object being made
            continue
        if extents is None:
            total += st.st_blocks * 512
        else:
            ranges.setdefault(st.st_dev, []).extend(extents)
    for extents in ranges.values():
        end = 0
        for a, b in sorted(extents):
            a = max(a, end)
            if b > a:
                total += b - a
                end = b
    return total


def unmount_system(system, lamina, mnts, cache):
    """Unmounts both images, then (lamina) waits for every daemon of the
    cache to exit: one image's daemons outlive the other's unmount."""
    pids = list(procs_of(str(cache))) if cache else []
    for m in mnts:
        if not is_mountpoint(m):
            continue
        if system == "overlayfs":
            sys_umount(str(m))
        else:
            run([lamina.path, "umount", m, "--cache-dir", cache], check=False)
    wait_gone(pids)


def read_all_in(cgroup, mnt):
    """Reads every regular file under `mnt` from a process in `cgroup`;
    (seconds, read errors)."""
    script = f'echo $$ > {cgroup}/cgroup.procs && exec find {mnt} -xdev -type f -exec cat {{}} + > /dev/null'
    t = time.perf_counter()
    r = run(["sh", "-c", script], timeout=1800, check=False)
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    return time.perf_counter() - t, errors


def cgroup_cache(cgroup):
    for line in (cgroup / "memory.stat").read_text().splitlines():
        key, value = line.split()
        if key == "cache":
            return int(value)
    raise RuntimeError(f"no cache in {cgroup}/memory.stat")


def read_in_turn(cgroup, views, layouts, cached, label, extra=lambda image: {}, code=None):
    """After `drop_caches`, reads every regular file of each of `views` (A,
    then the second image) from a process in the memory cgroup `cgroup`
    (made here). Per image: the rise of `cached()` less what `cachestat` finds
    resident of the `layouts`' blobs (a lazy mount reads the converted
    image's as it would a registry's answers), the cgroup's charge, the
    read's time and errors, `extra(image)`, and how much of the rise is the
    executable `code` (a lazy mount's daemons run lamina: its pages are in
    the page cache too, once per node whatever the number of mounts)."""
    drop_caches()
    time.sleep(1)
    base, base_buffers = cached(), meminfo("Buffers")
    base_code = resident([code]) if code else 0
    cgroup.mkdir()
    figures = {}
    for image, view in zip("AB", views):
        seconds, errors = read_all_in(cgroup, view)
        time.sleep(1)
        node = cached() - base - resident([f for layout in layouts for f in files_under(layout / "blobs")])
        figures[image] = {"node_page_cache": node, "reader_cgroup": cgroup_cache(cgroup),
                          "read_s": round(seconds, 3), "read_errors": errors[:5],
                          "read_error_count": len(errors),
                          # ext4 keeps directories and inodes there: overlayfs's metadata
                          "buffers": meminfo("Buffers") - base_buffers,
                          "lamina_code": resident([code]) - base_code if code else 0, **extra(image)}
        log(f"{label}, after {image}: page cache {node / MiB:.1f} MiB (reader's cgroup "
            f"{figures[image]['reader_cgroup'] / MiB:.1f}), {len(errors)} read errors")
    return figures


def remove_cgroup(cgroup):
    if cgroup.exists():
        try:
            cgroup.rmdir()
        except OSError as e:
            log(f"cgroup {cgroup}: {e}")


def measure_system(results, scenario, system, lamina, work, src, conv, run_no):
    second = SCENARIOS[scenario]
    mnts, cache = mount_system(system, lamina, work, conv, second)
    cgroup = CGROUP / f"lamina-density-{scenario}-{system}-{run_no}"

    def lamina_figures(image):
        cache_files = files_under(cache / "blobs") if cache else []
        return {"cache_files_resident": resident(cache_files),
                "disk": disk_bytes([cache / d for d in ("blobs", "meta", "objects", "shards", "mounts")] if cache else
                                   overlay_trees(work, second, image))}

    try:
        figures = read_in_turn(cgroup, mnts, (src, conv), meminfo_cached,
                               f"{scenario}: {system} run {run_no}", lamina_figures, lamina.path)
        results.add_run(scenario=scenario, system=system, run=run_no, **figures)
    finally:
        unmount_system(system, lamina, mnts, cache)
        remove_cgroup(cgroup)
        if cache:
            shutil.rmtree(cache, ignore_errors=True)


def measure(results, lamina, work, quick, options):
    unknown = set(options) - {"runs", "systems", "scenarios"}
    if unknown:
        raise SystemExit(f"bench density: unknown option(s) {', '.join(sorted(unknown))} (runs, systems, scenarios)")
    runs = int(options.get("runs", 1))
    systems = chosen(options, "systems", SYSTEMS)
    scenarios = chosen(options, "scenarios", tuple(SCENARIOS))
    results.doc["config"].update(runs=runs, systems=list(systems), scenarios=list(scenarios),
                                 top_file_bytes=TOP_FILE_BYTES, source=str(SOURCE))
    results.doc["machine"].update(machine_info(lamina.path, packages=("umoci", "fuse3")))
    # Disk figures depend on it (reflinks: XFS, btrfs).
    results.doc["machine"]["work_fs"] = run(["findmnt", "-n", "-o", "FSTYPE", "--target", str(work)],
                                            check=False).stdout.strip()
    if not (CGROUP / "memory.stat").exists():
        raise SystemExit(f"bench density: no cgroup v1 memory controller at {CGROUP}")
    src, conv = prepare(work, lamina)
    for r in range(runs):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for scenario in scenarios:
            for system in order:
                measure_system(results, scenario, system, lamina, work, src, conv, r)
    results.doc["anomalies"] = list(ANOMALIES)
    derive(results.doc)


def chosen(options, name, known):
    """The comma-separated subset of `known` option `name` names (all by
    default), in `known`'s order."""
    wanted = options.get(name)
    if wanted is None:
        return tuple(known)
    names = [n for n in wanted.split(",") if n]
    bad = sorted(set(names) - set(known))
    if bad or not names:
        raise SystemExit(f"bench density: {name} must name some of {', '.join(known)}; not {', '.join(bad)}")
    return tuple(n for n in known if n in names)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def derive(doc):
    """Medians per scenario and system; the issue's bounds as targets."""
    per = {}
    for r in doc["runs"]:
        v = per.setdefault(r.get("scenario", "shared_base"), {}).setdefault(
            r["system"], {"A": [], "B": [], "disk_A": [], "disk_B": [], "errors": 0, "buf_A": [], "buf_B": [],
                          "code_B": []})
        v["code_B"].append(r["B"].get("lamina_code", 0))
        for img in "AB":
            v[img].append(r[img]["node_page_cache"])
            if r[img].get("buffers") is not None:
                v[f"buf_{img}"].append(r[img]["node_page_cache"] + r[img]["buffers"])
            if r[img].get("disk") is not None:
                v[f"disk_{img}"].append(r[img]["disk"])
            v["errors"] += r[img]["read_error_count"]
    summary = {}
    for scenario, systems in per.items():
        out = summary[scenario] = {}
        for sys, v in systems.items():
            out[sys] = {"after_A": median(v["A"]), "after_B": median(v["B"]), "read_errors": v["errors"],
                        "disk_A": median(v["disk_A"]) if v["disk_A"] else None,
                        "disk_B": median(v["disk_B"]) if v["disk_B"] else None,
                        "after_A_with_buffers": median(v["buf_A"]) if v["buf_A"] else None,
                        "after_B_with_buffers": median(v["buf_B"]) if v["buf_B"] else None,
                        "lamina_code_B": median(v["code_B"])}
        ref = out.get("overlayfs")
        for v in out.values():
            v["B_adds_of_A"] = (v["after_B"] - v["after_A"]) / v["after_A"] if v["after_A"] else None
            v["disk_B_vs_A"] = v["disk_B"] / v["disk_A"] if v["disk_A"] else None
            if ref:
                v["after_A_vs_overlayfs"] = v["after_A"] / ref["after_A"]
                v["after_B_vs_overlayfs"] = v["after_B"] / ref["after_B"]
                v["after_B_less_code_vs_overlayfs"] = (v["after_B"] - v["lamina_code_B"]) / ref["after_B"]
                if v["after_B_with_buffers"] and ref["after_B_with_buffers"]:
                    v["after_B_with_buffers_vs_overlayfs"] = (v["after_B_with_buffers"]
                                                              / ref["after_B_with_buffers"])
    doc["summary"] = summary
    doc["targets"] = []

    def target(name, value, bound):
        doc["targets"].append({"name": name, "value": value, "op": "<=", "bound": bound,
                               "met": value is not None and value <= bound})

    for sys, v in summary.get("shared_base", {}).items():
        if sys == "overlayfs" or "after_B_vs_overlayfs" not in v:
            continue
        target(f"shared base, {sys}: page cache after A and B / overlayfs", v["after_B_vs_overlayfs"], 1.05)
        target(f"shared base, {sys}: what B adds / A", v["B_adds_of_A"], 0.05)
        if sys in ("lamina-lazy", "lamina-fuse", "lamina-shared-lazy"):
            target(f"{sys}: lazy mount read whole (A) / overlayfs", v["after_A_vs_overlayfs"], 1.1)
    rebuilt = summary.get("rebuild", {})
    one_image = (rebuilt.get("overlayfs") or {}).get("disk_A")  # A unpacked: one image on disk
    for sys, v in rebuilt.items():
        if sys == "overlayfs" or not one_image or v["disk_B"] is None:
            continue
        # Both images are mounted before A is read: lamina's figures hold
        # both images' cache files from then on.
        target(f"rebuild, {sys}: disk with A and R / one image unpacked", v["disk_B"] / one_image, 1.1)
        if sys in ("lamina-fuse", "lamina-fuse-eager", "lamina-shared", "lamina-shared-lazy"):
            target(f"rebuild, {sys}: page cache after A and R / after A", v["after_B"] / v["after_A"], 1.1)


def render(doc, plot_path):
    out = [report.heading(doc)]
    for scenario, systems in doc["summary"].items():
        second = "B" if scenario == "shared_base" else "R"
        rows = [(sys, f"{v['after_A'] / MiB:.1f}", f"{v['after_B'] / MiB:.1f}",
                 f"{v.get('after_B_vs_overlayfs', 0):.2f}", f"{100 * v['B_adds_of_A']:.1f}%",
                 "" if v["disk_A"] is None else f"{v['disk_A'] / MiB:.1f}",
                 "" if v["disk_B"] is None else f"{v['disk_B'] / MiB:.1f}",
                 f"{v['after_B_with_buffers_vs_overlayfs']:.2f}" if v.get("after_B_with_buffers_vs_overlayfs")
                 else "", f"{v.get('lamina_code_B', 0) / MiB:.1f}",
                 f"{v['after_B_less_code_vs_overlayfs']:.2f}" if "after_B_less_code_vs_overlayfs" in v else "",
                 v["read_errors"])
                for sys, v in systems.items()]
        out += ["", f"{scenario.replace('_', ' ')} (A, then {second}):", "",
                report.table(("system", "page cache after A, MiB", f"after A and {second}, MiB",
                              f"after A and {second} / overlayfs", f"{second} adds (of A)", "disk after A, MiB",
                              f"disk after A and {second}, MiB",
                              f"with Buffers: after A and {second} / overlayfs",
                              "of which lamina's executable, MiB",
                              f"less the executable: after A and {second} / overlayfs", "read errors"), rows)]
    out += ["", report.targets(doc)]
    detail = [(r.get("scenario", "shared_base"), r["system"], r["run"], img,
               f"{r[img]['node_page_cache'] / MiB:.1f}", f"{r[img]['reader_cgroup'] / MiB:.1f}",
               f"{r[img]['cache_files_resident'] / MiB:.1f}", r[img]["read_s"])
              for r in doc["runs"] for img in "AB"]
    out += ["", report.table(("scenario", "system", "run", "after", "node page cache, MiB",
                              "reader's cgroup, MiB", "cache files resident, MiB", "read s"), detail)]
    plot(doc, plot_path)
    return "\n".join(out)


def plot(doc, path, title=""):
    """Page cache after A and after both, per system (or design) and
    scenario; `title` goes before each panel's."""
    plt = report.pyplot()
    if plt is None or not path:
        return
    scenarios = list(doc["summary"])
    fig, axes = plt.subplots(1, len(scenarios), figsize=(8 * len(scenarios), 4.5), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        s = doc["summary"][scenario]
        second = "B" if scenario == "shared_base" else "R"
        names = list(s)
        w = 0.38
        xs = range(len(names))
        b1 = ax.bar([x - w / 2 for x in xs], [s[n]["after_A"] / MiB for n in names], w, label="after A",
                    color=report.WARM)
        b2 = ax.bar([x + w / 2 for x in xs], [s[n]["after_B"] / MiB for n in names], w,
                    label=f"after A and {second}", color=report.COLD)
        report.label_bars(ax, list(b1) + list(b2), "{:.0f}")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, fontsize=9)
        ax.set_ylabel("page cache, MiB (median)")
        what = "two images on one base" if scenario == "shared_base" else "an image and its rebuild"
        ax.set_title(f"{title}{what}, every file read - {doc['date'][:10]}", fontsize=10)
        ax.legend(fontsize=8, frameon=False, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


BENCHMARK = {
    "out": ROOT / "docs" / "density-results.json",
    "plot": ROOT / "docs" / "density.png",
    "tables_in": None,
    "needs": ["umoci", "find"],
    "measure": measure,
    "derive": derive,
    "render": render,
}
