#!/usr/bin/env python3
"""Chart of a scripts/bench_scale.sh result file.

Usage: bench_scale_plot.py RESULTS.json OUT.png

Panels (medians, against the number of files): convert s and peak RSS,
lamina vs mkfs.erofs; bytes before the first read vs mkfs.erofs metadata;
lazy mount ms; daemons' RSS; `ls -lR` warm and cold; python3 start bytes and
requests before/after packing. Needs python3-matplotlib.
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench.harness
from bench.harness.report import COLD, LAMINA, WARM, label_bars as harness_label_bars  # noqa: E402


def label_bars(ax, bars, fmt):
    harness_label_bars(ax, bars, fmt, fontsize=7)

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


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        r = json.load(f)
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
            label_bars(a, list(bars), "{:.2f}" if scale != 1 else "{:.0f}")
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
    fig.savefig(sys.argv[2], dpi=90)


if __name__ == "__main__":
    main()
