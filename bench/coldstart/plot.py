"""The cold-start benchmark's chart (docs/coldstart.png and the like), from
a results file as summary.view gives it."""

from ..harness import report

COLORS = {"containerd": "#7570b3", "lamina": "#d95f02", "lamina-boot": "#1b9e77", "snapshotter": "#e7298a",
          "snapshotter-boot": "#66a61e", "run": "#e6ab02", "run-boot": "#a6761d", "local": "#1f78b4",
          "proxy": "#999999", "faults": "#e31a1c", "faults-nohedge": "#fb9a99", "index": "#6a3d9a",
          "index-boot": "#cab2d6", "docker-index": "#0db7ed", "lamina-nopredict": "#fdbf6f", "lamina-static": "#b15928",
          "index-static": "#8c6bb1", "lamina-all": "#33a02c", "lamina-base": "#999999", "lamina-base-boot": "#bbbbbb",
          "lamina-rests": "#e6ab02"}
LABELS = {"containerd": "containerd 1.6: pull + ctr run", "lamina": "lamina: lazy mount + runc",
          "lamina-boot": "lamina + boot set", "snapshotter": "containerd + lamina snapshotter",
          "snapshotter-boot": "lamina snapshotter + boot set", "run": "lamina run",
          "run-boot": "lamina run + boot set", "local": "local disk, cold page cache (the limit)",
          "proxy": "lamina via the fault proxy, clean", "faults": "lamina, fault mix",
          "faults-nohedge": "lamina, fault mix, --no-hedge",
          "index": "unmodified image through its tar index",
          "index-boot": "tar index + boot set",
          "docker-index": "docker pull + run, through its tar index",
          "lamina-nopredict": "lamina, --predict-max 0",
          "lamina-static": "lamina + boot set from the image (--boot-exec)",
          "index-static": "tar index + boot set from the image",
          "lamina-all": "lamina, --prefetch all", "lamina-base": "lamina, the build compared with",
          "lamina-base-boot": "lamina + boot set, the build compared with",
          "lamina-rests": "lamina, --fetch-rests"}
TITLES = {"python": "python3 -c 'print(\"hello\")'\n(first stdout line)",
          "nginx": "nginx\n(first HTTP 200)", "redis": "redis-server\n(first +PONG)",
          "readall": "every file read once\n(find -exec cat, then echo)",
          "datasci": "python3: import numpy, pandas, scipy, sklearn, ...\n(first stdout line)",
          "node": "node: require 8 npm packages\n(first stdout line)"}


def fmt(s):
    return f"{s:.2f}" if s < 10 else f"{s:.1f}"


def plot(r, path):
    """One panel per workload: seconds from start to first useful output (log
    scale) per link, one bar per variant: the median, with a min-max whisker,
    labelled with its value; at the foot of each lamina bar, containerd / it."""
    plt = report.pyplot()
    if plt is None:
        return
    links = r["config"]["links"]
    workloads = r["config"]["workloads"]
    variants = r["config"]["variants"]
    med = r["medians"]
    allv = [med[lk][w][v]["time_s"][k] for lk in links for w in workloads for v in variants
            if v in med[lk][w] for k in ("min", "max")]
    lo, hi = min(allv) * 0.5, max(allv) * 4
    cols = 2 if len(workloads) == 4 else len(workloads)
    rows = -(-len(workloads) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=((6 if len(variants) <= 3 else 8) * cols, 6 * rows),
                             squeeze=False)
    for ax in axes.flat[len(workloads):]:
        ax.set_visible(False)
    for ax, w in zip(axes.flat, workloads):
        panel(ax, r, w, lo, hi)
    axes[0][0].legend(fontsize=8, loc="upper left", frameon=False)
    fig.suptitle(title(r), fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97 if rows > 1 else 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def panel(ax, r, w, lo, hi):
    """Workload w's bars, per link and variant, on a log scale from lo to hi."""
    links, variants, med = r["config"]["links"], r["config"]["variants"], r["medians"]
    w_bar = 0.8 / len(variants)
    for j, v in enumerate(variants):
        xs, ys, lo_err, hi_err = [], [], [], []
        for i, lk in enumerate(links):
            s = med[lk][w].get(v)
            if not s:
                continue
            t = s["time_s"]
            xs.append(i + (j - (len(variants) - 1) / 2) * w_bar)
            ys.append(t["median"])
            lo_err.append(t["median"] - t["min"])
            hi_err.append(t["max"] - t["median"])
        bars = ax.bar(xs, ys, w_bar, color=COLORS.get(v), label=LABELS.get(v, v),
                      yerr=[lo_err, hi_err], capsize=2, error_kw={"elinewidth": 0.8})
        for b, y, e in zip(bars, ys, hi_err):
            ax.text(b.get_x() + b.get_width() / 2, (y + e) * 1.08, fmt(y), ha="center", va="bottom",
                    fontsize=6 if len(variants) > 3 else 7, rotation=90 if len(variants) > 3 else 0)
        if v != "containerd":
            for i, lk in enumerate(links):
                x = r["ratios"][lk][w].get(v)
                s = med[lk][w].get(v)
                if x and s:
                    ax.text(i + (j - (len(variants) - 1) / 2) * w_bar, lo * 1.15,
                            f"{x:.1f}×" if x < 10 else f"{x:.0f}×", ha="center", va="bottom",
                            fontsize=8 if len(variants) <= 3 else 5, color="white", fontweight="bold",
                            rotation=0 if len(variants) <= 3 else 90)
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    ax.set_xticks(range(len(links)))
    ax.set_xticklabels(links)
    ax.set_xlabel("link (tbf on the registry's loopback)")
    ax.set_ylabel("seconds to first useful output (median, log)")
    ax.set_title(TITLES.get(w, w), fontsize=10)
    ax.grid(axis="y", which="both", alpha=0.25)


def title(r):
    m = r["machine"]
    runs = r["config"]["runs"]
    cdr = r["config"]["containerd_runs"]
    slow = sorted({n for n in cdr.values() if n != runs})
    heavy = "".join(f", {w} {i['layer_bytes'] / 1e6:.1f} MB" for w, i in (r.get("images") or {}).items())
    return (f"Cold start of the Debian image ({r['image']['layer_bytes'] / 1e6:.1f} MB compressed{heavy}) from a "
            f"registry - {m['date'][:10]}, kernel {m['kernel']}, {m['nproc']} CPUs; medians of {runs} runs"
            f"{f' ({slow[0]} for containerd at ' + ', '.join(k for k, n in cdr.items() if n != runs) + ')' if slow else ''}"
            f"; white: containerd / lamina")
