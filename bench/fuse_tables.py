"""The FUSE benchmark's tables and plot (`bench/fuse.py`), from the results
as one dict by part (`fuse.view`)."""

from .harness import report
from .harness.report import binary as report_binary, kib_mib, met_cell, spread_ms


FS_LABEL = {
    "erofs": "kernel EROFS (mkfs.erofs, file-backed; reference)",
    "lamina-kernel": "lamina, kernel path (`--mode kernel`, eager)",
    "lamina-fuse": "lamina FUSE (`--mode fuse`, eager)",
    "lamina-fuse-fresh": "lamina FUSE, new daemon before each cold run (umount, drop_caches, mount)",
    "squashfuse": "squashfuse (mksquashfs zstd image)",
    "ext4": "ext4 directory (umoci rootfs)",
}
FIO_LABEL = {
    "ext4": "ext4 file (reference)",
    "lamina-fuse": "lamina FUSE (`--mode fuse`, eager)",
    "lamina-kernel": "lamina, kernel path (`--mode kernel`, eager)",
}


def debian_tables(r, w):
    """The Debian part's tables: `ls -lR` and stat+open."""
    d = r["debian"]
    w("")
    w("### `ls -lR` of the Debian tree (ms; median, min–max in parentheses)")
    w("")
    ls = r["ls_lR"]
    w(f"{d['entries']['erofs']:,} entries on every filesystem"
      if len(set(d["entries"].values())) == 1 else f"entries differ: {d['entries']}")
    w("")
    w("| filesystem | warm | cold | warm / EROFS | cold / EROFS |")
    w("|---|---:|---:|---:|---:|")
    for n in ls["cold"]:
        rc = ls["cold"][n]["median_s"] / ls["cold"]["erofs"]["median_s"]
        if n in ls["warm"]:
            rw = ls["warm"][n]["median_s"] / ls["warm"]["erofs"]["median_s"]
            w(f"| {FS_LABEL.get(n, n)} | {spread_ms(ls['warm'][n])} | {spread_ms(ls['cold'][n])} | "
              f"{rw:.3f} | {rc:.3f} |")
        else:
            w(f"| {FS_LABEL.get(n, n)} | – | {spread_ms(ls['cold'][n])} | – | {rc:.3f} |")
    w("")
    w(f"nydusd: {r.get('nydusd')}.")

    so = r["stat_open"]
    w("")
    w(f"### stat + open + close of the {so['paths']} deepest files (paths per second)")
    w("")
    w(f"Depth {so['depth_min']}–{so['depth_max']} components (mean {so['depth_mean']}), e.g. "
      f"`{so['sample'][0]}`. Warm: {so['repeat_warm']} passes per run after a warm-up pass; "
      f"cold: one pass after drop_caches.")
    w("")
    w("| filesystem | warm paths/s | cold paths/s | warm / EROFS | cold / EROFS |")
    w("|---|---:|---:|---:|---:|")
    for n in so["cold"]:
        cv = so["cold"][n]["paths_per_s"]
        if n in so["warm"]:
            wv = so["warm"][n]["paths_per_s"]
            w(f"| {FS_LABEL.get(n, n)} | {wv:,.0f} | {cv:,.0f} | {wv / so['warm']['erofs']['paths_per_s']:.3f} | "
              f"{cv / so['cold']['erofs']['paths_per_s']:.3f} |")
        else:
            w(f"| {FS_LABEL.get(n, n)} | – | {cv:,.0f} | – | {cv / so['cold']['erofs']['paths_per_s']:.3f} |")


def fio_table(w, f, seq, rand):
    """The fio table of cases `seq` and `rand` of the fio part `f`."""
    def mib(x):
        return f"{x:.0f}" if x is not None else "–"
    w("| file | sequential | / ext4 | disk read, MiB | random | / ext4 | disk read, MiB |")
    w("|---|---:|---:|---:|---:|---:|---:|")
    for n in ("ext4", "lamina-fuse", "lamina-kernel"):
        s, q = f[seq][n], f[rand][n]
        w(f"| {FIO_LABEL[n]} | {s['mb_s']:.1f} ({min(s['runs_mb_s']):.1f}–{max(s['runs_mb_s']):.1f}) | "
          f"{s['mb_s'] / f[seq]['ext4']['mb_s']:.3f} | {mib(s.get('disk_read_mib'))} | "
          f"{q['mb_s']:.1f} ({min(q['runs_mb_s']):.1f}–{max(q['runs_mb_s']):.1f}) | "
          f"{q['mb_s'] / f[rand]['ext4']['mb_s']:.3f} | {mib(q.get('disk_read_mib'))} |")


def tables(r):
    out = []
    w = out.append
    m, cfg, rt = r["machine"], r["config"], r["ratios"]
    w(f"Measured {m['date']} on {m['nproc']} vCPUs ({m.get('cpu', '?')}), kernel {m['kernel']}, "
      f"{m.get('os', '')}, work dir on {m.get('work_fs', '?')}. Medians of {cfg['runs']} runs of mounts "
      f"and lookup_bench, {cfg.get('fio_runs', cfg['runs'])} of fio, {cfg['warm_runs']} warm and {cfg['cold_runs']} cold runs of `ls -lR` and stat+open. "
      f"While the bench ran ({r['bench_seconds']:.0f} s), other processes on the machine used "
      f"{m.get('other_cpu_s_during_bench')} CPU-seconds (load {' '.join(m.get('loadavg_at_start', []))} → "
      f"{' '.join(m.get('loadavg_at_end', []))}).")
    w("")
    w(report_binary(m))
    w("")
    w("### Targets")
    w("")
    w("| figure | value | target | met |")
    w("|---|---:|---:|---|")
    for k, x in rt.items():
        if x["target"]:
            w(f"| `{k}` | {x['value']:.3f} | {x['target']} | {met_cell(x)} |")
    w("")
    w("Ratios are FUSE / reference for times (lower is better) and for throughputs "
      "(MB/s, paths/s: higher is better).")

    if "debian" in r:  # parts= may leave it out
        debian_tables(r, w)

    f = r.get("fio")
    if f:
        w("")
        w(f"### fio, 4 KiB buffered reads of a {f['file_bytes'] / 2**20:.0f} MiB file, cold (MB/s)")
        w("")
        w(f"Sequential: the whole file; random: {f['rand']['io_mib']} MiB of it. {f['cold']}.")
        w("")
        fio_table(w, f, "seq", "rand")
        if "seq_overlay" in f:
            w("")
            w(f"Through a read-write overlayfs over each (lowerdir: the file's tree), libaio, "
              f"{f['overlay_cmd'].split('--iodepth=')[1].split()[0]} requests in flight:")
            w("")
            fio_table(w, f, "seq_overlay", "rand_overlay")
        first = f.get("fuse_first_open")
        if first:
            w("")
            w(f"The first open of the FUSE file, before the runs above, is served by the daemon while its "
              f"passthrough object is made: {first['mb_s']:.1f} MB/s sequential, one run "
              f"({first['mb_s'] / f['seq']['ext4']['mb_s']:.3f} of ext4's median). The runs above start once "
              f"the daemon counted {f['fuse_objects_before_runs'].get('objects_created')} object(s) made.")
        w("")
        w("Disk read: median MiB read from the work directory's block device during a run "
          "(`/sys/dev/block/M:m/stat`; every process's reads, not only fio's).")
        w("")
        w(f"Lines of the FUSE daemon's log (`fuse.log`) mentioning passthrough: "
          f"{f['fuse_log_passthrough_lines']}.")

    mp = r.get("mphf")
    if mp:
        w("")
        w("### Perfect-hash build (`lookup_bench`)")
        w("")
        w("| keys | threads | hash function build s | s per million keys | bits per key | "
          "whole table build s | table bytes per key | peak RSS MiB |")
        w("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for x in mp["by_keys"].values():
            w(f"| {x['keys']:,} | {x['threads']} | {x['build_s']:.3f} | {x['build_s_per_million_keys']:.3f} | "
              f"{x['bits_per_key']:.3f} | {x['table_build_s']:.3f} | {x['table_bytes_per_key']:.2f} | "
              f"{kib_mib(x['peak_rss_kib'])} |")

    b = r.get("big")
    if b:
        w("")
        w("### Many small files: convert, mount, FUSE daemon RSS")
        w("")
        w("| files | convert s | convert peak RSS MiB | eager FUSE mount, filled cache, ms | lazy FUSE mount, "
          "fresh cache, ms | daemon RSS after mount MiB (anon / file) | `ls -lR` s | daemon RSS after "
          "`ls -lR` MiB (anon / file) | 2 s later MiB |")
        w("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for x in b["by_files"].values():
            ra, rl = x["rss_after_mount"] or {}, x["rss_after_ls"] or {}
            rr = x.get("rss_at_rest_after_ls") or {}
            w(f"| {x['files']:,} | {x['convert']['wall_s']:.1f} | {kib_mib(x['convert']['peak_rss_kib'])} | "
              f"{x['fuse_mount']['median_s'] * 1000:.1f} | {x['fuse_lazy_mount']['median_s'] * 1000:.1f} | "
              f"{kib_mib(ra.get('VmRSS_kib'))} ({kib_mib(ra.get('RssAnon_kib'))} / "
              f"{kib_mib(ra.get('RssFile_kib'))}) | {x['ls_lR_s']:.2f} | "
              f"{kib_mib(rl.get('VmRSS_kib'))} ({kib_mib(rl.get('RssAnon_kib'))} / "
              f"{kib_mib(rl.get('RssFile_kib'))}) | {kib_mib(rr.get('VmRSS_kib'))} |")
        w("")
        w("Lookup table in use (the daemon logged \"lookups through the lookup table\"): " + ", ".join(
            f"{x['files']:,} files {'yes' if x['fuse_log_lookup_table'] else 'no'}" for x in b["by_files"].values())
          + f"; Debian image {'yes' if r['debian'].get('fuse_log_lookup_table') else 'no'}.")

    out += report.notes(r)
    return "\n".join(out) + "\n"


SHORT = {"erofs": "kernel\nEROFS\n(ref)", "lamina-kernel": "lamina\nkernel", "lamina-fuse": "lamina\nFUSE",
         "lamina-fuse-fresh": "lamina\nFUSE\nnew\ndaemon", "squashfuse": "squash-\nfuse", "ext4": "ext4", "nydusd": "nydusd"}


def label_bars(ax, bars, fmt):
    report.label_bars(ax, bars, fmt, fontsize=7)


def pair_panel(ax, names, a, b, la, lb, ylabel, title, fmt):
    w = 0.38
    xs = range(len(names))
    b1 = ax.bar([x - w / 2 for x in xs], a, w, label=la, color=report.WARM)
    b2 = ax.bar([x + w / 2 for x in xs], b, w, label=lb, color=report.COLD)
    label_bars(ax, list(b1) + list(b2), fmt)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([SHORT.get(n, n) for n in names], fontsize=8)
    for lbl in ax.get_xticklabels():
        if lbl.get_text().startswith("lamina\nFUSE"):
            lbl.set_color(report.LAMINA)
            lbl.set_fontweight("bold")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, max(x for x in a + b if x == x) * 1.3)
    ax.legend(fontsize=8, loc="upper center", ncol=2, frameon=False)


def debian_panels(axes, r):
    """`ls -lR` and stat+open, warm and cold, on the first two of `axes`."""
    rt = r["ratios"]
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


def plot(r, path):
    """ls -lR and stat+open warm/cold per filesystem; fio MB/s; the FUSE
    daemon's RSS per image size (medians, labelled)."""
    plt = report.pyplot()
    if plt is None:
        return
    rt = r["ratios"]
    debian = "ls_lR" in r  # parts= may leave it out
    panels = 2 * debian + ("fio" in r) + ("big" in r)
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 5.4), squeeze=False)
    axes = axes[0]
    i = 0
    if debian:
        debian_panels(axes, r)
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
    fig.savefig(path, dpi=100)
