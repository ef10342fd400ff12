#!/usr/bin/env bash
# Install qcg-gpu with its test and lint tools, check the code (ruff format and lint, mypy) and the docs (mkdocs),
# then run the whole test suite (real models, no GPU needed). Arguments go to pytest;
# scripts/test.sh -m "not llm" is the fast selection (no LLM loaded) for the inner loop.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
scripts/install.sh dev
"$PY" -m ruff format --check --quiet .
"$PY" -m ruff check --quiet .
"$PY" -m mypy
"$PY" -m mkdocs build --strict --site-dir "$(mktemp -d)"  # not --quiet: it hides the warnings strict fails on
"$PY" -m pytest -q --durations=15 "$@"
