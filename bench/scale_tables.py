"""Tables and plot of `python3 -m bench scale` (moved from
scripts/bench_scale_report.py and bench_scale_plot.py)."""

from .harness.report import COLD, LAMINA, WARM, kib_mib, label_bars, met_cell, notes, pyplot, spread_ms
from .harness.report import binary as report_binary

FS_LABEL = {
    "erofs": "kernel EROFS (mkfs.erofs image, file-backed; reference)",
    "lamina-kernel": "lamina, kernel path, lazy",
    "lamina-fuse": "lamina FUSE, lazy",
}
TARGET_TEXT = {
    "wire_before_first_read_vs_erofs_metadata": "bytes before the first read / mkfs.erofs metadata",
    "registry_wire_before_first_read_vs_erofs_metadata":
        "bytes on the registry's link before the first read (answer bodies) / mkfs.erofs metadata",
    "read_one_file_requests": "requests to read one small file after mount",
    "lazy_mount_s": "lazy mount, s",
    "daemon_rss_mib": "daemons' RSS (sum of VmRSS, highest of after mount / read / `ls -lR`), MiB",
    "daemon_rss_vs_smallest": "daemons' RSS / the same at the smallest size",
    "daemon_rss_anon_vs_smallest": "daemons' RssAnon (highest of the three) / the same at the smallest size",
    "convert_lamina_vs_mkfs_erofs": "convert time, lamina / mkfs.erofs",
    "ls_warm_vs_erofs": "`ls -lR` warm, lamina / kernel EROFS",
    "ls_cold_vs_erofs": "`ls -lR` cold, lamina / kernel EROFS",
    "python_packed_vs_unpacked_bytes": "python3 start, bytes fetched, packed / unpacked",
    "python_packed_vs_unpacked_requests": "python3 start, requests, packed / unpacked",
}


def mb(b):
    return f"{b / 1e6:.2f}" if b is not None else "–"


def tables(r):
    """The Markdown tables of `bench.scale.view(doc)`."""
    out = []
    for section in (heading, targets_table, convert_table, lazy_tables, ls_table, python_table):
        section(r, out.append)
    out += notes(r)
    return "\n".join(out) + "\n"


def heading(r, w):
    """When, where and how the figures were measured."""
    m, cfg = r["machine"], r["config"]
    sizes = [str(s) for s in cfg["sizes"]]
    w(("**Quick run** (`--quick`): " if r.get("quick") else "")
      + f"measured {m['date']} on {m['nproc']} vCPUs ({m.get('cpu', '?')}), kernel {m['kernel']}, "
      f"{m.get('os', '')}, work dir on {m.get('work_fs', '?')}. Image sizes: "
      f"{', '.join(f'{int(s):,}' for s in sizes)} files"
      + (" with varied metadata (every file a name of its own, mtimes spread over a year)"
         if cfg.get("metadata") == "varied" else "")
      + f". Medians of {cfg['runs']} run(s) of convert and "
      f"mounts, {cfg['warm_runs']} warm and {cfg['cold_runs']} cold runs of `ls -lR`, {cfg['py_runs']} python3 "
      f"starts per variant. While the bench ran ({r['bench_seconds']:.0f} s), other processes on the machine "
      f"used {m.get('other_cpu_s_during_bench')} CPU-seconds (load {' '.join(m.get('loadavg_at_start', []))} → "
      f"{' '.join(m.get('loadavg_at_end', []))}).")
    load = [float(x) for x in m.get("loadavg_at_start", []) + m.get("loadavg_at_end", [])[:1]]
    if load and max(load) >= 1.5:
        w("")
        w(f"The machine was shared and busy during this run (load average up to {max(load):.1f} on "
          f"{m['nproc']} vCPUs at its start and end): the times below (convert, mount, `ls -lR`) include "
          "waiting for the CPU behind other processes.")
    w("")
    w(report_binary(m))
    if "1000000" not in sizes:
        w("")
        w("The targets are set at 1,000,000 files; this run has no 1,000,000-file image, so the table "
          "below evaluates them at the sizes measured and says nothing about 1M files.")


def targets_table(r, w):
    """Every figure with a target, by size and path."""
    rt = r["ratios"]
    w("")
    w("### Targets")
    w("")
    w("| figure | files / path | value | target | met |")
    w("|---|---|---:|---:|---|")
    for k, x in rt.items():
        if not x["target"]:
            continue
        name, _, where = k.partition("@")
        if where:
            n, _, path = where.partition("/")
            where = f"{int(n):,}" + (f" / {path}" if path else "")
        w(f"| {TARGET_TEXT.get(name, name)} | {where or '–'} | {x['value']:.3f} | {x['target']} | {met_cell(x)} |")


def convert_table(r, w):
    """Convert time and peak RSS, lamina against mkfs.erofs."""
    by = r["by_files"]
    w("")
    w("### Convert (wall s and peak RSS MiB; median, min–max in parentheses)")
    w("")
    w("| files | lamina convert s | mkfs.erofs s | lamina / mkfs.erofs | lamina peak RSS MiB | "
      "mkfs.erofs peak RSS MiB | source layer MB (gzip) | lamina image MB | mkfs.erofs image MB |")
    w("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, x in by.items():
        c = x["convert"]
        lo, me = c["lamina"], c["mkfs.erofs"]
        w(f"| {int(k):,} | {lo['median_s']:.2f} ({lo['min_s']:.2f}–{lo['max_s']:.2f}) | "
          f"{me['median_s']:.2f} ({me['min_s']:.2f}–{me['max_s']:.2f}) | {lo['median_s'] / me['median_s']:.2f} | "
          f"{kib_mib(lo['peak_rss_kib'])} | {kib_mib(me['peak_rss_kib'])} | {mb(x['source']['layer_bytes'])} | "
          f"{mb(x['lamina_oci_bytes'])} | {mb(x['erofs_image_bytes'])} |")
    w("")
    w("lamina reads the gzip layer from the OCI layout; mkfs.erofs reads the extracted tree from a tmpfs "
      "(both warm in memory). lamina image: every file of the output layout (data blob, metadata layers, "
      "manifest, config).")


def lazy_tables(r, w):
    """Bytes before the first read, one small file, mount, daemons; and from a registry."""
    by = r["by_files"]
    w("")
    w("### Before the first read, one small file, mount, daemons")
    w("")
    w("| files | path | bytes before first read (compressed layers) | mkfs.erofs metadata bytes | ratio | "
      "C/meta layers (uncompressed bytes) | lazy mount ms | read one file: bytes, requests | "
      "daemons' VmRSS MiB after mount / read / `ls -lR` (highest RssAnon) |")
    w("|---:|---|---:|---:|---:|---|---:|---:|---:|")
    for k, x in by.items():
        em = x["erofs_metadata"]["metadata_bytes"]
        for mode, lz in x["lazy"].items():
            layers = " + ".join(f"{t.split('.')[1]} {b:,}" for t, b in lz["wire_before_first_read_layers"].items())
            w(f"| {int(k):,} | {mode} | {lz['wire_before_first_read_bytes']:,} ({layers}) | {em:,} | "
              f"{lz['wire_before_first_read_bytes'] / em:.3f} | {', '.join(l.split('.')[1] for l in lz['meta_files_layers'])}"
              f" ({lz['meta_files_bytes']:,}){'' if lz['meta_files_match_wire_layers'] else ' **mismatch**'} | "
              f"{lz['mount']['median_s'] * 1000:.1f} | {lz['read_one_file_bytes']:,}, {lz['read_one_file_requests']} | "
              f"{kib_mib(lz['rss_after_mount_kib'])} / {kib_mib(lz['rss_after_read_kib'])} / "
              f"{kib_mib(x['rss_after_ls'][mode]['VmRSS_kib'])} ({kib_mib(lz['rss_anon_max_kib'])}) |")
    w("")
    if any(x.get("registry_wire") for x in by.values()):
        w("**From a registry.** The image pushed to a local registry (skopeo, digests kept) and mounted lazily "
          "through `tests/tools/faultproxy.py` spoiling nothing, which counts the answer bodies it sends (manifest, "
          "config, layers): right after the mount (and `settle` s), then right after reading the one file (the "
          "metadata frames a lazy FUSE mount fetches for it included), then 12 s more (a lazy mount fetches layers no "
          "reader waits for, such as the FUSE lookup table and the rest of its metadata, once the start is over).")
        w("")
        w("| files | path | bytes before first read | / mkfs.erofs metadata | answers | reading one file: bytes (answers) | bytes once the start was over |")
        w("|---:|---|---:|---:|---:|---:|---:|")
        for k, x in by.items():
            em = x["erofs_metadata"]["metadata_bytes"]
            for mode, g in (x.get("registry_wire") or {}).items():
                if "before_first_read_body_bytes" not in g:
                    continue  # the index's own figures, below
                one = (f"{g['read_one_file_body_bytes']:,} ({g['read_one_file_requests']})"
                       if "read_one_file_body_bytes" in g else "–")
                w(f"| {int(k):,} | {mode} | {g['before_first_read_body_bytes']:,} | "
                  f"{g['before_first_read_body_bytes'] / em:.3f} | {g['before_first_read_requests']} | {one} | "
                  f"{g['after_read_and_quiet_body_bytes']:,} |")
        w("")
        for k, x in by.items():
            ix = (x.get("registry_wire") or {}).get("index")
            if ix:
                w(f"Paths index-kernel and index-fuse: the unmodified source image ({int(k):,} files, "
                  f"{ix['image_layer_bytes']:,} bytes of layers) pushed beside it and mounted through its tar "
                  f"index (`lamina index` at its defaults: {ix['s']:.1f} s, an artifact of "
                  f"{ix['artifact_bytes']:,} bytes).")
                w("")
    w("mkfs.erofs metadata: the image of `mkfs.erofs --chunksize=1048576 --blobdev=BLOB` (file data in BLOB), "
      "what an EROFS client must have before its first read. Bytes before the first read: the compressed "
      "sizes, from the manifest, of the layers lamina fetches at mount (index and EROFS metadata; of metadata that "
      "lists its frames a lazy FUSE mount fetches the first frame alone, and the rest as reads need them or once "
      "the start is over; a lazy FUSE mount "
      "fetches the lookup table once the start is over (its first read, then 500 ms without one, or 10 s without "
      "any), waited for before the one-file read); the C/meta column lists the layer files found in the cache dir after the mount, "
      "each checked against the manifest's digest and uncompressed size. Read one file: `lamina status` "
      "fetched_bytes and requests before and after reading (the worker's: not the metadata frames a lazy FUSE "
      "mount's daemon fetches itself, which the registry table counts) "
      + ", ".join(f"`{x['one_file']}`" for x in list(by.values())[:1]) + " (and the same file position at "
      "every size). Daemons: every process whose command line names the mount's cache dir (kernel path: "
      "`internal-holder` + `internal-worker`; FUSE: `internal-fuse` + `internal-worker`), VmRSS and RssAnon "
      "summed over them (the JSON has every process's VmRSS, RssAnon, RssFile and VmHWM).")


def ls_table(r, w):
    """`ls -lR` warm and cold by size and filesystem."""
    by = r["by_files"]
    w("")
    w("### `ls -lR` (ms; median, min–max in parentheses)")
    w("")
    w("| files | filesystem | warm | cold | warm / EROFS | cold / EROFS |")
    w("|---:|---|---:|---:|---:|---:|")
    for k, x in by.items():
        ls = x["ls_lR"]
        for n in ls["warm"]:
            w(f"| {int(k):,} | {FS_LABEL.get(n, n)} | {spread_ms(ls['warm'][n])} | {spread_ms(ls['cold'][n])} | "
              f"{ls['warm'][n]['median_s'] / ls['warm']['erofs']['median_s']:.3f} | "
              f"{ls['cold'][n]['median_s'] / ls['cold']['erofs']['median_s']:.3f} |")
    w("")
    w("Entries on each mount: " + "; ".join(
        f"{int(k):,} files: " + (f"{next(iter(x['entries'].values())):,} on every mount"
                                 if len(set(x["entries"].values())) == 1 else str(x["entries"]))
        for k, x in by.items()) + ".")


def python_table(r, w):
    """python3 starts before and after small-file packing."""
    py = r.get("python")
    if py:
        w("")
        w("### python3 start on the Debian image, before and after small-file packing")
        w("")
        w(f"`{py['cmd']}` on a fresh lazy kernel mount (fresh cache dir, drop_caches before); "
          "`lamina status` after the start. Median, all runs in parentheses.")
        w("")
        w("| image | convert | packs / packed files | fetched bytes | requests | of which misses |")
        w("|---|---|---:|---:|---:|---:|")
        for v, x in py["variants"].items():
            st = x.get("stats") or {}
            rb = ", ".join(f"{y['fetched_bytes']:,}" for y in x["runs"])
            rq = ", ".join(str(y["requests"]) for y in x["runs"])
            w(f"| {v} | `{x['convert_flags']}` | {st.get('packs', 0):,} / {st.get('packed_files', 0):,} | "
              f"{x['fetched_bytes']:,.0f} ({rb}) | {x['requests']:g} ({rq}) | {x['miss_requests']:g} |")


EROFS = "#7570b3"
FUSE = "#e7298a"


def lines(ax, xs, series, ylabel, title, log=False):
    for label, ys, color, style in series:
        ax.plot(xs, ys, style, color=color, label=label, marker="o")
        for x, y in zip(xs, ys):
            if y is not None:
                ax.annotate(f"{y:.3g}", (x, y), textcoords="offset points", xytext=(0, 5), ha="center",
                            fontsize=7, color=color)
    ax.set_xscale("log")
    if log:
        ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x:,}" for x in xs], fontsize=8)
    ax.set_xlabel("files")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, frameon=False)
    ax.grid(alpha=0.3)


def plot(r, path):
    """Eight panels: convert time and RSS, bytes before the first read, mount time, daemons' RSS, `ls -lR`,
    python3's bytes and requests; by image size."""
    plt = pyplot()
    if plt is None:
        return
    by = r["by_files"]
    ks = list(by)
    xs = [int(k) for k in ks]
    fig, axes = plt.subplots(2, 4, figsize=(22, 10))
    ax = axes.flat
    lines(ax[0], xs, [("lamina convert", [by[k]["convert"]["lamina"]["median_s"] for k in ks], LAMINA, "-"),
                      ("mkfs.erofs", [by[k]["convert"]["mkfs.erofs"]["median_s"] for k in ks], EROFS, "--")],
          "seconds (median)", "convert time (target: lamina ≤ 0.5 × mkfs.erofs)", log=True)
    lines(ax[1], xs, [("lamina convert", [by[k]["convert"]["lamina"]["peak_rss_kib"] / 1024 for k in ks],
                       LAMINA, "-"),
                      ("mkfs.erofs", [by[k]["convert"]["mkfs.erofs"]["peak_rss_kib"] / 1024 for k in ks],
                       EROFS, "--")],
          "peak RSS, MiB", "convert peak RSS", log=True)
    lines(ax[2], xs, [("lamina kernel path", [by[k]["lazy"]["kernel"]["wire_before_first_read_bytes"] / 1e6
                                               for k in ks], LAMINA, "-"),
                      ("lamina FUSE", [by[k]["lazy"]["fuse"]["wire_before_first_read_bytes"] / 1e6
                                                         for k in ks], FUSE, "-"),
                      ("mkfs.erofs metadata", [by[k]["erofs_metadata"]["metadata_bytes"] / 1e6 for k in ks],
                       EROFS, "--"),
                      ("0.1 × mkfs.erofs metadata (target)",
                       [by[k]["erofs_metadata"]["metadata_bytes"] / 1e7 for k in ks], "grey", ":")],
          "MB", "bytes before the first read", log=True)
    lines(ax[3], xs, [(f"lamina {m}", [by[k]["lazy"][m]["mount"]["median_s"] * 1000 for k in ks],
                       LAMINA if m == "kernel" else FUSE, "-") for m in ("kernel", "fuse")],
          "ms (median)", "lazy mount time (target ≤ 300 ms)")
    lines(ax[4], xs, [(f"lamina {m} VmRSS", [by[k]["lazy"][m]["rss_max_kib"] / 1024 for k in ks],
                       LAMINA if m == "kernel" else FUSE, "-") for m in ("kernel", "fuse")]
          + [(f"lamina {m} RssAnon", [by[k]["lazy"][m]["rss_anon_max_kib"] / 1024 for k in ks],
              LAMINA if m == "kernel" else FUSE, ":") for m in ("kernel", "fuse")],
          "MiB", "daemons' RSS (sum, highest of mount/read/ls; target ≤ 32)")
    ax[4].set_ylim(bottom=0)
    series = []
    for t, color in (("warm", WARM), ("cold", COLD)):
        for n, style in (("erofs", "--"), ("lamina-kernel", "-"), ("lamina-fuse", "-.")):
            series.append((f"{n} {t}", [by[k]["ls_lR"][t][n]["median_s"] for k in ks], color, style))
    lines(ax[5], xs, series, "seconds (median)", "ls -lR (targets: warm ≤ 1.0, cold ≤ 0.5 × EROFS)", log=True)
    py = r.get("python")
    if py:
        names = list(py["variants"])
        for i, (key, label, scale) in enumerate((("fetched_bytes", "MB fetched", 1e6), ("requests", "requests", 1))):
            a = ax[6 + i]
            bars = a.bar(names, [py["variants"][v][key] / scale for v in names], color=[WARM, LAMINA][:len(names)])
            label_bars(a, list(bars), "{:.2f}" if scale != 1 else "{:.0f}", fontsize=7)
            a.set_ylabel(f"{label} (median of {r['config']['py_runs']})")
            a.set_title(f"python3 start, Debian image: {label}\n(unpacked: --pack-limit 0; packed: default 16K)",
                        fontsize=10)
    else:
        ax[6].axis("off")
        ax[7].axis("off")
    m = r["machine"]
    fig.suptitle(f"lamina scale benchmark{' (QUICK RUN)' if r.get('quick') else ''} - {m['date'][:10]}, "
                 f"kernel {m['kernel']}, {m['nproc']} CPUs, load {' '.join(m.get('loadavg_at_start', []))}; "
                 f"commit {m.get('lamina_binary', {}).get('git_head', '?')[:10]}", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=90)
    plt.close(fig)
