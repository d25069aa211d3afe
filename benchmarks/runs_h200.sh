#!/usr/bin/env bash
# Every result recorded under benchmarks/results/ up to 2026-12-05 that a command can make again (those
# since come from benchmarks/checks_gpu.sh parts, each folder's README naming its commands), one `weightstream bench`
# line each (the results' own files say what they measured: each JSON's `command`, each folder's README).
# Usage, from the repository root on the GPU machine ($OUT: the device's output folder):
#   bash benchmarks/runs_h200.sh list            the names, one per recorded result
#   OUT=/tmp/out bash benchmarks/runs_h200.sh NAME   run that one; NAME as listed, e.g.
#                                                    2026-12-03_h200_quantized/quant_llama-3-8b.json#fp8
# Its file lands in $OUT under the recorded file's name (`#tag` adds _tag before the extension). A name
# may stand for several lines (a script that made one file from several runs, now one run per part).
# Lines for results made by the retired scripts (bench_*.py) are their equivalents in the one harness:
# the same model, budget, phases and methods, written in the one schema (the old files stay as they
# were). Diagnostics without an equivalent (diag_*.py, ab_eager_ops.py) are listed at the end, with where
# their findings went. The card of each recorded run is in its folder's name (h200, h100); on the other
# card the figures differ.
set -euo pipefail
export PYTHONUNBUFFERED=1
WANT=${1:?give a NAME, or list}
found=0
start() {  # once, before the one run asked for: diffusers' wheel where one is carried, the output folder
    found=1
    OUT=${OUT:?set OUT to the folder for results}
    mkdir -p "$OUT"
    if ls .whl/diffusers-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/diffusers-*.whl
    fi
    export PYTHONPATH=src:/tmp/site
}
out_of() {  # the output file of a NAME: folder/file.ext#tag -> $OUT/file_tag.ext
    local file=${1##*/} base tag
    base=${file%%#*}
    tag=${file#"$base"}
    tag=${tag#\#}
    if [[ -n $tag ]]; then echo "$OUT/${base%.*}_$tag.${base##*.}"; else echo "$OUT/$base"; fi
}
run() {  # run NAME ARGS...: one `weightstream bench` run writing the NAME's file
    local name=$1
    shift
    if [[ $WANT == list ]]; then echo "$name"; return; fi
    [[ $WANT == "$name" ]] || return 0
    start
    python3 -m weightstream bench "$@" --out "$(out_of "$name")" 2>&1 | tee "$(out_of "$name").log"
}
read_stored() {  # read_stored NAME ARGS...: a reading of stored results (--bound, --waits), printed to the NAME's file
    local name=$1
    shift
    if [[ $WANT == list ]]; then echo "$name"; return; fi
    [[ $WANT == "$name" ]] || return 0
    start
    python3 -m weightstream bench "$@" | tee "$(out_of "$name")"
}
R=benchmarks/results

# --- 2026-12-02, H200: the first Llama-3-8B runs (former bench_core.py, bench_plan.py, bench_load.py) and the LLM suite
# bench_core.py --methods resident,stream: every layer through two slots (3040911872 bytes, what it planned)
run 2026-12-02_h200_llama-3-8b-core/core_llama-3-8b_stream.json --shape llama-3-8b --budgets 3040911872 --phases decode-b1,prefill-2048 --methods resident,ws-stream --reps 10 --emulate-precision-casts
# bench_core.py --methods resident,uva,accelerate: its hand-made zero copy of every layer is ws-uva at the same budget
run 2026-12-02_h200_llama-3-8b-core/core_llama-3-8b_uva_accelerate.json --shape llama-3-8b --budgets 3040911872 --phases decode-b1,prefill-2048 --methods resident,ws-uva,accelerate-cpu_offload --reps 5 --emulate-precision-casts
# bench_plan.py --reps 5 (also the part `plan` of suite_h200.sh)
run 2026-12-02_h200_llama-3-8b-planner-sweep/plan_llama-3-8b.json --shape llama-3-8b --budgets 1.0,0.25,0.5,0.75 --phases decode-b1,prefill-2048 --modes eager,graph-eager --methods resident,ws-stream,ws-uva,ws-auto --reps 5 --no-timeline --method-seconds 120
# bench_load.py
run 2026-12-02_h200_llama-3-8b-load/load_llama-3-8b.json --kind load --shape llama-3-8b --budgets 4GiB --reps 5
run 2026-12-02_h200_llm-suite/suite_llama-3-8b_auto.json --shape llama-3-8b --budgets 0.25 --methods resident,ws-auto --reps 10 --emulate-precision-casts
run 2026-12-02_h200_llm-suite/suite_llama-3-8b_device_map_prefill.json --shape llama-3-8b --budgets 0.25 --phases prefill-2048 --modes eager --reps 5 --no-timeline --methods resident,accelerate-device_map
run 2026-12-02_h200_llm-suite/suite_llama-3-8b_diffusers.json --shape llama-3-8b --budgets 0.25 --modes eager --reps 5 --no-timeline --methods resident,diffusers-group
run 2026-12-02_h200_llm-suite/suite_llama-3-8b_peers.json --shape llama-3-8b --budgets 0.25 --methods resident,accelerate-cpu_offload,accelerate-device_map,diffusers-group --modes eager --reps 5
run 2026-12-02_h200_llm-suite/suite_llama-3-8b_uva.json --shape llama-3-8b --budgets 0.25 --phases decode-b1,prefill-2048 --methods resident,ws-uva --reps 5 --no-timeline --emulate-precision-casts
run 2026-12-02_h200_llm-suite/suite_mixtral-8x7b_auto.json --max-seconds 200 --shape mixtral-8x7b --budgets 0.25 --phases decode-b1,prefill-2048 --modes eager --methods resident,ws-auto --reps 5 --no-timeline
run 2026-12-02_h200_llm-suite/suite_mixtral-8x7b_peers.json --max-seconds 290 --shape mixtral-8x7b --budgets 0.25 --phases decode-b1 --modes eager --reps 3 --no-timeline --methods resident,accelerate-cpu_offload,accelerate-device_map,diffusers-group
run 2026-12-02_h200_llm-suite/suite_qwen2.5-32b.json --shape qwen2.5-32b --budgets 0.25 --phases decode-b1,prefill-2048 --modes eager --reps 3 --no-timeline --methods resident,ws-auto,accelerate-cpu_offload,accelerate-device_map,diffusers-group
run 2026-12-02_h200_llm-suite/suite_qwen2.5-32b_peers.json --max-seconds 120 --shape qwen2.5-32b --budgets 0.25 --phases decode-b1 --modes eager --reps 3 --no-timeline --methods resident,accelerate-device_map,diffusers-group

# --- 2026-12-03, H200: codec, diffusion, encoder-decoder, pipeline, quantized, LLM suite
# bench_codec.py --budgets 25,all --reps 7 (`all` = 3609295768 bytes: every layer through two compressed slots; its graph was of the eager forward)
run 2026-12-03_h200_codec/codec_llama-3-8b.json --shape llama-3-8b --budgets 0.25,3609295768 --phases decode-b1,decode-b64,prefill-2048 --modes eager,graph-eager --methods resident,ws-stream-raw,ws-stream-compress --reps 7 --no-timeline
# bench_codec.py --shape qwen2.5-32b --budgets 25 --eager --reps 8
run 2026-12-03_h200_codec/codec_qwen2.5-32b.json --shape qwen2.5-32b --budgets 0.25 --phases decode-b1,decode-b64,prefill-2048 --modes eager --methods resident,ws-stream-raw,ws-stream-compress --reps 8 --no-timeline
run 2026-12-03_h200_diffusion-suite/suite_flux-dev-transformer.json --max-seconds 125 --no-timeline --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB,0.25 --modes eager --methods resident,ws-auto,diffusers-group,diffusers-leaf,diffusers-model_cpu_offload,diffusers-sequential_cpu_offload --reps 5 --method-seconds 45
run 2026-12-03_h200_diffusion-suite/suite_flux-dev-transformer_compiled.json --max-seconds 200 --no-timeline --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB --modes compiled --methods resident,ws-auto --reps 5 --method-seconds 200 --emulate-precision-casts
run 2026-12-03_h200_diffusion-suite/suite_flux-dev-transformer_compiled_raw-vs-compressed.json --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB --modes compiled --methods resident,ws-auto-compress,ws-auto-raw --reps 5 --emulate-precision-casts --max-seconds 225 --method-seconds 130
run 2026-12-03_h200_diffusion-suite/suite_flux-dev-transformer_raw-vs-compressed.json --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB,0.25 --modes eager --methods resident,ws-auto-compress,ws-auto-raw --reps 5 --max-seconds 50 --method-seconds 40
run 2026-12-03_h200_diffusion-suite/suite_wan2.1-14b.json --max-seconds 110 --no-timeline --phases denoise-b1 --shape wan2.1-14b --budgets 0.25 --modes eager --methods resident,ws-auto,diffusers-group,diffusers-leaf,diffusers-model_cpu_offload,diffusers-sequential_cpu_offload --reps 3 --method-seconds 70
read_stored 2026-12-03_h200_diffusion-suite/bound_flux-dev-transformer.md --bound $R/2026-12-03_h200_diffusion-suite/suite_flux-dev-transformer.json
read_stored 2026-12-03_h200_diffusion-suite/bound_wan2.1-14b.md --bound $R/2026-12-03_h200_diffusion-suite/suite_wan2.1-14b.json
read_stored 2026-12-03_h200_diffusion-suite/bound_flux-dev-transformer_compiled.md --bound $R/2026-12-03_h200_diffusion-suite/suite_flux-dev-transformer_compiled.json
# bench_encdec.py: a decoder step eager and replayed from a graph of it, then 8 greedy tokens (generate-8)
run 2026-12-03_h200_encdec/encdec_t5-xxl.json --shape t5-xxl --budgets 0.25 --phases decode-b1,generate-8 --modes eager,graph-eager --methods resident,ws-auto --reps 10 --no-timeline
# bench_pipeline.py --max-seconds 130 --peers diffusers-group,diffusers-model_cpu_offload
run 2026-12-03_h200_flux-pipeline/pipeline_flux-dev.json --kind pipeline --shape flux-dev-pipeline --budgets 16GiB --methods resident,ws-auto,diffusers-group,diffusers-model_cpu_offload --max-seconds 130
# bench_quant.py, variant bf16
run 2026-12-03_h200_quantized/quant_llama-3-8b.json#bf16 --shape llama-3-8b --budgets 0.25 --phases decode-b1 --modes eager --methods resident,ws-stream --reps 10 --no-timeline
# bench_quant.py, variant fp8: 25% raised to what stays resident plus two layer slots, as it did
run 2026-12-03_h200_quantized/quant_llama-3-8b.json#fp8 --shape llama-3-8b-fp8 --budgets 2538750464 --phases decode-b1 --modes eager --methods resident,ws-stream --reps 10 --no-timeline
# bench_quant.py, variant int4: 25% raised to what stays resident plus two layer slots, as it did
run 2026-12-03_h200_quantized/quant_llama-3-8b.json#int4 --shape llama-3-8b-int4 --budgets 2334171648 --phases decode-b1 --modes eager --methods resident,ws-stream --reps 10 --no-timeline
run 2026-12-03_h200_llm-suite/suite_llama-3-8b_50.json --max-seconds 60 --shape llama-3-8b --budgets 0.5 --phases decode-b1 --modes eager,graph --reps 10 --methods resident,ws-auto --emulate-precision-casts
run 2026-12-03_h200_llm-suite/suite_llama-3-8b_decode-b1_auto-uva.json --max-seconds 140 --shape llama-3-8b --budgets 0.25 --phases decode-b1 --modes eager,graph --methods resident,ws-auto,ws-uva --reps 10 --no-timeline --method-seconds 70 --emulate-precision-casts
run 2026-12-03_h200_llm-suite/suite_llama-3-8b_uva_b64.json --max-seconds 180 --shape llama-3-8b --budgets 0.25 --phases decode-b64 --modes eager,compiled,graph --reps 5 --no-timeline --method-seconds 150 --methods resident,ws-uva --emulate-precision-casts
run 2026-12-03_h200_llm-suite/suite_mixtral-8x7b_b64.json --max-seconds 90 --shape mixtral-8x7b --budgets 0.25 --phases decode-b64 --modes eager --reps 3 --no-timeline --method-seconds 240 --methods resident,ws-auto,accelerate-device_map
run 2026-12-03_h200_llm-suite/suite_mixtral-8x7b_diffusers.json --max-seconds 60 --shape mixtral-8x7b --budgets 0.25 --phases decode-b1 --modes eager --reps 3 --no-timeline --method-seconds 480 --methods resident,diffusers-group
run 2026-12-03_h200_llm-suite/suite_mixtral-8x7b_uva.json --max-seconds 60 --shape mixtral-8x7b --budgets 0.25 --phases decode-b1,prefill-2048 --modes eager --reps 3 --no-timeline --method-seconds 150 --methods resident,ws-uva
run 2026-12-03_h200_llm-suite/suite_qwen2.5-32b_b64.json --max-seconds 100 --shape qwen2.5-32b --budgets 0.25 --phases decode-b64 --modes eager --reps 3 --no-timeline --method-seconds 200 --methods resident,ws-auto,accelerate-device_map
run 2026-12-03_h200_llm-suite/suite_qwen2.5-32b_diffusers.json --max-seconds 100 --shape qwen2.5-32b --budgets 0.25 --phases decode-b1 --modes eager --reps 3 --no-timeline --method-seconds 480 --methods resident,diffusers-group
run 2026-12-03_h200_llm-suite/suite_qwen2.5-32b_uva.json --max-seconds 250 --shape qwen2.5-32b --budgets 0.25 --phases decode-b1,prefill-2048 --modes eager --reps 3 --no-timeline --method-seconds 150 --methods resident,ws-uva
run 2026-12-03_h200_mixtral-routed-experts/suite_mixtral-8x7b_auto.json --max-seconds 150 --shape mixtral-8x7b --budgets 0.25 --phases decode-b1,decode-b64,prefill-2048 --modes eager --methods resident,ws-auto --reps 5 --no-timeline

# --- 2026-12-04, H200: codec, decoder, diffusion
# bench_codec.py --budgets 25 --reps 5
run 2026-12-04_h200_codec/codec_llama-3-8b.json --shape llama-3-8b --budgets 0.25 --phases decode-b1,decode-b64,prefill-2048 --modes eager,graph-eager --methods resident,ws-stream-raw,ws-stream-compress --reps 5 --no-timeline
# bench_codec.py --compiled --budgets 25 --reps 8 (its compiled+graph is the mode graph)
run 2026-12-04_h200_codec/codec_llama-3-8b_compiled.json --shape llama-3-8b --budgets 0.25 --phases decode-b1,decode-b64,prefill-2048 --modes eager,graph-eager,graph --methods resident,ws-stream-raw,ws-stream-compress --reps 8 --no-timeline --emulate-precision-casts
# bench_codec.py --shape mixtral-8x7b --budgets 25 --eager --reps 6
run 2026-12-04_h200_codec/codec_mixtral-8x7b.json --shape mixtral-8x7b --budgets 0.25 --phases decode-b1,decode-b64,prefill-2048 --modes eager --methods resident,ws-stream-raw,ws-stream-compress --reps 6 --no-timeline
# bench_decoder.py (its log: bench_decoder.log; the kernel of that day, before its rewrite)
run 2026-12-04_h200_decoder/bench_decoder.json --kind codec --warps 2,4,8,16 --reps 20
run 2026-12-04_h200_diffusion-suite/suite_flux-dev-transformer.json --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB,0.25 --modes eager --methods resident,ws-auto,ws-auto-raw --reps 5 --max-seconds 170 --method-seconds 90
run 2026-12-04_h200_diffusion-suite/suite_flux-dev-transformer_ahead.json --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB,0.25 --modes eager --methods resident,ws-auto-compress,ws-auto-raw --reps 5 --max-seconds 210 --method-seconds 120
run 2026-12-04_h200_diffusion-suite/suite_flux-dev-transformer_compiled.json --max-seconds 230 --no-timeline --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB --modes compiled --methods resident,ws-auto --reps 5 --method-seconds 200 --emulate-precision-casts
# the decode stream's priority was changed in the engine for these two runs; the command was the same
run 2026-12-04_h200_diffusion-suite/suite_flux-dev-transformer_decode-priority-high.json --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB --modes eager --methods resident,ws-auto-compress --reps 5 --max-seconds 120 --method-seconds 100
# the decode stream's priority was changed in the engine for these two runs; the command was the same
run 2026-12-04_h200_diffusion-suite/suite_flux-dev-transformer_decode-priority-normal.json --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB --modes eager --methods resident,ws-auto-compress --reps 5 --max-seconds 120 --method-seconds 100
run 2026-12-04_h200_diffusion-suite/suite_wan2.1-14b_peers.json --max-seconds 300 --no-timeline --phases denoise-b1 --shape wan2.1-14b --budgets 0.25 --modes eager --methods resident,diffusers-leaf,diffusers-model_cpu_offload,diffusers-sequential_cpu_offload --reps 3 --method-seconds 110
read_stored 2026-12-04_h200_diffusion-suite/bound_flux-dev-transformer.md --bound $R/2026-12-04_h200_diffusion-suite/suite_flux-dev-transformer.json
read_stored 2026-12-04_h200_diffusion-suite/bound_flux-dev-transformer_ahead.md --bound $R/2026-12-04_h200_diffusion-suite/suite_flux-dev-transformer_ahead.json
read_stored 2026-12-04_h200_diffusion-suite/bound_flux-dev-transformer_compiled.md --bound $R/2026-12-04_h200_diffusion-suite/suite_flux-dev-transformer_compiled.json
read_stored 2026-12-04_h200_diffusion-suite/bound_wan2.1-14b_peers.md --bound $R/2026-12-04_h200_diffusion-suite/suite_wan2.1-14b_peers.json

# --- 2026-12-05: readings on the CPU of stored H100/H200 runs
# plan_flux_pipeline.py: predicted, no GPU
run 2026-12-05_cpu_flux-pipeline-plan/plan_flux-dev_pipeline_reference.md --kind pipeline --shape flux-dev-pipeline --predict --budgets 12GiB,16GiB
# plan_flux_pipeline.py --decode-gbps 990
run 2026-12-05_cpu_flux-pipeline-plan/plan_flux-dev_pipeline_decode990.md --kind pipeline --shape flux-dev-pipeline --predict --budgets 12GiB,16GiB --decode-gbps 990
read_stored 2026-12-05_cpu_flux-timeline-gaps/timeline_waits_flux_h200.log --waits $R/2026-12-04_h200_diffusion-suite/suite_flux-dev-transformer.json $R/2026-12-04_h200_diffusion-suite/suite_flux-dev-transformer_ahead.json
read_stored 2026-12-05_cpu_flux-timeline-gaps/timeline_gaps_flux_h100-h200.log --waits $R/2026-12-05_h100_diffusion-suite/suite_flux-dev-transformer_timeline.json $R/2026-12-04_h200_diffusion-suite/suite_flux-dev-transformer.json

# --- 2026-12-05, H100
run 2026-12-05_h100_diffusion-compiled/suite_flux-dev-transformer_compiled.json --max-seconds 210 --no-timeline --phases denoise-b1 --shape flux-dev-transformer --budgets 0.25 --modes compiled --methods resident,ws-auto --reps 5 --method-seconds 200 --emulate-precision-casts
run 2026-12-05_h100_diffusion-compiled/suite_wan2.1-14b_compiled.json --max-seconds 400 --no-timeline --phases denoise-b1 --shape wan2.1-14b --budgets 0.25 --modes compiled --methods resident,ws-auto --reps 3 --method-seconds 250 --emulate-precision-casts
read_stored 2026-12-05_h100_diffusion-compiled/bound_flux-dev-transformer_compiled.md --bound $R/2026-12-05_h100_diffusion-compiled/suite_flux-dev-transformer_compiled.json
read_stored 2026-12-05_h100_diffusion-compiled/bound_wan2.1-14b_compiled.md --bound $R/2026-12-05_h100_diffusion-compiled/suite_wan2.1-14b_compiled.json
run 2026-12-05_h100_diffusion-suite/suite_flux-dev-transformer.json --max-seconds 150 --no-timeline --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB,0.25 --modes eager --methods resident,ws-auto,diffusers-group,diffusers-leaf,diffusers-model_cpu_offload,diffusers-sequential_cpu_offload --reps 5 --method-seconds 45
run 2026-12-05_h100_diffusion-suite/suite_flux-dev-transformer_compiled.json --max-seconds 200 --no-timeline --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB --modes compiled --methods resident,ws-auto --reps 5 --method-seconds 200 --emulate-precision-casts
run 2026-12-05_h100_diffusion-suite/suite_flux-dev-transformer_raw.json --max-seconds 90 --no-timeline --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB,0.25 --modes eager --methods resident,ws-auto-raw --reps 5 --method-seconds 60
run 2026-12-05_h100_diffusion-suite/suite_flux-dev-transformer_timeline.json --max-seconds 150 --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB --modes eager --methods resident,ws-auto --reps 5 --method-seconds 80
run 2026-12-05_h100_diffusion-suite/suite_wan2.1-14b.json --max-seconds 300 --no-timeline --phases denoise-b1 --shape wan2.1-14b --budgets 0.25 --modes eager --methods resident,ws-auto,diffusers-leaf --reps 3 --method-seconds 100
run 2026-12-05_h100_diffusion-suite/suite_wan2.1-14b_peers.json --max-seconds 150 --no-timeline --phases denoise-b1 --shape wan2.1-14b --budgets 0.25 --modes eager --methods resident,diffusers-group,diffusers-sequential_cpu_offload --reps 3 --method-seconds 80
# bench_decoder.py (diffusion_h200.sh decoder)
run 2026-12-05_h100_diffusion-suite/bench_decoder.json --kind codec --warps 2,4,8,16 --reps 20
# bench_pipeline.py --raw-too --peers none --gpu-memory 16GiB --max-seconds 300
run 2026-12-05_h100_diffusion-suite/pipeline_flux-dev.json --kind pipeline --shape flux-dev-pipeline --budgets 16GiB --methods resident,ws-auto,ws-auto-raw --max-seconds 300
read_stored 2026-12-05_h100_diffusion-suite/bound_flux-dev-transformer.md --bound $R/2026-12-05_h100_diffusion-suite/suite_flux-dev-transformer.json
read_stored 2026-12-05_h100_diffusion-suite/bound_flux-dev-transformer_compiled.md --bound $R/2026-12-05_h100_diffusion-suite/suite_flux-dev-transformer_compiled.json
read_stored 2026-12-05_h100_diffusion-suite/bound_flux-dev-transformer_raw.md --bound $R/2026-12-05_h100_diffusion-suite/suite_flux-dev-transformer_raw.json
read_stored 2026-12-05_h100_diffusion-suite/bound_flux-dev-transformer_timeline.md --bound $R/2026-12-05_h100_diffusion-suite/suite_flux-dev-transformer_timeline.json
read_stored 2026-12-05_h100_diffusion-suite/bound_wan2.1-14b.md --bound $R/2026-12-05_h100_diffusion-suite/suite_wan2.1-14b.json
read_stored 2026-12-05_h100_diffusion-suite/bound_wan2.1-14b_peers.md --bound $R/2026-12-05_h100_diffusion-suite/suite_wan2.1-14b_peers.json
read_stored 2026-12-05_h100_diffusion-suite/timeline_waits_flux.log --waits $R/2026-12-05_h100_diffusion-suite/suite_flux-dev-transformer_timeline.json
run 2026-12-05_h100_eager-host-profiler/suite_llama-3-8b_residue.json --max-seconds 150 --shape llama-3-8b --budgets 0.97 --phases decode-b1 --modes eager,graph-eager --methods resident,ws-auto,ws-stream --reps 10 --method-seconds 60
# bench_pipeline.py --raw-too --peers none --gpu-memory 16GiB --max-seconds 240
run 2026-12-05_h100_flux-pipeline-4608-tokens/pipeline_flux-dev.json --kind pipeline --shape flux-dev-pipeline --budgets 16GiB --methods resident,ws-auto,ws-auto-raw --max-seconds 240
run 2026-12-05_h100_flux-transformer-short/suite_flux-dev-transformer.json --max-seconds 130 --no-timeline --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB,0.25 --modes eager --methods resident,ws-auto,diffusers-leaf --reps 5 --method-seconds 40
read_stored 2026-12-05_h100_flux-transformer-short/bound_flux-dev-transformer.md --bound $R/2026-12-05_h100_flux-transformer-short/suite_flux-dev-transformer.json
run 2026-12-05_h100_llama-3-8b-loop/suite_llama-3-8b_loop.json --max-seconds 200 --shape llama-3-8b --budgets 0.25,0.97 --phases decode-b1 --modes eager,graph-eager --methods resident,ws-stream,ws-uva,ws-auto --reps 10 --method-seconds 120

# --- 2026-12-05, H200
run 2026-12-05_h200_diffusion-suite/suite_flux-dev-transformer.json --max-seconds 150 --no-timeline --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB,0.25 --modes eager --methods resident,ws-auto,ws-auto-raw --reps 5 --method-seconds 70
run 2026-12-05_h200_diffusion-suite/suite_flux-dev-transformer_compiled.json --max-seconds 230 --no-timeline --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB --modes compiled --methods resident,ws-auto --reps 5 --method-seconds 200 --emulate-precision-casts
run 2026-12-05_h200_diffusion-suite/suite_flux-dev-transformer_eager-direct.json --max-seconds 50 --no-timeline --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB --modes eager --methods resident,ws-auto --reps 5 --method-seconds 30
run 2026-12-05_h200_diffusion-suite/suite_flux-dev-transformer_timeline.json --max-seconds 200 --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB --modes eager,graph-eager --methods resident,ws-auto --reps 5 --method-seconds 80
run 2026-12-05_h200_diffusion-suite/suite_wan2.1-14b.json --max-seconds 240 --no-timeline --phases denoise-b1 --shape wan2.1-14b --budgets 0.25 --modes eager --methods resident,ws-auto --reps 3 --method-seconds 120
# bench_pipeline.py --raw-too --peers none --gpu-memory 16GiB --max-seconds 280
run 2026-12-05_h200_diffusion-suite/pipeline_flux-dev.json --kind pipeline --shape flux-dev-pipeline --budgets 16GiB --methods resident,ws-auto,ws-auto-raw --max-seconds 280
read_stored 2026-12-05_h200_diffusion-suite/bound_flux-dev-transformer.md --bound $R/2026-12-05_h200_diffusion-suite/suite_flux-dev-transformer.json
read_stored 2026-12-05_h200_diffusion-suite/bound_flux-dev-transformer_compiled.md --bound $R/2026-12-05_h200_diffusion-suite/suite_flux-dev-transformer_compiled.json
read_stored 2026-12-05_h200_diffusion-suite/bound_wan2.1-14b.md --bound $R/2026-12-05_h200_diffusion-suite/suite_wan2.1-14b.json
read_stored 2026-12-05_h200_diffusion-suite/timeline_waits_flux.log --waits $R/2026-12-05_h200_diffusion-suite/suite_flux-dev-transformer_timeline.json

# --- Results of retired diagnostics: no command makes them again (findings: docs/diagnostics.md)
# diag_compile_exactness.log (2026-12-02_h200_compile-exactness): the compiled exactness that
#   --emulate-precision-casts gives; diag_flux_compile*.{json,log} (2026-12-03/-04 _h200_flux-compile-exactness);
# diag_decode_overlap.log, diag_decoder_variants*.log (2026-12-04_h200_decoder); diag_eager_host*.log,
#   diag_host_sync*.log, diag_profiler_residue*.log (2026-12-05 _h100_eager-host-sync, _h100_eager-host-profiler,
#   _h200_eager-host, _h200_diffusion-suite: `--profile DIR` records what they timed per row);
# diag_launch_gaps.log (2026-12-05 _h100_launch-gaps, _h200_diffusion-suite); ab_eager_ops*.log (2026-12-05
#   _cpu_eager-ops-ab, _h100_eager-ops-ab). Logs of other commands (demo, probe, GPU tests) are not bench runs.

if [[ $WANT != list && $found == 0 ]]; then
    echo "runs_h200.sh: no recorded result named $WANT (see: bash benchmarks/runs_h200.sh list)" >&2
    exit 2
fi
