#!/usr/bin/env bash
# One prepared run on a lent GPU machine (the `device` tool): the model, sampler,
# log-prob, loss and update tests on the GPU, then the benchmarks in bf16 with
# transformers on the same GPU as the peer. Each stage has its own time limit so
# that a slow one cannot eat the rest; everything goes to $OUT/log.
#
#   run(command="bash launch/device_check.sh", carry=[".whl"], timeout_s=540)
#
# The GPU image has JAX (CUDA), flax, optax, orbax, transformers and torch, but not
# ml_collections: its wheel travels in .whl/ (ignored by git; built with pip download for the device image).
set -uo pipefail
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}" XLA_PYTHON_CLIENT_PREALLOCATE=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices(), '| torch', torch.__version__, torch.cuda.is_available(), '| transformers', transformers.__version__)"

stage() { local limit=$1; shift; echo; echo "=== $* (limit ${limit}s)"; local t0=$SECONDS; timeout "$limit" "$@"; echo "=== rc $? in $((SECONDS - t0)) s"; }

# Parity tests compare f32 against transformers: ask XLA for full f32 products
# (on Hopper its default for f32 is TF32). 4 workers share the GPU, no preallocation.
JAX_DEFAULT_MATMUL_PRECISION=highest stage "${TEST_LIMIT:-210}" python3 -m pytest -q -n 4 -p no:cacheprovider \
  tests/test_qwen3.py tests/test_qwen35.py tests/test_gated_deltanet.py tests/test_blocked_attention.py \
  tests/test_attention.py \
  tests/test_sampling.py tests/test_logprobs.py tests/test_losses.py tests/test_train_update.py \
  --durations=8 -o addopts="" --timeout=200

stage 90 python3 launch/bench_generate.py --dtype=bfloat16
stage 90 python3 launch/bench_generate.py --dtype=bfloat16 --hidden=1024 --layers=16 --intermediate=3072 \
  --heads=16 --kv_heads=8 --batch=64 --new_tokens=256
stage 120 python3 launch/bench_qwen35.py --dtype=bfloat16
stage 45 python3 launch/bench_corrections.py --quick
stage 90 python3 launch/bench_update.py --repeats=3
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
