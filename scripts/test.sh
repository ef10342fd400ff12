#!/usr/bin/env bash
# Install qcg-gpu with its test and lint tools, check the code (ruff format and lint, mypy) and the docs (mkdocs),
# then run the whole test suite (real models, no GPU needed). Arguments go to pytest;
# scripts/test.sh -m "not llm" is the fast selection (no LLM loaded) for the inner loop.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
scripts/install.sh dev
# tests/test_report.py opens report.html in headless Chromium: Debian's, with its driver (root installs them)
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "scripts/test.sh: the browser tests skip: install Debian's chromium and chromium-driver" >&2
  fi
fi
[ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] && export QCG_BROWSER_TESTS=required
"$PY" -m ruff format --check --quiet .
"$PY" -m ruff check --quiet .
"$PY" -m mypy
"$PY" -m mkdocs build --strict --site-dir "$(mktemp -d)"  # not --quiet: it hides the warnings strict fails on
"$PY" -m pytest -q --durations=15 "$@"
