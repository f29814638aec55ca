#!/usr/bin/env bash
# vLLM's GPU engine with this checkout's plugin, on the H200/H100 (vLLM's CUDA build installed from
# ../shared/device-vllm/ (0.32) or ../shared/device-vllm/v0.34/ (0.34)). Run from the repo root there:
#   VLLM=0.34 bash scripts/gpu_engine.sh STAGE...        (VLLM: 0.34, the default, or 0.32)
# Both releases can sit side by side: 0.34's parts go to /tmp/parts034 and install into /tmp/site034,
# 0.32's to /tmp/parts and /tmp/site (its recipe's own paths).
# Stages:
#   install     joins the parts sent to the release's parts folder (its install.sh among them) and
#               installs them (scripts/gpu_parts.sh re-cuts prepare.sh's parts to fit one call)
#   tests       tests/test_gpu_engine.py (every plugin backend in the GPU engine, by logprobs; prefix
#               caching on and off; vLLM 0.34's extensible KV cache on and off); TESTS_K selects
#               configurations by pytest's -k (TESTS_K=mla: the MLA engines only)
#   bench-tests the GPU tests of graph_launch_cost, graph_node_cost and mla_eager_host. A minute.
#   k3-tests    the K3 served tests (tests/test_k3_e2e.py: required, named and auto through
#               `vllm serve --tool-call-parser atom_kimi_k3`, under vLLM's strict default)
#   tbo-mha, tbo-mla
#               two-batch overlap on Model Runner V2 (tests/test_gpu_tbo_mrv2.py): decode, prefill
#               and all, graphs and eager, on the MHA (tiny Mixtral) or MLA (tiny DeepSeek-V2) MoE
#               model, against TBO off by logprobs, splits and split graphs counted
#   tbo-k3      the K3 channel beside TBO on Model Runner V2, and the TBO workers' torch.cuda check
#   tbo-bench   TBO decode and prefill against off in the engine (benchmarks/tbo_engine.py,
#               DeepSeek-V2-Lite shape); TBO_ARGS adds arguments
#   kernels     the kernel GPU tests (scripts/gpu_kernel_tests.txt, and those that import vLLM)
#               on vLLM's torch and Triton, four pytest workers on the one GPU
#   kernels-quick
#               the kernel GPU tests of the K3 channel's tables, of MLA's prefill rows on the
#               decode kernel, of MLA's token plan and of MLA decodes replayed from CUDA graphs
#               (a subset of kernels)
#   mla16       MLA at 16 query heads (DeepSeek-V3's TP8 slice): one wave of MLA16_CASES (default
#               ATOM_AITER_MLA, FLASH_ATTN_MLA, FLASHMLA) on MLA16_WORKLOADS (lat-1, lat-8,
#               decode-2k, shared-8k), MLA16_REPEATS rounds (default 3) of each workload's new
#               pass and its again pass (prefix cache on; the table: each row's median pass),
#               with the step probe, host load and profiles; OLD_PLUGIN (a folder holding atom_plugin/) adds ATOM_AITER_MLA@old;
#               MLA16_ARGS adds arguments; MLA16_PROFILE (cases; default every case, empty:
#               none) and MLA16_PROFILE_WORKLOADS (NAME[@again][:decode|:prefill]) choose the
#               profiles. The cases measure pass by pass in rotating order, SM clocks sampled.
#               MLA16_ARGS=--engine-process (with MLA16_PROFILE= : no profiles then) runs each
#               engine's core in a process of its own, as vLLM serves. About 4-6 minutes.
#   mla-host    one eager MLA layer call's host time at 16 heads, decode and cache write, with a
#               cProfile of the decode, and the step's plan with its token plan made on the
#               device and from the host's offsets (benchmarks/mla_eager_host.py). Under a minute.
#   host-pace   the host's speed CPU by CPU: a fixed piece of Python pinned to each CPU in turn,
#               20 rounds (benchmarks/host_pace.py): a slow CPU or a slow moment. Seconds.
#   mla-heads   the MLA engine benchmark at 128 heads (deepseek-v3-attn-4l, two engines at a time)
#               and 64 heads (deepseek-v3-tp2, four at a time), 4 layers each, MLA16_CASES on
#               HEADS_WORKLOADS (lat-8, decode-2k), HEADS_REPEATS rounds (default 3), prefix
#               cache on; HEADS_ARGS adds arguments (--engine-process); HEADS_SHAPES picks the
#               shapes (both take more than one 600 s device call: name one a call). About 6-11
#               minutes.
#   mla-configs the MLA decode kernel at 16 heads with launch configurations beside the plan's own
#               (benchmarks/attention_mla.py --configs): MLA_CONFIGS (JSON list; default block,
#               warp, stage, TMA, Gluon and fp8-math variants), MLA_CONFIG_CACHES (default fp8).
#               About two minutes.
#   mla-schedule
#               a Gluon MLA decode schedule (MLA_SCHEDULE, e.g. scorer): its GPU tests
#               (tests/test_mla_gluon.py -k MLA_SCHEDULE), then its kernel time beside the
#               lockstep schedule's at 64 and 128 heads on a bf16 cache (benchmarks/attention_mla.py
#               --configs; the engine's decode-2k and lat-8 shapes among them). About two minutes.
#   graph-cost  whether one of the plugin's kernels (or vLLM's FA3, or idle CUDA contexts beside)
#               makes every later CUDA-graph node of a process slower
#               (benchmarks/graph_node_cost.py). About a minute.
#   graph-launch the host's CUDA-graph launch call for graphs of the plugin's MLA kernels, node
#               for node, beside torch, cuBLAS, Triton and vLLM kernels
#               (benchmarks/graph_launch_cost.py). Under a minute.
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
VLLM=${VLLM:-0.34}
case "$VLLM" in
  0.34) PARTS=/tmp/parts034 SITE=/tmp/site034 ;;
  0.32) PARTS=/tmp/parts SITE=/tmp/site ;;
  *) echo "VLLM=$VLLM: the recipes here are for 0.34 and 0.32" >&2; exit 2 ;;
esac
export PARTS SITE W=/tmp/w$VLLM
mkdir -p "$OUT"
if [ "${1:-}" = install ]; then
  shift
  printf '\n===== install vLLM %s (%s)\n' "$VLLM" "$(date -u +%H:%M:%S)"
  bash "$PARTS/install.sh" || exit 1
fi
source "$PARTS/install.sh" env || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PYTHONPATH"
# vLLM discovers plugins through installed entry points: announce this checkout's package.
dist=$SITE/atom_plugin-0.1.0.dist-info
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: atom-plugin\nVersion: 0.1.0\n' >"$dist/METADATA"
python3 - "$dist/entry_points.txt" <<'EOF2'
import sys, tomllib
eps = tomllib.load(open("pyproject.toml", "rb"))["project"]["entry-points"]
with open(sys.argv[1], "w") as f:
    for group, names in eps.items():
        f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in names.items()) + "\n")
EOF2
status=0
stage() { printf '\n===== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }
for what in "$@"; do
  case "$what" in
    tests)
      stage "GPU engine tests (vLLM $VLLM)"
      timeout 590 python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu_engine.py \
        ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/gpu_engine_tests_$VLLM.log" || status=1 ;;
    bench-tests)
      stage "the GPU tests of the benchmarks that time graphs and eager calls (vLLM $VLLM)"
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/test_graph_launch_cost_bench.py tests/test_graph_node_cost_bench.py \
        tests/test_mla_eager_host_bench.py 2>&1 | tee "$OUT/gpu_bench_tests_$VLLM.log" || status=1 ;;
    k3-tests)
      stage "K3 served tests (vLLM $VLLM)"
      timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_k3_e2e.py \
        -k "serve or channel_off" 2>&1 | tee "$OUT/k3_served_tests_$VLLM.log" || status=1 ;;
    tbo-mha|tbo-mla)
      stage "TBO on Model Runner V2, ${what#tbo-} MoE model (vLLM $VLLM)"
      VLLM_USE_FLASHINFER_SAMPLER=0 timeout 590 python3 -m pytest -q -p no:cacheprovider -s \
        tests/test_gpu_tbo_mrv2.py -k "equals_tbo_off and ${what#tbo-}-" \
        2>&1 | tee "$OUT/gpu_${what}_tests_$VLLM.log" || status=1 ;;
    tbo-k3)
      stage "K3 channel beside TBO on Model Runner V2 (vLLM $VLLM)"
      VLLM_USE_FLASHINFER_SAMPLER=0 timeout 400 python3 -m pytest -q -p no:cacheprovider -s \
        tests/test_gpu_tbo_mrv2.py -k k3_channel \
        "tests/test_tbo_workers.py::test_gpu_tbo_worker_leaves_torch_cuda_alone" \
        2>&1 | tee "$OUT/gpu_tbo_k3_tests_$VLLM.log" || status=1 ;;
    tbo-bench)
      stage "TBO in the engine against off (vLLM $VLLM)"
      VLLM_USE_FLASHINFER_SAMPLER=0 timeout 420 python3 -m benchmarks.tbo_engine \
        --out "$OUT/tbo_engine_$VLLM.md" --json "$OUT/tbo_engine_$VLLM.json" ${TBO_ARGS:-} \
        2>&1 | tee "$OUT/tbo_engine_$VLLM.log" || status=1 ;;
    kernels)
      stage "kernel GPU tests"
      timeout 500 python3 -m pytest -q -p no:cacheprovider -n 4 \
        $(grep -v '^#' scripts/gpu_kernel_tests.txt) \
        tests/test_kernels_vs_vllm.py tests/test_mla_decode_planner.py \
        2>&1 | tee "$OUT/gpu_kernel_tests.log" || status=1 ;;
    kernels-quick)
      stage "kernel GPU tests of the K3 channel's tables, MLA's prefill rows, token plan and graph replays"
      timeout 500 python3 -m pytest -q -p no:cacheprovider -n 3 tests/test_channel_kernel.py \
        tests/test_spec_rows.py tests/test_required_channel.py tests/test_k3_gate_core.py \
        tests/test_mla_kernels.py tests/test_mla_gpu_paths.py tests/test_mla_plan.py -m gpu \
        -k "prefill_rows or replays or not (test_mla_kernels or test_mla_gpu_paths)" \
        2>&1 | tee "$OUT/gpu_kernel_quick_tests.log" || status=1 ;;
    mla16)
      cases=${MLA16_CASES:-ATOM_AITER_MLA,FLASH_ATTN_MLA,FLASHMLA}
      [ -n "${OLD_PLUGIN:-}" ] && cases="$cases,ATOM_AITER_MLA@old"
      stage "MLA at 16 heads, vLLM $VLLM"
      out=/tmp/engine-mla16-$VLLM
      rm -rf "$out"
      timeout 590 python3 -m benchmarks.engine --shape deepseek-v3-tp8 --cases "$cases" \
        --workloads "${MLA16_WORKLOADS:-lat-1,lat-8,decode-2k,shared-8k}" --repeats "${MLA16_REPEATS:-3}" \
        --prefix-caching --again --probe --wave 4 --kv-gib 6 --gpu-util 0.15 \
        --max-model-len 16384 --profile "${MLA16_PROFILE-$cases}" \
        --profile-workloads "${MLA16_PROFILE_WORKLOADS:-lat-1@again:prefill,decode-2k:decode,decode-2k@again:decode}" \
        --deadline-s "${MLA16_DEADLINE_S:-570}" \
        ${OLD_PLUGIN:+--old-plugin "$OLD_PLUGIN"} --out-dir "$out" ${MLA16_ARGS:-} \
        2>&1 | tee "$OUT/engine_mla16_$VLLM.log" || status=1
      tar -czf "$OUT/engine_mla16_$VLLM.tgz" -C "$out" --exclude shapes --exclude '*.json.gz' . \
        || status=1
      # the profiles' Chrome traces apart (the largest files)
      traces=$(cd "$out" && ls -- *.json.gz 2>/dev/null)
      [ -z "$traces" ] || tar -cf "$OUT/engine_mla16_${VLLM}_traces.tar" -C "$out" $traces ;;
    mla-host)
      stage "eager MLA call's host time at 16 heads (vLLM $VLLM)"
      timeout 300 python3 -m benchmarks mla_eager_host --profile 25 \
        2>&1 | tee "$OUT/mla_eager_host_$VLLM.log" || status=1 ;;
    host-pace)
      stage "the host's speed CPU by CPU"
      timeout 120 python3 -m benchmarks host_pace 2>&1 | tee "$OUT/host_pace.log" || status=1 ;;
    mla-configs)
      stage "MLA decode at 16 heads, launch configurations beside the plan's (vLLM $VLLM)"
      configs=${MLA_CONFIGS:-'[{"BLOCK_N": 64}, {"num_warps": 8}, {"num_stages": 3}, {"tma": false}, {"kernel": "gluon"}, {"fp8_math": "bf16"}]'}
      timeout 400 python3 -m benchmarks attention_mla --heads 16 \
        --caches "${MLA_CONFIG_CACHES:-fp8}" --batches 8,64 --contexts 2048,8192 --no-spec \
        --configs "$configs" --markdown "$OUT/mla_configs_$VLLM.md" \
        2>&1 | tee "$OUT/mla_configs_$VLLM.log" || status=1 ;;
    mla-schedule)
      sched=${MLA_SCHEDULE:?MLA_SCHEDULE names a Gluon schedule, e.g. scorer}
      stage "Gluon MLA decode, the $sched schedule: GPU tests, then beside lockstep (vLLM $VLLM)"
      timeout 300 python3 -m pytest -q -p no:cacheprovider -n 4 -m gpu tests/test_mla_gluon.py \
        -k "$sched" 2>&1 | tee "$OUT/gpu_tests_${sched}_$VLLM.log" || status=1
      configs='[{"kernel": "gluon", "schedule": "lockstep"}, {"kernel": "gluon", "schedule": "'$sched'"}]'
      timeout 280 python3 -m benchmarks attention_mla --heads 128,64 --caches bf16 \
        --batches 8,64,128 --contexts 1024,2048,8192,32768 --no-spec --configs "$configs" \
        --json "$OUT/mla_${sched}_$VLLM.json" --markdown "$OUT/mla_${sched}_$VLLM.md" \
        2>&1 | tee "$OUT/mla_${sched}_$VLLM.log" || status=1 ;;
    graph-cost)
      stage "CUDA-graph node cost after each trigger (vLLM $VLLM)"
      timeout 300 python3 -m benchmarks graph_node_cost \
        2>&1 | tee "$OUT/graph_node_cost_$VLLM.md" || status=1 ;;
    graph-launch)
      stage "CUDA-graph launch call by kind of node (vLLM $VLLM)"
      timeout 200 python3 -m benchmarks graph_launch_cost \
        2>&1 | tee "$OUT/graph_launch_cost_$VLLM.md" || status=1 ;;
    mla-heads)
      cases=${MLA16_CASES:-ATOM_AITER_MLA,FLASH_ATTN_MLA,FLASHMLA,TRITON_MLA}
      for shape in ${HEADS_SHAPES:-deepseek-v3-attn-4l deepseek-v3-tp2}; do
        stage "MLA at ${shape}'s heads, vLLM $VLLM"
        out=/tmp/engine-$shape-$VLLM
        rm -rf "$out"
        # 128 heads: four engines of V3's unsliced widths (each 14-27 GiB at start-up) ran out
        # of the H100's memory on 2026-12-06; two at a time fit.
        case $shape in
          deepseek-v3-attn-4l) wave=2 limit=540 ;;
          *) wave=4 limit=285 ;;
        esac
        timeout "$limit" python3 -m benchmarks.engine --shape "$shape" --layers 4 --cases "$cases" \
          --workloads "${HEADS_WORKLOADS:-lat-8,decode-2k}" --repeats "${HEADS_REPEATS:-3}" --prefix-caching \
          --wave "$wave" --kv-gib 3 --gpu-util 0.15 --max-model-len 4096 \
          --deadline-s $((limit - 15)) ${HEADS_ARGS:-} \
          --out-dir "$out" 2>&1 | tee "$OUT/engine_${shape}_$VLLM.log" || status=1
        tar -czf "$OUT/engine_${shape}_$VLLM.tgz" -C "$out" --exclude shapes . || status=1
      done ;;
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
        # the checkout under test in place of this one, the release's site as installed
        (cd "$dir" && PYTHONPATH="$dir:${PYTHONPATH#"$PWD:"}" timeout 280 python3 "${bench[@]}" \
          --json "$out/${kind}_$side.json") 2>&1 | tee "$OUT/${kind}_$side.log" || status=1
      done
      python3 -m benchmarks.compare_runs "$OUT/${kind}_before.json" "$OUT/${kind}_after.json" \
        --out "$OUT/${kind}_same.md" || status=1 ;;
    *) echo "unknown stage '$what'; stages: install tests bench-tests k3-tests tbo-mha tbo-mla tbo-k3 tbo-bench kernels kernels-quick mla16 mla-host host-pace mla-configs mla-schedule graph-cost graph-launch mla-heads mha mla anchors profile k3 k3-serve same-mha same-mla" >&2; exit 2 ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
exit $status
