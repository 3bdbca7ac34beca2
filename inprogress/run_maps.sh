#!/bin/bash
# Resume the full width-32 and width-64 phase maps (configs/phase_map.toml and
# configs/phase_map_w64.toml as written) into this folder, one core each, at nice 19.
# Their cells are committed as they land, so a session that ends mid-map loses only the
# cell in progress. Usage, from the repository root:  bash inprogress/run_maps.sh
set -euo pipefail
cd "$(dirname "$0")/.."
here=inprogress
make -s venv
# the 70B's rho targets: the ladder refitted from its shipped cells (seconds; the same
# fit.json a standard study's ladder stage writes)
[ -f "$here/ladder/fit.json" ] || .venv/bin/adamspike simulate ladder \
    --cells-from adamspike/data/llama2_70b/ladder --out "$here/ladder" --no-progress
setsid nohup nice -n 19 .venv/bin/adamspike phase-map --ladder "$here/ladder" \
    --out "$here/phase_maps/w32" --no-progress >>"$here/w32.log" 2>&1 &
setsid nohup nice -n 19 .venv/bin/adamspike phase-map --config configs/phase_map_w64.toml \
    --ladder "$here/ladder" --out "$here/phase_maps/w64" --no-progress --no-check \
    >>"$here/w64.log" 2>&1 &
echo "started: tail -f $here/w32.log $here/w64.log; cells land in $here/phase_maps/*/cells"
