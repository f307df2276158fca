#!/usr/bin/env python3
"""Tables of a scripts/big_image.sh results file (standard library only).

    big_image_report.py RESULTS.json                 # print the Results section
    big_image_report.py RESULTS.json --update DOC    # replace it in DOC, between
                                                     # <!-- big-image-tables:begin/end -->

Every figure printed comes from the results file.
"""

import argparse
import json
import sys

BEGIN, END = "<!-- big-image-tables:begin -->", "<!-- big-image-tables:end -->"


def n(x):
    return f"{x:,}" if isinstance(x, int) else str(x)


def status(m, when="status_after_reads"):
    return ((m.get(when) or {}).get("status")) or {}


def render(r):
    out = []
    w = out.append
    mc, g, c = r["machine"], r["generate"], r["convert"]
    dirty = " with uncommitted changes in the working tree" if r.get("lamina_tree_dirty") else ""
    w(f"One run: {r['date']}, lamina at commit `{r['lamina_commit'][:12]}`{dirty}, on {mc['nproc']} "
      f"{mc.get('cpu', '?')} cores, {n(mc['mem_total_kib'])} KiB of RAM, {mc.get('os', '')}, Linux "
      f"{mc['kernel']}, work dir on {mc.get('work_fs', '?')}. The whole run took {r['total_s']:.0f} s. "
      f"{sum(r['checks'].values())} of {len(r['checks'])} checks passed (`ok: {str(r['ok']).lower()}`).")
    w("")
    large = {k: v for k, v in r["files"].items() if v.get("large")}
    small = [v for v in r["files"].values() if not v.get("large")]
    w(f"**Image** (`--size {r['size']}`; chunk size {n(r['chunk_size'])} bytes)")
    w("")
    w("| file | bytes | tar size field |")
    w("|---|---:|---|")
    for name, v in large.items():
        w(f"| `{name}` | {n(v['size'])} | {'GNU base-256' if v.get('tar_header') == 'gnu' else 'ustar'} |")
    w(f"| {len(small)} small files | {n(min(v['size'] for v in small))} to "
      f"{n(max(v['size'] for v in small))} | ustar |")
    w("")
    w("| figure | value |")
    w("|---|---:|")
    w(f"| tar layer (the source blob) | {n(g['tar_bytes'])} bytes |")
    w(f"| generate (openssl + sha256 + write) | {g['wall_s']:.1f} s ({g['mb_s']} MB/s) |")
    w(f"| files over 4 GiB | {r['files_over_4gib']} (largest {n(r['largest_file_bytes'])} bytes) |")
    w("")
    w("**Convert** (from the OCI layout into the local registry)")
    w("")
    w("| figure | value |")
    w("|---|---:|")
    w(f"| wall time | {c['wall_s']:.1f} s ({c['mb_s']} MB/s of tar) |")
    w(f"| CPU | {c['user_s']} s user, {c['sys_s']} s system |")
    w(f"| peak RSS | {n(c['peak_rss_kib'])} KiB |")
    for i, b in enumerate(c["blobs"], 1):
        w(f"| data blob {i}: compressed / cache file / chunks | {n(b['compressed_bytes'])} / "
          f"{n(b['cache_bytes'])} / {n(b['chunks'])} |")
    rep = c["report"]
    w(f"| metadata image / index layer | {n(rep['metadata_bytes'])} / {n(rep['index_bytes'])} bytes |")
    w(f"| registry storage after the push | {n(r['registry_bytes'])} bytes |")
    df = r["disk_free"]
    w(f"| least free disk in the work dir's filesystem (sampled each second) vs. at the start | "
      f"{n(df['least_during_run'])} vs. {n(df['start'])} bytes |")
    w("")
    modes = r["modes"]
    names = list(modes)
    w("**Lazy mounts** (`--prefetch none`, loopback registry; each mode after `drop_caches`, with an "
      "empty cache)")
    w("")
    w("| figure | " + " | ".join(names) + " |")
    w("|---|" + "---:|" * len(names))

    def row(label, f):
        w(f"| {label} | " + " | ".join(f(modes[k]) for k in names) + " |")

    row("`lamina mount`", lambda m: f"{m['mount_s']:.3f} s")
    row("pread check regions (cold), all right", lambda m: f"{m['pread_regions']} in {m['pread_s']:.2f} s")
    row("read every large file whole, sha256 right",
        lambda m: f"{m['read_all']['s']:.1f} s, {m['read_all']['mb_s']} MB/s")
    for name in large:
        row(f"— `{name}`", lambda m, name=name: f"{m['reads'][name]['mb_s']} MB/s")
    row("`fetched_bytes` after the reads", lambda m: n(status(m).get("fetched_bytes")))
    row("`requests` (of which `miss_requests` / `ahead_requests`)",
        lambda m: f"{n(status(m).get('requests'))} ({n(status(m).get('miss_requests'))} / "
                  f"{n(status(m).get('ahead_requests'))})")
    row("`misses`, `failed_misses`, `bad_chunks`",
        lambda m: f"{n(status(m).get('misses'))}, {n(status(m).get('failed_misses'))}, "
                  f"{n(status(m).get('bad_chunks'))}")
    row("`cached_bytes` / `total_bytes`",
        lambda m: f"{n(status(m).get('cached_bytes'))} / {n(status(m).get('total_bytes'))}")
    row("daemons' peak RSS up to the end of the reads (VmHWM summed)",
        lambda m: f"{n(m['daemons_peak_rss_kib'])} KiB")
    row("daemons' RssAnon after the reads (summed)", lambda m: f"{n(m.get('daemons_rss_anon_kib'))} KiB")
    row("`fsck.erofs` (with the cache files as devices)",
        lambda m: "passed" + ("; `--extract` passed" if m["checks"].get("fsck_erofs_extract") else ""))
    row("overlay on top: a write, a copy-up, regions past 2^32 read right, no copy-up of the big file",
        lambda m: f"passed (upper dir {n(m['overlay_upper_bytes'])} bytes)"
        if all(m["checks"].get(k) for k in ("overlay_write", "overlay_read", "overlay_no_copy_up"))
        else "FAILED")
    w("")
    w(f"Data bytes of the image (compressed): {n(sum(b['compressed_bytes'] for b in c['blobs']))}. This "
      f"machine hashes sha256 from memory at {r['sha256_ceiling_mb_s']} MB/s (`sha256_ceiling_mb_s`).")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results")
    ap.add_argument("--update", metavar="DOC")
    a = ap.parse_args()
    with open(a.results) as f:
        text = render(json.load(f))
    if not a.update:
        print(text)
        return
    with open(a.update) as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        sys.exit(f"{a.update}: no {BEGIN} ... {END} markers")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(a.update, "w") as f:
        f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


if __name__ == "__main__":
    main()
