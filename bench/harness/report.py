"""Tables and plots from a results file: what docs/ carry."""

import json
import sys
from pathlib import Path

from .core import log


def load(path):
    return json.loads(Path(path).read_text())


def table(header, rows):
    """A Markdown table; numbers right-aligned."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.2f}"
        return "" if v is None else str(v)

    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


def targets(doc):
    rows = [(t["name"], t["value"], f"{t['op']} {t['bound']}",
             "met" if t["met"] else ("not measured" if t["met"] is None else "NOT met"))
            for t in doc["targets"]]
    return table(("target", "value", "bound", ""), rows)


def heading(doc):
    m = doc["machine"]
    return (f"{doc['benchmark']}: {doc['date']}, commit {doc['commit'][:12]}, "
            f"{m.get('cpu', '?')} x{m.get('nproc')}, Linux {m.get('kernel')}"
            + (" (quick run)" if doc.get("quick") else ""))


def pyplot():
    """matplotlib's pyplot on a file backend, or None (said on stderr) when
    this Python has no matplotlib (scripts/setup.sh installs Debian's)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        log(f"no plot: {sys.executable} has no matplotlib (run /usr/bin/python3 after scripts/setup.sh)")
        return None


def replace_between(doc_path, begin, end, text):
    """Replaces the part of the Markdown file `doc_path` between the markers
    `begin` and `end` with `text` (the tables a results file renders)."""
    doc = Path(doc_path).read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{doc_path}: markers {begin} / {end} not found")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    Path(doc_path).write_text(head + begin + "\n" + text + end + tail)


def report_main(render, begin, end, usage):
    """`REPORT results.json` prints the tables; `REPORT results.json --update
    DOC` replaces the part of DOC between the `begin` and `end` markers with
    them (the older drivers under scripts/)."""
    args = sys.argv[1:]
    if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--update"):
        sys.exit(usage)
    text = render(load(args[0]))
    if len(args) == 1:
        sys.stdout.write(text)
        return
    replace_between(args[2], begin, end, text)


# The markers of the tables a doc carries from its results file.
TABLES_BEGIN = "<!-- bench-tables:begin -->"
TABLES_END = "<!-- bench-tables:end -->"


# Plot colours: lamina, the others; warm and cold runs.
LAMINA = "#d95f02"
OTHER = "#7570b3"
WARM = "#66a61e"
COLD = "#1f78b4"


def label_bars(ax, bars, fmt, fontsize=8):
    """Writes each bar's value above it (bars that are nan: not measured)."""
    top = max((b.get_height() for b in bars if b.get_height() == b.get_height()), default=0)
    for b in bars:
        if b.get_height() != b.get_height():
            continue
        ax.text(b.get_x() + b.get_width() / 2, b.get_height() + top * 0.015, fmt.format(b.get_height()),
                ha="center", va="bottom", fontsize=fontsize)


def notes(r):
    """The closing lines of a results file's tables: what went wrong and was
    worked around (`anomalies`), and what was not measured and why."""
    anomalies = r.get("anomalies") or []
    lines = ["", "Anomalies during the run (worked around, see `anomalies` in the JSON): "
             + ("; ".join(anomalies) if anomalies else "none") + "."]
    missing = r.get("not_measured") or {}
    if missing:
        lines += ["", "Not measured: " + "; ".join(f"{k} ({v})" for k, v in missing.items()) + "."]
    return lines


def ms(seconds):
    return f"{seconds * 1000:.1f}"


def spread_ms(d):
    """A summary's median and range in ms: `median (min–max)` (its `runs_s`)."""
    return f"{ms(d['median_s'])} ({ms(min(d['runs_s']))}–{ms(max(d['runs_s']))})"


def kib_mib(kib):
    return f"{kib / 1024:.1f}" if kib is not None else "–"


def met_cell(x):
    """A judged figure's table cell."""
    if x["met"] is None:
        return ""
    return "yes" if x["met"] else "**no**"


def binary(machine):
    """The line saying which lamina binary was measured and the versions of
    the tools beside it (`measure.machine_info`)."""
    lb = machine.get("lamina_binary", {})
    return (f"lamina binary sha256 `{lb.get('sha256', '?')[:16]}…`, built {lb.get('built_at', '?')} "
            f"from commit `{lb.get('git_head', '?')[:10]}`"
            f"{' (working tree had uncommitted changes)' if lb.get('git_tree_dirty') else ''}; "
            f"{', '.join(f'{k} {v}' for k, v in machine.get('versions', {}).items() if v and k != 'lamina')}.")
