# Two entry points (see README): `make demo` runs the main offline job, `make test` the suite.
# Both create .venv and install the package on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench-calib clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	@# runs/ is the demo's own scratch folder: each run replaces the previous report, atomically
	$(BIN)/featcal bench --preset default --seed 0 --out runs/bench-default --overwrite --rebuild-zoo

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests

# calibration cost vs its floor (one forward of merged + experts); medians of 3, 1 thread, a few minutes on CPU
bench-calib: $(STAMP)
	$(BIN)/python benchmarks/calibration_speed.py --preset small --tasks 4 --examples 64 --batch-size 16 \
		--repeats 3 --threads 1 --out runs/bench-calib.json

clean:
	rm -rf $(VENV) runs zoo-cache
