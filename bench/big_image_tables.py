"""The tables of a bench/big_image.py results file (docs/big-image.md
carries them between its big-image-tables markers); every figure printed
comes from the results file. Also reads the files scripts/big_image.sh
wrote (schema lamina-big-image/1), lifted into the lamina-bench/1 shape."""

from .harness.core import SCHEMA

BEGIN, END = "<!-- big-image-tables:begin -->", "<!-- big-image-tables:end -->"
OLD_SCHEMA = "lamina-big-image/1"


def lift(old):
    """A scripts/big_image.sh results document in the lamina-bench/1 shape
    (the same figures; `ok`, the modes' `checks` and `lamina_tree_dirty` are
    derived again, the last from machine.lamina_binary)."""
    generate = dict(old["generate"], files=old["files"], largest_file_bytes=old["largest_file_bytes"],
                    files_over_4gib=old["files_over_4gib"])
    mounts = [{"part": "mount", "mode": mode, "figures": {k: v for k, v in m.items() if k != "checks"}}
              for mode, m in old["modes"].items()]
    host = {"sha256_ceiling_mb_s": old["sha256_ceiling_mb_s"], "disk_free": old["disk_free"]}
    return {"schema": SCHEMA, "benchmark": "big_image", "quick": False, "machine": old["machine"],
            "commit": old["lamina_commit"], "date": old["date"],
            "config": {"size": old["size"], "chunk_size": old["chunk_size"], "lifted_from": old["schema"]},
            "runs": [{"part": "generate", "figures": generate},
                     {"part": "convert", "figures": dict(old["convert"], registry_bytes=old["registry_bytes"])},
                     *mounts, {"part": "host", "figures": host}, {"part": "checks", "figures": old["checks"]}],
            "summary": {}, "targets": [], "not_measured": {}, "seconds": old["total_s"]}


def current(doc):
    """`doc` in the lamina-bench/1 shape (lifted when an old file)."""
    return lift(doc) if doc.get("schema") == OLD_SCHEMA else doc


def view(doc):
    """The results as one dict, in the shape scripts/big_image.sh wrote
    (what the tables read)."""
    parts = {r["part"]: r["figures"] for r in doc["runs"] if r["part"] != "mount"}
    checks = parts["checks"]
    generate = dict(parts["generate"])
    files, largest, over_4gib = (generate.pop(k) for k in ("files", "largest_file_bytes", "files_over_4gib"))
    convert = dict(parts["convert"])
    registry_bytes = convert.pop("registry_bytes")
    modes = {r["mode"]: dict(r["figures"], checks={k.split(".", 1)[1]: v for k, v in checks.items()
                                                   if k.startswith(r["mode"] + ".")})
             for r in doc["runs"] if r["part"] == "mount"}
    return {"date": doc["date"], "quick": doc.get("quick"), "size": doc["config"]["size"],
            "chunk_size": doc["config"]["chunk_size"], "lamina_commit": doc["commit"],
            "lamina_tree_dirty": (doc["machine"].get("lamina_binary") or {}).get("git_tree_dirty"),
            "machine": doc["machine"], "sha256_ceiling_mb_s": parts["host"]["sha256_ceiling_mb_s"],
            "disk_free": parts["host"]["disk_free"], "generate": generate, "files": files,
            "largest_file_bytes": largest, "files_over_4gib": over_4gib, "registry_bytes": registry_bytes,
            "convert": convert, "modes": modes, "checks": checks, "ok": all(checks.values()),
            "total_s": doc.get("seconds", 0)}


def summary(r):
    """The headline figures of a view."""
    return {"ok": r["ok"], "checks_passed": sum(r["checks"].values()), "checks": len(r["checks"]),
            "generate_mb_s": r["generate"]["mb_s"], "convert_s": r["convert"]["wall_s"],
            "convert_peak_rss_kib": r["convert"]["peak_rss_kib"],
            "largest_blob_bytes": r["convert"]["largest_blob_bytes"],
            "read_all_mb_s": {mode: m["read_all"]["mb_s"] for mode, m in r["modes"].items()},
            "daemons_peak_rss_kib": {mode: m["daemons_peak_rss_kib"] for mode, m in r["modes"].items()}}


def n(x):
    return f"{x:,}" if isinstance(x, int) else str(x)


def status(m, when="status_after_reads"):
    return ((m.get(when) or {}).get("status")) or {}


def tables(r):
    """The Markdown of a view: the run, the image, convert, the lazy mounts."""
    out = image_tables(r) + [""] + convert_table(r) + [""] + mount_table(r)
    c = r["convert"]
    out += ["", f"Data bytes of the image (compressed): {n(sum(b['compressed_bytes'] for b in c['blobs']))}. "
            f"This machine hashes sha256 from memory at {r['sha256_ceiling_mb_s']} MB/s (`sha256_ceiling_mb_s`)."]
    return "\n".join(out) + "\n"


def image_tables(r):
    mc, g = r["machine"], r["generate"]
    dirty = " with uncommitted changes in the working tree" if r.get("lamina_tree_dirty") else ""
    out = [f"One run{' (--quick)' if r.get('quick') else ''}: {r['date']}, lamina at commit "
           f"`{r['lamina_commit'][:12]}`{dirty}, on {mc['nproc']} "
           f"{mc.get('cpu', '?')} cores, {n(mc['mem_total_kib'])} KiB of RAM, {mc.get('os', '')}, Linux "
           f"{mc['kernel']}, work dir on {mc.get('work_fs', '?')}. The whole run took {r['total_s']:.0f} s. "
           f"{sum(r['checks'].values())} of {len(r['checks'])} checks passed (`ok: {str(r['ok']).lower()}`).", ""]
    large = {k: v for k, v in r["files"].items() if v.get("large")}
    small = [v for v in r["files"].values() if not v.get("large")]
    out += [f"**Image** (`--size {r['size']}`; chunk size {n(r['chunk_size'])} bytes)", "",
            "| file | bytes | tar size field |", "|---|---:|---|"]
    for name, v in large.items():
        out.append(f"| `{name}` | {n(v['size'])} | {'GNU base-256' if v.get('tar_header') == 'gnu' else 'ustar'} |")
    out += [f"| {len(small)} small files | {n(min(v['size'] for v in small))} to "
            f"{n(max(v['size'] for v in small))} | ustar |", "",
            "| figure | value |", "|---|---:|",
            f"| tar layer (the source blob) | {n(g['tar_bytes'])} bytes |",
            f"| generate (openssl + sha256 + write) | {g['wall_s']:.1f} s ({g['mb_s']} MB/s) |",
            f"| files over 4 GiB | {r['files_over_4gib']} (largest {n(r['largest_file_bytes'])} bytes) |"]
    return out


def convert_table(r):
    c, df = r["convert"], r["disk_free"]
    out = ["**Convert** (from the OCI layout into the local registry)", "",
           "| figure | value |", "|---|---:|",
           f"| wall time | {c['wall_s']:.1f} s ({c['mb_s']} MB/s of tar) |",
           f"| CPU | {c['user_s']} s user, {c['sys_s']} s system |",
           f"| peak RSS | {n(c['peak_rss_kib'])} KiB |"]
    for i, b in enumerate(c["blobs"], 1):
        out.append(f"| data blob {i}: compressed / cache file / chunks | {n(b['compressed_bytes'])} / "
                   f"{n(b['cache_bytes'])} / {n(b['chunks'])} |")
    rep = c["report"]
    out += [f"| metadata image / index layer | {n(rep['metadata_bytes'])} / {n(rep['index_bytes'])} bytes |",
            f"| registry storage after the push | {n(r['registry_bytes'])} bytes |",
            f"| least free disk in the work dir's filesystem (sampled each second) vs. at the start | "
            f"{n(df['least_during_run'])} vs. {n(df['start'])} bytes |"]
    return out


def mount_table(r):
    modes = r["modes"]
    names = list(modes)
    large = [k for k, v in r["files"].items() if v.get("large")]
    out = ["**Lazy mounts** (`--prefetch none`, loopback registry; each mode after `drop_caches`, with an "
           "empty cache)", "",
           "| figure | " + " | ".join(names) + " |",
           "|---|" + "---:|" * len(names)]

    def row(label, f):
        out.append(f"| {label} | " + " | ".join(f(modes[k]) for k in names) + " |")

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
    return out
