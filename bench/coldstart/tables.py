"""The cold-start benchmark's tables (Markdown, as docs/coldstart.md and
docs/coldstart-heavy.md carry them), from a results file as
summary.view gives it."""

VLABEL = {"containerd": "containerd", "lamina": "lamina", "lamina-boot": "lamina + boot set",
          "snapshotter": "snapshotter", "snapshotter-boot": "snapshotter + boot set", "run": "lamina run",
          "run-boot": "lamina run + boot set", "proxy": "lamina, through the fault proxy (clean)",
          "faults": "lamina, fault mix",
          "faults-nohedge": "lamina, fault mix, --no-hedge", "local": "local disk (limit)",
          "index": "tar index (unmodified image)", "index-boot": "tar index + boot set",
          "docker-index": "docker, through the tar index", "lamina-nopredict": "lamina, --predict-max 0",
          "lamina-static": "lamina + boot set from the image", "index-static": "tar index + boot set from the image",
          "lamina-all": "lamina, --prefetch all", "lamina-base": "lamina, the build compared with",
          "lamina-base-boot": "lamina + boot set, the build compared with",
          "lamina-rests": "lamina, --fetch-rests"}
THROUGH = ("containerd", "snapshotter", "snapshotter-boot", "run", "run-boot")
WLABEL = {"python": "python3", "nginx": "nginx", "redis": "redis", "readall": "read all",
          "datasci": "data science (python3)", "node": "Node.js"}


def mb(n):
    return f"{n / 1e6:.2f}"


def secs(s):
    return f"{s:.3f}" if s < 10 else f"{s:.2f}"


def spread(t):
    if t["n"] == 1:
        return f"{secs(t['median'])}"
    return f"{secs(t['median'])} ({secs(t['min'])}–{secs(t['max'])})"


def tables(r):
    """Every table of a results file (summary.view), in Markdown."""
    out = []
    w = out.append
    for section in (heading, targets, cold_start, through, heavy, faults, where_time_goes, bytes_table,
                    second_container, boot_sets, links):
        section(w, r)
    return "\n".join(out) + "\n"


def heading(w, r):
    m, cfg, img = r["machine"], r["config"], r["image"]
    img_bytes = img["layer_bytes"]
    w(f"Measured {m['date']} on {m['nproc']} vCPUs ({m.get('cpu', '?')}), kernel {m['kernel']}, "
      f"{m.get('os', '')}, work dir on {m.get('work_fs', '?')}; containerd {m['versions'].get('containerd')}, "
      f"runc {m['versions'].get('runc')}, docker-registry {m['versions'].get('docker-registry')}. "
      f"The whole run took {r['bench_seconds'] / 60:.1f} min; the machine was busy for "
      f"{m.get('busy_cpu_s_during_bench')} CPU-seconds in that time (everything: containerd, lamina, "
      f"containers, other users), load {' '.join(m.get('loadavg_at_start', []))} → "
      f"{' '.join(m.get('loadavg_at_end', []))}.")
    lb = m.get("lamina_binary", {})
    w("")
    w(f"lamina binary sha256 `{lb.get('sha256', '?')[:16]}…`, built {lb.get('built_at', '?')} from commit "
      f"`{lb.get('git_head', '?')[:10]}`{' (working tree had uncommitted changes)' if lb.get('git_tree_dirty') else ''}; "
      f"chunk size {cfg.get('chunk_size')} B, `--fill-window` default {cfg.get('fill_window')}. "
      f"Image: {len(img['layers'])} tar+gzip layers, {img_bytes:,} B compressed. "
      f"Runs per link: {cfg['runs']} (containerd: "
      f"{', '.join(f'{n} at {k}' for k, n in cfg['containerd_runs'].items())}).")
    if r.get("incomplete"):
        w("")
        w(f"**Incomplete run**: {r['incomplete']}.")
    for f in r.get("failed_runs") or []:
        w("")
        w(f"**Failed start** ({f['link']}, {WLABEL.get(f['workload'], f['workload'])}, "
          f"{VLABEL.get(f['variant'], f['variant'])}, run {f['run']}): {f['error']}; not in the medians.")


def targets(w, r):
    w("")
    w("### Targets")
    w("")
    w("| figure | workload | link | measured | target | met |")
    w("|---|---|---|---:|---:|---|")
    for t in r["targets"]:
        if t["op"] == ">=":
            bound, ok = f"≥ {t['bound']:.0f}×", t["met"]
            val = f"{t['value']:.1f}×"
            by = f"**no** (reached {t['value'] / t['bound']:.0%} of it)" if not ok else "yes"
        else:
            unit = t.get("unit", "%")
            fmt = {"%": "{:.2f} %", "x": "{:.2f}×", "MiB": "{:.1f} MiB"}[unit]
            bound, ok = "≤ " + fmt.format(t["bound"]), t["met"]
            val = fmt.format(t["value"])
            by = f"**no** ({t['value'] / t['bound']:.2f}× the bound)" if not ok else "yes"
        w(f"| {t['name']} | {WLABEL.get(t['workload'], t['workload'])} | {t['link']} | {val} | {bound} | {by} |")


def cold_start(w, r):
    med, rt = r["medians"], r["ratios"]
    w("")
    w("### Cold start: seconds from start to first useful output")
    w("")
    w("Median (min–max). containerd: `ctr image pull` + `ctr run`; lamina: `lamina mount` + overlayfs + "
      "`runc run`. Ratio = containerd / lamina.")
    w("")
    w("| link | workload | containerd | lamina | lamina + boot set | ratio lamina | ratio boot set |")
    w("|---|---|---:|---:|---:|---:|---:|")
    for link, per_w in med.items():
        for wl, per_v in per_w.items():
            cells = [spread(per_v[v]["time_s"]) if v in per_v else "–" for v in ("containerd", "lamina", "lamina-boot")]
            rl = rt[link][wl].get("lamina")
            rb = rt[link][wl].get("lamina-boot")
            w(f"| {link} | {WLABEL.get(wl, wl)} | {' | '.join(cells)} | "
              f"{f'{rl:.1f}×' if rl else '–'} | {f'{rb:.1f}×' if rb else '–'} |")


def where_time_goes(w, r):
    med = r["medians"]
    w("")
    w("### Where the time goes (medians, seconds)")
    w("")
    w("containerd: *pull* = `ctr image pull` (download and unpack), of which *download* = wire bytes at the "
      "measured wire rate of the link; *run* = `ctr run` to first output. lamina: *mount* = `lamina mount` (manifest, "
      "chunk index and metadata fetched, daemons started, kernel mount); *warm* = the same container started "
      "again on the same mount (nothing fetched: runc + the workload itself); *data* = bytes on the wire "
      "after the mount, at the link's measured wire rate; *rest* = total − mount − overlay − warm − data, i.e. what "
      "the misses cost beyond their bytes: request latency of serialized page faults, decompression and "
      "verification; *req × lat* = requests × the median 1-byte Range GET time of that link.")
    w("")
    w("| link | workload | containerd pull (download) | run | lamina | mount | warm | data | rest | req × lat "
      "| boot set: total | mount | data | rest |")
    w("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for link, per_w in med.items():
        cal = r["links"].get(link, {})
        # wire bytes per second of the link (payload + TCP/IP headers + ACKs), from the calibration transfer
        bps = cal["wire_bytes"] / cal["seconds"] if cal.get("seconds") else 0
        lat = cal.get("range_request_1byte_ms", 0) / 1000

        def parts(s):
            if not s:
                return None
            total = s["time_s"]["median"]
            mount = s["mount_s"]["median"]
            ovl = s["overlay_s"]["median"]
            warm = s["second_time_s"]["median"]
            data = (s["wire_bytes_ready"]["median"] - s["wire_bytes_mount"]["median"]) / bps if bps else 0
            rest = total - mount - ovl - warm - data
            return total, mount, warm, data, rest, s["requests"]["median"] * lat
        for wl, per_v in per_w.items():
            cd = per_v.get("containerd")
            cdc = (f"{secs(cd['pull_s']['median'])} ({secs(cd['wire_bytes']['median'] / bps) if bps else '?'})",
                   secs(cd["container_s"]["median"])) if cd else ("–", "–")
            la = parts(per_v.get("lamina"))
            bo = parts(per_v.get("lamina-boot"))
            lac = [secs(x) for x in la] if la else ["–"] * 6
            boc = [secs(x) for x in bo[:2] + bo[3:5]] if bo else ["–"] * 4
            w(f"| {link} | {WLABEL.get(wl, wl)} | {cdc[0]} | {cdc[1]} | {' | '.join(lac)} | {' | '.join(boc)} |")


def bytes_table(w, r):
    cfg, img_bytes = r["config"], r["image"]["layer_bytes"]
    w("")
    w("### Bytes")
    w("")
    w("*wire* = bytes sent on the namespace's `lo` from the start to the first useful output (requests, "
      "responses, TCP/IP headers; the registry is only reachable there); *fetched* = lamina's `fetched_bytes` "
      "at that point (compressed chunk and boot-page bytes received by its worker; the mount's manifest, index "
      "and metadata are not counted); % of the image's "
      f"compressed size ({img_bytes / 1e6:.1f} MB). *after background* = lamina's wire bytes once its "
      "background fetching is done (with boot pages: the boot set's whole chunks, fetched after the start). "
      "Medians over all links.")
    w("")
    w("| workload | containerd wire MB | lamina fetched MB (%) | lamina wire MB (%) | requests / misses "
      "| boot set fetched MB (%) | boot set wire MB (%) | requests / misses | boot set wire after background MB "
      "| mount wire MB |")
    w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for wl in cfg["workloads"]:
        runs = [x for x in r["runs"] if x["workload"] == wl]

        def medv(v, k):
            vals = sorted(x[k] for x in runs if x["variant"] == v and x.get(k) is not None)
            if not vals:
                return None
            n = len(vals)
            return vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2

        def pct(n):
            return f"{mb(n)} ({100 * n / img_bytes:.2f} %)" if n is not None else "–"
        cdw = medv("containerd", "wire_bytes")
        row = [mb(cdw) if cdw else "–"]
        for v in ("lamina", "lamina-boot"):
            req, mis = medv(v, "requests_ready"), medv(v, "misses_ready")
            row += [pct(medv(v, "fetched_bytes_ready")), pct(medv(v, "wire_bytes_ready")),
                    f"{req:.0f} / {mis:.0f}" if req is not None else "–"]
        after = medv("lamina-boot", "wire_bytes")
        row.append(mb(after) if after else "–")
        mw = medv("lamina", "wire_bytes_mount")
        row.append(mb(mw) if mw else "–")
        w(f"| {WLABEL.get(wl, wl)} | {' | '.join(row)} |")


def second_container(w, r):
    cfg = r["config"]
    w("")
    w("### Second container, daemon memory")
    w("")
    w("A second container of the same image right after the first (lamina: same mount and cache dir, "
      "new overlay; snapshotter: same image, same lazy mount, a new snapshot on it; `lamina run`: a new run "
      "on the same cache dir, mounted again; containerd: image already unpacked; page cache warm). Memory: "
      "VmHWM of the lamina holder + worker (at the end of each run; `lamina run`: the highest seen while it "
      "ran).")
    w("")
    w("| workload | variant | 2nd start s | 2nd fetched B (max) | 2nd wire B (max) | holder VmHWM MB | worker VmHWM MB | sum MB (max) |")
    w("|---|---|---:|---:|---:|---:|---:|---:|")
    for wl in cfg["workloads"]:
        for v in cfg["variants"]:
            runs = [x for x in r["runs"] if x["workload"] == wl and x["variant"] == v]
            if not runs:
                continue
            ts = sorted(x["second"]["time_s"] for x in runs)
            t2 = ts[len(ts) // 2]
            wire = max(x["second"]["wire_bytes"] for x in runs)
            if v in ("containerd", "local"):
                w(f"| {WLABEL.get(wl, wl)} | {VLABEL.get(v, v)} | {t2:.3f} | – | {wire:,} | – | – | – |")
                continue
            fetched = max((x["second"].get("fetched_bytes") or 0) for x in runs)
            w(f"| {WLABEL.get(wl, wl)} | {VLABEL.get(v, v)} | {t2:.3f} | {fetched:,} | {wire:,} | {memory(runs)} |")


def memory(runs):
    """The memory cells of a variant's runs: holder and worker VmHWM
    (medians) and their largest sum, in MB; "–" for runs that measured none
    (docker-index)."""
    if not all(x.get("rss_kib") for x in runs):
        return "– | – | –"
    hs = sorted(x["rss_kib"]["holder"] or 0 for x in runs)
    ws = sorted(x["rss_kib"]["worker"] or 0 for x in runs)
    ss = [x["rss_kib"]["sum"] or 0 for x in runs]
    return f"{hs[len(hs) // 2] / 1024:.1f} | {ws[len(ws) // 2] / 1024:.1f} | {max(ss) / 1024:.1f}"


def boot_sets(w, r):
    w("")
    w("### Boot sets")
    w("")
    w("Recorded per workload on the unshaped link, two starts appended to one trace (`lamina mount "
      "--record-trace`, readahead off, workload run to its first useful output, fresh cache each): every read of "
      "data not yet local. *Read* = bytes those reads asked for; "
      "*chunks* = the chunks they fall in (uncompressed MB); *boot pages* = the 4 KiB pages they touched, as "
      "`lamina convert --prefetch` packs them (uncompressed → compressed). Files by share of the chunks.")
    w("")
    w("| workload | reads | read MB | chunks (MB) | boot pages MB → compressed MB | first recorded run: fetched MB, requests / misses | largest files (chunks) |")
    w("|---|---:|---:|---:|---:|---:|---|")
    for wl, t in r["setup"]["traces"].items():
        rec = t["record_run"]
        top = ", ".join(f"`{' = '.join(x.rsplit('/', 1)[-1] for x in f['path'].split(' = '))}` ({f['chunks']})"
                        for f in t["files"][:5])
        bp = (r["setup"]["convert"].get(f"lamina-boot-{wl}") or {}).get("boot_pages") or {}
        pages = f"{mb(bp['bytes'])} → {mb(bp['compressed_bytes'])}" if bp else "–"
        w(f"| {WLABEL.get(wl, wl)} | {t.get('reads', t.get('chunks', 0))} | {mb(t.get('bytes_read', 0))} | "
          f"{t['distinct_chunks']} ({mb(t['bytes'])}) | {pages} | {mb(rec['fetched_bytes'])}, "
          f"{rec['requests']} / {rec['misses']} | {top} |")


def links(w, r):
    w("")
    w("### Links")
    w("")
    w("| link | nominal MB/s | measured MB/s (Range GET of 1 s worth) | 1-byte Range GET ms (median of 5) |")
    w("|---|---:|---:|---:|")
    for link, c in r["links"].items():
        w(f"| {link} | {c['nominal_MBps']:.2f} | {c['MBps']:.2f} | {c['range_request_1byte_ms']:.1f} |")


def heavy(w, r):
    """Issue 29: heavy starts against their limit."""
    med = r["medians"]
    limits = r.get("limits") or {}
    rows = [(link, wl, per_v) for link, per_w in med.items() for wl, per_v in per_w.items()
            if per_v.get("local") or (limits.get(link) or {}).get(wl)]
    if not rows:
        return
    w("")
    w("### Heavy starts")
    w("")
    w("Each on its own image (scripts/heavy-image.sh): *datasci* imports numpy, pandas, scipy.stats, "
      "sklearn.linear_model, pyarrow, statsmodels.api and matplotlib.pyplot; *node* requires 8 npm packages "
      "(12,097 files in node_modules). *local*: the same start from the image unpacked on local disk (umoci), page "
      "cache dropped, same overlay + runc. *limit*: the larger of *local* and the boot set's bytes (fetched to "
      "first output) at the link's measured rate. Median seconds; × = that / limit (containerd: that / lamina). "
      "*ahead*: chunk bytes (uncompressed) lamina fetched ahead of readers (predicted or in order) by the end of "
      "the run, and of those never read. *events*: pre-content events (reads of cache files not yet complete) to "
      "first output, those the worker answered and those the holder answered within boot pages.")
    w("")
    w("| link | workload | containerd | local | limit | lamina | × | lamina + boot set | × | MB to first output "
      "(lamina / boot set) | requests (lamina / boot set) | events (lamina / boot set) | ahead, MB (not read) |")
    w("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for link, wl, per_v in rows:
        limit = (limits.get(link) or {}).get(wl)

        def t(v):
            return per_v[v]["time_s"]["median"] if per_v.get(v) else None

        def over(v):
            return f"{t(v) / limit:.2f}×" if t(v) and limit else "–"

        def cell(v):
            return f"{t(v):.2f}" if t(v) else "–"

        def ready(v, key):
            x = (per_v.get(v) or {}).get(key)
            return x["median"] if x else None
        mb = " / ".join(f"{ready(v, 'fetched_bytes_ready') / 1e6:.1f}" if ready(v, "fetched_bytes_ready") else "–"
                        for v in ("lamina", "lamina-boot"))
        rq = " / ".join(f"{ready(v, 'requests_ready'):.0f}" if ready(v, "requests_ready") else "–"
                        for v in ("lamina", "lamina-boot"))
        # results from before the holder answered boot pages: every event was a miss
        ev = " / ".join(f"{n:,.0f}" if (n := ready(v, "events_ready") or ready(v, "misses_ready")) else "–"
                        for v in ("lamina", "lamina-boot"))
        ahead, used = ready("lamina", "ahead_chunk_bytes"), ready("lamina", "ahead_used_bytes")
        ah = f"{ahead / 1e6:.1f} ({(ahead - used) / 1e6:.1f})" if ahead is not None and used is not None else "–"
        cd = f"{cell('containerd')}" + (f" ({t('containerd') / t('lamina'):.1f}×)" if t("containerd") and t("lamina")
                                         else "")
        w(f"| {link} | {WLABEL.get(wl, wl)} | {cd} | {cell('local')} | {f'{limit:.2f}' if limit else '–'} | "
          f"{cell('lamina')} | {over('lamina')} | {cell('lamina-boot')} | {over('lamina-boot')} | {mb} | {rq} | {ev} | {ah} |")


def faults(w, r):
    """Issue 29: starts through the demo's fault mix, with and without hedging."""
    med, cfg = r["medians"], r["config"]
    if "faults" not in cfg["variants"] and "faults-nohedge" not in cfg["variants"]:
        return
    w("")
    w("### Through faults")
    w("")
    w("`lamina mount` (no boot set) through `tests/tools/faultproxy.py mix --every 5 --stall 3`: every 5th range "
      "answer spoilt in turn by a flipped byte, a truncated body, a reset, a 500, a 503 and a 3 s stall. *Clean*: "
      "the same proxy spoiling nothing (it runs in the shaped namespace, so every byte crosses the link twice, "
      "and it forwards an answer once it has all of it). Median (min–max) seconds to first output; × = that / "
      "clean; answers spoilt, hedges sent (won) per start (medians).")
    w("")
    w("| link | workload | clean | fault mix | × | spoilt | hedges (won) | --no-hedge | × |")
    w("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for link, per_w in med.items():
        for wl, per_v in per_w.items():
            if "faults" not in per_v and "faults-nohedge" not in per_v:
                continue
            clean = per_v.get("proxy")

            def cell(v):
                if v not in per_v:
                    return "–", "–"
                x = per_v[v]["time_s"]["median"] / clean["time_s"]["median"] if clean else None
                return spread(per_v[v]["time_s"]), f"{x:.2f}×" if x else "–"
            runs = [x for x in r["runs"] if x["workload"] == wl and x["link"] == link and x["variant"] == "faults"]

            def median_of(key):
                vals = sorted(key(x) or 0 for x in runs)
                return vals[len(vals) // 2] if vals else 0
            spoilt = median_of(lambda x: (x.get("proxy") or {}).get("faulted"))
            hedges, won = median_of(lambda x: x.get("hedges")), median_of(lambda x: x.get("hedge_wins"))
            (t, x), (tn, xn) = cell("faults"), cell("faults-nohedge")
            w(f"| {link} | {WLABEL.get(wl, wl)} | {spread(clean['time_s']) if clean else '–'} | {t} | {x} | "
              f"{spoilt} | {hedges} ({won}) | {tn} | {xn} |")


def through(w, r):
    """The table of issue 8: starts through containerd and with `lamina run`."""
    med, rt, cfg = r["medians"], r["ratios"], r["config"]
    if not any(v in cfg["variants"] for v in THROUGH[1:]):
        return
    w("")
    w("### Through containerd, and with `lamina run`")
    w("")
    w("Median (min–max) seconds to first useful output. containerd: full pull into its overlayfs snapshotter + "
      "`ctr run`; snapshotter: `ctr-remote image rpull --snapshotter lamina` + `ctr-remote run --snapshotter lamina` "
      "(the same containerd 1.6, lamina snapshotter as its proxy plugin); `lamina run`: one command, mount + "
      "overlay + runc. ×: containerd / that variant. Last columns: snapshotter time / `lamina run` time, "
      "without and with the boot set.")
    w("")
    cols = [v for v in THROUGH if v in cfg["variants"]]
    w("| link | workload | " + " | ".join(VLABEL.get(v, v) for v in cols) + " | snapshotter / run | with boot set |")
    w("|---|---|" + "---:|" * (len(cols) + 2))
    for link, per_w in med.items():
        for wl, per_v in per_w.items():
            cells = []
            for v in cols:
                if v not in per_v:
                    cells.append("–")
                    continue
                x = rt[link][wl].get(v)
                cells.append(spread(per_v[v]["time_s"]) + (f" **{x:.1f}×**" if x else ""))

            def over(a, b):
                if a in per_v and b in per_v:
                    return f"{per_v[a]['time_s']['median'] / per_v[b]['time_s']['median']:.2f}"
                return "–"
            w(f"| {link} | {WLABEL.get(wl, wl)} | {' | '.join(cells)} | {over('snapshotter', 'run')} | "
              f"{over('snapshotter-boot', 'run-boot')} |")
    w("")
    w("Bytes to first useful output (medians over all links; fetched = lamina's `fetched_bytes`, wire = "
      "the namespace's `lo`; snapshotter: from `rpull` on, with the image's manifest and config):")
    w("")
    w("| workload | " + " | ".join(f"{VLABEL.get(v, v)} fetched / wire MB" for v in cols[1:]) + " |")
    w("|---|" + "---:|" * (len(cols) - 1))
    img_bytes = r["image"]["layer_bytes"]
    for wl in cfg["workloads"]:
        cells = []
        for v in cols[1:]:
            runs = [x for x in r["runs"] if x["workload"] == wl and x["variant"] == v]
            f_ = sorted(x["fetched_bytes_ready"] for x in runs if x.get("fetched_bytes_ready") is not None)
            w_ = sorted(x["wire_bytes_ready"] for x in runs if x.get("wire_bytes_ready") is not None)
            fm = f"{mb(f_[len(f_) // 2])}" if f_ else "–"
            wm = f"{mb(w_[len(w_) // 2])} ({100 * w_[len(w_) // 2] / img_bytes:.1f} %)" if w_ else "–"
            cells.append(f"{fm} / {wm}")
        w(f"| {WLABEL.get(wl, wl)} | {' | '.join(cells)} |")
    idle_and_peers(w, r)


def idle_and_peers(w, r):
    """The snapshotter's idle footprint, and the peers found on PATH."""
    cfg = r["config"]
    idle = r.get("idle")
    if idle:
        w("")
        w(f"**Idle footprint.** {idle['images']} distinct images (the Debian image plus a one-file layer each, "
          f"converted) pulled through lamina snapshotter, each a lazy mount ({idle['mounts']} mounts), then "
          f"{idle['settle_s']} s with nothing reading: snapshotter RSS {idle['snapshotter_rss_kib'] / 1024:.1f} MiB "
          f"(PSS {idle['snapshotter_pss_kib'] / 1024:.1f} MiB, peak {idle['snapshotter_hwm_kib'] / 1024:.1f} MiB); "
          f"the {idle['daemons']} mount daemons (a holder and a worker per mount) RSS "
          f"{idle['daemons_rss_kib'] / 1024:.1f} MiB, PSS {idle['daemons_pss_kib'] / 1024:.1f} MiB in all "
          f"({idle['daemons_pss_kib'] / 1024 / max(idle['mounts'], 1):.1f} MiB PSS per mount); "
          f"{idle['content_blobs']} blobs in containerd's content store.")
    peers = cfg.get("peers") or {}
    if peers:
        found = [k for k, p in peers.items() if p]
        w("")
        w("Other lazy-pulling snapshotters on PATH: " + (", ".join(found) if found else "none") +
          f" (looked for {', '.join(f'`{k}`' for k in peers)}); none is compared here.")
