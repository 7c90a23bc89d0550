#!/usr/bin/env bash
# `pip install .` beside an existing PyTorch / transformers stack, with no extra, in a fresh venv:
#   1. a venv holding only the stack ($PINS: the pinned CPU torch and transformers, as the Makefile installs them);
#   2. `pip install .`, which must leave that torch and transformers as they are and bring no extra's package;
#   3. .ci/clean_install_check.py: featcal --version, merge and calibrate a tiny model, and the one-line errors
#      of features whose extra is absent.
# The venv lives in a temporary folder, removed at the end. Usage: PINS="torch==... transformers==..." $0
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
PINS=${PINS:-torch==2.13.0 transformers==5.24.0}
ROOT=$(mktemp -d "${TMPDIR:-/tmp}/featcal-clean.XXXXXX")
trap 'rm -rf "$ROOT"' EXIT
start=$SECONDS
$PY -m venv "$ROOT/venv"
BIN=$ROOT/venv/bin
# shellcheck disable=SC2086
$BIN/python -m pip install -q $PINS
before=$($BIN/python -m pip freeze | grep -iE '^(torch|transformers)==' | sort)
stack=$SECONDS
$BIN/python -m pip install -q .
after=$($BIN/python -m pip freeze | grep -iE '^(torch|transformers)==' | sort)
if [ "$before" != "$after" ]; then
  echo "clean install: pip install . changed the stack: $(echo $before) -> $(echo $after)" >&2
  exit 1
fi
installed=$SECONDS
# run from outside the repository, so the installed package is imported and not ./src
(cd "$ROOT" && HF_HUB_OFFLINE=1 "$BIN/python" "$OLDPWD/.ci/clean_install_check.py" "$OLDPWD/tests" "$ROOT/work")
echo "clean install: passed (stack $((stack - start)) s, pip install . $((installed - stack)) s," \
     "checks $((SECONDS - installed)) s)"
