#!/usr/bin/env bash
# One GPU call (at most 9.5 minutes on an H200): the verdict of issue 15 on the depth-routing kernels,
# issue 25's data-parallel step and issue 33's decode table.
#   on the device machine:  bash bench/gpu_check.sh            (results under $OUT, or ./bench-out)
#   on a CPU, to check that every python part starts:  bash bench/gpu_check.sh --dry-run
# Order: correctness first (a wrong kernel's speed is worth nothing), then the routing of one step
# against its byte floor (H=1 and 8) and the per-call table, then whole-model training steps
# (prenorm eager and compiled; Full, Block and MHAR H=8 in PyTorch, compiled, reslab's kernels and
# fla-core when it is importable) with tokens/s, the ratio to compiled prenorm and peak memory; last,
# one run on 1 and 2 ranks under DDP and FSDP2 (NCCL; compiled, reslab's kernels): tokens/s scaling and
# the loss against one rank (a 1-GPU machine runs the 1-rank rows: the kernels under the wrappers); then
# every variant's decode tokens/s at batch 1 and 16 and decode state at gpt2-124m, bf16 (bench_decode.py);
# on a machine with 2 or more GPUs, issue 38's 2-stage pipeline (NCCL): bytes per step against the
# declaration and the step time, gpt2-124m at 1024 tokens (bench_pipeline.py). After the kernel tests, issue
# 53's matrix (bench_impls.py): every implementation of Full and Block AttnRes (reference, reslab's Triton,
# fla, liger, flash-attn-res) against the float64 reference, then the paired step-time ratio to prenorm with
# its interval, peak memory and decode time per layer of those that pass.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-out}
mkdir -p "$out"
dry=0
[[ "${1:-}" == "--dry-run" ]] && dry=1

# the folders install under the reslab. namespace (pyproject's package-dir), so PYTHONPATH=$PWD
# is not enough; the GPU image has its own torch and triton and no network: no deps, no isolation
if ! python -c "import reslab.kernels.depth_history" 2>/dev/null; then
    pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3 | tee "$out/install.txt"
fi
if ! python -c "import reslab.kernels.depth_history" 2>/dev/null; then
    # fallback without pip: a reslab/ directory of links to the top-level folders
    shim=$(mktemp -d)
    mkdir -p "$shim/reslab"
    for d in common models kernels experiments orchestrator results; do ln -s "$PWD/$d" "$shim/reslab/$d"; done
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
    echo "pip install -e failed; importing reslab through links in $shim" | tee -a "$out/install.txt"
fi
python -c "import reslab.kernels.depth_history" || { echo "reslab is not importable"; exit 1; }
python bench/traffic_model.py | tee "$out/traffic.md"

if (( dry )); then
    # the python parts on tiny shapes: Triton's interpreter on the CPU, no compile for the models
    timeout 300 python bench/bench_depth_read.py --smoke --step 2>&1 | tail -8 | tee "$out/depth_read.md"
    timeout 600 python bench/bench_impls.py --device cpu --impls reference,fla,flash_attn_res 2>&1 \
        | grep -v "Warning\|_cpu_device_warning" | tail -12 | tee "$out/impls.md"
    timeout 400 python bench/bench_training.py throughput --smoke --only "prenorm,Triton eager" 2>&1 \
        | tail -8 | tee "$out/training.md"
    timeout 300 python bench/bench_ddp.py --smoke --variants attnres 2>&1 | tail -8 | tee "$out/ddp.md"
    timeout 300 python bench/bench_decode.py --quick --variants prenorm,attnres,block_attnres,mhar 2>&1 \
        | tail -12 | tee "$out/decode.md"
    timeout 120 python bench/bench_pipeline.py --smoke --stages 2 --variants prenorm,attnres 2>&1 \
        | tail -6 | tee "$out/pipeline.md"
    exit 0
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
# budget: about 30 s install and start, 140 + 80 + 70 + 150 + 60 + 50 s below (each step has its own timeout)
timeout 140 python -m pytest tests/kernels -m gpu -q -p no:cacheprovider 2>&1 | tail -15 | tee "$out/kernel_tests.txt"
# the field's libraries when the image lacks them and their wheels were carried in (no network): bench-wheels/
if ls bench-wheels/*.whl >/dev/null 2>&1; then pip install -q --no-deps bench-wheels/*.whl 2>&1 | tail -2; fi
timeout 80 python bench/bench_impls.py --device cuda --time --seeds 2 --rounds 3 --json "$out/impls.json" 2>&1 \
    | grep -v "^W[0-9]" | tee "$out/impls.md"
timeout 70 python bench/bench_depth_read.py --step --heads 1,8 --reps 5 --json "$out/depth_read.json" 2>&1 \
    | grep -v "^  H=" | tee "$out/depth_read.md"
# rows print as they finish, the kernels' rows first, so a timeout keeps what was measured
timeout 150 python bench/bench_training.py throughput --preset gpt2-124m --batch 16 --steps 5 --warmup 2 2>&1 \
    | grep -v "^W[0-9]" | tail -22 | tee "$out/training.md"
timeout 60 python bench/bench_ddp.py --preset gpt2-124m --variants prenorm,attnres --world 1,2 --sharding ddp,fsdp \
    --compile --steps 5 --warmup 2 2>&1 | grep -v "^W[0-9]" | tail -12 | tee "$out/ddp.md"
# the decode step is eager (one token per row: launch-bound); rows print as they finish, prenorm and the
# variants with issue 33's targets (Block and Full AttnRes, MHAR) first, so a timeout keeps them
timeout 50 python bench/bench_decode.py --device cuda --dtype bfloat16 --batches 1,16 --prompt 32 --new 8 \
    --repeats 3 2>&1 | grep -v "^W[0-9]" | tee "$out/decode.md"
if (( $(python -c "import torch; print(torch.cuda.device_count())") >= 2 )); then
    timeout 90 python bench/bench_pipeline.py --device cuda --stages 2 --seq 1024 --steps 3 \
        --variants prenorm,attnres,block_attnres,mgr,dar,mhc 2>&1 | grep -v "^W[0-9]" | tail -12 | tee "$out/pipeline.md"
else
    echo "one GPU: the 2-stage pipeline case (bench_pipeline.py --device cuda) needs 2" | tee "$out/pipeline.md"
fi
