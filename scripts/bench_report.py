#!/usr/bin/env python3
"""Markdown tables of a scripts/bench.sh result file.

Usage: bench_report.py RESULTS.json                 (prints the tables)
       bench_report.py RESULTS.json --update DOC.md (replaces the text between
                                                     <!-- bench-tables:begin --> and
                                                     <!-- bench-tables:end --> in DOC.md)
"""

import json
import sys

BEGIN = "<!-- bench-tables:begin -->"
END = "<!-- bench-tables:end -->"

FS_LABEL = {
    "lamina": "lamina (`lamina mount`, eager)",
    "lamina-lazy": "lamina `--lazy` (cache filled)",
    "erofs": "mkfs.erofs, uncompressed",
    "erofs-chunked": "mkfs.erofs `--chunksize=1M --blobdev` (`device=`)",
    "ext4": "ext4 directory (umoci rootfs)",
}


def ms(x):
    return f"{x * 1000:.1f}"


def spread_ms(d):
    return f"{ms(d['median_s'])} ({ms(d['min_s'])}–{ms(d['max_s'])})"


def mb(n):
    return f"{n / 1e6:.2f} MB"


def render(r):
    out = []
    w = out.append
    m, c, s, rt = r["machine"], r["convert"], r["sizes"], r["ratios"]
    ls, rd = r["ls_lR"], r["read_all"]
    cfg = r["config"]

    def met(k):
        v = rt[k]
        return "yes" if v["met"] else f"**no** (by {v['value'] / v['target_max'] - 1:.0%})"

    w(f"Measured {m['date']} on {m['nproc']} vCPUs ({m.get('cpu', '?')}), kernel {m['kernel']}, "
      f"{m.get('os', '')}, work dir on {m.get('work_fs', '?')}. "
      f"Medians of {cfg['runs']} convert/mount runs, {cfg['cold_runs']} cold and {cfg['warm_runs']} warm runs. "
      f"While the bench ran ({r['bench_seconds']:.0f} s), other processes on the machine used "
      f"{m.get('other_cpu_s_during_bench')} CPU-seconds (load {' '.join(m.get('loadavg_at_start', []))} → "
      f"{' '.join(m.get('loadavg_at_end', []))}).")
    lb = m.get("lamina_binary", {})
    if lb:
        w("")
        w(f"lamina binary sha256 `{lb.get('sha256', '?')[:16]}…`, built {lb.get('built_at', '?')} "
          f"from commit `{lb.get('git_head', '?')[:10]}`"
          f"{' (working tree had uncommitted changes)' if lb.get('git_tree_dirty') else ''}.")
    w("")
    w("### Targets")
    w("")
    w("| figure | lamina | reference | ratio | target | met |")
    w("|---|---:|---:|---:|---:|---|")
    w(f"| convert, s | {c['lamina']['median_s']:.2f} | mksquashfs {c['mksquashfs']['median_s']:.2f} | "
      f"{rt['convert_lamina_vs_mksquashfs']['value']:.3f} | ≤ 0.25 | {met('convert_lamina_vs_mksquashfs')} |")
    w(f"| `ls -lR` warm, ms | {ms(ls['warm']['lamina']['median_s'])} | mkfs.erofs {ms(ls['warm']['erofs']['median_s'])} | "
      f"{rt['ls_warm_lamina_vs_erofs']['value']:.3f} | ≤ 1.10 | {met('ls_warm_lamina_vs_erofs')} |")
    w(f"| `ls -lR` cold, ms | {ms(ls['cold']['lamina']['median_s'])} | mkfs.erofs {ms(ls['cold']['erofs']['median_s'])} | "
      f"{rt['ls_cold_lamina_vs_erofs']['value']:.3f} | ≤ 1.25 | {met('ls_cold_lamina_vs_erofs')} |")
    w("")
    w("### Convert")
    w("")
    w("| tool | input | median s | min–max s | CPU s (user+sys) | lamina / tool |")
    w("|---|---|---:|---:|---:|---:|")
    for n, v in c.items():
        ratio = c["lamina"]["median_s"] / v["median_s"]
        w(f"| {n} | {v['input']} | {v['median_s']:.2f} | {v['min_s']:.2f}–{v['max_s']:.2f} | "
          f"{v['cpu_median_s']:.2f} | {ratio:.3f} |")
    w("")
    w("### `ls -lR` and full read (ms; median, min–max in parentheses)")
    w("")
    w("| filesystem | `ls -lR` warm | `ls -lR` cold | read all warm | read all cold |")
    w("|---|---:|---:|---:|---:|")
    for n in ls["warm"]:
        w(f"| {FS_LABEL.get(n, n)} | {spread_ms(ls['warm'][n])} | {spread_ms(ls['cold'][n])} | "
          f"{spread_ms(rd['warm'][n])} | {spread_ms(rd['cold'][n])} |")
    w("")
    w("| ratio | warm | cold |")
    w("|---|---:|---:|")
    for label, key in (("`ls -lR` lamina / mkfs.erofs", "ls_{}_lamina_vs_erofs"),
                       ("`ls -lR` lamina / mkfs.erofs chunked", "ls_{}_lamina_vs_erofs-chunked"),
                       ("`ls -lR` lamina / ext4", "ls_{}_lamina_vs_ext4"),
                       ("read all lamina / mkfs.erofs", "read_{}_lamina_vs_erofs"),
                       ("`ls -lR` lamina --lazy / mkfs.erofs", "ls_{}_lamina-lazy_vs_erofs"),
                       ("read all lamina --lazy / mkfs.erofs", "read_{}_lamina-lazy_vs_erofs")):
        if key.format("warm") in rt:
            w(f"| {label} | {rt[key.format('warm')]['value']:.3f} | {rt[key.format('cold')]['value']:.3f} |")
    w("")
    w("### Mount")
    w("")
    lm = r["mount"]["lamina"]
    w("| step | median s | min–max s | fetched |")
    w("|---|---:|---:|---:|")
    w(f"| `lamina mount` (eager, fresh cache: whole image fetched and decompressed) | {lm['median_s']:.3f} | "
      f"{lm['min_s']:.3f}–{lm['max_s']:.3f} | {mb(lm['fetched_bytes'])} |")
    lz = r["mount"].get("lamina-lazy")
    if lz:
        st = lz["status_after_first_read"]
        fr = lz["first_read_all"]
        w(f"| `lamina mount --lazy` (fresh cache) | {lz['median_s']:.3f} | {lz['min_s']:.3f}–{lz['max_s']:.3f} | 0 |")
        w(f"| first full read of the fresh lazy mount (fetch on demand) | {fr['median_s']:.3f} | "
          f"{fr['min_s']:.3f}–{fr['max_s']:.3f} | {mb(st.get('fetched_bytes', 0))} in {st.get('requests')} "
          f"requests, {st.get('misses')} misses |")
    w("")
    w("### Sizes")
    w("")
    L = s["lamina"]
    w("| what | bytes | |")
    w("|---|---:|---|")
    rows = [
        ("source layers (2 × tar+gzip)", s["source_layers_bytes"], ""),
        ("regular-file bytes in the tree", s["tree_file_bytes"], f"{s['tree_entries']} entries"),
        ("lamina metadata (EROFS image)", L["metadata_bytes"],
         f"{rt['metadata_lamina_vs_erofs-chunked']['value']:.3f} × mkfs.erofs chunked metadata"),
        ("lamina metadata, zstd (as pushed)", L["metadata_compressed_bytes"], ""),
        ("lamina chunk index (raw)", L["index_bytes"], ""),
        ("lamina blobs, zstd", L["blob_bytes"],
         f"{rt['blobs_lamina_vs_source_layers']['value']:.3f} × source layers; "
         + ", ".join(mb(b["size"]) for b in L["blobs"])),
        ("lamina blob cache files (uncompressed)", L["cache_bytes"], ""),
        ("lamina OCI artifact, all blobs", L["oci_layout_blob_bytes"], ""),
        ("mksquashfs -comp zstd image", s["mksquashfs_image_bytes"], ""),
        ("mkfs.erofs image (uncompressed)", s["erofs_image_bytes"], ""),
        ("mkfs.erofs -zlz4hc image", s["erofs_lz4hc_image_bytes"], ""),
        ("mkfs.erofs chunked: metadata image", s["erofs_chunked_meta_bytes"], ""),
        ("mkfs.erofs chunked: blob", s["erofs_chunked_blob_bytes"], ""),
    ]
    for k, v, note in rows:
        w(f"| {k} | {v:,} | {note} |")
    st = L["stats"]
    w("")
    w(f"Dedup: {st['chunk_refs']:,} chunk references, {st['chunks_stored']:,} chunks stored, "
      f"dedup ratio {L['dedup_ratio']:.4f} (referenced / stored bytes: "
      f"{st['referenced_bytes']:,} / {st['stored_bytes']:,}).")
    return "\n".join(out) + "\n"


def report_main(render, begin, end, usage):
    """`REPORT results.json` prints the tables; `REPORT results.json --update DOC` replaces the
    part of DOC between the `begin` and `end` markers with them."""
    args = sys.argv[1:]
    if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--update"):
        sys.exit(usage)
    with open(args[0]) as f:
        r = json.load(f)
    text = render(r)
    if len(args) == 1:
        sys.stdout.write(text)
        return
    with open(args[2]) as f:
        doc = f.read()
    if begin not in doc or end not in doc:
        sys.exit(f"{args[2]}: markers {begin} / {end} not found")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(args[2], "w") as f:
        f.write(head + begin + "\n" + text + end + tail)


def main():
    report_main(render, BEGIN, END, __doc__)


if __name__ == "__main__":
    main()
