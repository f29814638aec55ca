#!/usr/bin/env bash
# The kernel, K3 and TBO benchmarks and the `gpu` tests on a bare CUDA machine (torch, triton,
# pytest, hypothesis; no vLLM there): run from the repo root.
#   bash scripts/gpu_batch.sh tests k3 tbo tbo_prefill attention mla (any subset, in order)
#   bash scripts/gpu_batch.sh dp                         (needs 2 GPUs: the nvidia-h200-x2 kind)
# The tbo stage runs benchmarks/tbo.py as one rank of 1 and of 8 expert-parallel
# ranks (TBO_EP_RANKS="1 8"), each at contexts 1024 and 8192, communication off,
# at 30% and at 50% of the step. The tbo_prefill stage times an
# eager prefill step (256..16384 new tokens) split at the token midpoint vs unsplit, for the
# same ranks and communication fractions.
# Each stage writes its log (and tables) under $OUT (default: ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
XGR_WHEEL=$(ls .whl/xgrammar-*.whl 2>/dev/null | head -1)
status=0
stage() { printf '\n===== %s: %s (%s)\n' "$1" "$2" "$(date -u +%H:%M:%S)"; }

for what in "$@"; do
  case "$what" in
    tests)
      stage tests "kernels and graphs compiled on the GPU"
      timeout 500 python3 -m pytest -q -p no:cacheprovider \
        $(grep -v '^#' scripts/gpu_kernel_tests.txt) tests/test_tbo_model_dp.py \
        2>&1 | tee "$OUT/gpu_tests.log" || status=1 ;;
    k3)
      stage k3 "required-channel logits kernel vs xgrammar bitmask"
      timeout 240 python3 benchmarks/k3_logits.py --out "$OUT/k3_logits.md" \
        ${XGR_WHEEL:+--xgrammar-wheel "$XGR_WHEEL"} 2>&1 | tee "$OUT/k3_logits.log" || status=1 ;;
    tbo)
      stage tbo "decode step: split replay vs unsplit graph vs eager split"
      for ep in ${TBO_EP_RANKS:-1 8}; do
        for ctx in 1024 8192; do
          name=tbo_ep${ep}_ctx$ctx
          timeout 300 python3 -m benchmarks.tbo --context $ctx --ep-ranks $ep --comm 0 0.3 0.5 \
            --out "$OUT/$name.md" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" || status=1
        done
      done ;;
    tbo_prefill)
      stage tbo_prefill "prefill step: split at the token midpoint vs unsplit (eager)"
      for ep in ${TBO_EP_RANKS:-1 8}; do
        name=tbo_prefill_ep$ep
        timeout 240 python3 -m benchmarks.tbo_prefill --ep-ranks $ep --comm 0 0.3 0.5 \
          --out "$OUT/$name.md" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" || status=1
      done ;;
    dp)
      stage dp "two GPUs over NCCL: TBO on == off (eager and replay), step time on vs off"
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      timeout 240 python3 -m pytest -q -p no:cacheprovider -k gpus \
        tests/test_tbo_dp_bench.py tests/test_tbo_model_dp.py \
        2>&1 | tee "$OUT/dp_tests.log" || status=1
      for setting in 1:per_comm 2:per_comm 1:staged 2:staged; do
        streams=${setting%:*} overlap=${setting#*:}
        name=tbo_dp_streams${streams}_$overlap
        timeout 200 python3 -m benchmarks.tbo_dp --compute-streams $streams --overlap $overlap \
          --out "$OUT/$name.md" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" || status=1
      done ;;
    attention)
      stage attention "MHA/MLA decode and prefill vs copy bandwidth and matmul rate"
      timeout 400 python3 -m benchmarks.attention --out "$OUT/attention.md" \
        --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log" || status=1 ;;
    mla)
      stage mla "MLA decode at 16/64/128 heads, bf16/fp8, 1-2 tokens, vs the physical limit"
      timeout 500 python3 -m benchmarks.attention_mla --json "$OUT/mla.json" \
        --markdown "$OUT/mla.md" 2>&1 | tee "$OUT/mla.log" || status=1 ;;
    *) echo "unknown stage '$what'; stages: tests k3 tbo tbo_prefill attention mla dp" >&2; exit 2 ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
exit $status
