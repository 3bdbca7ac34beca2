# Two commands do everything on a fresh machine:
#   make reproduce   the whole study at CPU scale, into $(OUT) (the standard scale: the
#                    multi-hour measurements read from the fit shipped with the package;
#                    `make reproduce-full` recomputes them too, hours, resumable)
#   make test        the test suite
# Both create .venv and install the pinned CPU environment when it is missing or stale.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
OUT    ?= out/study
PYTEST_ARGS ?=

.PHONY: test compat reproduce reproduce-full reproduce-quick venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup $(PYTEST_ARGS)

# python 3.8 + torch 2.1.0 (the 910B seed stack: the Megatron probe, config, model info,
# launch; .[cluster]), python 3.10 smoke, python 3.11 .[study] and python 3.11 .[trainer]
# (torch 2.13.0 CPU) jobs; environments cached in ~/.cache/adamspike (.ci/compat.sh)
compat: $(STAMP)
	MAIN_PY=$(abspath $(PY)) bash .ci/compat.sh

reproduce: $(STAMP)
	$(VENV)/bin/adamspike reproduce --out $(OUT)

reproduce-full: $(STAMP)
	$(VENV)/bin/adamspike reproduce --full --resume --out $(OUT)-full

reproduce-quick: $(STAMP)
	$(VENV)/bin/adamspike reproduce --quick --out out/quick

bench: $(STAMP)
	for f in bench/bench_*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf out .pytest_cache
