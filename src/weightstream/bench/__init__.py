"""`weightstream bench`: one harness that runs every offload method on the same model and records one
result schema. Each file is one idea:

| file | what it owns |
| --- | --- |
| `cli.py` | the `weightstream bench` command line (`weightstream/cli.py` hands `bench ...` to it) |
| `runner.py` | the run: `run_suite`, prepare / time / compare / undo per method, budget, phase, mode |
| `limits.py` | `--method-seconds` (a SIGALRM timer) and the limits' checks |
| `measure.py` | one measurement (warm-up + `placement.timing`), `compare_outputs`, link bound, bandwidth |
| `methods/` | the method registry (`methods/__init__.py`) and one file per family of methods |
| `shapes.py` | the model shapes (`SHAPES`), `ModelKind`, build a model where it fits |
| `causal_lm.py` | the causal-LM model kind: build with random bf16 weights, input ids, forward |
| `diffusion.py` | the diffusion model kind: Flux, Wan, T5 encoder from published configs; one denoise step |
| `phases.py` | `decode-bN`, `prefill-N`, `denoise-bN` (`PHASE_KINDS`) |
| `schema.py` | `ResultRow`, the document, `validate`, `write_json`, `load_results` |
| `index.py` | the results folder's layout (`<date>_<gpu>_<topic>/`) and INDEX.md, a line per row |
| `memory.py`, `progress.py` | bytes and GPU memory; progress lines and error summaries |
| `timeline.py` | profiler timelines of one forward (copy row / compute row) |
| `report.py` | markdown table, run sections, the bars, docs/benchmarks.md, the planner's predictions |
| `plots.py` | tokens/s against budget; timelines (matplotlib) |

How to add:
- a peer (another library's offloading): a file `methods/<family>.py` with a `METHODS` tuple of
  `Method(name, prepare, modes, about, requires=...)`, and the module in `methods.FAMILIES`. `prepare
  (model, budget_bytes, phase_tokens, device) -> (setup_info with link_bytes, undo)` changes the model
  in place; the runner checks that undo put every tensor back.
- a variant of weightstream: one line in `methods/weightstream.py`, as `ws-auto-compress` is
  (`Method("ws-auto-compress", ws_prepare("auto", compress=True), MODES, ...)`): `ws_prepare` passes
  further keywords to `offload`. Every weightstream row records wire_bytes, wire_raw_bytes and
  wire_ratio, and its link bound counts wire bytes.
- a shape of a known kind: one `Shape(name, fields)` entry in `shapes.SHAPES` (planning shapes come
  from `weightstream/placement/shapes.py`, so a planning shape is benched as soon as it is added there).
- quantized weights (fp8, int4): a model kind in its own file (e.g. `quantized_lm.py`: `CausalLM` whose
  `build` converts the linear weights and whose `dtype_name` says so), plus `Shape` entries using it.
- a diffusion shape: one entry in `diffusion.SHAPE_FIELDS` (the constructor's keywords, `model_type` =
  the class, `input_*` = the step's geometry). The model kind's `resolve` gives `denoise-bN` its tokens
  per sample (the runner calls `shapes.resolve_phase`).
- a multi-rank run: each rank runs `run_suite` on its shard with its own `--out` (e.g. with a rank
  suffix) and a method whose `prepare` offloads that rank's shard; the report already merges several
  documents of one shape. A `rank` field in the header would say which is which.
"""

from .cli import main
from .runner import run_suite
from .schema import ResultRow, load_results, validate

__all__ = ["ResultRow", "load_results", "main", "run_suite", "validate"]
