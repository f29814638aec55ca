#!/usr/bin/env bash
# Several stages of scripts/gpu_engine.sh side by side on one GPU, for correctness stages whose
# engines are small (never for timings: those run alone). Each group of stages runs in its own
# process; the logs of every group are packed into one archive under $OUT.
#   VLLM=0.34 bash scripts/gpu_parallel.sh NAME "tests" "tbo-mha" "k3-tests tbo-k3" ...
# NAME names the archive ($OUT/NAME.tgz); each further argument is one group of stages, run in
# order within the group. Prints each group's exit status and the last lines of its log.
set -uo pipefail
name=${1:?usage: gpu_parallel.sh NAME "STAGE..." ...}
shift
root=${OUT:-gpu-out}
work=/tmp/gpu-parallel/$name
rm -rf "$work" && mkdir -p "$work" "$root"
# The plugin's entry points are written into the release's site once, before the groups start.
OUT=$work bash scripts/gpu_engine.sh >"$work/announce.log" 2>&1 || { cat "$work/announce.log"; exit 1; }
pids=()
for group in "$@"; do
  dir=$work/${group// /+}
  mkdir -p "$dir"
  OUT=$dir bash scripts/gpu_engine.sh $group >"$dir/stdout.log" 2>&1 &
  pids+=($!)
done
status=0
i=0
for group in "$@"; do
  wait "${pids[$i]}"
  rc=$?
  [ $rc = 0 ] || status=1
  printf '\n### %s: exit %s\n' "$group" "$rc"
  grep -E "passed|failed|error|Error|FAILED|ERROR|skipped" "$work/${group// /+}/stdout.log" | tail -8
  i=$((i + 1))
done
tar -czf "$root/$name.tgz" -C "$work" .
exit $status
