#!/usr/bin/env bash
# Two checkouts' bench on the same job, alternating, twice: a before/after comparison
# whose ratios share the machine's minute.
#   benchmarks/ab_bench.sh OLD_CHECKOUT NEW_CHECKOUT [OUT]
# Each side runs with its own PYTHONPATH, PIPETUNE_HOME and MLflow store.
set -euo pipefail
old=$1 new=$2 out=${3:-/tmp/pipetune-ab}
strategies=optuna-plain,v1-one-core,pipetune-cold,pipetune-warm
python=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
mkdir -p "$out"
for round in 1 2; do
  for side in old new; do
    dir=${!side}
    (cd "$dir" && PYTHONPATH=$dir PIPETUNE_HOME=$out/home-$side-$round "$python" -m pipetune bench \
      benchmarks/jobs/lenet_mnist.yaml --strategies $strategies --no-oracle \
      --out "$out/$side-$round" --tracking-uri "sqlite:///$out/$side-$round.db" \
      > "$out/$side-$round.log" 2>&1)
    grep -E "^\| (optuna|v1-one|pipetune)" "$out/$side-$round/results.md" | sed "s/^/$side-$round /"
  done
done
