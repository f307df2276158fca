"""python3 -m bench NAME [--quick] [--set KEY=VALUE]... [--out FILE] [--plot FILE] [--work DIR]
python3 -m bench NAME --report FILE [--plot FILE]   # tables (and plot) of a results file again

Runs one benchmark (as root, from the repository's root) and writes its
results file (by default the one docs/ carry) and plot, then prints its
tables in Markdown."""

import argparse
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .harness import report, workdir
from .harness.core import ROOT, Results, log
from .harness.lamina import Lamina, binary

BENCHMARKS = ("big_image", "coldstart", "density", "density_containers", "density_designs", "fleet", "fuse", "image", "scale")


def main():
    p = argparse.ArgumentParser(prog="python3 -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=BENCHMARKS)
    p.add_argument("--quick", action="store_true", help="fewer, smaller runs (to try the benchmark)")
    p.add_argument("--out", help="results file (default: the benchmark's file under docs/)")
    p.add_argument("--plot", help="plot file (default: the benchmark's under docs/, or beside --out)")
    p.add_argument("--work", help="work dir (default: a fresh one under /tmp, removed after)")
    p.add_argument("--report", metavar="FILE", help="print the tables of this results file and exit")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a benchmark's own option (e.g. fleet: nodes=8, variants=dragonfly, update=no)")
    args = p.parse_args()
    bench = importlib.import_module(f"bench.{args.name}").BENCHMARK
    if args.report:
        doc = report.load(args.report)
        if "derive" in bench:  # summary and targets as this code derives them
            bench["derive"](doc)
        print(bench["render"](doc, args.plot or os.devnull))
        return
    if os.geteuid() != 0:
        raise SystemExit("bench: must run as root (mounts, network namespaces)")
    missing = [t for t in bench.get("needs", []) if not shutil.which(t)]
    if missing:
        raise SystemExit(f"bench {args.name}: missing {', '.join(missing)} (run scripts/setup.sh)")
    work = Path(args.work or tempfile.mkdtemp(prefix=f"lamina-bench-{args.name}."))
    work.mkdir(parents=True, exist_ok=True)
    # A private copy: a rebuild of target/ while the benchmark runs must not
    # change the binary under test.
    built = binary()
    os.environ["LAMINA_BENCH_BINARY_SOURCE"] = str(built)  # its build time goes in the results
    lamina = Lamina(shutil.copy2(built, work / "lamina"))
    options = dict(kv.split("=", 1) for kv in args.set)
    results = Results(args.name, {"lamina": str(lamina.path), "options": options}, quick=args.quick)
    out = Path(args.out or bench["out"])
    measured = False
    try:
        bench["measure"](results, lamina, work, args.quick, options)
        measured = True
    finally:
        lamina.umount_all()
        if not measured and not args.work:  # a failed run's too, unless something stays mounted in it
            workdir.remove(work)
    results.write(out)
    plot = args.plot or bench["plot"]  # None: the benchmark draws none
    if args.out and not args.plot and plot:  # a results file given: its plot beside it (docs/ left alone)
        plot = out.with_name(Path(plot).name)
    tables = bench["render"](results.doc, plot)
    print(tables)
    carrier = tables_doc(bench, out, args.out)
    incomplete = results.doc.get("incomplete")  # a run stopped early: its tables stay out of docs/
    if carrier and not incomplete:
        begin, end = bench.get("markers", (report.TABLES_BEGIN, report.TABLES_END))  # a doc's own markers
        report.replace_between(ROOT / carrier, begin, end, tables)
        log(f"tables updated in {carrier}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    log(f"done in {results.doc['seconds']} s")
    if incomplete:
        raise SystemExit(f"bench {args.name}: incomplete run: {incomplete} (results in {out})")


def tables_doc(bench, out, given):
    """The doc that carries the tables of results file `out`: `tables_in`
    for the benchmark's own file, else the one its `tables_of` maps `out`
    to (paths from the repository's root); None for any other file."""
    rel = os.path.relpath(out.resolve(), ROOT)
    if not given or rel == os.path.relpath(Path(bench["out"]).resolve(), ROOT):
        return bench.get("tables_in")
    return bench.get("tables_of", {}).get(rel)


if __name__ == "__main__":
    sys.exit(main())
