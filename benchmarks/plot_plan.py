"""The planner against measurement, from stored results: tokens/s against the GPU budget (one line per
method and mode, one panel per phase) and a markdown table of predicted against measured times.

A thin script over the bench package: it reads any result file (the planner sweep of
`bash benchmarks/suite_h200.sh plan`, or the older `bench_plan.py` file on record, converted).
Run: python3 benchmarks/plot_plan.py benchmarks/results/plan_llama-3-8b.json docs/plan_llama-3-8b.png
"""

from __future__ import annotations

import sys

from weightstream.bench.plots import plot_tokens_per_s
from weightstream.bench.report import prediction_table
from weightstream.bench.schema import load_results

if __name__ == "__main__":
    *sources, png = sys.argv[1:]
    docs = load_results(sources)
    plot_tokens_per_s(docs, png)
    print(prediction_table(docs))
