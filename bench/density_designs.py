"""Memory density, the designs (issue 43): which kernel-path structure lets
images share page cache on this kernel, and what it costs, measured side by
side in one run on prototypes: trees arranged by this benchmark, each made
into an EROFS by `lamina convert` and mounted by `lamina mount` (kernel
path), stacked with overlayfs where the design says.

Images as in `bench density`: A = the Debian test image (two layers: the
base system, then python3, nginx and redis), B = A plus one layer of one
300 KB file, R = A rebuilt (one regular file in 50 changed, every layer
digest new). Designs:

- `overlayfs`: overlayfs over the layers unpacked on ext4 (containerd's
  layer sharing); the reference.
- `merged`: one EROFS per image of its merged tree, eager (lamina today).
- `merged-overlay`: the same under a read-only overlayfs, as a container's
  root sees it today (containerd's overlayfs over the snapshotter's
  mount): the reference for what the overlayfs designs cost a container.
- `per-layer`: one EROFS per layer (each layer made an image of its own:
  A's two, B's top one, R's two; the layers hold no whiteouts), each
  mounted once and shared, stacked as the lowers of one read-only overlayfs
  per image.
- `objects`: composefs's shape. Per image a metadata-only EROFS: every
  non-empty regular file a sparse file (all-zero chunks are holes: no data)
  carrying `trusted.overlay.metacopy` and `trusted.overlay.redirect=/xx/<sha256>`;
  beside it shards of content-addressed objects (an EROFS of the files
  named by their sha256): A's shard holds A's files, B's and R's only the
  files A's does not. Each image is `overlay lowerdir=meta::shard-a::own`
  (data-only lowers). Eager mounts.
- `objects-lazy`: the same, with each shard a lazy mount (`--prefetch
  none`): the data-only lowers fill on demand. Before anything is read, a
  shell and perl are run from A's view (`chroot`): their shared libraries
  are mapped through overlayfs, so their pages fault into the shard's EROFS,
  whose reads of its cache files must raise the pre-content events that
  fill them.

For each design and scenario (A with B, A with R), after `drop_caches`, a
process in a memory cgroup of its own reads every regular file of A, then of
the second image: page cache is the rise of the node's `Cached` and
`Buffers` (ext4 keeps its metadata in `Buffers`, EROFS over a file in
`Cached`) less what `cachestat` finds resident of the layouts' blobs. Every
file's bytes read through each view are hashed and compared with the
unpacked tree. Metadata cost: `ls -lR` of A's view, cold (after
`drop_caches`) and warm, and the cold read of every file, against `merged`.

Options (--set): runs (default 1), ls_runs (default 3).
"""

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

from . import density
from .harness import report
from .harness.core import ROOT, log, run
from .harness.measure import ANOMALIES, drop_caches, machine_info, sys_mount, sys_umount, wait_gone, procs_of

DESIGNS = ("overlayfs", "merged", "merged-overlay", "per-layer", "objects", "objects-lazy")
MiB = 1 << 20
OVL_OPTS = "metacopy=on,redirect_dir=follow"


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def regular_files(root):
    """(relative path, absolute path) of every non-empty regular file."""
    for d, _, names in os.walk(root):
        for n in names:
            p = Path(d) / n
            st = os.lstat(p)
            if (st.st_mode & 0o170000) == 0o100000 and st.st_size > 0:
                yield p.relative_to(root), p


def add_objects(root, shard, known):
    """Copies each file of `root` whose content is not in `known` into
    `shard` as xx/<rest of its sha256>; returns {relative path: sha256}."""
    names = {}
    for rel, p in regular_files(root):
        digest = sha256_file(p)
        names[rel] = digest
        if digest in known:
            continue
        known.add(digest)
        dest = shard / digest[:2] / digest[2:]
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dest)
    return names


def build_meta(root, meta, names):
    """The metadata-only tree of `root` in `meta`: attributes, links and
    special files copied; each non-empty regular file a sparse file of its
    size with overlayfs's metacopy and an absolute redirect to its object."""
    run(["cp", "-a", "--attributes-only", f"{root}/.", str(meta)], timeout=600)
    done = set()
    for rel, digest in names.items():
        p = meta / rel
        st = os.lstat(p)
        if st.st_ino in done:  # a hard link's other name
            continue
        done.add(st.st_ino)
        src = os.lstat(root / rel)
        os.truncate(p, src.st_size)
        os.setxattr(p, "trusted.overlay.metacopy", b"", follow_symlinks=False)
        os.setxattr(p, "trusted.overlay.redirect", f"/{digest[:2]}/{digest[2:]}".encode(),
                    follow_symlinks=False)
        os.utime(p, ns=(src.st_atime_ns, src.st_mtime_ns), follow_symlinks=False)


def with_xattrs(info, root):
    """tarfile's filter: owner root, and the file's xattrs as PAX records."""
    info.uid = info.gid = 0
    path = root / info.name
    for name in os.listxattr(path, follow_symlinks=False):
        value = os.getxattr(path, name, follow_symlinks=False)
        info.pax_headers[f"SCHILY.xattr.{name}"] = value.decode("utf-8", "surrogateescape")
    return info


def oci_of_dir(layout, tag, tree):
    """An OCI image `tag` in `layout` whose one gzip layer is `tree` (with
    its xattrs)."""
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')

    def put(data):
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as t:
        t.add(tree, arcname=".", filter=lambda i: with_xattrs(i, tree))
    raw = raw.getvalue()
    layer = put(gzip.compress(raw, compresslevel=1, mtime=1))
    config = put(json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {
        "type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(raw).hexdigest()}"]}}).encode())
    manifest = put(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": dict(config, mediaType="application/vnd.oci.image.config.v1+json"),
        "layers": [dict(layer, mediaType="application/vnd.oci.image.layer.v1.tar+gzip")]}).encode())
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {"schemaVersion": 2, "manifests": []}
    index["manifests"].append(dict(manifest, mediaType="application/vnd.oci.image.manifest.v1+json",
                                   annotations={"org.opencontainers.image.ref.name": tag}))
    index_path.write_text(json.dumps(index))


def layer_images(layout, tag, prefix):
    """Tags `prefix`1.. in `layout`: each layer of `tag` as an image of its
    own (its one layer, its one diff_id); returns the tags."""
    blobs = layout / "blobs" / "sha256"
    read = lambda d: json.loads((blobs / d.split(":")[1]).read_text())  # noqa: E731

    def put(data):
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    index = json.loads((layout / "index.json").read_text())
    entry = next(m for m in index["manifests"]
                 if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag)
    manifest = read(entry["digest"])
    config = read(manifest["config"]["digest"])
    tags = []
    for i, (layer, diff_id) in enumerate(zip(manifest["layers"], config["rootfs"]["diff_ids"]), 1):
        one = dict(config, rootfs={"type": "layers", "diff_ids": [diff_id]}, history=[])
        m = dict(manifest, layers=[layer], config=dict(manifest["config"], **put(json.dumps(one).encode())))
        tags.append(f"{prefix}{i}")
        index["manifests"].append(dict(entry, **put(json.dumps(m).encode()),
                                       annotations={"org.opencontainers.image.ref.name": tags[-1]}))
    (layout / "index.json").write_text(json.dumps(index))
    return tags


def prepare(work, lamina):
    """density's images, then each design's trees and EROFS images."""
    src, conv = density.prepare(work, lamina)
    roots = {"a": work / "ovl-a" / "rootfs", "r": work / "ovl-r" / "rootfs"}
    b_root = work / "b-rootfs"  # B merged: A's tree and B's file
    run(["cp", "-a", f"{roots['a']}/.", str(b_root)], timeout=600)
    run(["cp", "-a", f"{work / 'ovl-b-top'}/.", str(b_root)], timeout=600)
    roots["b"] = b_root
    # Each layer an image of its own: A's and R's, and B's top one.
    for src_tag, prefix in (("bookworm", "layer-a"), ("rebuilt", "layer-r")):
        for tag in layer_images(src, src_tag, prefix):
            lamina("convert", f"oci:{src}:{tag}", f"oci:{conv}:{tag}", timeout=1800)
    oci_of_dir(work / "designs-oci", "btop", work / "ovl-b-top")
    lamina("convert", f"oci:{work / 'designs-oci'}:btop", f"oci:{conv}:btop", timeout=1800)
    known = set()
    names = {}
    for tag in "abr":  # A first: B's and R's shards hold only what A's lacks
        shard = work / f"shard-{tag}"
        shard.mkdir()
        names[tag] = add_objects(roots[tag], shard, known)
        meta = work / f"meta-{tag}"
        meta.mkdir()
        build_meta(roots[tag], meta, names[tag])
        for what, tree in (("shard", shard), ("meta", meta)):  # lamina's own EROFS of each
            oci_of_dir(work / "designs-oci", f"{what}-{tag}", tree)
            lamina("convert", f"oci:{work / 'designs-oci'}:{what}-{tag}", f"oci:{conv}:{what}-{tag}",
                   timeout=1800)
    expected = {tag: {str(rel): d for rel, d in n.items()} for tag, n in names.items()}
    sizes = metadata_sizes(conv)
    log(f"designs: EROFS metadata {', '.join(f'{k} {v / MiB:.2f} MiB' for k, v in sorted(sizes.items()))}")
    return src, conv, expected, sizes


def metadata_sizes(conv):
    """{tag: bytes of its EROFS metadata} of the converted images."""
    index = json.loads((conv / "index.json").read_text())
    out = {}
    for m in index["manifests"]:
        manifest = json.loads((conv / "blobs" / "sha256" / m["digest"].split(":")[1]).read_text())
        for layer in manifest["layers"]:
            if ".lamina.erofs." in layer["mediaType"]:
                tag = m["annotations"]["org.opencontainers.image.ref.name"]
                out[tag] = int(layer["annotations"]["dev.lamina.uncompressed.size"])
    return out


class Mounts:
    """Kernel and lamina mounts made for one design, undone in reverse."""

    def __init__(self, work, lamina, cache):
        self.work, self.lamina, self.cache, self.done = work, lamina, cache, []

    def dir(self, name):
        d = self.work / "mnt" / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def overlay(self, name, lowerdir, extra=""):
        m = self.dir(name)
        sys_mount("overlay", str(m), "overlay", f"lowerdir={lowerdir}" + (f",{extra}" if extra else ""))
        self.done.append(("sys", m))
        return m

    def lamina_mount(self, name, conv, lazy):
        m = self.dir(name)
        how = ["--lazy", "--prefetch", "none"] if lazy else []
        self.lamina("mount", *how, "--mode", "kernel", f"oci:{conv}:{name}", m, "--cache-dir", self.cache,
                    timeout=600)
        self.done.append(("lamina", m))
        return m

    def undo(self):
        pids = list(procs_of(str(self.cache)))
        for how, m in reversed(self.done):
            if how == "sys":
                sys_umount(str(m))
            else:
                run([self.lamina.path, "umount", m, "--cache-dir", self.cache], check=False)
        self.done = []
        wait_gone(pids)
        shutil.rmtree(self.cache, ignore_errors=True)


def views(design, mounts, work, conv, second):
    """The read-only views of A and of the second image."""
    empty = work / "empty"
    empty.mkdir(exist_ok=True)
    if design == "overlayfs":
        a = work / "ovl-a" / "rootfs"
        lower = {"b": f"{work / 'ovl-b-top'}:{a}", "r": f"{empty}:{work / 'ovl-r' / 'rootfs'}"}[second]
        return mounts.overlay("ovl-a", f"{empty}:{a}"), mounts.overlay(f"ovl-{second}", lower)
    eager = lambda tag: mounts.lamina_mount(tag, conv, False)  # noqa: E731
    if design == "merged":
        return eager("a"), eager(second)
    if design == "merged-overlay":  # as a container sees it: under its overlayfs
        return tuple(mounts.overlay(f"view-{t}", f"{empty}:{eager(t)}") for t in ("a", second))
    if design == "per-layer":  # the top layer first
        a = f"{eager('layer-a2')}:{eager('layer-a1')}"
        view_a = mounts.overlay("view-a", a)
        if second == "b":
            return view_a, mounts.overlay("view-b", f"{eager('btop')}:{a}")
        return view_a, mounts.overlay("view-r", f"{eager('layer-r2')}:{eager('layer-r1')}")
    lazy = design == "objects-lazy"
    shard_a = mounts.lamina_mount("shard-a", conv, lazy)
    shard_2 = mounts.lamina_mount(f"shard-{second}", conv, lazy)
    meta = lambda t: mounts.lamina_mount(f"meta-{t}", conv, False)  # noqa: E731
    view_a = mounts.overlay("view-a", f"{meta('a')}::{shard_a}", OVL_OPTS)
    view_2 = mounts.overlay(f"view-{second}", f"{meta(second)}::{shard_a}::{shard_2}", OVL_OPTS)
    return view_a, view_2


def mismatches(view, expected):
    """Files of `expected` whose bytes through `view` differ (or fail)."""
    bad = []
    for rel, digest in expected.items():
        try:
            if sha256_file(view / rel) != digest:
                bad.append(rel)
        except OSError as e:
            bad.append(f"{rel}: {e}")
    return bad


def run_from(view):
    """A shell and perl started from `view` before anything of it was read:
    their libraries are mapped through overlayfs. Their output, or the error."""
    r = subprocess.run(["chroot", str(view), "/bin/sh", "-c", "/usr/bin/perl -e 'print 6*7'; echo; ls /usr | wc -l"],
                       capture_output=True, text=True, timeout=120)
    return {"rc": r.returncode, "out": r.stdout.strip(), "err": r.stderr.strip()[-300:]}


def timed(cmd):
    t = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=1800)
    return time.perf_counter() - t, r.returncode


def metadata_costs(view, ls_runs):
    """`ls -lR` cold and warm, and the cold read of every file, of `view`."""
    out = {"ls_cold_s": [], "ls_warm_s": []}
    for _ in range(ls_runs):
        drop_caches()
        out["ls_cold_s"].append(round(timed(["ls", "-lR", str(view)])[0], 4))
        out["ls_warm_s"].append(round(timed(["ls", "-lR", str(view)])[0], 4))
    drop_caches()
    out["read_cold_s"] = round(timed(["sh", "-c", f"find {view} -xdev -type f -exec cat {{}} + >/dev/null"])[0], 3)
    return out


def node_cache():
    """Cached + Buffers (/proc/meminfo): ext4 keeps its metadata in Buffers,
    EROFS over a file in Cached."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[k].split()[0]) * 1024 for k in ("Cached", "Buffers"))


def measure_design(results, design, scenario, lamina, work, conv, src, expected, run_no, ls_runs):
    second = density.SCENARIOS[scenario]
    mounts = Mounts(work, lamina, work / f"cache-{design}")
    cgroup = density.CGROUP / f"lamina-designs-{scenario}-{design}-{run_no}"
    try:
        view_a, view_2 = views(design, mounts, work, conv, second)
        figures = {"scenario": scenario, "design": design, "run": run_no}
        if design == "objects-lazy":
            figures["run_from_view"] = run_from(view_a)
            log(f"designs: {design}: run from A's view before any read: {figures['run_from_view']}")
        label = f"designs: {scenario}: {design} run {run_no}"
        figures.update(density.read_in_turn(cgroup, (view_a, view_2), (src, conv), node_cache, label))
        tag = {"A": "a", "B": second}
        figures["content_mismatches"] = {img: mismatches(v, expected[tag[img]])[:5]
                                         for img, v in zip("AB", (view_a, view_2))}
        if scenario == "shared_base":
            figures["metadata"] = metadata_costs(view_a, ls_runs)
        results.add_run(**figures)
    finally:
        mounts.undo()
        density.remove_cgroup(cgroup)


def measure(results, lamina, work, quick, options):
    unknown = set(options) - {"runs", "ls_runs"}
    if unknown:
        raise SystemExit(f"bench density_designs: unknown option(s) {', '.join(sorted(unknown))}")
    runs, ls_runs = int(options.get("runs", 1)), int(options.get("ls_runs", 3))
    results.doc["config"].update(runs=runs, ls_runs=ls_runs, designs=list(DESIGNS), overlay_options=OVL_OPTS)
    results.doc["machine"].update(machine_info(lamina.path, packages=("umoci", "erofs-utils")))
    src, conv, expected, sizes = prepare(work, lamina)
    results.doc["metadata_bytes"] = sizes
    for r in range(runs):
        order = DESIGNS[r % len(DESIGNS):] + DESIGNS[:r % len(DESIGNS)]
        for scenario in density.SCENARIOS:
            for design in order:
                measure_design(results, design, scenario, lamina, work, conv, src, expected, r, ls_runs)
    results.doc["anomalies"] = list(ANOMALIES)
    derive(results.doc)


def derive(doc):
    """Medians per scenario and design, as ratios to overlayfs (page cache)
    and to merged (metadata)."""
    med = density.median
    per = {}
    for r in doc["runs"]:
        v = per.setdefault(r["scenario"], {}).setdefault(r["design"], {"A": [], "B": [], "bad": 0, "meta": []})
        v["A"].append(r["A"]["node_page_cache"])
        v["B"].append(r["B"]["node_page_cache"])
        v["bad"] += sum(len(x) for x in r["content_mismatches"].values())
        v["bad"] += r["A"]["read_error_count"] + r["B"]["read_error_count"]
        if "metadata" in r:
            v["meta"].append(r["metadata"])
    summary = {}
    for scenario, designs in per.items():
        out = summary[scenario] = {}
        for d, v in designs.items():
            s = out[d] = {"after_A": med(v["A"]), "after_B": med(v["B"]), "wrong_or_failed": v["bad"]}
            s["B_adds_of_A"] = (s["after_B"] - s["after_A"]) / s["after_A"]
            if v["meta"]:
                for k in ("ls_cold_s", "ls_warm_s"):
                    s[k] = med([x for m in v["meta"] for x in m[k]])
                s["read_cold_s"] = med([m["read_cold_s"] for m in v["meta"]])
        ref, merged = out.get("overlayfs"), out.get("merged")
        for s in out.values():
            if ref:
                s["after_B_vs_overlayfs"] = s["after_B"] / ref["after_B"]
            if merged and "ls_cold_s" in s and "ls_cold_s" in merged:
                for k in ("ls_cold_s", "ls_warm_s", "read_cold_s"):
                    s[f"{k}_vs_merged"] = s[k] / merged[k]
    doc["summary"] = summary
    doc["targets"] = []
    for d, s in summary.get("shared_base", {}).items():
        if d != "overlayfs" and "after_B_vs_overlayfs" in s:
            doc["targets"].append({"name": f"shared base, {d}: page cache after A and B / overlayfs",
                                   "value": s["after_B_vs_overlayfs"], "op": "<=", "bound": 1.05,
                                   "met": s["after_B_vs_overlayfs"] <= 1.05})
    for d, s in summary.get("rebuild", {}).items():
        if d != "overlayfs":
            v = s["after_B"] / s["after_A"]
            doc["targets"].append({"name": f"rebuild, {d}: page cache after A and R / after A",
                                   "value": v, "op": "<=", "bound": 1.1, "met": v <= 1.1})


def render(doc, plot_path):
    out = [report.heading(doc)]
    f = lambda x: "" if x is None else f"{x / MiB:.1f}"  # noqa: E731
    for scenario, designs in doc["summary"].items():
        second = "B" if scenario == "shared_base" else "R"
        rows = [(d, f(s["after_A"]), f(s["after_B"]), s.get("after_B_vs_overlayfs"),
                 f"{100 * s['B_adds_of_A']:.1f}%", s["wrong_or_failed"]) for d, s in designs.items()]
        out += ["", f"{scenario.replace('_', ' ')} (A, then {second}):", "",
                report.table(("design", "page cache after A, MiB", f"after A and {second}, MiB",
                              f"after A and {second} / overlayfs", f"{second} adds (of A)",
                              "files wrong or failed"), rows)]
    meta = [(d, s["ls_cold_s"], s.get("ls_cold_s_vs_merged"), s["ls_warm_s"], s.get("ls_warm_s_vs_merged"),
             s["read_cold_s"], s.get("read_cold_s_vs_merged"))
            for d, s in doc["summary"].get("shared_base", {}).items() if "ls_cold_s" in s]
    out += ["", "A's view (median of the runs):", "",
            report.table(("design", "ls -lR cold, s", "/ merged", "ls -lR warm, s", "/ merged",
                          "read every file cold, s", "/ merged"), meta)]
    ran = [(r["scenario"], r["run"], r["run_from_view"]["rc"], r["run_from_view"]["out"].replace("\n", " "))
           for r in doc["runs"] if "run_from_view" in r]
    if ran:
        out += ["", "objects-lazy: a shell and perl run from A's view before any read:", "",
                report.table(("scenario", "run", "exit", "output"), ran)]
    out += ["", report.targets(doc)]
    density.plot(doc, plot_path, title="designs: ")
    return "\n".join(out)


BENCHMARK = {
    "out": ROOT / "docs" / "density-designs-results.json",
    "plot": ROOT / "docs" / "density-designs.png",
    "tables_in": None,
    "needs": ["umoci", "find", "chroot", "cp"],
    "measure": measure,
    "derive": derive,
    "render": render,
}
