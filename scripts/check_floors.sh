#!/usr/bin/env bash
# The dependency floors of pyproject.toml, exercised: a second virtual environment with the lowest version each
# floor allows (`pip install --resolution lowest-direct`-style, by hand: pip has no such flag), then the tests that
# touch those libraries, one pytest-xdist worker per core. Run by .ci/run after the README's test command.
#   bash scripts/check_floors.sh [PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NANORFT_FLOORS_VENV:-.venv-floors}
PY="$VENV/bin/python"
# NOTE: keep in step with pyproject.toml's floors (tests/test_repo.py checks that every floor is listed here).
FLOORS=(
  "transformers==4.56.0" "datasets==3.0.0" "tokenizers==0.22.0" "safetensors==0.4.4" "tyro==0.9.3"
  "omegaconf==2.3.0" "pyyaml==6.0" "tqdm==4.66.3" "math-verify==0.8.0" "pytest==8.0.0" "pytest-xdist==3.5.0"
  "wandb==0.19.10"
  "tensorboard==2.18.0" "matplotlib==3.9.0" "fastapi==0.115.0" "uvicorn==0.30.0" "openai==1.55.3"
  "mlflow-skinny==3.3.0" "sqlalchemy==2.0.0" "alembic==1.11.0" "psycopg==3.1.4" "psycopg-binary==3.1.4" "peft==0.14.0"
  "streamlit==1.45.0" "playwright==1.45.0"
)
[ -x "$PY" ] || python3 -m venv "$VENV"
"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
"$PY" -m pip install -q --disable-pip-version-check "${FLOORS[@]}"
# --no-deps: the project itself, the floors above staying in place
"$PY" -m pip install -q --disable-pip-version-check --no-deps -e .
"$PY" -m pip check
"$PY" -m pip list 2>/dev/null | grep -iE "^(torch|transformers|datasets|tokenizers|safetensors|tyro|omegaconf|tqdm|math-verify|pytest|wandb|tensorboard|matplotlib|numpy|fastapi|uvicorn|openai|pydantic|mlflow-skinny|sqlalchemy|alembic|protobuf|psycopg|psycopg-binary|peft|streamlit|playwright|altair|pandas|pyarrow) "
# NOTE: this venv has no vLLM: test_lora's one test that reads vLLM's LoRA ranks runs in `bash run.sh test` only.
# NOTE: the studio: its run page through AppTest, all three pages in the real browser. The config and viewer pages'
# AppTest files read AppTest.html and query_params as strings, which Streamlit's AppTest has only after 1.50: they run
# on the current Streamlit (bash run.sh test), their pages here in the browser
exec "$PY" -m pytest -q -p no:cacheprovider -n auto --dist loadgroup \
  tests/test_config.py tests/test_config_keys.py tests/test_workflows.py tests/test_engines.py tests/test_tasksets.py \
  tests/test_train.py tests/test_monitor.py tests/test_launch.py tests/test_openai_api.py tests/test_buffer_db.py \
  tests/test_lora.py tests/test_studio_run.py tests/test_studio_browser.py -x "$@" \
  --deselect tests/test_lora.py::test_vllm_engines_start_on_the_base_serving_the_saved_adapter
