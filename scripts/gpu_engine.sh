#!/usr/bin/env bash
# vLLM's GPU engine with this checkout's plugin, on the H200 (vLLM's CUDA build installed by
# ../shared/device-vllm/install.sh into /tmp/site). Run from the repo root there:
#   bash scripts/gpu_engine.sh STAGE...
# Stages:
#   install     joins the parts sent to /tmp/parts (install.sh among them) and installs them
#   tests       tests/test_gpu_engine.py (every plugin backend in the GPU engine, by logprobs)
#               and TBO's refusal of Model Runner V2 on the GPU build
#   kernels     the kernel GPU tests (scripts/gpu_batch.sh's list) on vLLM's torch and Triton,
#               four pytest workers on the one GPU
#   mha, mla    the engine benchmark (benchmarks/engine.py); ENGINE_ARGS adds arguments
#   anchors     the kernels beside FlashMLA and FA3 (benchmarks/kernels_vs_vllm.py); ANCHOR_ARGS
#   k3          the K3 logits benchmark against xgrammar (benchmarks/k3_logits.py); K3_ARGS
#   k3-serve    the K3 serving benchmark (benchmarks/k3_serving.py): vllm serve with the plugin's
#               atom_kimi_k3 against vLLM's kimi_k3 (plugin disabled), one engine per
#               configuration, concurrencies 1/16/64/256; K3_SERVE_ARGS (e.g. --configs ...)
#   same-mha, same-mla
#               a change that must not move the kernels' speed: the MHA (benchmarks.attention
#               --no-mla) or MLA (benchmarks.attention_mla) kernel benchmark in the checkout
#               BEFORE (a folder) and in AFTER (a folder; default this checkout), one after
#               the other, then benchmarks.compare_runs
#   profile     Nsight Compute profiles of the kernels' misses beside FlashMLA and FA3
#               (benchmarks/kernel_profile.py); PROFILE_ARGS; reports under $OUT/kernel_profile
# Each stage writes its log under $OUT (default ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if [ "${1:-}" = install ]; then
  shift
  printf '\n===== install (%s)\n' "$(date -u +%H:%M:%S)"
  mkdir -p /tmp/w && cp /tmp/parts/install.sh /tmp/w/ && bash /tmp/w/install.sh || exit 1
fi
source /tmp/w/install.sh env || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PYTHONPATH"
# vLLM discovers plugins through installed entry points: announce this checkout's package.
dist=/tmp/site/atom_plugin-0.1.0.dist-info
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: atom-plugin\nVersion: 0.1.0\n' >"$dist/METADATA"
python3 - "$dist/entry_points.txt" <<'EOF'
import sys, tomllib
eps = tomllib.load(open("pyproject.toml", "rb"))["project"]["entry-points"]
with open(sys.argv[1], "w") as f:
    for group, names in eps.items():
        f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in names.items()) + "\n")
EOF
status=0
stage() { printf '\n===== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }
for what in "$@"; do
  case "$what" in
    tests)
      stage "GPU engine tests"
      timeout 560 python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu_engine.py \
        "tests/test_tbo_vllm_refusals.py::test_model_runner_v2_is_refused_with_the_setting_that_works" \
        "tests/test_tbo_workers.py::test_gpu_tbo_worker_leaves_torch_cuda_alone" \
        2>&1 | tee "$OUT/gpu_engine_tests.log" || status=1 ;;
    kernels)
      stage "kernel GPU tests"
      timeout 500 python3 -m pytest -q -p no:cacheprovider -n 4 \
        tests/test_attention_triton.py tests/test_mla_kernels.py tests/test_mla_gluon.py \
        tests/test_channel_kernel.py tests/test_spec_rows.py tests/test_required_channel.py \
        tests/test_k3_gate_core.py tests/test_tbo_gpu.py tests/test_kernels_vs_vllm.py \
        tests/test_mla_plan.py tests/test_mla_gluon_lazy.py tests/test_mha_gluon_prefill.py \
        2>&1 | tee "$OUT/gpu_kernel_tests.log" || status=1 ;;
    mha)
      stage "engine benchmark, MHA"
      python3 -m benchmarks.engine --shape llama-3.1-8b --out-dir /tmp/engine-mha ${ENGINE_ARGS:-} \
        2>&1 | tee "$OUT/engine_mha.log" || status=1
      tar -czf "$OUT/engine_mha.tgz" -C /tmp/engine-mha --exclude shapes . ;;
    mla)
      stage "engine benchmark, MLA"
      python3 -m benchmarks.engine --out-dir /tmp/engine-mla ${ENGINE_ARGS:-} \
        2>&1 | tee "$OUT/engine_mla.log" || status=1
      tar -czf "$OUT/engine_mla.tgz" -C /tmp/engine-mla --exclude shapes . ;;
    anchors)
      stage "kernels beside FlashMLA and FA3"
      timeout 540 python3 -m benchmarks.kernels_vs_vllm --out "$OUT/kernels_vs_vllm.md" \
        ${ANCHOR_ARGS:-} 2>&1 | tee "$OUT/kernels_vs_vllm.log" || status=1 ;;
    profile)
      stage "Nsight Compute profiles beside FlashMLA and FA3"
      timeout 480 python3 -m benchmarks.kernel_profile --out-dir "$OUT/kernel_profile" \
        ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/kernel_profile.log" || status=1 ;;
    k3)
      stage "K3 logits benchmark"
      timeout 300 python3 benchmarks/k3_logits.py --out "$OUT/k3_logits.md" ${K3_ARGS:-} \
        2>&1 | tee "$OUT/k3_logits.log" || status=1 ;;
    k3-serve)
      stage "K3 serving benchmark"
      rm -rf /tmp/k3-serve
      timeout 570 python3 -m benchmarks.k3_serving \
        --configs atom:parameter,vllm:function,vllm:parameter --workdir /tmp/k3-serve \
        --out "$OUT/k3_serving.md" --json "$OUT/k3_serving.json" ${K3_SERVE_ARGS:-} \
        2>&1 | tee "$OUT/k3_serving.log" || status=1
      tar -czf "$OUT/k3_serving_servers.tgz" -C /tmp/k3-serve --exclude model . ;;
    same-mha|same-mla)
      stage "kernel benchmark before ($BEFORE) and after (${AFTER:-$PWD}), ${what#same-}"
      kind=${what#same-}
      bench=(-m benchmarks.attention --no-mla)
      [ "$kind" = mla ] && bench=(-m benchmarks.attention_mla)
      out=$(realpath "$OUT")
      for side in before after; do
        dir=${AFTER:-$PWD}
        [ $side = before ] && dir=$BEFORE
        (cd "$dir" && PYTHONPATH="$dir:/tmp/site" timeout 280 python3 "${bench[@]}" \
          --json "$out/${kind}_$side.json") 2>&1 | tee "$OUT/${kind}_$side.log" || status=1
      done
      python3 -m benchmarks.compare_runs "$OUT/${kind}_before.json" "$OUT/${kind}_after.json" \
        --out "$OUT/${kind}_same.md" || status=1 ;;
    *) echo "unknown stage '$what'; stages: install tests kernels mha mla anchors profile k3 k3-serve same-mha same-mla" >&2; exit 2 ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
exit $status
