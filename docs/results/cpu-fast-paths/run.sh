#!/bin/bash
# CPU before / after of issue #43's fsdp fast paths: benchmarks/train_throughput.py --shape small, fp32, 3 timed
# updates on fresh batches after one, the two sides in turns, 3 runs each. BASE: a checkout of the old main (with
# gspo_ascend/{patches,env,configs} linked to its top-level folders, as pyproject maps them); the benchmark script
# is this tree's on both sides. OUT: where the JSON goes.
#   BASE=/work/base OUT=/tmp/bench bash docs/results/cpu-fast-paths/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
: "${BASE:?set BASE to a checkout of the old main}" "${OUT:=$here}"
for i in 1 2 3; do
  for side in base new; do
    if [ $side = base ]; then run=(.venv/bin/python "$here/with_tree.py" "$BASE"); else run=(.venv/bin/python); fi
    "${run[@]}" benchmarks/train_throughput.py --device cpu --shape small --dtype float32 --steps 3 \
      --json "$OUT/${side}_$i.json" > "$OUT/${side}_$i.log" 2>&1
    echo "$side $i: $(tail -1 "$OUT/${side}_$i.log")"
  done
done
