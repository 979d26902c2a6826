#!/usr/bin/env bash
# The test suite: setup (idempotent), then pytest. Extra arguments go to pytest.
#   scripts/test.sh              every test (CI), servers included
#   scripts/test.sh --fast       only the tests that start no server (-m "not server"), minutes
#   scripts/test.sh tests/morph  one folder (pytest.ini's testpaths when no path is given)
# Two test processes share the machine (pytest-xdist; see tests/conftest.py for how tests are
# grouped and how server starts take turns); MORPH_TEST_WORKERS=0 runs them in this process.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
marker=()
if [[ "${1:-}" == "--fast" ]]; then
  marker=(-m "not server")
  shift
fi
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# --durations: the slowest tests in the CI log, to keep the whole run under 40 minutes.
workers="${MORPH_TEST_WORKERS:-2}"
xdist=(-n "$workers")
[[ "$workers" == 0 ]] || xdist+=(--dist loadgroup --no-loadscope-reorder)
exec "$ROOT/.venv/bin/python" -m pytest -ra --durations=25 "${xdist[@]}" "${marker[@]}" "$@"
