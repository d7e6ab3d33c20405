#!/usr/bin/env bash
# nanorft launcher.
#   bash run.sh [CONFIG] [--section.key VALUE ...]   set up .venv on first use, build the embedded default, then run
#                                                    the experiment CONFIG (default: configs/tiny.yaml) via launch.py
#   bash run.sh test [PYTEST ARGS]                   set up .venv on first use, then run the test suite
# Set-up happens once: later calls reuse .venv until pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
PY="$VENV/bin/python"

# pytest and openai, TRL (scripts/bench_vs_trl.py's other side), mlflow (a monitor), psycopg (the PostgreSQL DB)
TEST_EXTRAS="test,bench,mlflow,postgres"

setup() {  # $1: "" (the project) or $TEST_EXTRAS (the project and what its tests need)
  local hash stamp
  hash=$(sha256sum pyproject.toml | cut -c1-16)
  stamp="$VENV/.setup-${1:+$1-}$hash"
  [ -f "$stamp" ] || { [ -z "$1" ] && [ -f "$VENV/.setup-$TEST_EXTRAS-$hash" ]; } && return 0
  python3 -c 'import sys; assert sys.version_info >= (3, 10), "nanorft needs Python >= 3.10"'
  echo "[run.sh] first use: creating $VENV and installing dependencies (a few minutes)"
  local t0=$SECONDS extras=${1:+[$1]}
  [ -x "$PY" ] || python3 -m venv "$VENV"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q --disable-pip-version-check -e ".$extras"
    echo "[run.sh] GPU found. For the vLLM rollout engine: $VENV/bin/pip install -e '.[gpu]'"
  else
    # NOTE: torch first, pinned: any other spec pulls a multi-GB CUDA build; 2.13.0 is the CPU wheel here.
    "$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
    "$PY" -m pip install -q --disable-pip-version-check -e ".$extras"
  fi
  find "$VENV" -maxdepth 1 -name ".setup-*" ! -name "*$hash" -delete  # stamps of an older pyproject.toml
  touch "$stamp"
  echo "[run.sh] set-up done in $((SECONDS - t0)) s"
}

if [ "${1:-}" = "test" ]; then
  setup "$TEST_EXTRAS"
  shift
  exec "$PY" -m pytest -q "$@"
fi
setup ""
CONFIG="${1:-configs/tiny.yaml}"
[ $# -gt 0 ] && shift
"$PY" tiny.py --out assets
# Every stage with the processes its mode needs (explorer, trainer); then summary.json and a plot.
exec "$PY" launch.py --config "$CONFIG" "$@"
