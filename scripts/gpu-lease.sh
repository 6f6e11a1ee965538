#!/usr/bin/env bash
# The one command a GPU lease runs (docs/gpu-runs.md, "The lease"): on the lent machine, from the
# checkout's root, with `.whl/` carried (scripts/gpu-wheels.sh made it here):
#
#     bash scripts/gpu-lease.sh          # the device tool: carry [".whl"], timeout_s 540
#
# It installs the carried wheels where the machine's Python finds them (no registry there), then
# runs `saccade bench gpu --lease`: the stages docs/gpu-results.json has not recorded ok yet, in the
# order of their value, within what the install left of LEASE_S (8 minutes), each stage's record
# written to $OUT/bench-gpu/ the moment it ends, so a command cut short still returns what finished.
# Back here: `saccade bench gpu --record RETURNED/bench-gpu` merges them into
# docs/gpu-results.json and rewrites docs/gpu-runs.md's table; commit both.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
lease_s=${LEASE_S:-480}
out=${OUT:-runs/gpu-lease}/bench-gpu
site=${SITE:-/tmp/site}  # where the wheels go (the tests give another)
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        2>&1 | tail -3
else
    echo "no .whl/ here: run scripts/gpu-wheels.sh before the lease and carry .whl" >&2
fi
export PYTHONPATH=$site:src PYTHONUNBUFFERED=1
installed=$(( $(date +%s) - start ))
budget=$(( lease_s - installed - 10 ))
echo "wheels installed in ${installed} s; the stages get ${budget} s"
python3 -m saccade bench gpu --lease --out "$out" --budget "$budget" "$@" 2>&1 | tee -a "$out/lease-console.log"
code=${PIPESTATUS[0]}
echo "saccade bench gpu --lease exited ${code} after $(( $(date +%s) - start )) s; results in $out"
exit "$code"
