#!/usr/bin/env bash
# The whole test suite: setup (idempotent), then pytest. Extra arguments go to pytest.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# --durations: the slowest tests in the CI log, to keep the whole run under 40 minutes.
exec "$ROOT/.venv/bin/python" -m pytest tests -ra --durations=25 "$@"
