#!/usr/bin/env bash
# Re-cuts a folder of vLLM wheel parts (as ../shared/device-vllm/*/prepare.sh writes it: DIR/parts/
# NAME.part.NN, one DIR/pNN/ folder a part, DIR/SHA256SUMS where it has one) into parts of SIZE
# (split's units: 54m), so that one part and this checkout together fit the 64 MiB a device
# `run` call carries (prepare.sh cuts 60 MiB; the checkout is about 5 MB). The joined wheels
# are unchanged (checked); install.sh joins NAME.part.* in name order as before. The last
# part's folder also holds DIR/SHA256SUMS and DIR/install.sh where DIR has them (copy the
# recipe's install.sh into DIR first), so the call that carries it brings all the install needs.
#   bash scripts/gpu_parts.sh DIR [SIZE]
set -euo pipefail
dir=${1:?usage: gpu_parts.sh DIR [SIZE]}
size=${2:-54m}
[ -d "$dir/parts" ] || { echo "$dir/parts: no such folder (prepare.sh writes it)" >&2; exit 2; }
cd "$dir"
names=$(ls parts | sed 's/\.part\.[0-9]*$//' | sort -u)
before=$(for n in $names; do cat parts/"$n".part.* | md5sum; done)
rm -rf parts.new && mkdir parts.new
for n in $names; do cat parts/"$n".part.* | split -b "$size" -d -a 2 - parts.new/"$n".part.; done
after=$(for n in $names; do cat parts.new/"$n".part.* | md5sum; done)
[ "$before" = "$after" ] || { rm -rf parts.new; echo "re-cut parts differ; left as they were" >&2; exit 1; }
rm -rf parts p[0-9][0-9] && mv parts.new parts
cd parts
i=0
{ ls small.tar.part.*; ls | grep -v '^small\.tar\.'; } | while read -r f; do
  d=$(printf '../p%02d' "$i"); mkdir -p "$d" && ln "$f" "$d/$f"; i=$((i + 1))
done
[ ! -f ../SHA256SUMS ] || sha256sum -- * > ../SHA256SUMS
count=$(ls | wc -l)
last=$(printf '../p%02d' $((count - 1)))
for f in ../SHA256SUMS ../install.sh; do [ ! -f "$f" ] || cp "$f" "$last/"; done
echo "$count parts of at most $size, one a folder: $dir/p00..; $dir/${last#../} also holds" \
  "$(cd "$last" && ls | grep -v '\.part\.' | tr '\n' ' ')"
