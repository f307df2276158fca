#!/usr/bin/env python3
"""Chart of a scripts/bench_fuse.sh result file.

Usage: bench_fuse_plot.py RESULTS.json OUT.png

Panels (medians, labelled): ls -lR warm/cold ms per filesystem; stat+open
paths/s warm/cold; fio MB/s sequential/random; FUSE daemon RSS after mount
and after ls -lR per image size (when measured). Needs python3-matplotlib.
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench.harness
from bench.harness.report import COLD, LAMINA, WARM, label_bars as harness_label_bars  # noqa: E402

SHORT = {"erofs": "kernel\nEROFS\n(ref)", "lamina-kernel": "lamina\nkernel", "lamina-fuse": "lamina\nFUSE",
         "lamina-fuse-fresh": "lamina\nFUSE\nnew\ndaemon", "squashfuse": "squash-\nfuse", "ext4": "ext4", "nydusd": "nydusd"}


def label_bars(ax, bars, fmt):
    harness_label_bars(ax, bars, fmt, fontsize=7)


def pair_panel(ax, names, a, b, la, lb, ylabel, title, fmt):
    w = 0.38
    xs = range(len(names))
    b1 = ax.bar([x - w / 2 for x in xs], a, w, label=la, color=WARM)
    b2 = ax.bar([x + w / 2 for x in xs], b, w, label=lb, color=COLD)
    label_bars(ax, list(b1) + list(b2), fmt)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([SHORT.get(n, n) for n in names], fontsize=8)
    for lbl in ax.get_xticklabels():
        if lbl.get_text().startswith("lamina\nFUSE"):
            lbl.set_color(LAMINA)
            lbl.set_fontweight("bold")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, max(x for x in a + b if x == x) * 1.3)
    ax.legend(fontsize=8, loc="upper center", ncol=2, frameon=False)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        r = json.load(f)
    rt = r["ratios"]
    panels = 2 + ("fio" in r) + ("big" in r)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 5.4))
    ls = r["ls_lR"]
    names = list(ls["cold"])
    nan = float("nan")
    pair_panel(axes[0], names, [ls["warm"][n]["median_s"] * 1000 if n in ls["warm"] else nan for n in names],
               [ls["cold"][n]["median_s"] * 1000 for n in names], "warm", "cold (drop_caches)",
               "milliseconds (median)",
               f"ls -lR Debian tree\nlamina FUSE / EROFS: warm {rt['ls_warm_lamina-fuse_vs_erofs']['value']:.2f}, "
               f"cold {rt['ls_cold_lamina-fuse_vs_erofs']['value']:.2f}", "{:.0f}")
    so = r["stat_open"]
    pair_panel(axes[1], names, [so["warm"][n]["paths_per_s"] / 1000 if n in so["warm"] else nan for n in names],
               [so["cold"][n]["paths_per_s"] / 1000 for n in names], "warm", "cold (drop_caches)",
               "thousand paths per second (median)",
               f"stat+open+close, {so['paths']} deepest files\nlamina FUSE / EROFS: warm "
               f"{rt['stat_open_warm_lamina-fuse_vs_erofs']['value']:.2f}, cold "
               f"{rt['stat_open_cold_lamina-fuse_vs_erofs']['value']:.2f}", "{:.1f}")
    i = 2
    if "fio" in r:
        f = r["fio"]
        fn = ["ext4", "lamina-fuse", "lamina-kernel"]
        pair_panel(axes[i], fn, [f["seq"][n]["mb_s"] for n in fn], [f["rand"][n]["mb_s"] for n in fn],
                   "sequential", "random", "MB/s (median)",
                   f"fio 4 KiB buffered reads, cold, {f['file_bytes'] / 2**20:.0f} MiB file\nlamina FUSE / ext4: "
                   f"seq {rt['fio_seq_lamina-fuse_vs_ext4']['value']:.2f}, "
                   f"rand {rt['fio_rand_lamina-fuse_vs_ext4']['value']:.2f}", "{:.0f}")
        i += 1
    if "big" in r:
        by = r["big"]["by_files"]
        ks = list(by)
        after_mount = [(by[k]["rss_after_mount"] or {}).get("VmRSS_kib", 0) / 1024 for k in ks]
        after_ls = [(by[k]["rss_after_ls"] or {}).get("VmRSS_kib", 0) / 1024 for k in ks]
        ax = axes[i]
        pair_panel(ax, [f"{int(k):,} files" for k in ks], after_mount, after_ls, "after mount", "after ls -lR",
                   "FUSE daemon VmRSS, MiB",
                   "FUSE daemon RSS; eager mount (filled cache) ms: "
                   + ", ".join(f"{by[k]['fuse_mount']['median_s'] * 1000:.0f}" for k in ks), "{:.1f}")
    m = r["machine"]
    fig.suptitle(f"lamina FUSE benchmark - {m['date'][:10]}, kernel {m['kernel']}, {m['nproc']} CPUs; "
                 f"commit {m.get('lamina_binary', {}).get('git_head', '?')[:10]}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(sys.argv[2], dpi=100)


if __name__ == "__main__":
    main()
