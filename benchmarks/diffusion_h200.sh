#!/usr/bin/env bash
# The diffusion benchmarks on one H200, one part per call (docs/diffusion.md): one denoising step of the
# Flux.1-dev transformer (1024x1024: 4096 image + 512 text tokens) and of Wan 2.1 14B (480p, 81 frames),
# random bf16 weights from the published configs, weightstream auto against diffusers' offloading.
# Usage (repository root, diffusers' wheel in .whl/, $OUT set by the device tool):
#   bash benchmarks/diffusion_h200.sh PART      PART: flux | wan | flux-compiled | wan-compiled | all
#                                                     (flux then wan) | pipeline | decoder | gpu-tests
#                                                     | flux-short | flux-timeline | pipeline-plan
# (COMPILED_BUDGETS=12GiB,0.25 for flux-compiled at both budgets, with COMPILED_SECONDS=400)
# Each part writes suite_<name>.json/.log under $OUT and prints the table against max(compute, transfer)
# (`weightstream bench --bound`). Every recorded result's own command line: benchmarks/runs_h200.sh.
# `all` stays under about 7 minutes: no method is started after FLUX_SECONDS (140) / WAN_SECONDS (120)
# of each run, and each method has 45 / 70 s (--method-seconds); what is cut is recorded as skipped.
# `pipeline`: the whole FLUX.1-dev pipeline at 16 GiB (`weightstream bench --kind pipeline`), weightstream
# compress="auto" and raw, no peers (their figures: results/2026-12-03_h200_flux-pipeline), about
# 4 minutes. `decoder`: the codec alone (`--kind codec`, warps sweep, about 30 s). `pipeline-plan`: the
# planner's predicted split of the pipeline (`--predict`, no GPU needed). `gpu-tests`: the GPU tests of the
# compressed path and the pipelines (about 4 minutes). `flux-short`: the flux part with only the resident
# step, weightstream auto and diffusers' best peer (leaf level), for a call with little device time left
# (about 4 minutes; the slower peers' figures are in results/suite_flux-dev-transformer.json).
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the folder for results}
if ls .whl/diffusers-*.whl >/dev/null 2>&1; then  # only diffusers: other helpers' wheels may sit beside it
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/diffusers-*.whl
fi
export PYTHONPATH=src:/tmp/site
PEERS=diffusers-group,diffusers-leaf,diffusers-model_cpu_offload,diffusers-sequential_cpu_offload
bench() {  # bench NAME MAX_SECONDS ARGS...
    local name=$1 max=$2
    shift 2
    python3 -m weightstream bench --max-seconds "$max" --out "$OUT/suite_$name.json" --no-timeline \
        --phases denoise-b1 "$@" 2>&1 | tee "$OUT/suite_$name.log" | grep "^\[" || true
    python3 -m weightstream bench --bound "$OUT/suite_$name.json" | tee "$OUT/bound_$name.md"
}
flux() {
    bench flux-dev-transformer ${FLUX_SECONDS:-140} --shape flux-dev-transformer --budgets 12GiB,0.25 \
        --modes eager --methods resident,ws-auto,$PEERS --reps 5 --method-seconds 45
}
wan() {
    bench wan2.1-14b ${WAN_SECONDS:-120} --shape wan2.1-14b --budgets 0.25 --modes eager \
        --methods resident,ws-auto,$PEERS --reps 3 --method-seconds 70
}
case ${1:?give a part} in
flux) flux ;;
flux-short)
    bench flux-dev-transformer_short ${FLUX_SECONDS:-130} --shape flux-dev-transformer --budgets 12GiB,0.25 \
        --modes eager --methods resident,ws-auto,diffusers-leaf --reps 5 --method-seconds 40 ;;
wan) wan ;;
all) flux; wan ;;
flux-compiled)  # fullgraph compile of the resident and the offloaded transformer: about 4 minutes
    bench flux-dev-transformer_compiled ${COMPILED_SECONDS:-200} --shape flux-dev-transformer \
        --budgets ${COMPILED_BUDGETS:-12GiB} --modes compiled --methods resident,ws-auto --reps 5 \
        --method-seconds 200 --emulate-precision-casts ;;
wan-compiled)  # the same for Wan 2.1 14B at 25%: about 5 minutes on an H100 (2026-12-05)
    bench wan2.1-14b_compiled ${COMPILED_SECONDS:-400} --shape wan2.1-14b --budgets 0.25 --modes compiled \
        --methods resident,ws-auto --reps 3 --method-seconds 250 --emulate-precision-casts ;;
pipeline)
    python3 -m weightstream bench --kind pipeline --shape flux-dev-pipeline --budgets 16GiB \
        --methods resident,ws-auto,ws-auto-raw --max-seconds "${PIPELINE_SECONDS:-400}" \
        --out "$OUT/pipeline_flux-dev.json" 2>&1 | tee "$OUT/pipeline_flux-dev.log" | tail -20 ;;
pipeline-plan)
    python3 -m weightstream bench --kind pipeline --shape flux-dev-pipeline --predict --budgets 12GiB,16GiB \
        --out "$OUT/plan_flux-dev_pipeline_reference.md" ;;
decoder)
    python3 -m weightstream bench --kind codec --warps 2,4,8,16 --out "$OUT/codec_group.json" 2>&1 \
        | tee "$OUT/codec_group.log" ;;
flux-timeline)  # the 12 GiB step and the resident step profiled in one run (the bench keeps both
    # timelines since 2026-12-05): are the gaps between kernels the offloaded step's own? Each also
    # replayed from a CUDA graph of the eager step (graph-eager): a graph's launches do not go through
    # the host's command stream one by one, so if the link's traffic slows each launch, the offloaded
    # step's graph gains more over its eager step than the resident one does. About 2 minutes
    python3 -m weightstream bench --max-seconds 200 --out "$OUT/suite_flux-dev-transformer_timeline.json" \
        --phases denoise-b1 --shape flux-dev-transformer --budgets 12GiB --modes eager,graph-eager \
        --methods resident,ws-auto \
        --reps 5 --method-seconds 80 2>&1 | tee "$OUT/suite_flux-dev-transformer_timeline.log" | grep "^\[" || true
    python3 -m weightstream bench --waits "$OUT/suite_flux-dev-transformer_timeline.json" \
        | tee "$OUT/timeline_waits_flux.log" ;;
gpu-tests)
    PYTHONPATH=src:tests:/tmp/site python3 -m pytest -m gpu -q -p no:cacheprovider tests/wire/test_codec.py \
        tests/wire/test_wire.py tests/engine/test_gpu_call_orders.py tests/test_gpu.py tests/formats/test_gpu_hf.py \
        tests/test_pipeline.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
*) echo "unknown part $1" >&2; exit 2 ;;
esac
