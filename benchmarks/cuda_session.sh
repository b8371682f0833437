#!/usr/bin/env bash
# The CUDA figures of results/*_cuda*: every GPU measurement of this repo in one go, on a machine
# with one NVIDIA GPU, from the repository root. Peer libraries are installed from wheels in .whl/
# when that folder exists (the GPU machine may have no network):
#
#     OUT=/tmp/cuda bash benchmarks/cuda_session.sh            # all parts, ~10 min on an H100
#     OUT=/tmp/cuda bash benchmarks/cuda_session.sh tests core # only some parts
#
# Parts: tests (the CUDA-only tests and the core's suite on CUDA), core (core_peers + core_stack
# with the overlap), paired (many paired rounds at three shapes: small, the issue's, and one
# large enough for the GPU to be the bottleneck, with the overlap), profile (ops, kernels and
# syncs per step; the fingerprint products' device time), tf32 (core_stack with TF32 off), zoo, transformer, planner, compile,
# ab (benchmarks/ab_versions.py: the working tree against an exported revision in $AB_BASE_DIR,
# default .ab/base, prepared where git is: mkdir -p .ab/base && git archive REV revtrain | tar -x -C
# .ab/base && echo REV > .ab/base/REVISION; .ab/ is git-ignored, so carry it to the GPU machine).
# Results go to $OUT/cuda/ and, packed, to $OUT/cuda_results.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
R="${OUT:-results}/cuda"
mkdir -p "$R"
parts="${*:-tests core paired profile tf32 zoo transformer planner compile ab}"
want() { [[ " $parts " == *" $1 "* ]]; }
say() { echo "=== $* ($(date -u +%H:%M:%S))"; }

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peers .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/peers"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
  python3 -c "from revtrain.bench.peers import installed_peers; print('peers', installed_peers())"
} 2>&1 | tee "$R/machine.txt"

if want tests; then
  say tests
  python3 -m pytest -q -p no:cacheprovider tests/core tests/test_memory.py tests/test_compilation.py 2>&1 \
    | tail -15 | tee "$R/pytest_cuda.txt"
fi
if want core; then
  say core_peers
  python3 benchmarks/core_peers.py --device cuda --out "$R/core_peers_cuda"
  say core_stack
  python3 benchmarks/core_stack.py --device cuda --methods plain M C checkpoint M-nocheck M-overlap \
    --with-peers --out "$R/core_stack_cuda"
fi
if want paired; then
  for shape in 8x16x8x16 32x64x32x16; do
    say paired_rounds $shape
    python3 benchmarks/paired_rounds.py --device cuda --shape $shape --rounds 150 \
      --methods plain C M M-nocheck M-check4 revlib revtorch --out "$R/paired_rounds_${shape}_cuda"
  done
  say paired_rounds 256x256x32x8
  python3 benchmarks/paired_rounds.py --device cuda --shape 256x256x32x8 --rounds 60 \
    --methods plain C M M-nocheck M-overlap revlib revtorch --out "$R/paired_rounds_256x256x32x8_cuda"
fi
if want ab; then
  base="${AB_BASE_DIR:-.ab/base}"
  if [ -f "$base/revtrain/__init__.py" ]; then
    for shape in 8x16x8x16 32x64x32x16; do
      for order in bn nb; do
        say ab_versions $shape $order
        python3 benchmarks/ab_versions.py --base-dir "$base" --device cuda --shape $shape --rounds 200 \
          --order $order --out "$R/ab_versions_${shape}_M_${order}_cuda"
      done
    done
  else
    echo "ab: no exported revtrain/ in $base; see the header of this script"
  fi
fi
if want profile; then
  say step_profile
  python3 benchmarks/step_profile.py --device cuda --shape 32x64x32x8 \
    --methods plain C M M-nocheck M-check4 revlib revtorch --out "$R/step_profile_32x64x32x8_cuda"
  say fingerprint_products_cuda
  python3 benchmarks/fingerprint_products_cuda.py --out "$R/fingerprint_products_cuda"
fi
if want tf32; then
  # The same stack with TF32 off for convolutions and matrix products (PyTorch enables it for
  # cuDNN convolutions by default): does the rebuild drift come from TF32's input rounding?
  say core_stack without TF32
  python3 -c "import runpy, sys, torch
torch.backends.cudnn.allow_tf32 = False; torch.backends.cuda.matmul.allow_tf32 = False
sys.argv = ['benchmarks/core_stack.py', '--device', 'cuda', '--methods', 'plain', 'M', 'M-nocheck', 'M-check4',
            'revlib', 'revtorch', '--depths', '8', '32', '--out', '$R/core_stack_cuda_no_tf32']
runpy.run_path('benchmarks/core_stack.py', run_name='__main__')"
fi
if want zoo; then
  say zoo_modes
  python3 benchmarks/zoo_modes.py --device cuda --cases revnet38:8:64 revnet38:32:128 revnet110:8:64 \
    revnet110:32:128 revnet110:32:512 --out "$R/zoo_modes_cuda"
fi
if want transformer; then
  say transformer_memory
  python3 benchmarks/transformer_memory.py --device cuda --out "$R/transformer_memory_cuda"
fi
if want planner; then
  say planner_sweep
  python3 benchmarks/planner_sweep.py --device cuda --model revnet110 --batch-sizes 64 128 256 512 \
    --out "$R/planner_revnet110_cuda"
fi
if want compile; then
  say compile_gain
  python3 benchmarks/compile_gain.py --device cuda --out "$R/compile_cuda"
fi
say done
tar czf "${OUT:-results}/cuda_results.tgz" -C "$R" .
