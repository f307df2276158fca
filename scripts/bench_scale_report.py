#!/usr/bin/env python3
"""Markdown tables of a scripts/bench_scale.sh result file.

Usage: bench_scale_report.py RESULTS.json                 (prints the tables)
       bench_scale_report.py RESULTS.json --update DOC.md (replaces the text between
                                                           <!-- bench-tables:begin --> and
                                                           <!-- bench-tables:end --> in DOC.md)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench.harness
from bench.harness.report import TABLES_BEGIN as BEGIN, TABLES_END as END, notes, report_main  # noqa: E402
from bench.harness.report import binary as report_binary, kib_mib, met_cell, spread_ms  # noqa: E402

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


def render(r):
    out = []
    w = out.append
    m, cfg, rt = r["machine"], r["config"], r["ratios"]
    sizes = [str(s) for s in cfg["sizes"]]
    w(("**Quick run** (`--quick`): " if r.get("quick") else "")
      + f"measured {m['date']} on {m['nproc']} vCPUs ({m.get('cpu', '?')}), kernel {m['kernel']}, "
      f"{m.get('os', '')}, work dir on {m.get('work_fs', '?')}. Image sizes: "
      f"{', '.join(f'{int(s):,}' for s in sizes)} files. Medians of {cfg['runs']} run(s) of convert and "
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
          "config, layers): right after the mount (and `--settle`), then after reading the one file and 12 s more "
          "(a lazy mount fetches layers no reader waits for, such as the FUSE lookup table, once the start is over).")
        w("")
        w("| files | path | bytes before first read | / mkfs.erofs metadata | answers | bytes once the start was over |")
        w("|---:|---|---:|---:|---:|---:|")
        for k, x in by.items():
            em = x["erofs_metadata"]["metadata_bytes"]
            for mode, g in (x.get("registry_wire") or {}).items():
                w(f"| {int(k):,} | {mode} | {g['before_first_read_body_bytes']:,} | "
                  f"{g['before_first_read_body_bytes'] / em:.3f} | {g['before_first_read_requests']} | "
                  f"{g['after_read_and_quiet_body_bytes']:,} |")
        w("")
    w("mkfs.erofs metadata: the image of `mkfs.erofs --chunksize=1048576 --blobdev=BLOB` (file data in BLOB), "
      "what an EROFS client must have before its first read. Bytes before the first read: the compressed "
      "sizes, from the manifest, of the layers lamina fetches at mount (index and EROFS metadata; a lazy FUSE mount "
      "fetches the lookup table once the start is over (its first read, then 500 ms without one, or 10 s without "
      "any), waited for before the one-file read); the C/meta column lists the layer files found in the cache dir after the mount, "
      "each checked against the manifest's digest and uncompressed size. Read one file: `lamina status` "
      "fetched_bytes and requests before and after reading "
      + ", ".join(f"`{x['one_file']}`" for x in list(by.values())[:1]) + " (and the same file position at "
      "every size). Daemons: every process whose command line names the mount's cache dir (kernel path: "
      "`internal-holder` + `internal-worker`; FUSE: `internal-fuse` + `internal-worker`), VmRSS and RssAnon "
      "summed over them (the JSON has every process's VmRSS, RssAnon, RssFile and VmHWM).")

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

    out += notes(r)
    return "\n".join(out) + "\n"


def main():
    report_main(render, BEGIN, END, __doc__)


if __name__ == "__main__":
    main()
