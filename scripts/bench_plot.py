#!/usr/bin/env python3
"""Bar chart of a scripts/bench.sh result file.

Usage: bench_plot.py RESULTS.json OUT.png

Three panels, medians labelled with their values:
  1. convert seconds per tool;
  2. ls -lR warm / cold milliseconds per filesystem;
  3. full read (every regular file) warm / cold milliseconds per filesystem.
Needs python3-matplotlib (Debian package).
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LAMINA = "#d95f02"
OTHER = "#7570b3"
WARM = "#66a61e"
COLD = "#1f78b4"


def label_bars(ax, bars, fmt):
    top = max((b.get_height() for b in bars), default=0)
    for b in bars:
        h = b.get_height()
        ax.text(b.get_x() + b.get_width() / 2, h + top * 0.015, fmt.format(h),
                ha="center", va="bottom", fontsize=8)


def convert_panel(ax, r):
    conv = r["convert"]
    names = list(conv)
    vals = [conv[n]["median_s"] for n in names]
    bars = ax.bar(range(len(names)), vals, color=[LAMINA if n == "lamina" else OTHER for n in names])
    label_bars(ax, bars, "{:.2f}")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.replace("mkfs.erofs-", "mkfs.erofs\n") for n in names], fontsize=8)
    ax.set_ylabel("seconds (median)")
    rt = r["ratios"]["convert_lamina_vs_mksquashfs"]
    ax.set_title(f"convert Debian image\nlamina / mksquashfs = {rt['value']:.3f} (target <= {rt['target_max']})",
                 fontsize=10)
    ax.set_ylim(0, max(vals) * 1.15)


def warm_cold_panel(ax, r, key, title, ratio_prefix):
    data = r[key]
    names = list(data["warm"])
    warm = [data["warm"][n]["median_s"] * 1000 for n in names]
    cold = [data["cold"][n]["median_s"] * 1000 for n in names]
    w = 0.38
    xs = range(len(names))
    b1 = ax.bar([x - w / 2 for x in xs], warm, w, label="warm", color=WARM)
    b2 = ax.bar([x + w / 2 for x in xs], cold, w, label="cold (drop_caches)", color=COLD)
    label_bars(ax, list(b1) + list(b2), "{:.0f}")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([{"lamina": "lamina", "lamina-lazy": "lamina\n--lazy\n(filled)",
                         "erofs": "mkfs.erofs\nuncompr.", "erofs-chunked": "mkfs.erofs\nchunked",
                         "ext4": "ext4 dir\n(reference)"}.get(n, n) for n in names], fontsize=8)
    for lbl in ax.get_xticklabels():
        if lbl.get_text().startswith("lamina"):
            lbl.set_color(LAMINA)
            lbl.set_fontweight("bold")
    ax.set_ylabel("milliseconds (median)")
    rw = r["ratios"][f"{ratio_prefix}_warm_lamina_vs_erofs"]["value"]
    rc = r["ratios"][f"{ratio_prefix}_cold_lamina_vs_erofs"]["value"]
    ax.set_title(f"{title}\nlamina / mkfs.erofs: warm {rw:.3f}, cold {rc:.3f}", fontsize=10)
    ax.set_ylim(0, max(warm + cold) * 1.3)
    ax.legend(fontsize=8, loc="upper center", ncol=2, frameon=False)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        r = json.load(f)
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.6), gridspec_kw={"width_ratios": [1, 1.25, 1.25]})
    convert_panel(axes[0], r)
    warm_cold_panel(axes[1], r, "ls_lR", "ls -lR MNT > /dev/null", "ls")
    warm_cold_panel(axes[2], r, "read_all", "read every file (find | xargs cat)", "read")
    m = r["machine"]
    s = r["sizes"]
    fig.suptitle(f"lamina on Debian bookworm ({s['tree_entries']} entries, "
                 f"{s['tree_file_bytes'] / 1e6:.0f} MB of files) - {m['date'][:10]}, kernel {m['kernel']}, "
                 f"{m['nproc']} CPUs; medians of {r['config']['runs']} convert, "
                 f"{r['config'].get('cold_runs', r['config']['runs'])} cold, {r['config']['warm_runs']} warm runs",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
