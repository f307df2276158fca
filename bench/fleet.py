"""Issue 31: a fleet starting one image at once, with and without Dragonfly,
and an update from v1 to v2 on one node.

Images: the Debian reference image converted with the boot pages of a
python3 start (`deb:v1`), and v2, the same image rebuilt with one file in
50 changed (other layer and blob digests, same boot trace).

Fleet (harness/fleet.py: registry uplink 100mbit, node links 1gbit, each
node a network namespace and a fresh cache; variants: straight to the
registry, through Dragonfly with `bulk_only`, and the same with
`--prefetch all`): for each variant and N, every
node at once mounts v1 lazily and starts python3 (timed from the mount),
then reads every file of the mount (timed); the registry's egress is read
after the starts and after the reads.

Update (one node, straight to the shaped registry): v2 started and read
whole on a fresh cache, against v2 on the cache of a node that ran v1
(read whole, every chunk in): bytes fetched, chunks copied on the node,
times. The
changed chunks' compressed size comes from both images' chunk tables
(`lamina inspect --chunks`).
"""

import shutil
import threading

from .harness import fleet as fleetctl
from .harness.core import ROOT, Results, log, run, stats, timed
from .harness.registry import DEBIAN_LAYOUT, Registry, debian_layout
from .harness.rebuild import rebuild
from .harness import report

SCRIPT = "import json, os, re, email.parser; print('ok')"
PREFIX, NET = "lb", "10.203.0"
# name -> (fleet.py up flags, lamina mount flags)
VARIANTS = {
    "direct": (["--no-dragonfly"], []),
    "dragonfly": (["--bulk-only"], []),
    # Every node prefetches the whole image through P2P behind its start.
    "dragonfly-all": (["--bulk-only"], ["--prefetch", "all"]),
}


def prepare(lamina, work):
    """The registry's data dir with deb:v1 and deb:v2 (boot pages of one
    python3 start), and what they hold."""
    source = debian_layout()
    layout = work / "layout"
    shutil.copytree(DEBIAN_LAYOUT, layout)
    changed = rebuild(layout, "bookworm", "v2")
    reg = Registry(work / "registry")
    try:
        lamina("convert", source, reg.ref("deb:plain"))
        trace = work / "python3.trace"
        mnt, cache = work / "mnt-record", work / "cache-record"
        lamina.mount(reg.ref("deb:plain"), mnt, cache, "--record-trace", trace)
        run(["chroot", mnt, "/usr/bin/python3", "-c", SCRIPT], timeout=300, env=clean_env())
        lamina.umount(mnt)
        lamina("convert", "--prefetch", trace, source, reg.ref("deb:v1"))
        lamina("convert", "--prefetch", trace, f"oci:{layout}:v2", reg.ref("deb:v2"))
        images = {tag: lamina.json("inspect", reg.ref(f"deb:{tag}")) for tag in ("v1", "v2")}
        chunks = {tag: lamina.json("inspect", "--chunks", reg.ref(f"deb:{tag}")) for tag in ("v1", "v2")}
    finally:
        reg.stop()
    held = {c["digest"] for b in chunks["v1"]["blobs"] for c in b["chunk_list"]}
    new = [c for b in chunks["v2"]["blobs"] for c in b["chunk_list"] if c["digest"] not in held]
    changed.update(chunks_changed=len(new), changed_compressed_bytes=sum(c["compressed_size"] for c in new))
    return reg.data, images, changed


def clean_env():
    return {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LC_ALL": "C"}


def start(lamina, node, image, mnt, cache, extra=()):
    """Mounts `image` on `node` and starts python3 on it: seconds."""
    def go():
        lamina.mount(image, mnt, cache, "--hosts-dir", node["hosts_dir"], *extra, netns=node["netns"])
        r = run(["chroot", mnt, "/usr/bin/python3", "-c", SCRIPT], netns=node["netns"], timeout=300,
                env=clean_env())
        if r.stdout != "ok\n":
            raise RuntimeError(f"python3 on {node['name']}: {r.stdout!r} {r.stderr}")
    return timed(go)[0]


def read_all(mnt):
    """Reads every regular file under `mnt`: seconds."""
    script = 'find "$1" -xdev -type f -print0 | xargs -0 -r -n 200 cat > /dev/null'
    return timed(run, ["bash", "-c", script, "-", mnt], timeout=1800)[0]


def drop_data(d):
    """Removes what a fleet cached (each node's lamina cache and dfdaemon
    storage: about the image per node), keeping its logs: a full run would
    otherwise leave gigabytes in a kept work dir."""
    for cache in list(d.glob("*/lamina-cache")) + list(d.glob("*/storage")) + list(d.glob("cache-*")):
        shutil.rmtree(cache, ignore_errors=True)


def on_all(fn, items):
    """fn(i, item) on every item at once, one thread each: their results."""
    out, errors = [None] * len(items), []

    def one(i, item):
        try:
            out[i] = fn(i, item)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i, x)) for i, x in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def fleet_run(lamina, work, data, variant, n, image_tag="v1"):
    """One fleet of `n` nodes in `variant`: the figures of its starts and reads."""
    up_flags, mount_flags = VARIANTS[variant]
    d = work / f"fleet-{variant}-{n}"
    state = fleetctl.bring_up(d, n, data, PREFIX, NET, up_flags)
    try:
        image = f"docker://{state['registry']}/deb:{image_tag}"
        nodes = state["nodes"]
        mnts = [d / f"mnt{i}" for i in range(n)]
        e0 = fleetctl.registry_egress(state)
        starts = on_all(lambda i, node: start(lamina, node, image, mnts[i], node["cache"], mount_flags), nodes)
        e1 = fleetctl.registry_egress(state)
        reads = on_all(lambda i, node: read_all(mnts[i]), nodes)
        e2 = fleetctl.registry_egress(state)
        fetched = [lamina.figures(node["cache"], mnts[i]).get("fetched_bytes") for i, node in enumerate(nodes)]
        for m in mnts:
            lamina.umount(m)
        # The floor of this machine: the same starts at once, every byte
        # already in each node's cache (nothing fetched; CPU and disk only).
        warm = on_all(lambda i, node: start(lamina, node, image, mnts[i], node["cache"], mount_flags), nodes)
        for m in mnts:
            lamina.umount(m)
    finally:
        lamina.umount_all()
        fleetctl.bring_down(d)
        drop_data(d)
    log(f"{variant} N={n}: start {[round(s, 2) for s in starts]} s, egress {e1 - e0} B; "
        f"read all {[round(s, 1) for s in reads]} s, egress {e2 - e1} B; warm start {[round(s, 2) for s in warm]} s")
    return {"kind": "fleet", "variant": variant, "nodes": n, "start_seconds": starts,
            "read_all_seconds": reads, "start_egress_bytes": e1 - e0, "read_all_egress_bytes": e2 - e1,
            "node_fetched_bytes": fetched, "warm_start_seconds": warm}


def update_run(lamina, work, data):
    """v2 on a fresh cache against v2 on a cache holding v1, one node."""
    d = work / "fleet-update"
    state = fleetctl.bring_up(d, 1, data, PREFIX, NET, ["--no-dragonfly"])
    node = state["nodes"][0]
    ref = f"docker://{state['registry']}/deb:"
    out = {"kind": "update"}
    try:
        for label, cache in (("fresh", d / "cache-fresh"), ("after_v1", d / "cache-v1")):
            if label == "after_v1":
                # A node that ran v1: read whole, and its chunks all in.
                start(lamina, node, ref + "v1", d / "mnt-v1", cache)
                read_all(d / "mnt-v1")
                lamina.wait_complete(cache)
                lamina.umount(d / "mnt-v1")
            mnt = d / f"mnt-v2-{label}"
            e0 = fleetctl.registry_egress(state)
            secs = start(lamina, node, ref + "v2", mnt, cache)
            read = read_all(mnt)
            fig = lamina.figures(cache, mnt)
            out[label] = {"start_seconds": secs, "read_all_seconds": read,
                          "egress_bytes": fleetctl.registry_egress(state) - e0,
                          "fetched_bytes": fig.get("fetched_bytes"),
                          "located_chunks": fig.get("located_chunks"), "located_bytes": fig.get("located_bytes")}
            lamina.umount(mnt)
            log(f"update, v2 {label}: {out[label]}")
    finally:
        lamina.umount_all()
        fleetctl.bring_down(d)
        drop_data(d)
    return out


def measure(results, lamina, work, quick, options):
    """Options: nodes=1,4,8 (fleet sizes), variants=direct,dragonfly,...,
    update=yes|no."""
    data, images, changed = prepare(lamina, work)
    results.doc["config"].update(images={t: {k: images[t][k] for k in ("compressed_bytes", "chunks", "files")}
                                         for t in images}, v2_changes=changed)
    sizes = [int(n) for n in options.get("nodes", "1,3" if quick else "1,4,8").split(",")]
    variants = options.get("variants", ",".join(VARIANTS)).split(",")
    for n in sizes:
        for variant in variants:
            results.add_run(**fleet_run(lamina, work, data, variant, n))
    if options.get("update", "yes") == "yes":
        results.add_run(**update_run(lamina, work, data))
    derive(results.doc)


def derive(doc):
    """The summary and targets of `doc`, from its raw runs and config."""
    sizes = [r["nodes"] for r in doc["runs"] if r["kind"] == "fleet"]
    summarize(Results.of(doc), doc["config"]["images"]["v1"]["compressed_bytes"],
              doc["config"]["v2_changes"]["changed_compressed_bytes"], max(sizes, default=0))


def summarize(results, image_bytes, changed_bytes, big):
    """Per variant and fleet size: medians and maxima; the issue's targets
    for each Dragonfly variant at the largest fleet."""
    results.doc["targets"] = []
    runs = [r for r in results.doc["runs"] if r["kind"] == "fleet"]
    by = {(r["variant"], r["nodes"]): r for r in runs}
    summary = {}
    for (variant, n), r in sorted(by.items()):
        summary[f"{variant}/{n}"] = {"start": stats(r["start_seconds"]), "read_all": stats(r["read_all_seconds"]),
                                     "start_egress_bytes": r["start_egress_bytes"],
                                     "read_all_egress_bytes": r["read_all_egress_bytes"]}
        if r.get("warm_start_seconds"):
            summary[f"{variant}/{n}"]["warm_start"] = stats(r["warm_start_seconds"])
    results.doc["summary"] = summary
    lone = by.get(("direct", 1))
    for variant in ("dragonfly", "dragonfly-all"):
        p2p = by.get((variant, big))
        if not (lone and p2p):
            continue
        ratio = p2p["start_egress_bytes"] / lone["start_egress_bytes"]
        results.target(f"{variant}: start egress, {big} nodes vs 1 alone", ratio, "<=", 1.3)
        total = p2p["start_egress_bytes"] + p2p["read_all_egress_bytes"]
        results.target(f"{variant}: read-all egress, {big} nodes vs the image", total / image_bytes, "<=", 1.2)
        slowest = max(p2p["start_seconds"]) / lone["start_seconds"][0]
        results.target(f"{variant}: slowest start, {big} nodes vs 1 alone", slowest, "<=", 1.5)
        # Not a target: how the route scales, against a lone node on it.
        alone = by.get((variant, 1))
        if alone:
            summary.setdefault("scaling", {})[variant] = max(p2p["start_seconds"]) / alone["start_seconds"][0]
    # Not a target: the slowest of the largest fleet's starts with every
    # byte cached, against the lone node's cold start the target divides by.
    warm = by.get(("direct", big), {}).get("warm_start_seconds")
    if lone and warm:
        summary["floor"] = {"nodes": big, "slowest_warm_start": max(warm),
                            "vs_lone_cold_start": max(warm) / lone["start_seconds"][0]}
    update = next((r for r in results.doc["runs"] if r["kind"] == "update"), None)
    if update and changed_bytes:
        results.target("update: registry bytes vs changed chunks", update["after_v1"]["egress_bytes"] / changed_bytes,
                       "<=", 1.2)


def render(doc, plot_path):
    """The tables docs/dragonfly.md carries, and the plot."""
    rows = []
    for key, s in doc["summary"].items():
        if "/" not in key:
            continue
        variant, n = key.split("/")
        warm = s.get("warm_start", {}).get("max", "-")
        rows.append((variant, n, s["start_egress_bytes"] / 1e6, s["start"]["median"], s["start"]["max"],
                     s["read_all_egress_bytes"] / 1e6, s["read_all"]["median"], s["read_all"]["max"], warm))
    out = [report.heading(doc), "",
           report.table(("variant", "nodes", "start: registry MB", "start s (median)", "start s (max)",
                         "read all: registry MB", "read all s (median)", "read all s (max)",
                         "warm start s (max)"), rows)]
    update = next((r for r in doc["runs"] if r["kind"] == "update"), None)
    if update:
        ch = doc["config"]["v2_changes"]
        out += ["", f"v2: {ch['files_changed']} files changed, {ch['chunks_changed']} chunks new, "
                f"{ch['changed_compressed_bytes']} compressed bytes", "",
                report.table(("v2 on", "registry MB", "chunks copied", "start s", "read all s"),
                             [(k, update[k]["egress_bytes"] / 1e6, update[k]["located_chunks"],
                               update[k]["start_seconds"], update[k]["read_all_seconds"])
                              for k in ("fresh", "after_v1")])]
    out += ["", report.targets(doc)]
    scaling = doc["summary"].get("scaling", {})
    if scaling:
        out += ["", "Slowest start of the largest fleet against a lone node on the same route (not a target): "
                + ", ".join(f"{v} {x:.2f}x" for v, x in scaling.items()) + "."]
    floor = doc["summary"].get("floor")
    if floor:
        out += ["", f"The machine's floor (not a target): {floor['nodes']} nodes starting at once with the whole "
                f"image in their caches, nothing fetched: slowest {floor['slowest_warm_start']:.2f} s, "
                f"{floor['vs_lone_cold_start']:.2f}x a lone node's cold start straight to the registry."]
    plt = report.pyplot()
    if plt and doc["summary"]:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        for variant in sorted({k.split("/")[0] for k in doc["summary"] if "/" in k}):
            keys = sorted((k for k in doc["summary"] if k.startswith(variant + "/")), key=lambda k: int(k[len(variant) + 1:]))
            ns = [int(k.split("/")[1]) for k in keys]
            s = [doc["summary"][k] for k in keys]
            a.plot(ns, [(x["start_egress_bytes"] + x["read_all_egress_bytes"]) / 1e6 for x in s], "o-", label=variant)
            b.plot(ns, [x["start"]["max"] for x in s], "o-", label=variant)
        a.set(xlabel="nodes", ylabel="registry sent (MB), start + read all", title="Registry egress")
        b.set(xlabel="nodes", ylabel="slowest python3 start (s)", title="Start")
        for ax in (a, b):
            ax.legend()
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(plot_path, dpi=100)
    return "\n".join(out)


BENCHMARK = {"name": "fleet", "doc": __doc__, "measure": measure, "derive": derive, "render": render,
             "out": ROOT / "docs" / "fleet-results.json", "plot": ROOT / "docs" / "fleet.png",
             "needs": ["docker-registry", "nsenter", "tc"]}
