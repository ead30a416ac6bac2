#!/usr/bin/env bash
# Everything a GPU run needs, exported on this machine (TVM, nvcc) and packed to travel:
#
#   bash scripts/gpu_export.sh DIR [PACK]
#
# writes bundles into DIR (benchmarks/gpu_kernels.py export: every model, tiny at O0-O4 and at
# fp16 and bf16 (O4), paper at O0-O4 and at fp16 (O4), BERT at bf16 (O4), BERT and ResNeXt at tf32
# (O4; tiny BERT and MMoE too), each with
# static.json and, for one-kernel programs with grid barriers, its timeline build; and the
# compiler variants of benchmarks/gpu_variants.py,
# each beside its base), the commit into DIR/COMMIT, and packs DIR into PACK
# (default DIR.tar.xz), which must stay under the 64 MiB a lent GPU machine is sent. Compiles
# that were done before come from nvcc's cache. Then, on the GPU machine:
#
#   mkdir -p /tmp/b && tar -xJf PACK -C /tmp/b && bash scripts/gpu_run.sh /tmp/b/$(basename DIR) $OUT
set -eu -o pipefail
dir=$1 pack=${2:-$1.tar.xz}
python=${PYTHON:-python}
export=(env PYTHONUNBUFFERED=1 "$python" benchmarks/gpu_kernels.py export "$dir")
"${export[@]}" --configs tiny --levels 0 1 2 3 4
"${export[@]}" --configs tiny --levels 4 --precisions fp16
"${export[@]}" --configs paper --levels 3 4
"${export[@]}" --configs paper --levels 4 --precisions fp16 --models lstm bert resnext mmoe swin
"${export[@]}" --configs tiny --levels 4 --precisions bf16
"${export[@]}" --configs paper --levels 4 --precisions bf16 --models bert
"${export[@]}" --configs tiny --levels 4 --precisions tf32 --models bert mmoe
"${export[@]}" --configs paper --levels 4 --precisions tf32 --models bert resnext
# compiler variants (benchmarks/gpu_variants.py), each timed beside its base: what the last GPU run
# asked (two-blocks and occupancy were timed on the H100: benchmarks/results/gpu_h100.md; no-on-chip
# too, when the weights were placed for one block per SM)
"${export[@]}" --configs paper --levels 4 --precisions fp16 --models bert swin resnext --variant register-pipeline
"${export[@]}" --configs paper --levels 4 --precisions tf32 --models bert --variant register-pipeline
"${export[@]}" --configs paper --levels 4 --precisions fp32 fp16 --models bert swin resnext --variant no-split-k
"${export[@]}" --configs paper --levels 4 --precisions fp32 fp16 --models bert resnext --variant split-k-256
"${export[@]}" --configs paper --levels 4 --precisions fp32 --models bert resnext swin --variant k-chunk-32
"${export[@]}" --configs paper --levels 4 --precisions fp16 --models bert swin --variant tc-depth-128
"${export[@]}" --configs paper --levels 4 --precisions fp32 fp16 --models bert swin resnext --variant no-pipeline
"${export[@]}" --configs paper --levels 4 --precisions fp32 fp16 --models lstm --variant two-rows-per-warp
"${export[@]}" --configs paper --levels 4 --precisions fp32 fp16 --models lstm --variant no-on-chip
"${export[@]}" --configs paper --levels 4 --precisions fp16 --models lstm --variant no-staged-vector
"${export[@]}" --configs paper --levels 4 --precisions fp16 --models bert swin --variant no-row-resident
"${export[@]}" --configs paper --levels 4 --precisions fp16 --models bert resnext --variant 8-byte-copies
"${export[@]}" --configs paper --levels 4 --precisions fp16 --models resnext efficientnet --variant dlight-order
"${export[@]}" --configs paper --levels 4 --precisions fp16 --models bert --variant no-96-row-tiles
"${export[@]}" --configs paper --levels 4 --precisions fp16 --models bert --variant eight-warp-tiles
"${export[@]}" --configs paper --levels 4 --precisions fp16 --models bert --variant no-aligned-tiles
"${export[@]}" --configs paper --levels 4 --precisions fp16 --models lstm --variant no-rows-together
"${export[@]}" --configs paper --levels 0 1 2 --models lstm bert resnext mmoe
# the slowest to build come last, nvcc's cache or not: EfficientNet's and Swin's O0-O2 (hundreds of
# kernels; 12.5 minutes for EfficientNet's O2 on a 2-core machine) and EfficientNet at fp16 (its
# depthwise convolutions)
"${export[@]}" --configs paper --levels 0 1 2 --models efficientnet swin
"${export[@]}" --configs paper --levels 4 --precisions fp16 --models efficientnet
"$python" benchmarks/gpu_barrier.py export "$dir/barrier"  # the grid barrier's cost, measured first
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo '+uncommitted')" > "$dir/COMMIT"
tar -C "$(dirname "$dir")" -cf - "$(basename "$dir")" | xz -6 -T0 > "$pack"
size=$(stat -c %s "$pack")
echo "$pack: $((size / 1000000)) MB"
if [ "$size" -gt $((60 * 1024 * 1024)) ]; then
    echo "$pack is over 60 MiB: a GPU machine is sent at most 64 MiB with the tree" >&2
    exit 1
fi
