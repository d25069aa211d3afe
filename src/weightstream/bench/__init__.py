"""`weightstream bench`: one harness that runs every offload method on the same model and records one
result schema. `--kind` picks what one run measures (`kinds.py`): `suite` (methods x budgets x phases x
modes on one model), `pipeline` (whole diffusers pipeline generations), `load` (a checkpoint loaded
into place, host and disk tiers), `codec` (the wire codec alone). Each file is one idea:

| file | what it owns |
| --- | --- |
| `cli.py` | the `weightstream bench` command line (`weightstream/cli.py` hands `bench ...` to it) |
| `kinds.py` | `--kind`, the options of each kind and their defaults, `--bound`/`--waits`/`--predict` |
| `runner.py` | the suite: `run_suite`, prepare / time / compare / undo per method, budget, phase, mode |
| `pipeline_run.py`, `flux_pipeline.py` | `--kind pipeline`: whole generations; FLUX.1-dev from configs |
| `load.py` | `--kind load`: save, `from_pretrained` into place, host and disk tiers |
| `codec.py` | `--kind codec`: wire ratio and torch / Triton decoder throughput on one group |
| `limits.py` | `--method-seconds` (a SIGALRM timer) and the limits' checks |
| `measure.py` | one measurement (warm-up + `placement.timing`), `compare_outputs`, link bound, bandwidth |
| `methods/` | the method registry (`methods/__init__.py`) and one file per family of methods |
| `shapes.py` | the model shapes (`SHAPES`), `ModelKind`, build a model where it fits |
| `causal_lm.py` | the causal-LM model kind: build with random bf16 weights, input ids, forward, generate |
| `quantized_lm.py` | the causal LM with fp8 (128x128 scales) or torchao int4 weights, streamed as stored |
| `seq2seq_lm.py` | the encoder-decoder (T5) model kind: decoder steps on fixed encoder states, generate |
| `diffusion.py` | the diffusion model kind: Flux, Wan, T5 encoder from published configs; one denoise step |
| `phases.py` | `decode-bN`, `prefill-N`, `denoise-bN`, `generate-N` (`PHASE_KINDS`) |
| `schema.py` | `ResultRow`, the document, `validate`, `write_json`, `load_results` |
| `index.py` | the results folder's layout (`<date>_<gpu>_<topic>/`) and INDEX.md, a line per row |
| `memory.py`, `progress.py` | bytes and GPU memory; progress lines and error summaries |
| `timeline.py` | profiler timelines of one forward (copy row / compute row) |
| `profile.py` | `--profile DIR`: host time, synchronizing and blocking calls, top ops, a trace per row |
| `analysis.py` | `--bound` (rows against max(compute, transfer)) and `--waits` (stored timelines) |
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
  wire_ratio, and its link bound counts wire bytes; on an offloaded mixture of experts its setup also
  records `expert_bytes_per_token` and `expert_hit_rate` (where a GPU expert cache is on), counted over
  eager forwards of the inputs the timed calls cycled through (`runner.rotating_inputs`: a mixture of
  experts is timed on routing that changes from call to call), after the timed calls
  (`runner.expert_fields`).
- a shape of a known kind: one `Shape(name, fields)` entry in `shapes.SHAPES` (planning shapes come
  from `weightstream/placement/shapes.py`, so a planning shape is benched as soon as it is added there).
- quantized weights of another format: a variant in `quantized_lm.py` (its `quantize` and `meta`),
  plus `Shape` entries using it.
- a kind of run that is not methods x budgets x phases x modes on one model: a module with a
  `run_<kind>` writing the one schema (`runner.base_header` for the document), an entry in
  `kinds.KINDS`, its options in `kinds.add_options` and `kinds.OPTION_KINDS`, its defaults in
  `kinds.DEFAULTS`.
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
