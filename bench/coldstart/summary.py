"""The cold-start benchmark's summary and targets, derived from its raw
runs: medians per link, workload and variant; containerd / variant time
ratios; the limits of the heavy starts; the targets of issues 2, 8 and 29.
Also reads the results files of the old driver (scripts/coldstart.sh,
schema 1: the same raw runs, with their medians beside them)."""

import statistics

from ..harness.core import SCHEMA
from .workloads import HEAVY

# containerd / lamina-boot time ratios wanted for python3, per link
TIME_TARGETS = {"python": {"1gbit": 18.0, "100mbit": 24.0, "10mbit": 32.0}}
# bytes fetched for a cold start, % of the image's compressed size (source layers)
BYTES_TARGET_PCT = 3.0
FAULTS_OVER_CLEAN_MAX = 2.0
# Through containerd with a boot set: its time at most this many times `lamina run`'s (issue 8)
SNAPSHOTTER_OVER_RUN_MAX = 1.3
# containerd / snapshotter-boot for python3 at 100mbit (issue 8)
SNAPSHOTTER_TARGETS = {"python": {"100mbit": 20.0}}
IDLE_RSS_TARGET_MIB = 32
# Heavy starts with a boot set: at most this times the limit; without: HEAVY_NO_BOOT_OVER_LIMIT_MAX,
# and at least HEAVY_VS_CONTAINERD_MIN times faster than containerd's full pull at 100mbit.
HEAVY_BOOT_OVER_LIMIT_MAX = 1.3
HEAVY_NO_BOOT_OVER_LIMIT_MAX = 2.0
HEAVY_VS_CONTAINERD_MIN = 10.0
# the baselines: every other variant's time is a ratio to containerd's
BASELINES = ("containerd", "local")
# per-variant figures summarised over runs, when the runs have them
SUMMARY_KEYS = ("pull_s", "mount_s", "overlay_s", "container_s", "wire_bytes_pull", "wire_bytes_mount",
                "wire_bytes_ready", "fetched_bytes", "requests", "misses", "prefetch_total", "fetched_bytes_ready",
                "requests_ready", "misses_ready", "events_ready", "content_blobs", "ahead_chunk_bytes", "ahead_used_bytes",
                "predictions", "predicted_requests")
# what a schema-1 results file keeps beside its runs (raw figures of the set-up)
MEASURED = ("image", "images", "lamina_image", "setup", "links", "idle", "incomplete", "failed_runs")


def lift(doc):
    """A results file of the old driver (schema 1) in this one's shape; {}
    for one already in it. Its medians, ratios and targets are derived
    again from its runs (derive)."""
    if doc.get("schema") != 1:
        return {}
    m = doc["machine"]
    return dict({k: doc[k] for k in MEASURED if k in doc},
                schema=SCHEMA, lifted_from="schema 1 of scripts/coldstart.sh", benchmark="coldstart",
                quick=False, machine=m, commit=(m.get("lamina_binary") or {}).get("git_head", "unknown"),
                date=m.get("date"), config=doc["config"], runs=doc["runs"], summary={}, targets=[],
                not_measured={}, seconds=doc.get("bench_seconds", 0))


def stats(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def target(what, workload, link, value, op, bound, unit=None):
    t = {"name": what, "workload": workload, "link": link, "value": value, "op": op, "bound": bound}
    if unit:
        t["unit"] = unit
    t["met"] = value >= bound if op == ">=" else value <= bound
    return t


def summarise(rs, variant, img_bytes):
    s = {"runs": len(rs), "time_s": stats([r["time_s"] for r in rs]),
         "runs_s": [round(r["time_s"], 4) for r in rs],
         "wire_bytes": stats([r["wire_bytes"] for r in rs]),
         "second_time_s": stats([r["second"]["time_s"] for r in rs]),
         "second_wire_bytes": stats([r["second"]["wire_bytes"] for r in rs])}
    for k in SUMMARY_KEYS:
        if any(r.get(k) is not None for r in rs):
            s[k] = stats([r.get(k) for r in rs])
    if variant != "containerd":
        s["second_fetched_bytes"] = stats([r["second"].get("fetched_bytes") for r in rs])
        for part in ("sum", "holder", "worker", "snapshotter"):
            vals = stats([(r.get("rss_kib") or {}).get(part) for r in rs])
            if vals:
                s[f"rss_kib_{part}"] = vals
        if s.get("fetched_bytes"):
            s["fetched_pct"] = 100 * s["fetched_bytes"]["median"] / img_bytes
    s["wire_pct"] = 100 * s["wire_bytes"]["median"] / img_bytes
    return s


def time_targets(ratios, agg, compared):
    """Start-time targets: issue 2's (containerd / lamina mount) and issue 8's
    (through containerd: against the full pull and against `lamina run`)."""
    targets = []
    for w, per_link in TIME_TARGETS.items():
        for link, want in per_link.items():
            for v in ("lamina", "lamina-boot"):
                got = ratios.get(link, {}).get(w, {}).get(v)
                if got is not None:
                    targets.append(target(f"time containerd / {v}", w, link, got, ">=", want))
    for w, per_link in SNAPSHOTTER_TARGETS.items():
        for link, want in per_link.items():
            got = ratios.get(link, {}).get(w, {}).get("snapshotter-boot")
            if got is not None:
                targets.append(target("time containerd / snapshotter-boot", w, link, got, ">=", want))
    for link, per_w in agg.items():
        for w, per_v in per_w.items():
            for snap, own in (("snapshotter-boot", "run-boot"), ("snapshotter", "run")):
                if snap in per_v and own in per_v:
                    got = per_v[snap]["time_s"]["median"] / per_v[own]["time_s"]["median"]
                    targets.append(target(f"time {snap} / {own}", w, link, got, "<=", SNAPSHOTTER_OVER_RUN_MAX, "x"))
            if "lamina" in per_v and "lamina-nopredict" in per_v:
                # issue 44: predictions must pay for themselves
                plain, without = per_v["lamina"], per_v["lamina-nopredict"]
                got = plain["time_s"]["median"] / without["time_s"]["median"]
                targets.append(target("time lamina / lamina --predict-max 0", w, link, got, "<=", 1.0, "x"))
                fetched = [(v.get("fetched_bytes_ready") or {}).get("median") for v in (plain, without)]
                if all(fetched):
                    targets.append(target("bytes fetched by lamina / lamina --predict-max 0", w, link,
                                          fetched[0] / fetched[1], "<=", 1.0, "x"))
            if "faults" in per_v and "proxy" in per_v:
                got = per_v["faults"]["time_s"]["median"] / per_v["proxy"]["time_s"]["median"]
                targets.append(target("time through the fault mix / through the same proxy, clean", w, link, got,
                                      "<=", FAULTS_OVER_CLEAN_MAX, "x"))
            for v in compared:
                got = ratios.get(link, {}).get(w, {}).get(v)
                if got is not None:
                    # "never slower than overlayfs' full pull"
                    targets.append(target(f"time containerd / {v} (never slower)", w, link, got, ">=", 1.0))
    return targets


def heavy_targets(links, agg):
    """Issue 29: heavy starts against their limit, the larger of the same start from local disk (cold page
    cache) and the boot set's bytes (fetched to first output) at the link's measured rate. (targets,
    limits by link and workload)"""
    targets, limits = [], {}
    for link, per_w in agg.items():
        rate = (links.get(link) or {}).get("MBps")
        for w in HEAVY:
            per_v = per_w.get(w) or {}
            loc, boot, plain = per_v.get("local"), per_v.get("lamina-boot"), per_v.get("lamina")
            if not (loc and boot and rate):
                continue
            boot_bytes = (boot.get("fetched_bytes_ready") or {}).get("median") or 0
            limit = max(loc["time_s"]["median"], boot_bytes / 1e6 / rate)
            limits.setdefault(link, {})[w] = limit
            for v, bound in (("lamina-boot", HEAVY_BOOT_OVER_LIMIT_MAX), ("lamina", HEAVY_NO_BOOT_OVER_LIMIT_MAX)):
                if per_v.get(v):
                    got = per_v[v]["time_s"]["median"] / limit
                    targets.append(target(f"time {v} / limit (local disk, or boot set bytes at link rate)", w, link,
                                          got, "<=", bound, "x"))
            cd = per_v.get("containerd")
            if cd and plain and link == "100mbit":
                got = cd["time_s"]["median"] / plain["time_s"]["median"]
                targets.append(target("time containerd / lamina (no boot set)", w, link, got, ">=",
                                      HEAVY_VS_CONTAINERD_MIN))
    return targets, limits


def bytes_targets(doc):
    """Issue 2's bytes target is for starts, counted to their first output;
    reading the whole image needs every byte."""
    targets = []
    img_bytes = doc["image"]["layer_bytes"]
    for w in [w for w in doc["config"]["workloads"] if w not in ("readall",) + HEAVY]:
        for v in ("lamina", "lamina-boot", "lamina-nopredict"):
            fetched = [r["fetched_bytes_ready"] for r in doc["runs"]
                       if r["workload"] == w and r["variant"] == v and r.get("fetched_bytes_ready") is not None]
            wire = [r["wire_bytes_ready"] for r in doc["runs"] if r["workload"] == w and r["variant"] == v]
            if fetched:
                pf = 100 * statistics.median(fetched) / img_bytes
                pw = 100 * statistics.median(wire) / img_bytes
                targets.append(target(f"bytes fetched by {v} to first output (lamina status), % of compressed image",
                                      w, "all", pf, "<=", BYTES_TARGET_PCT))
                targets.append(target(f"bytes on the wire for {v} to first output (lo tx), % of compressed image",
                                      w, "all", pw, "<=", BYTES_TARGET_PCT))
    idle = doc.get("idle")
    if idle and idle.get("snapshotter_rss_kib"):
        mib = idle["snapshotter_rss_kib"] / 1024
        targets.append(target(f"snapshotter idle RSS (MiB) with {idle['images']} images mounted", "-", "-", mib,
                              "<=", IDLE_RSS_TARGET_MIB, "MiB"))
    return targets


def derive(doc):
    """Medians per link / workload / variant, ratios, limits (the summary) and targets."""
    lifted = lift(doc)
    if lifted:
        doc.clear()
        doc.update(lifted)
    cfg = doc["config"]
    compared = [v for v in cfg["variants"] if v not in BASELINES]
    agg, ratios = {}, {}
    for link in cfg["links"]:
        agg[link], ratios[link] = {}, {}
        for w in cfg["workloads"]:
            agg[link][w] = {}
            img_bytes = (doc.get("images") or {}).get(w, doc["image"])["layer_bytes"]
            for v in cfg["variants"]:
                rs = [r for r in doc["runs"] if r["link"] == link and r["workload"] == w and r["variant"] == v]
                if rs:
                    agg[link][w][v] = summarise(rs, v, img_bytes)
            cd = agg[link][w].get("containerd")
            ratios[link][w] = {}
            for v in compared:
                la = agg[link][w].get(v)
                if cd and la:
                    ratios[link][w][v] = cd["time_s"]["median"] / la["time_s"]["median"]
    heavy, limits = heavy_targets(doc["links"], agg)
    doc["summary"] = {"medians": agg, "ratios": ratios, "limits": limits}
    doc["targets"] = time_targets(ratios, agg, compared) + heavy + bytes_targets(doc)


def view(doc):
    """The results as the tables and plot read them (the shape of the old
    driver's files: medians, ratios and limits beside the raw figures)."""
    s = doc["summary"]
    r = dict(doc, medians=s["medians"], ratios=s["ratios"], bench_seconds=doc.get("seconds", 0))
    if s.get("limits"):
        r["limits"] = s["limits"]
    return r
