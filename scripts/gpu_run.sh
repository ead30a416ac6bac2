#!/usr/bin/env bash
# The whole GPU run, on a bare lent GPU machine: Python with torch, cuda-bindings and numpy, no
# TVM, no package registry, this tree as sent. The kernels are exported beforehand on a machine
# with TVM:
#
#   python benchmarks/gpu_kernels.py export BUNDLES --configs tiny paper --levels 0 1 2 3 4 [--precisions fp32 fp16]
#   git rev-parse --short HEAD > BUNDLES/COMMIT
#
# and then, on the GPU machine:
#
#   bash scripts/gpu_run.sh BUNDLES OUT [SECONDS]
#
# runs, within about SECONDS (default 480): pytest -m gpu (without the default options: the GPU
# machine has no pytest-xdist); every bundle's outputs against
# PyTorch's, poisoned first, and its CUDA-event times; compute-sanitizer racecheck and synccheck
# on the tiny O3 and O4 kernels; the paper O4 kernels' timelines (the stages between grid
# barriers, timed) and ncu's DRAM bytes and launches; PyTorch eager, CUDA graphs, torch.compile
# (reduce-overhead, default, max-autotune) on the same weights and inputs.
# OUT gets gpu_barrier.{json,md} (the cost of a grid barrier by grid size,
# where BUNDLES has the barrier/ benchmarks/gpu_barrier.py exports), gpu_kernels.{json,md},
# gpu_torch.{json,md} and log.txt (the GPU, driver, commit and tools, and pytest's summary, first):
# 7 files, within the 8 a lent GPU machine sends back.
#
# What a run that follows an earlier one should measure first can be set in the environment (the
# defaults in brackets): FIRST, the bundles checked and timed first ['*+*' '*_paper_O4*'
# '*_paper_*' '*_tiny_O[34]*'], SANITIZE ['*_tiny_O[34]*'], NCU and TIMELINE ['*_paper_O4*'],
# TORCH_BUNDLES ['*_O4*'] and TORCH_MODES [eager cuda-graph reduce-overhead compile max-autotune],
# each a space-separated list taken in its order.
set -u -f -o pipefail  # -f: the bundle globs below reach the scripts unexpanded
bundles=$1 out=$2 seconds=${3:-480}
python=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 SOUFFLE_COMMIT=$(cat "$bundles/COMMIT" 2>/dev/null)
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
start=$SECONDS
left() { echo $((seconds - (SECONDS - start))); }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
echo "commit ${SOUFFLE_COMMIT:-unknown}; $($python -c 'import torch; print("torch", torch.__version__)')"
echo "tools: $(command -v nvcc ncu compute-sanitizer | tr '\n' ' ')"

echo "== pytest -m gpu ($(left) s left)"
SOUFFLE_GPU_ARTIFACTS=$bundles timeout 90 $python -m pytest -o addopts= -m gpu -q -p no:cacheprovider \
    tests/test_runtime_cuda.py tests/test_gpu.py 2>&1 | tail -40

if [ -d "$bundles/barrier" ]; then
    echo "== grid barrier cost ($(left) s left)"
    timeout 60 $python benchmarks/gpu_barrier.py run "$bundles/barrier" --results "$out" --phases 1000 --repeat 10
fi

echo "== Souffle's kernels ($(left) s left)"
# the compiler variants and the paper kernels first; the checks stop starting at 30% of what is
# left, so that the timelines, sanitizers and ncu get their share
timeout $(( $(left) * 62 / 100 )) $python benchmarks/gpu_kernels.py run "$bundles" --results "$out" \
    --timeout 90 --jobs 4 --budget $(( $(left) * 58 / 100 )) --check-budget $(( $(left) * 3 / 10 )) \
    --repeat 50 --warmup 10 --first ${FIRST:-*+* *_paper_O4* *_paper_* *_tiny_O[34]*} \
    --sanitize "${SANITIZE:-*_tiny_O[34]*}" --ncu "${NCU:-*_paper_O4*}" --timeline "${TIMELINE:-*_paper_O4*}"

echo "== PyTorch ($(left) s left)"
timeout $(( $(left) - 10 )) $python benchmarks/gpu_torch.py "$bundles" --souffle "$out/gpu_kernels.json" \
    --results "$out" --budget $(( $(left) - 60 )) --repeat 50 --warmup 10 \
    --bundles ${TORCH_BUNDLES:-*_O4*} --modes ${TORCH_MODES:-eager cuda-graph reduce-overhead compile max-autotune}
echo "== done in $((SECONDS - start)) s"
