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
