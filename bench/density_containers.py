"""Memory density with containers (issue 43): 50 containers from 5 images
on one Debian base, 10 per image, started through containerd on one node,
side by side in one run.

Images: the Debian test image (`/var/cache/lamina-test/debian-oci`, two
layers: the base system, then python3, nginx and redis) plus one top layer
each, a tenant's own: `py` (a python3 program importing a few modules),
`nginx` (a shell script that checks nginx's configuration), `redis` (a
script that runs redis-server and redis-cli for their versions), `sh` (a
shell script that lists /usr and /etc) and `data` (a 20 MB data file that
`sha256sum` reads). Each is pushed to a local registry as it is (for
containerd's own pull) and converted by `lamina convert`.

Systems, each on a fresh containerd (the one on PATH) and cache:
- `overlayfs`: containerd's overlayfs snapshotter, the five images pulled
  beforehand (`ctr image pull`), as a node that pre-pulls them.
- `lamina`: lamina snapshotter, lazy (kernel path, its defaults): lamina
  today.
- `lamina-shared`: the same with `--share-files --mode kernel`.

After the pulls (lamina: `ctr-remote image rpull`, which mounts), the page
cache is dropped; then the 50 containers start one after another (`ctr run
--rm`, images in turn), each reading its working set and printing `ready`.
A start is the time from `ctr run` to `ready`; every container must print
it. Page cache is the rise of the node's `Cached` (and, beside it, of
`Buffers`, where ext4 keeps overlayfs's directories and inodes) over the
50 starts, less what `cachestat` finds resident of the registry's blobs (a
lazy mount reads them as it would a remote registry's answers).

Options (--set): runs (default 1), per_image (default 10), containerd (a
containerd binary to measure instead of the one on PATH, e.g. the 2.x
that scripts/setup.sh builds; its directory goes first on PATH).
"""

import os
import shutil
import statistics
import subprocess
import time

from . import density
from .harness import report
from .harness.containerd import Containerd, start_snapshotter, stop_snapshotter, use_binary
from .harness.core import ROOT, log, run
from .harness.measure import ANOMALIES, drop_caches, machine_info
from .harness.registry import Registry

SYSTEMS = ("overlayfs", "lamina", "lamina-shared")
MiB = 1 << 20
DATA_BYTES = 20 << 20
# tag: (the top layer's file, its bytes, the container's command)
IMAGES = {
    "py": ("opt/py/app.py",
           b"import json, email.parser, http.client, sqlite3, decimal\nprint('ready', flush=True)\n",
           ["python3", "/opt/py/app.py"]),
    "nginx": ("opt/nginx/check.sh", b"nginx -t 2>/dev/null && echo ready\n", ["sh", "/opt/nginx/check.sh"]),
    "redis": ("opt/redis/check.sh",
              b"redis-server --version >/dev/null && redis-cli --version >/dev/null && echo ready\n",
              ["sh", "/opt/redis/check.sh"]),
    "sh": ("opt/sh/list.sh", b"ls -lR /usr/bin /etc >/dev/null 2>&1; echo ready\n", ["sh", "/opt/sh/list.sh"]),
    "data": ("opt/data/blob.bin", None, ["sh", "-c", "sha256sum /opt/data/blob.bin >/dev/null && echo ready"]),
}
START_TIMEOUT = 300


def prepare(work, lamina, reg):
    """The five images in the registry, as they are (`d:TAG`) and converted
    (`d:TAG-lamina`)."""
    src = work / "src"
    shutil.copytree(density.SOURCE, src)
    for tag, (path, body, _) in IMAGES.items():
        if body is None:
            body = b"".join(os.urandom(1 << 20) for _ in range(DATA_BYTES >> 20))
        density.add_top_layer(src, "bookworm", tag, path=path, body=body, mode=0o755)
        run(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{src}:{tag}",
             f"docker://{reg.address}/d:{tag}"], timeout=1800)
        lamina("convert", f"oci:{src}:{tag}", reg.ref(f"d:{tag}-lamina"), timeout=1800)


def start_one(ctr, snapshotter, ref, cid, cmd):
    """`ctr run --rm` of `cmd` until it prints `ready`; (seconds, ok)."""
    argv = list(ctr) + ["run", "--rm"] + (["--snapshotter", snapshotter] if snapshotter else []) + [ref, cid] + cmd
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = p.communicate(timeout=START_TIMEOUT)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    seconds = time.perf_counter() - t0
    ok = p.returncode == 0 and b"ready" in out
    if not ok:
        log(f"{cid}: exit {p.returncode}, {err.decode(errors='replace').strip()[-500:]}")
    return seconds, ok


def measure_system(results, system, lamina, work, reg, run_no, per_image):
    d = work / f"{system}-{run_no}"
    snap_sock = str(d / "snapshotter.sock")
    ctd = Containerd(d / "containerd", snap_sock)
    snap = None
    root = str(d / "snapshotter")
    try:
        ns = "density"
        if system == "overlayfs":
            ctr, snapshotter, suffix = ctd.ctr + ["-n", ns], None, ""
            for tag in IMAGES:
                run(ctr + ["image", "pull", "--plain-http", f"{reg.address}/d:{tag}"], timeout=1800)
        else:
            args = ["--share-files", "--mode", "kernel"] if system == "lamina-shared" else []
            snap = start_snapshotter(lamina.path, ctd, root, snap_sock, f"warmup-{run_no}", args=args)
            ctr = ["ctr-remote", "--address", ctd.sock, "-n", ns]
            snapshotter, suffix = "lamina", "-lamina"
            for tag in IMAGES:
                run(ctr + ["image", "rpull", "--plain-http", "--snapshotter", "lamina",
                           f"{reg.address}/d:{tag}{suffix}"], timeout=1800)
        drop_caches()
        time.sleep(1)
        base = density.meminfo("Cached"), density.meminfo("Buffers")
        starts = {tag: [] for tag in IMAGES}
        failed = 0
        t0 = time.perf_counter()
        for i in range(per_image):
            for tag, (_, _, cmd) in IMAGES.items():
                seconds, ok = start_one(ctr, snapshotter, f"{reg.address}/d:{tag}{suffix}", f"{tag}-{i}", cmd)
                starts[tag].append(seconds)
                failed += not ok
        elapsed = time.perf_counter() - t0
        time.sleep(1)
        registry_resident = density.resident(density.files_under(reg.data))
        cached = density.meminfo("Cached") - base[0] - registry_resident
        buffers = density.meminfo("Buffers") - base[1]
        all_starts = sorted(s for v in starts.values() for s in v)
        log(f"{system} run {run_no}: page cache {cached / MiB:.1f} MiB (Buffers {buffers / MiB:.1f}), "
            f"start p50 {statistics.median(all_starts):.3f} s, {failed} failed, {elapsed:.0f} s in all")
        results.add_run(system=system, run=run_no, page_cache=cached, buffers=buffers, failed=failed,
                        starts=starts, registry_resident=registry_resident)
    finally:
        # Images removed first: the snapshotter unmounts their mounts itself.
        refs = [f"{reg.address}/d:{tag}{'' if system == 'overlayfs' else '-lamina'}" for tag in IMAGES]
        ctd.forget("density", refs, None if system == "overlayfs" else "lamina")
        ctd.stop()
        if snap:
            stop_snapshotter(lamina.path, snap, root)
        shutil.rmtree(d, ignore_errors=True)


def measure(results, lamina, work, quick, options):
    unknown = set(options) - {"runs", "per_image", "containerd"}
    if unknown:
        raise SystemExit(f"bench density_containers: unknown option(s) {', '.join(sorted(unknown))}")
    if options.get("containerd"):
        use_binary(options["containerd"])
    runs = int(options.get("runs", 1))
    per_image = int(options.get("per_image", 3 if quick else 10))
    results.doc["config"].update(runs=runs, per_image=per_image, systems=list(SYSTEMS),
                                 images={t: v[2] for t, v in IMAGES.items()}, data_bytes=DATA_BYTES)
    results.doc["machine"].update(machine_info(lamina.path, packages=("containerd", "skopeo")))
    results.doc["machine"]["containerd_measured"] = run(["containerd", "--version"]).stdout.strip()
    reg = Registry(work / "registry")
    try:
        prepare(work, lamina, reg)
        for r in range(runs):
            for system in SYSTEMS[r % len(SYSTEMS):] + SYSTEMS[:r % len(SYSTEMS)]:
                measure_system(results, system, lamina, work, reg, r, per_image)
    finally:
        reg.stop()
    results.doc["anomalies"] = list(ANOMALIES)
    derive(results.doc)


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def derive(doc):
    per = {}
    for r in doc["runs"]:
        v = per.setdefault(r["system"], {"cache": [], "buffers": [], "starts": [], "failed": 0})
        v["cache"].append(r["page_cache"])
        v["buffers"].append(r["buffers"])
        v["starts"] += [s for xs in r["starts"].values() for s in xs]
        v["failed"] += r["failed"]
    summary = {}
    for sys, v in per.items():
        summary[sys] = {"page_cache": statistics.median(v["cache"]),
                        "page_cache_and_buffers": statistics.median(v["cache"]) + statistics.median(v["buffers"]),
                        "start_p50": percentile(v["starts"], 0.5), "start_p99": percentile(v["starts"], 0.99),
                        "starts": len(v["starts"]), "failed": v["failed"]}
    ref = summary.get("overlayfs")
    for v in summary.values():
        if ref:
            v["page_cache_vs_overlayfs"] = v["page_cache"] / ref["page_cache"]
            v["with_buffers_vs_overlayfs"] = v["page_cache_and_buffers"] / ref["page_cache_and_buffers"]
            v["p50_vs_overlayfs"] = v["start_p50"] / ref["start_p50"]
            v["p99_vs_overlayfs"] = v["start_p99"] / ref["start_p99"]
    doc["summary"] = summary
    doc["targets"] = []
    for sys, v in summary.items():
        doc["targets"].append({"name": f"{sys}: every start succeeds", "value": v["failed"], "op": "<=",
                               "bound": 0, "met": v["failed"] == 0})
    shared = summary.get("lamina-shared")
    if shared and ref:
        value = shared["page_cache_vs_overlayfs"]
        doc["targets"].append({"name": "lamina-shared: page cache of the 50 containers / overlayfs's",
                               "value": value, "op": "<=", "bound": 1.1, "met": value <= 1.1})


def render(doc, plot_path):
    out = [report.heading(doc)]
    rows = [(sys, f"{v['page_cache'] / MiB:.1f}", f"{v.get('page_cache_vs_overlayfs', 0):.2f}",
             f"{v.get('with_buffers_vs_overlayfs', 0):.2f}", f"{v['start_p50']:.3f}", f"{v['start_p99']:.3f}",
             f"{v.get('p50_vs_overlayfs', 0):.2f}", f"{v.get('p99_vs_overlayfs', 0):.2f}",
             f"{v['starts'] - v['failed']}/{v['starts']}")
            for sys, v in doc["summary"].items()]
    out += ["", report.table(("system", "page cache, MiB", "/ overlayfs", "with Buffers / overlayfs",
                              "start p50, s", "start p99, s", "p50 / overlayfs", "p99 / overlayfs",
                              "started"), rows), "", report.targets(doc)]
    plot(doc, plot_path)
    return "\n".join(out)


def plot(doc, path):
    plt = report.pyplot()
    if plt is None or not path:
        return
    s = doc["summary"]
    names = list(s)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars = a.bar(names, [s[n]["page_cache"] / MiB for n in names], color=report.COLD)
    report.label_bars(a, list(bars), "{:.0f}")
    a.set_ylabel("page cache after 50 starts, MiB")
    a.set_title(f"50 containers, 5 images on one base - {doc['date'][:10]}", fontsize=10)
    w = 0.38
    xs = range(len(names))
    b1 = b.bar([x - w / 2 for x in xs], [s[n]["start_p50"] for n in names], w, label="p50", color=report.WARM)
    b2 = b.bar([x + w / 2 for x in xs], [s[n]["start_p99"] for n in names], w, label="p99", color=report.COLD)
    report.label_bars(b, list(b1) + list(b2), "{:.2f}")
    b.set_xticks(list(xs))
    b.set_xticklabels(names)
    b.set_ylabel("start, s (ctr run to ready)")
    b.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


BENCHMARK = {
    "out": ROOT / "docs" / "density-containers-results.json",
    "plot": ROOT / "docs" / "density-containers.png",
    "tables_in": None,
    "needs": ["containerd", "ctr", "ctr-remote", "skopeo"],
    "measure": measure,
    "derive": derive,
    "render": render,
}
