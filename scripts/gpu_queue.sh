#!/usr/bin/env bash
# Stages queued on the GPU machine, run one after another in the background, so that a lease
# never idles between `run` calls and the order holds however long each stage takes:
#   bash scripts/gpu_queue.sh start NAME "COMMAND" ["COMMAND" ...]
#   bash scripts/gpu_queue.sh wait NAME [SECONDS]
# `start` copies this checkout (without the vLLM parts folders) to /tmp/queue/NAME/tree and
# starts the queue detached (setsid: it outlives the `run` call that started it). Each COMMAND
# is a shell line run from that copy with OUT set to a folder of its own, e.g.
#   "VLLM=0.34 bash scripts/gpu_engine.sh mla16"
# `wait` returns once every command has finished or after SECONDS (default 570, under one
# call's limit); each command finished and not yet packed is packed into
# $OUT/NAME-N.tgz (its OUT folder, its output and exit status; files over 12 MiB are left
# out and named), and the queue's state is printed. Call `wait` again until it says done.
set -uo pipefail
verb=${1:?usage: gpu_queue.sh start NAME COMMAND... | wait NAME [SECONDS]}
name=${2:?a queue name}
shift 2
root=/tmp/queue/$name
case "$verb" in
  start)
    [ $# -gt 0 ] || { echo "gpu_queue.sh start $name: no commands to queue" >&2; exit 2; }
    [ ! -e "$root" ] || { echo "queue $name exists ($root): choose another name" >&2; exit 2; }
    mkdir -p "$root/tree"
    tar --exclude='./.gpu-vllm-*' -cf - . | tar -xf - -C "$root/tree"
    i=0
    for command in "$@"; do
      i=$((i + 1))
      mkdir -p "$root/$i/out"
      printf '%s\n' "$command" >"$root/$i/command"
    done
    echo "$i" >"$root/count"
    setsid nohup bash "$root/tree/scripts/gpu_queue.sh" run "$name" >"$root/queue.log" 2>&1 </dev/null &
    echo "queue $name: $i commands started ($(date -u +%H:%M:%S) UTC)" ;;
  run)
    count=$(cat "$root/count")
    for i in $(seq 1 "$count"); do
      date -u +%s >"$root/$i/started"
      (cd "$root/tree" && OUT="$root/$i/out" bash -c "$(cat "$root/$i/command")") \
        >"$root/$i/output.log" 2>&1
      echo $? >"$root/$i/rc"
    done ;;
  wait)
    [ -d "$root" ] || { echo "no queue $name here (a machine started since would not have it)" >&2; exit 2; }
    limit=${1:-570}
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    count=$(cat "$root/count")
    deadline=$(($(date +%s) + limit))
    while [ "$(ls "$root"/*/rc 2>/dev/null | wc -l)" -lt "$count" ] \
      && [ "$(date +%s)" -lt "$deadline" ]; do
      sleep 5
    done
    for i in $(seq 1 "$count"); do
      [ -f "$root/$i/rc" ] && [ ! -f "$root/$i/packed" ] || continue
      left_out=()
      while IFS= read -r f; do
        echo "$name-$i: left on the machine (over 12 MiB): $f"
        left_out+=("--exclude=./${f#"$root/$i/"}")
      done < <(find "$root/$i" -type f -size +12M)
      tar -czf "$out/$name-$i.tgz" "${left_out[@]}" -C "$root/$i" . && touch "$root/$i/packed"
    done
    for i in $(seq 1 "$count"); do
      state=queued
      [ -f "$root/$i/started" ] && state="running since $(date -u -d "@$(cat "$root/$i/started")" +%H:%M:%S)"
      [ -f "$root/$i/rc" ] && state="exit $(cat "$root/$i/rc")"
      printf '%s-%s: %s: %s\n' "$name" "$i" "$state" "$(cat "$root/$i/command")"
      [ -f "$root/$i/rc" ] && tail -n 4 "$root/$i/output.log" | sed 's/^/    /'
    done
    finished=$(ls "$root"/*/rc 2>/dev/null | wc -l)
    echo "queue $name: $finished of $count finished$([ "$finished" -eq "$count" ] && echo ': done')" ;;
  *) echo "gpu_queue.sh: unknown verb '$verb'; verbs: start, wait" >&2; exit 2 ;;
esac
