#!/usr/bin/env bash
# One GPU call that builds, checks and times everything of issue 5 (about 8 minutes on an H200).
#   run on the device machine:  bash bench/gpu_check.sh   (results under $OUT, or ./bench-out)
# Order: correctness first (a wrong kernel's speed is worth nothing), then the routing op
# against its byte floor, then whole-model training steps.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
export PYTHONPATH=$PWD
timeout 150 python -m pytest tests/kernels -m gpu -q -p no:cacheprovider 2>&1 | tail -15 | tee "$out/kernel_tests.txt"
timeout 200 python bench/bench_depth_read.py --heads 1,8 --json "$out/depth_read.json" 2>&1 | tee "$out/depth_read.md"
timeout 300 python bench/bench_training.py throughput --preset gpt2-124m --batch 16 --steps 8 2>&1 | tee "$out/training.md"
