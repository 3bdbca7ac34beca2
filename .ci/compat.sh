#!/usr/bin/env bash
# CI compatibility jobs (called by .ci/run after `make test`; also `make compat`):
#   py38   python 3.8 + torch 2.1.0 (the 910B seed stack: CANN 7.0.1, torch/torch_npu 2.1.0):
#          the Megatron probe on a plain torch.optim.AdamW model (torch + numpy only: the
#          plain run-directory writer), the DCP metadata allowlist against a checkpoint
#          torch 2.1 writes (tests/compat/dcp_metadata_check.py), the config loader, `model info`, `launch` and
#          `analyze --log` (with that python's pandas / pyarrow / scipy), then `adamspike
#          analyze` of the probe's run directory in the main environment.
#          Then `pip install -e .[cluster]` (torch 2.1.0 pinned) into a clean python 3.8
#          environment: `model info` (the config's world size), `launch`, the probe's actions
#          on, and the one-line missing-extra messages (`train` on torch 2.1 -> [trainer],
#          `sweep` without jax -> [study]).
#   py310  python 3.10 (the declared minimum for the rest): import and CLI smoke tests
#          without torch / jax, and their missing-extra messages.
#   py311  `pip install -e .[study]` into a clean python 3.11 environment: no torch is pulled
#          in, `sweep run` of the quadratic grid at the quick study's size (jax + optax) finds spikes below eps*
#          and none above it, and the one-line missing-extra messages (`train` -> [trainer],
#          `model info` -> [cluster]).
#   py311_trainer  `pip install -e .[trainer]` with torch==$PY311_TORCH (2.13.0, the CPU
#          build) into a clean python 3.11 environment: no jax / optax / nvidia-* wheels are
#          pulled in (the distributions it does pull are printed), the smallest trainer run
#          (configs/tiny.toml, 5 steps) in one process and on 2 gloo ranks under torchrun
#          (steps rows 1-5, the same losses up to summation order), `model info` (torch
#          meta check), and `sweep run` without jax -> [study] in one line, exit 2.
# Wheels and environments are cached under $ADAMSPIKE_CACHE (default ~/.cache/adamspike):
# the first run downloads ~2.7 GB (torch 2.1.0 from PyPI with its CUDA dependencies; the
# CPU-only index is not reachable from the CI machines) plus ~225 MB for py311 (jax,
# jaxlib CPU and the rest of .[study]) and ~330 MB for py311_trainer (torch 2.13.0+cpu,
# 191 MB, where pip's find-links (pip config: /opt/wheels) has it: check the printed wheel
# name, a CUDA build would add GBs of nvidia-* wheels; then the base dependencies), later
# runs reuse the environment.
# A python that is missing, or wheels that cannot be fetched, skip that job with a message
# (exit 0); a failing check fails the job.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
CACHE="${ADAMSPIKE_CACHE:-$HOME/.cache/adamspike}"
PY38="${PY38:-/root/.pyenv/versions/3.8.18/bin/python}"
PY310="${PY310:-/root/.pyenv/versions/3.10.13/bin/python}"
PY311="${PY311:-/root/.pyenv/versions/3.11.7/bin/python}"
PY311_TORCH="${PY311_TORCH:-2.13.0}"   # py311_trainer's torch (the CPU build, see the top)
MAIN_PY="${MAIN_PY:-$ROOT/.venv/bin/python}"
JOBS="${*:-py38 py310 py311 py311_trainer}"
mkdir -p "$CACHE"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

skip() { echo "SKIP $1: $2"; }

# venv DIR PYTHON WHEELS REQUIREMENT...: a cached environment (rebuilt when its stamp, the
# requirements, changes), installed from cached wheels (downloaded once)
venv() {
  local dir="$1" py="$2" wheels="$3"; shift 3
  local want="$*"
  if [[ -f "$dir/.stamp" && "$(cat "$dir/.stamp")" == "$want" ]]; then return 0; fi
  mkdir -p "$wheels"
  if ! "$py" -m pip download -q -d "$wheels" "$@" >"$TMP/download.log" 2>&1; then
    tail -n 5 "$TMP/download.log"
    return 3
  fi
  rm -rf "$dir"
  "$py" -m venv "$dir"
  local t0=$SECONDS
  "$dir/bin/python" -m pip install -q --no-index --find-links "$wheels" "$@"
  echo "installed $want into $dir in $((SECONDS - t0)) s"
  echo "$want" > "$dir/.stamp"
}

job_py38() {
  if [[ ! -x "$PY38" ]]; then skip py38 "no python 3.8 at $PY38 (set PY38)"; return 0; fi
  local env="$CACHE/venv-py38-torch2.1" extra="$CACHE/py38-extra"
  local rc=0
  venv "$env" "$PY38" "$CACHE/wheels-py38" torch==2.1.0 "numpy<1.25" tomli || rc=$?
  if (( rc == 3 )); then skip py38 "torch==2.1.0 wheels for python 3.8 could not be downloaded"; return 0; fi
  (( rc == 0 )) || return $rc
  echo "== py38: $("$env/bin/python" -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__)')"
  # the probe without pandas / pyarrow / scipy / jax (what a 910B node may have)
  "$env/bin/python" - <<'PY'
import importlib.util, sys
for mod in ("pandas", "pyarrow", "scipy", "jax"):
    assert importlib.util.find_spec(mod) is None, f"{mod} must not be installed for this check"
PY
  PYTHONPATH="$ROOT" "$env/bin/python" tests/compat/probe_adamw.py "$TMP/py38" --steps 12 --skip 5
  ls "$TMP/py38/run/layers" | grep -q 'part-000000.jsonl'   # the plain writer was used
  # every global torch 2.1 writes into a DCP checkpoint's .metadata is one the restricted
  # unpickler admits (fullscale/dcp_metadata.py derives its allowlist from the torch installed)
  PYTHONPATH="$ROOT" "$env/bin/python" tests/compat/dcp_metadata_check.py "$TMP/dcp38"
  rc=0; PYTHONPATH="$ROOT" "$env/bin/python" -m fullscale.megatron_probe 2>/dev/null || rc=$?
  [[ $rc == 2 ]]                                   # the launcher's usage error
  # the config loader, model info, launch and analyze (--log) on 3.8, with that python's
  # pandas / pyarrow / scipy / matplotlib in a separate --target folder (the probe check
  # above ran without them)
  local extras=("pandas==2.0.3" "pyarrow<18" "tqdm" "scipy<1.11" "matplotlib<3.8")
  if [[ ! -f "$extra/.stamp" || "$(cat "$extra/.stamp")" != "${extras[*]}" ]]; then
    mkdir -p "$CACHE/wheels-py38-extra"
    if "$PY38" -m pip download -q -d "$CACHE/wheels-py38-extra" "${extras[@]}" >"$TMP/dl2.log" 2>&1; then
      rm -rf "$extra"
      "$env/bin/python" -m pip install -q --no-index --find-links "$CACHE/wheels-py38-extra" \
        --find-links "$CACHE/wheels-py38" --target "$extra" "${extras[@]}"
      echo "${extras[*]}" > "$extra/.stamp"
    fi
  fi
  if [[ -f "$extra/.stamp" ]]; then
    local py38x=(env PYTHONPATH="$ROOT:$extra" "$env/bin/python")
    "${py38x[@]}" -m study model info --config configs/llama2-70b.toml --world-size 1024 >/dev/null
    "${py38x[@]}" -m study launch --config configs/llama2-70b.toml \
      --cluster configs/cluster-128x8.toml --master-addr node-000 --out "$TMP/launch38" >/dev/null
    bash -n "$TMP/launch38/train_mindspeed.sh"
    grep -q "fullscale.megatron_probe" "$TMP/launch38/train_mindspeed.sh"
    "${py38x[@]}" - "$TMP/m.log" <<'PY'
import sys
# Megatron-LM training_log lines (megatron/training/training.py format strings)
with open(sys.argv[1], "w") as fh:
    for it in range(1, 61):
        fh.write(f" [2024-06-01 12:00:01.123456] iteration {it:8d}/{60:8d} |"
                 f" consumed samples: {it * 64:12d} | elapsed time per iteration (ms): {900.0:.1f} |"
                 f" learning rate: {1.5e-4:.6E} | global batch size: {64:5d} |"
                 f" lm loss: {3.0 - it / 100:.6E} | loss scale: {1.0:.1f} | grad norm: {0.8:.3f} |"
                 f" number of skipped iterations: {0:3d} | number of nan iterations: {0:3d} |\n")
PY
    "${py38x[@]}" -m study analyze --log "$TMP/m.log" "$TMP/py38/run" --seq-len 4096 --clip 1 \
      --out "$TMP/py38/report38" >/dev/null
    grep -q "^## Imported log" "$TMP/py38/report38/m.log.run/report.md"
  else
    skip "py38 model info / launch / analyze" "pandas / pyarrow / scipy wheels for python 3.8 could not be downloaded"
  fi
  # analyze the probe's (plain) run directory with the main environment
  if [[ -x "$MAIN_PY" ]]; then
    PYTHONPATH="$ROOT" "$MAIN_PY" -m study analyze "$TMP/py38/run" --out "$TMP/py38/report" \
      >/dev/null
    grep -q "^## Loss spikes" "$TMP/py38/report/run/report.md"
  else
    skip "py38 analyze" "no main environment at $MAIN_PY (make venv)"
  fi
  job_py38_cluster
  echo "py38: OK"
}

# expect_extra EXTRA CMD...: CMD exits 2 with one stderr line naming `.[EXTRA]`
expect_extra() {
  local extra="$1" rc=0; shift
  "$@" >/dev/null 2>"$TMP/extra.err" || rc=$?
  if [[ $rc != 2 || "$(wc -l < "$TMP/extra.err")" != 1 ]] || ! grep -qF "pip install -e '.[$extra]'" "$TMP/extra.err"; then
    echo "expected one line naming .[$extra] and exit 2 from: $* (exit $rc)"; cat "$TMP/extra.err"; return 1
  fi
}

# `pip install -e .[cluster]` into a clean python 3.8 environment (cached; rebuilt when
# pyproject.toml or the checkout it points at changes: an editable install), from cached wheels
job_py38_cluster() {
  local env="$CACHE/venv-py38-cluster" wheels="$CACHE/wheels-py38-cluster"
  local want="torch==2.1.0 .[cluster] $(sha256sum pyproject.toml | cut -c1-16) $ROOT"
  if [[ ! -f "$env/.stamp" || "$(cat "$env/.stamp")" != "$want" ]]; then
    mkdir -p "$wheels"
    if ! "$PY38" -m pip download -q -d "$wheels" --find-links "$CACHE/wheels-py38" \
        --find-links "$CACHE/wheels-py38-extra" "setuptools>=64" wheel "torch==2.1.0" \
        "$ROOT[cluster]" >"$TMP/dl3.log" 2>&1; then
      tail -n 5 "$TMP/dl3.log"; skip "py38 .[cluster]" "wheels could not be downloaded"; return 0
    fi
    rm -rf "$env"
    "$PY38" -m venv "$env"
    local t0=$SECONDS
    "$env/bin/python" -m pip install -q --no-index --find-links "$wheels" \
      --find-links "$CACHE/wheels-py38" --find-links "$CACHE/wheels-py38-extra" \
      -e "$ROOT[cluster]" "torch==2.1.0"
    echo "installed .[cluster] (python 3.8, torch 2.1.0) into $env in $((SECONDS - t0)) s"
    echo "$want" > "$env/.stamp"
  fi
  local a="$env/bin/adamspike"
  echo "== py38 .[cluster]: $("$env/bin/python" -c 'import sys, torch, pandas; print("python", sys.version.split()[0], "torch", torch.__version__, "pandas", pandas.__version__)')"
  (cd "$TMP" && "$a" model info --config "$ROOT/configs/llama2-70b.toml" --no-meta-check) \
    > "$TMP/info38.txt"
  grep -q "world 1024" "$TMP/info38.txt"        # the config's world size, not 1 card
  "$a" launch --config configs/llama2-70b.toml --cluster configs/cluster-128x8.toml \
    --master-addr node-000 --out "$TMP/launch38c" >/dev/null
  bash -n "$TMP/launch38c/train_mindspeed.sh"
  "$env/bin/python" -c "from fullscale.megatron_probe import ProbeActions as A; d = A.from_env({}).describe(); assert d.startswith('rules loss+grad_norm, skip-step on'), d"
  expect_extra trainer "$a" train --help        # torch 2.1 < the trainer's 2.6
  expect_extra study "$a" sweep run --help      # no jax on this stack
  echo "py38 .[cluster]: OK"
}

job_py310() {
  if [[ ! -x "$PY310" ]]; then skip py310 "no python 3.10 at $PY310 (set PY310)"; return 0; fi
  local env="$CACHE/venv-py310" rc=0
  venv "$env" "$PY310" "$CACHE/wheels-py310" "numpy>=1.24" "scipy>=1.10" "pandas>=2.0" \
    "pyarrow>=14" "matplotlib>=3.7" "tqdm>=4.60" "tomli" || rc=$?
  if (( rc == 3 )); then skip py310 "numpy / scipy / pandas / pyarrow wheels for python 3.10 could not be downloaded"; return 0; fi
  (( rc == 0 )) || return $rc
  echo "== py310: $("$env/bin/python" --version)"
  PYTHONPATH="$ROOT" "$env/bin/python" - <<'PY'
import importlib
for m in ("adamspike", "adamspike.config", "adamspike.train_config", "adamspike.metrics",
          "adamspike.rundir", "adamspike.predictions", "adamspike.llama", "adamspike.depth_groups",
          "theory", "analysis.megatron_log", "analysis.report", "analysis.cli", "figures.cli",
          "fullscale.model_info", "fullscale.launch", "fullscale.hf"):
    importlib.import_module(m)
from adamspike.config import load_config
from adamspike.train_config import RunConfig
cfg = load_config(RunConfig, "configs/llama2-70b.toml", ["--optim.eps", "1e-6"])
assert cfg.optim.eps == 1e-6 and cfg.model.rope_theta is None
print("py310 imports and config: ok")
PY
  PYTHONPATH="$ROOT" "$env/bin/python" -m study --help >/dev/null
  PYTHONPATH="$ROOT" "$env/bin/python" -m study theory --help >/dev/null
  PYTHONPATH="$ROOT" "$env/bin/python" -m study launch --config configs/llama2-70b.toml \
    --cluster configs/cluster-128x8.toml --master-addr node-000 --out "$TMP/launch310" >/dev/null
  if [[ -d "$TMP/py38/run" ]]; then
    PYTHONPATH="$ROOT" "$env/bin/python" -m study analyze "$TMP/py38/run" --out "$TMP/r310" >/dev/null
  fi
  # no torch / jax here: the commands that need them name their extra
  expect_extra cluster env PYTHONPATH="$ROOT" "$env/bin/python" -m study model info --config llama2-70b
  expect_extra trainer env PYTHONPATH="$ROOT" "$env/bin/python" -m study train --help
  expect_extra study env PYTHONPATH="$ROOT" "$env/bin/python" -m study sweep run --help
  echo "py310: OK"
}

# `pip install -e .[study]` into a clean python 3.11 environment (cached; rebuilt when
# pyproject.toml or the checkout it points at changes: an editable install), from cached wheels, the build backend included (as py38 .[cluster])
job_py311() {
  if [[ ! -x "$PY311" ]]; then skip py311 "no python 3.11 at $PY311 (set PY311)"; return 0; fi
  local env="$CACHE/venv-py311-study" wheels="$CACHE/wheels-py311-study"
  local want=".[study] $(sha256sum pyproject.toml | cut -c1-16) $ROOT"
  if [[ ! -f "$env/.stamp" || "$(cat "$env/.stamp")" != "$want" ]]; then
    mkdir -p "$wheels"
    if ! "$PY311" -m pip download -q -d "$wheels" "setuptools>=64" wheel "$ROOT[study]" \
        >"$TMP/dl4.log" 2>&1; then
      tail -n 5 "$TMP/dl4.log"; skip "py311 .[study]" "wheels could not be downloaded"; return 0
    fi
    rm -rf "$env"
    "$PY311" -m venv "$env"
    local t0=$SECONDS
    "$env/bin/python" -m pip install -q --no-index --find-links "$wheels" -e "$ROOT[study]"
    echo "installed .[study] (python 3.11) into $env in $((SECONDS - t0)) s"
    echo "$want" > "$env/.stamp"
  fi
  local a="$env/bin/adamspike"
  echo "== py311 .[study]: $("$env/bin/python" -c 'import sys, jax, optax, numpy; print("python", sys.version.split()[0], "jax", jax.__version__, "optax", optax.__version__, "numpy", numpy.__version__)')"
  "$env/bin/python" - <<'PY'
import importlib.util
assert importlib.util.find_spec("torch") is None, ".[study] must not pull torch"
PY
  # the quadratic grid's CI size (jax + optax, vmapped): eps* = 2.63e-4 at lr 1e-2
  # (the study's quick size of this stage, configs/study.toml [stages.sweep])
  "$a" sweep run --grid configs/sweep_quadratic.toml --set sweep.seeds=3 --set fixed.train.num_steps=15000 \
    --set "grid.optim.eps=[1e-8, 1e-5, 1e-4, 2.8e-4, 1e-3]" --set "grid.optim.b2=[0.95, 0.999]" \
    --set "grid.optim.lr=[1e-2]" \
    --out "$TMP/sweep311" --no-progress >/dev/null
  "$env/bin/python" - "$TMP/sweep311/runs.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert len(rows) == 30, len(rows)
spikes = {}
for r in rows:
    spikes.setdefault(float(r["optim.eps"]), []).append(int(r["num_spikes"]))
assert min(spikes[1e-8]) > 0 and max(spikes[1e-3]) == 0, spikes
print("py311 sweep: %d runs, spikes at eps 1e-8: %s, at eps 1e-3: %s"
      % (len(rows), spikes[1e-8], spikes[1e-3]))
PY
  # no torch here: the commands that need it name their extra
  expect_extra trainer "$a" train --help
  expect_extra cluster "$a" model info --config llama2-70b
  echo "py311 .[study]: OK"
}

# `pip install -e .[trainer]` into a clean python 3.11 environment (cached; rebuilt when
# pyproject.toml or the checkout it points at changes: an editable install), torch pinned to the CPU build of 2.13.0, from cached wheels, the
# build backend included (as py311 .[study])
job_py311_trainer() {
  if [[ ! -x "$PY311" ]]; then skip py311_trainer "no python 3.11 at $PY311 (set PY311)"; return 0; fi
  local env="$CACHE/venv-py311-trainer" wheels="$CACHE/wheels-py311-trainer"
  local torch_pin="torch==$PY311_TORCH"
  local want="$torch_pin .[trainer] $(sha256sum pyproject.toml | cut -c1-16) $ROOT"
  if [[ ! -f "$env/.stamp" || "$(cat "$env/.stamp")" != "$want" ]]; then
    mkdir -p "$wheels"
    if ! "$PY311" -m pip download -q -d "$wheels" "setuptools>=64" wheel "$torch_pin" \
        "$ROOT[trainer]" >"$TMP/dl5.log" 2>&1; then
      tail -n 5 "$TMP/dl5.log"; skip "py311 .[trainer]" "wheels could not be downloaded"; return 0
    fi
    # which torch build came (the CPU one, not a CUDA build with its nvidia-* wheels)
    local tw; tw="$(ls "$wheels" | grep -m1 "^torch-$PY311_TORCH[+-]" || true)"
    echo "py311 .[trainer] wheels: ${tw:-no torch-$PY311_TORCH wheel?} ($(( $(stat -c %s "$wheels/$tw" 2>/dev/null || echo 0) / 1000000 )) MB)," \
      "$(ls "$wheels" | grep -c '^nvidia' || true) nvidia-* wheels, $(du -sm "$wheels" | cut -f1) MB in $wheels"
    rm -rf "$env"
    "$PY311" -m venv "$env"
    local t0=$SECONDS
    "$env/bin/python" -m pip install -q --no-index --find-links "$wheels" -e "$ROOT[trainer]" \
      "$torch_pin"
    echo "installed .[trainer] (python 3.11, $torch_pin) into $env in $((SECONDS - t0)) s"
    echo "$want" > "$env/.stamp"
  fi
  local a="$env/bin/adamspike"
  echo "== py311 .[trainer]: $("$env/bin/python" -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "numpy", numpy.__version__)')"
  # what the extra pulls in: no jax / optax (the study's), no CUDA wheels
  "$env/bin/python" - <<'PY'
import importlib.metadata as md, importlib.util
names = sorted({d.metadata["Name"].lower() for d in md.distributions()}
               - {"pip", "setuptools", "wheel", "adamspike"})
for mod in ("jax", "jaxlib", "optax"):
    assert importlib.util.find_spec(mod) is None, f".[trainer] must not pull {mod}"
assert not [n for n in names if n.startswith("nvidia")], names
print("py311 .[trainer] pulls %d distributions (no jax / optax / nvidia-*): %s"
      % (len(names), " ".join(names)))
PY
  # the smallest trainer run (configs/tiny.toml, 5 steps), one process, then 2 gloo ranks
  local t0=$SECONDS
  (cd "$TMP" && OMP_NUM_THREADS=1 "$a" train --config "$ROOT/configs/tiny.toml" \
    --out "$TMP/train311" --train.num_steps 5 >"$TMP/train311.log" 2>&1) \
    || { tail -n 20 "$TMP/train311.log"; return 1; }
  local t1=$((SECONDS - t0)); t0=$SECONDS
  (cd "$TMP" && OMP_NUM_THREADS=1 timeout 120 "$env/bin/torchrun" --standalone \
    --nproc-per-node 2 -m fullscale.train --config "$ROOT/configs/tiny.toml" \
    --out "$TMP/train311x2" --train.num_steps 5 >"$TMP/torchrun311.log" 2>&1) \
    || { tail -n 20 "$TMP/torchrun311.log"; return 1; }
  local t2=$((SECONDS - t0))
  "$env/bin/python" - "$TMP/train311" "$TMP/train311x2" "$t1" "$t2" <<'PY'
import math, sys
from adamspike.rundir import load_run
one, two = load_run(sys.argv[1]), load_run(sys.argv[2])
for run, world in ((one, 1), (two, 2)):
    assert run.meta["world_size"] == world, run.meta.get("world_size")
    assert run.steps["step"].tolist() == [1, 2, 3, 4, 5], run.steps["step"].tolist()
    assert all(math.isfinite(x) for x in run.steps["loss"]), run.steps["loss"].tolist()
    assert len(run.layers) > 0
# same weights, same batches on 1 and 2 ranks: equal up to summation order
diff = max(abs(a - b) / abs(a) for a, b in zip(one.steps["loss"], two.steps["loss"]))
assert diff < 1e-4, diff
print("py311 train: 5 steps, loss %.4f -> %.4f (1 process, %s s); torchrun 2 gloo ranks %s s,"
      " losses within %.1e" % (one.steps["loss"].iloc[0], one.steps["loss"].iloc[-1],
                               sys.argv[3], sys.argv[4], diff))
PY
  # no jax here: the study's commands name their extra
  expect_extra study "$a" sweep run --grid configs/sweep_quadratic.toml --set sweep.seeds=1 \
    --out "$TMP/sweep311t" --no-progress
  [[ ! -e "$TMP/sweep311t" ]]                   # nothing written
  # torch >= 2.6 is also the cluster extra's torch: `model info` runs here
  "$a" model info --config llama2-70b >/dev/null
  echo "py311 .[trainer]: OK"
}

for j in $JOBS; do "job_$j"; done
