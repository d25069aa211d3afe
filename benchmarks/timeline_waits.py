"""Where a streamed forward waits: for each timeline stored in `weightstream bench` result files, the
span, each row's busy ms, and the compute row's idle ms split by what ran meanwhile (a decode, a copy,
or neither: host gaps between launches), recomputed from the stored events, so it reads files recorded
before the summary carried the split. Also the idle ms before the first compute after the first copy
began (the wait for the first streamed group, which the schedule only starts copying when the forward
reaches it), and the median gap between consecutive kernels while a copy runs and while the link is
idle. No GPU needed.

    python benchmarks/timeline_waits.py benchmarks/results/suite_flux-dev-transformer_session26.json [...]
"""

from __future__ import annotations

import json
import statistics
import sys

from weightstream.bench.timeline import kernel_gaps, row_spans, summary


def first_wait(events) -> float:
    """ms compute sat idle from the first copy's start to the end of the first streamed group's wait:
    the first compute idle span that holds a copy."""
    copies = row_spans(events, "copy")
    if not copies:
        return 0.0
    cursor = None
    for a, b in row_spans(events, "compute"):
        if cursor is not None and a > copies[0][0] and cursor < copies[0][1]:
            return a - max(cursor, copies[0][0])
        cursor = b
    return 0.0


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for path in argv:
        doc = json.load(open(path))
        for t in doc.get("timelines", []):
            events = [tuple(e) for e in t["events"]]
            s = summary(events)
            budget = t.get("budget_bytes")
            where = f" budget {budget / 2**30:.2f} GiB" if budget else ""
            print(f"{path}: {t['method']} {t['phase']} {t['mode']}{where}")
            print("  " + ", ".join(f"{k} {v:.1f}" for k, v in s.items()) + f", first_group_wait_ms "
                  f"{first_wait(events):.1f}")
            during, idle = kernel_gaps(events)
            parts = [f"{name}: {statistics.median(g):.1f} us median of {len(g)}"
                     for name, g in (("during a copy", during), ("link idle", idle)) if g]
            if parts:
                print("  gaps between kernels under 50 us, " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
