"""The reference Debian image converted and read, side by side with the
kernel's own EROFS (mkfs.erofs), mksquashfs and an ext4 directory.

1. convert: `lamina convert` from the OCI layout (gzip layers decompressed
   on the way) against mksquashfs (zstd), mkfs.erofs (uncompressed, lz4hc,
   chunked with --blobdev) and nydus-image when it is on PATH, on the tree
   `umoci unpack` made; interleaved run by run, warm page cache, outputs
   removed and `sync` before each run (not timed).
2. mount: `lamina mount` (eager: the whole image decompressed into a fresh
   cache), then `lamina mount --lazy` and the first full read of that fresh
   mount (fetched on demand from the layout); the last lazy mount, filled,
   is measured too ("lamina-lazy").
3. the mkfs.erofs images mounted file-backed through mount(2) (the chunked
   one with device=BLOB), as lamina mounts its images.
4. `ls -lR MNT` and a read of every file, warm (after one untimed pass) and
   cold (drop_caches before each run), on every filesystem, interleaved
   with a rotating order.

Options (--set): runs=N (convert and mount, default 3), warm_runs (5*runs),
cold_runs (3*runs). Moved from scripts/bench.sh; docs/benchmarks.md carries
its tables and plot.
"""

import json
import os
import shutil

from .harness import measure as m
from .harness import report
from .harness.core import ROOT, Results, log, run, stats
from .harness.registry import DEBIAN_LAYOUT, DEBIAN_TAG, debian_layout

# ratio name -> bound (lamina / reference, lower is better)
TARGETS = {
    "convert_lamina_vs_mksquashfs": 0.25,
    "ls_warm_lamina_vs_erofs": 1.10,
    "ls_cold_lamina_vs_erofs": 1.25,
}
READ_ALL = 'find "$1" -type f -print0 | xargs -0 cat > /dev/null'
WORKLOADS = {
    "ls_lR": lambda p: ["ls", "-lR", p],
    "read_all": lambda p: ["sh", "-c", READ_ALL, "sh", p],
}
FS_LABEL = {
    "lamina": "lamina (`lamina mount`, eager)",
    "lamina-lazy": "lamina `--lazy` (cache filled)",
    "erofs": "mkfs.erofs, uncompressed",
    "erofs-chunked": "mkfs.erofs `--chunksize=1M --blobdev` (`device=`)",
    "ext4": "ext4 directory (umoci rootfs)",
}


def converters(lamina, layout_ref, rootfs, out):
    """name -> (command, outputs, dirs to make first, input)."""
    P = out.joinpath
    tools = {
        "lamina": ([lamina, "convert", "--json", layout_ref, f"oci:{P('lamina-oci')}:x"],
                   [P("lamina-oci")], [], "OCI layout (gzip layers)"),
        "mksquashfs": (["mksquashfs", rootfs, P("squashfs.img"), "-comp", "zstd", "-noappend"],
                       [P("squashfs.img")], [], "unpacked tree"),
        "mkfs.erofs": (["mkfs.erofs", P("erofs.img"), rootfs], [P("erofs.img")], [], "unpacked tree"),
        "mkfs.erofs-lz4hc": (["mkfs.erofs", "-zlz4hc", P("erofs-lz4hc.img"), rootfs],
                             [P("erofs-lz4hc.img")], [], "unpacked tree"),
        "mkfs.erofs-chunked": (["mkfs.erofs", "--chunksize=1048576", f"--blobdev={P('erofs-chunked.blob')}",
                                P("erofs-chunked.img"), rootfs],
                               [P("erofs-chunked.img"), P("erofs-chunked.blob")], [], "unpacked tree"),
    }
    if shutil.which("nydus-image"):
        tools["nydus-image"] = (["nydus-image", "create", "--fs-version", "6", "--bootstrap",
                                 P("nydus", "bootstrap"), "--blob-dir", P("nydus", "blobs"), rootfs],
                                [P("nydus")], [P("nydus", "blobs")], "unpacked tree")
    return {n: ([str(a) for a in cmd], outs, dirs, what) for n, (cmd, outs, dirs, what) in tools.items()}


def measure_convert(results, lamina, layout_ref, rootfs, work, runs):
    """Every converter `runs` times, interleaved; lamina's `--json` report."""
    out = work / "convert"
    out.mkdir(exist_ok=True)
    tools = converters(lamina.path, layout_ref, rootfs, out)
    report_json = {}

    def once(name):
        cmd, outputs, dirs, _ = tools[name]
        for o in outputs:
            m.rm(str(o))
        for d in dirs:
            os.makedirs(d, exist_ok=True)
        os.sync()
        wall, cpu, stdout = m.timed_cmd(cmd, capture=(name == "lamina"))
        if name == "lamina":
            report_json.update(json.loads(stdout))
        os.sync()
        return wall, cpu

    log("warming the page cache with the inputs")
    m.warm_files([str(DEBIAN_LAYOUT / "blobs"), str(rootfs)])
    names = list(tools)
    try:
        m.round_robin(names, runs, once, "convert", record=recorder(results, "convert"))
    except RuntimeError as e:
        if "nydus-image" not in names:
            raise
        log(f"nydus-image failed, benchmark without it: {e}")
        results.doc["runs"] = [r for r in results.doc["runs"] if r["phase"] != "convert"]
        del tools["nydus-image"]
        names.remove("nydus-image")
        m.round_robin(names, runs, once, "convert", record=recorder(results, "convert"))
    results.doc["config"]["converters"] = {
        n: {"cmd": " ".join(c).replace(str(work), "$WORK").replace(str(rootfs), "$ROOTFS"), "input": what}
        for n, (c, _, _, what) in tools.items()}
    return report_json, out


def recorder(results, phase):
    def record(system, timing):
        results.add_run(phase=phase, system=system, wall_s=round(timing[0], 6), cpu_s=round(timing[1], 6))
    return record


def measure_mounts(results, lamina, ref, mnt, work, runs):
    """Eager and lazy lamina mounts on fresh caches (the last of each is
    kept mounted); the lazy mount's status after its first full read."""
    eager, lazy = mnt / "lamina", mnt / "lamina-lazy"
    eager_cache, lazy_cache = work / "cache", work / "cache-lazy"
    eager.mkdir(parents=True, exist_ok=True)
    lazy.mkdir(parents=True, exist_ok=True)
    for i in range(runs):
        m.lamina_umount(str(lamina.path), str(eager))
        m.rm(str(eager_cache))
        os.sync()
        wall, cpu, out = m.timed_cmd([str(lamina.path), "mount", "--json", ref, str(eager),
                                      "--cache-dir", str(eager_cache)], capture=True)
        m.LAMINA_MOUNTS.append((str(lamina.path), str(eager)))
        results.add_run(phase="mount", system="lamina", wall_s=wall, cpu_s=cpu,
                        fetched_bytes=json.loads(out).get("fetched_bytes"))
        log(f"lamina mount (eager, fresh cache): run {i + 1}/{runs}: {wall:.3f}s")
    results.add_run(phase="cache", system="lamina", bytes=m.dir_bytes(str(eager_cache)))
    for i in range(runs):
        m.lamina_umount(str(lamina.path), str(lazy), str(lazy_cache))
        m.rm(str(lazy_cache))
        os.sync()
        wall, cpu, _ = m.timed_cmd([str(lamina.path), "mount", "--lazy", ref, str(lazy),
                                    "--cache-dir", str(lazy_cache)])
        m.LAMINA_MOUNTS.append((str(lamina.path), str(lazy), str(lazy_cache)))
        read_wall, read_cpu, _ = m.timed_cmd(WORKLOADS["read_all"](str(lazy)))
        status = m.lamina_status(str(lamina.path), str(lazy_cache), str(lazy))
        kept = {k: v for k, v in status.items() if k not in ("blobs", "pid", "holder_pid")}
        results.add_run(phase="mount", system="lamina-lazy", wall_s=wall, cpu_s=cpu)
        results.add_run(phase="first_read", system="lamina-lazy", wall_s=read_wall, cpu_s=read_cpu, status=kept)
        log(f"lamina mount --lazy: run {i + 1}/{runs}: mount {wall:.3f}s, first full read "
            f"{read_wall:.3f}s, fetched {status.get('fetched_bytes')} bytes")
    return {"lamina": eager, "lamina-lazy": lazy}


def measure_workloads(results, targets, warm_runs, cold_runs):
    env = dict(os.environ, LC_ALL="C")
    names = list(targets)
    for workload, cmd in WORKLOADS.items():
        for n in names:  # the untimed pass that makes them warm
            m.run_quiet(cmd(str(targets[n])), env=env)
        m.round_robin(names, warm_runs, lambda n: m.timed_cmd(cmd(str(targets[n])), env=env)[:2],
                      f"{workload} warm", record=recorder(results, f"{workload}/warm"))

        def cold(n):
            m.drop_caches()
            return m.timed_cmd(cmd(str(targets[n])), env=env)[:2]
        m.round_robin(names, cold_runs, cold, f"{workload} cold", record=recorder(results, f"{workload}/cold"))


def sizes(lamina_json, out, layer_bytes):
    P = lambda *a: str(out.joinpath(*a))  # noqa: E731
    st = lamina_json.get("stats", {})
    figures = {
        "source_layers_bytes": layer_bytes,
        "tree_file_bytes": st.get("file_bytes"),
        "tree_entries": st.get("entries"),
        "lamina": {
            "metadata_bytes": lamina_json.get("metadata_bytes"),
            "metadata_compressed_bytes": lamina_json.get("metadata_compressed_bytes"),
            "index_bytes": lamina_json.get("index_bytes"),
            "blobs": lamina_json.get("blobs"),
            "blob_bytes": sum(b["size"] for b in lamina_json.get("blobs", [])),
            "cache_bytes": sum(b["cache_size"] for b in lamina_json.get("blobs", [])),
            "oci_layout_blob_bytes": m.dir_bytes(P("lamina-oci", "blobs")),
            "dedup_ratio": lamina_json.get("dedup_ratio"),
            "stats": st,
        },
        "mksquashfs_image_bytes": m.file_size(P("squashfs.img")),
        "erofs_image_bytes": m.file_size(P("erofs.img")),
        "erofs_lz4hc_image_bytes": m.file_size(P("erofs-lz4hc.img")),
        "erofs_chunked_meta_bytes": m.file_size(P("erofs-chunked.img")),
        "erofs_chunked_blob_bytes": m.file_size(P("erofs-chunked.blob")),
    }
    if os.path.exists(P("nydus", "bootstrap")):
        figures["nydus_bootstrap_bytes"] = m.file_size(P("nydus", "bootstrap"))
        figures["nydus_blob_bytes"] = m.dir_bytes(P("nydus", "blobs"))
    return figures


def measure(results, lamina, work, quick, options):
    runs = int(options.get("runs", 1 if quick else 3))
    warm_runs = int(options.get("warm_runs", 3 if quick else 5 * runs))
    cold_runs = int(options.get("cold_runs", 2 if quick else 3 * runs))
    results.doc["config"].update(runs=runs, warm_runs=warm_runs, cold_runs=cold_runs, chunk_size=1 << 20,
                                 lamina_zstd_level=3, statistic="median")
    results.doc["machine"] = m.machine_info(str(lamina.path))
    watch = m.MachineWatch()
    layout_ref = debian_layout()
    image = m.image_info(str(DEBIAN_LAYOUT), DEBIAN_TAG)
    results.doc["config"]["image"] = image
    log("umoci unpack (the tree mksquashfs and mkfs.erofs read, and the ext4 reference)")
    run(["umoci", "unpack", "--image", f"{DEBIAN_LAYOUT}:{DEBIAN_TAG}", work / "bundle"], timeout=1200)
    rootfs = work / "bundle" / "rootfs"
    try:
        lamina_json, out = measure_convert(results, lamina, layout_ref, rootfs, work, runs)
        mnt = work / "mnt"
        targets = measure_mounts(results, lamina, f"oci:{out / 'lamina-oci'}:x", mnt, work, runs)
        for name, img, opts in (("erofs", "erofs.img", None),
                                ("erofs-chunked", "erofs-chunked.img", f"device={out / 'erofs-chunked.blob'}")):
            targets[name] = mnt / name
            targets[name].mkdir(parents=True, exist_ok=True)
            m.sys_mount(str(out / img), str(targets[name]), opts=opts)
        targets["ext4"] = rootfs
        entries = {n: m.count_entries(str(p)) for n, p in targets.items()}
        if len(set(entries.values())) != 1:
            log(f"warning: entry counts differ between filesystems: {entries}")
        results.add_run(phase="entries", **entries)
        measure_workloads(results, targets, warm_runs, cold_runs)
        results.add_run(phase="sizes", **sizes(lamina_json, out, image["layer_bytes"]))
    finally:
        m.cleanup()
    watch.note_end(results.doc["machine"])
    derive(results.doc)


def derive(doc):
    """summary (medians by phase and system, sizes, the lazy mount's status)
    and targets, from the raw runs."""
    summary = {}
    for r in doc["runs"]:
        if "wall_s" in r:
            summary.setdefault(r["phase"], {}).setdefault(r["system"], []).append(r)
    for phase, systems in summary.items():
        for system, rs in systems.items():
            wall = stats([r["wall_s"] for r in rs])
            systems[system] = dict(wall, cpu_median=stats([r["cpu_s"] for r in rs])["median"])
    for r in doc["runs"]:
        if r["phase"] in ("sizes", "entries"):
            summary[r["phase"]] = {k: v for k, v in r.items() if k != "phase"}
        elif r["phase"] == "mount" and r["system"] == "lamina":
            summary["mount"]["lamina"]["fetched_bytes"] = r.get("fetched_bytes")
        elif r["phase"] == "first_read":
            summary["first_read"]["lamina-lazy"]["status"] = r.get("status", {})
        elif r["phase"] == "cache":
            summary["mount"]["lamina"]["cache_bytes"] = r["bytes"]
    summary["ratios"] = ratios(summary)
    doc["summary"] = summary
    results = Results.of(doc)
    doc["targets"] = []
    for name, bound in TARGETS.items():
        results.target(name, summary["ratios"].get(name), "<=", bound)


def ratios(s):
    med = lambda phase, n: s[phase][n]["median"]  # noqa: E731
    sz = s["sizes"]
    out = {
        "convert_lamina_vs_mksquashfs": med("convert", "lamina") / med("convert", "mksquashfs"),
        "convert_cpu_lamina_vs_mksquashfs": s["convert"]["lamina"]["cpu_median"]
        / s["convert"]["mksquashfs"]["cpu_median"],
        "metadata_lamina_vs_erofs-chunked": sz["lamina"]["metadata_bytes"] / sz["erofs_chunked_meta_bytes"],
        "blobs_lamina_vs_source_layers": sz["lamina"]["blob_bytes"] / sz["source_layers_bytes"],
        "blobs_lamina_vs_mksquashfs_image": sz["lamina"]["blob_bytes"] / sz["mksquashfs_image_bytes"],
        "first_read_lamina-lazy_vs_cold_read_erofs": med("first_read", "lamina-lazy") / med("read_all/cold", "erofs"),
    }
    for tool in s["convert"]:
        if tool not in ("lamina", "mksquashfs"):
            out[f"convert_lamina_vs_{tool}"] = med("convert", "lamina") / med("convert", tool)
    for short, workload in (("ls", "ls_lR"), ("read", "read_all")):
        for temp in ("warm", "cold"):
            phase = f"{workload}/{temp}"
            for system, ref in (("lamina", "erofs"), ("lamina", "erofs-chunked"), ("lamina", "ext4"),
                                ("lamina-lazy", "erofs")):
                out[f"{short}_{temp}_{system}_vs_{ref}"] = med(phase, system) / med(phase, ref)
    return out


def render(doc, plot_path):
    plot(doc, plot_path)
    return tables(doc)


def spread_ms(d):
    """A summary's median and range in ms (core.stats' keys)."""
    ms = report.ms
    return f"{ms(d['median'])} ({ms(d['min'])}–{ms(d['max'])})"


def mb(n):
    return f"{n / 1e6:.2f} MB"


def tables(doc):
    s, mach, cfg = doc["summary"], doc["machine"], doc["config"]
    out = [f"Measured {mach.get('date', doc['date'])} on {mach['nproc']} vCPUs ({mach.get('cpu', '?')}), "
           f"kernel {mach['kernel']}, {mach.get('os', '')}, work dir on {mach.get('work_fs', '?')}. "
           f"Medians of {cfg['runs']} convert/mount runs, {cfg['cold_runs']} cold and {cfg['warm_runs']} warm "
           f"runs. While the bench ran ({doc['seconds']:.0f} s), other processes on the machine used "
           f"{mach.get('other_cpu_s_during_bench')} CPU-seconds (load {' '.join(mach.get('loadavg_at_start', []))}"
           f" → {' '.join(mach.get('loadavg_at_end', []))}).", ""]
    lb = mach.get("lamina_binary", {})
    if lb:
        out += [f"lamina binary sha256 `{lb.get('sha256', '?')[:16]}…` from commit `{lb.get('git_head', '?')[:10]}`"
                f"{' (working tree had uncommitted changes)' if lb.get('git_tree_dirty') else ''}.", ""]
    out += ["### Targets", "", report.targets(doc), ""]
    out += convert_table(s, cfg) + read_tables(s) + mount_table(s) + size_table(s)
    return "\n".join(out) + "\n"


def convert_table(s, cfg):
    c = s["convert"]
    rows = [(n, cfg.get("converters", {}).get(n, {}).get("input", ""), v["median"],
             f"{v['min']:.2f}–{v['max']:.2f}", v["cpu_median"], f"{c['lamina']['median'] / v['median']:.3f}")
            for n, v in c.items()]
    return ["### Convert", "", report.table(("tool", "input", "median s", "min–max s", "CPU s (user+sys)",
                                             "lamina / tool"), rows), ""]


def read_tables(s):
    rows = [(FS_LABEL.get(n, n), spread_ms(s["ls_lR/warm"][n]), spread_ms(s["ls_lR/cold"][n]),
             spread_ms(s["read_all/warm"][n]), spread_ms(s["read_all/cold"][n])) for n in s["ls_lR/warm"]]
    rt = s["ratios"]
    ratio_rows = [(label, f"{rt[key.format('warm')]:.3f}", f"{rt[key.format('cold')]:.3f}") for label, key in (
        ("`ls -lR` lamina / mkfs.erofs", "ls_{}_lamina_vs_erofs"),
        ("`ls -lR` lamina / mkfs.erofs chunked", "ls_{}_lamina_vs_erofs-chunked"),
        ("`ls -lR` lamina / ext4", "ls_{}_lamina_vs_ext4"),
        ("read all lamina / mkfs.erofs", "read_{}_lamina_vs_erofs"),
        ("`ls -lR` lamina --lazy / mkfs.erofs", "ls_{}_lamina-lazy_vs_erofs"),
        ("read all lamina --lazy / mkfs.erofs", "read_{}_lamina-lazy_vs_erofs"))]
    return ["### `ls -lR` and full read (ms; median, min–max in parentheses)", "",
            report.table(("filesystem", "`ls -lR` warm", "`ls -lR` cold", "read all warm", "read all cold"), rows),
            "", report.table(("ratio", "warm", "cold"), ratio_rows), ""]


def mount_table(s):
    lm, lz, fr = s["mount"]["lamina"], s["mount"]["lamina-lazy"], s["first_read"]["lamina-lazy"]
    st = fr.get("status", {})
    rows = [
        ("`lamina mount` (eager, fresh cache: whole image fetched and decompressed)", f"{lm['median']:.3f}",
         f"{lm['min']:.3f}–{lm['max']:.3f}", mb(lm["fetched_bytes"])),
        ("`lamina mount --lazy` (fresh cache)", f"{lz['median']:.3f}", f"{lz['min']:.3f}–{lz['max']:.3f}", "0"),
        ("first full read of the fresh lazy mount (fetch on demand)", f"{fr['median']:.3f}",
         f"{fr['min']:.3f}–{fr['max']:.3f}",
         f"{mb(st.get('fetched_bytes', 0))} in {st.get('requests')} requests, {st.get('misses')} misses"),
    ]
    return ["### Mount", "", report.table(("step", "median s", "min–max s", "fetched"), rows), ""]


def size_table(s):
    sz, rt = s["sizes"], s["ratios"]
    L = sz["lamina"]
    rows = [
        ("source layers (2 × tar+gzip)", sz["source_layers_bytes"], ""),
        ("regular-file bytes in the tree", sz["tree_file_bytes"], f"{sz['tree_entries']} entries"),
        ("lamina metadata (EROFS image)", L["metadata_bytes"],
         f"{rt['metadata_lamina_vs_erofs-chunked']:.3f} × mkfs.erofs chunked metadata"),
        ("lamina metadata, zstd (as pushed)", L["metadata_compressed_bytes"], ""),
        ("lamina chunk index (raw)", L["index_bytes"], ""),
        ("lamina blobs, zstd", L["blob_bytes"], f"{rt['blobs_lamina_vs_source_layers']:.3f} × source layers; "
         + ", ".join(mb(b["size"]) for b in L["blobs"])),
        ("lamina blob cache files (uncompressed)", L["cache_bytes"], ""),
        ("lamina OCI artifact, all blobs", L["oci_layout_blob_bytes"], ""),
        ("mksquashfs -comp zstd image", sz["mksquashfs_image_bytes"], ""),
        ("mkfs.erofs image (uncompressed)", sz["erofs_image_bytes"], ""),
        ("mkfs.erofs -zlz4hc image", sz["erofs_lz4hc_image_bytes"], ""),
        ("mkfs.erofs chunked: metadata image", sz["erofs_chunked_meta_bytes"], ""),
        ("mkfs.erofs chunked: blob", sz["erofs_chunked_blob_bytes"], ""),
    ]
    st = L["stats"]
    return ["### Sizes", "", report.table(("what", "bytes", ""), [(k, f"{v:,}", n) for k, v, n in rows]), "",
            f"Dedup: {st['chunk_refs']:,} chunk references, {st['chunks_stored']:,} chunks stored, "
            f"dedup ratio {L['dedup_ratio']:.4f} (referenced / stored bytes: "
            f"{st['referenced_bytes']:,} / {st['stored_bytes']:,})."]


def plot(doc, path):
    """Three panels, medians labelled: convert seconds per tool; `ls -lR` and
    a full read, warm and cold, per filesystem."""
    plt = report.pyplot()
    if plt is None:
        return
    s = doc["summary"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.6), gridspec_kw={"width_ratios": [1, 1.25, 1.25]})
    names = list(s["convert"])
    bars = axes[0].bar(range(len(names)), [s["convert"][n]["median"] for n in names],
                       color=[report.LAMINA if n == "lamina" else report.OTHER for n in names])
    report.label_bars(axes[0], bars, "{:.2f}")
    axes[0].set_xticks(range(len(names)))
    axes[0].set_xticklabels([n.replace("mkfs.erofs-", "mkfs.erofs\n") for n in names], fontsize=8)
    axes[0].set_ylabel("seconds (median)")
    axes[0].set_title(f"convert Debian image\nlamina / mksquashfs = {s['ratios']['convert_lamina_vs_mksquashfs']:.3f}"
                      f" (target <= {TARGETS['convert_lamina_vs_mksquashfs']})", fontsize=10)
    for ax, workload, title, short in ((axes[1], "ls_lR", "ls -lR MNT > /dev/null", "ls"),
                                       (axes[2], "read_all", "read every file (find | xargs cat)", "read")):
        warm_cold_panel(ax, s, workload, short, title)
    sz, cfg = s["sizes"], doc["config"]
    fig.suptitle(f"lamina on Debian bookworm ({sz['tree_entries']} entries, {sz['tree_file_bytes'] / 1e6:.0f} MB "
                 f"of files) - {doc['date'][:10]}, kernel {doc['machine']['kernel']}, {doc['machine']['nproc']} "
                 f"CPUs; medians of {cfg['runs']} convert, {cfg['cold_runs']} cold, {cfg['warm_runs']} warm runs",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)


def warm_cold_panel(ax, s, workload, short, title):
    names = list(s[f"{workload}/warm"])
    warm = [s[f"{workload}/warm"][n]["median"] * 1000 for n in names]
    cold = [s[f"{workload}/cold"][n]["median"] * 1000 for n in names]
    w, xs = 0.38, range(len(names))
    b1 = ax.bar([x - w / 2 for x in xs], warm, w, label="warm", color=report.WARM)
    b2 = ax.bar([x + w / 2 for x in xs], cold, w, label="cold (drop_caches)", color=report.COLD)
    report.label_bars(ax, list(b1) + list(b2), "{:.0f}")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([{"lamina": "lamina", "lamina-lazy": "lamina\n--lazy\n(filled)",
                         "erofs": "mkfs.erofs\nuncompr.", "erofs-chunked": "mkfs.erofs\nchunked",
                         "ext4": "ext4 dir\n(reference)"}.get(n, n) for n in names], fontsize=8)
    for label in ax.get_xticklabels():
        if label.get_text().startswith("lamina"):
            label.set_color(report.LAMINA)
            label.set_fontweight("bold")
    ax.set_ylabel("milliseconds (median)")
    rt = s["ratios"]
    ax.set_title(f"{title}\nlamina / mkfs.erofs: warm {rt[f'{short}_warm_lamina_vs_erofs']:.3f}, "
                 f"cold {rt[f'{short}_cold_lamina_vs_erofs']:.3f}", fontsize=10)
    ax.set_ylim(0, max(warm + cold) * 1.3)
    ax.legend(fontsize=8, loc="upper center", ncol=2, frameon=False)


BENCHMARK = {
    "out": ROOT / "docs" / "bench-results.json",
    "plot": ROOT / "docs" / "bench.png",
    "tables_in": "docs/benchmarks.md",
    "needs": ["umoci", "mksquashfs", "mkfs.erofs", "findmnt"],
    "measure": measure,
    "derive": derive,
    "render": render,
}
