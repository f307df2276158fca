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

from .harness import report
from .harness.core import ROOT, Results, log
from .harness.lamina import Lamina, binary

BENCHMARKS = ("fleet", "fuse", "image", "scale")


def main():
    p = argparse.ArgumentParser(prog="python3 -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=BENCHMARKS)
    p.add_argument("--quick", action="store_true", help="fewer, smaller runs (to try the benchmark)")
    p.add_argument("--out", help="results file (default: the benchmark's file under docs/)")
    p.add_argument("--plot", help="plot file (default: the benchmark's under docs/)")
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
    try:
        bench["measure"](results, lamina, work, args.quick, options)
    finally:
        lamina.umount_all()
    results.write(out)
    tables = bench["render"](results.doc, args.plot or bench["plot"])
    print(tables)
    if "tables_in" in bench and not args.out:  # the doc that carries this results file's tables
        report.replace_between(ROOT / bench["tables_in"], report.TABLES_BEGIN, report.TABLES_END, tables)
        log(f"tables updated in {bench['tables_in']}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    log(f"done in {results.doc['seconds']} s")


if __name__ == "__main__":
    sys.exit(main())
