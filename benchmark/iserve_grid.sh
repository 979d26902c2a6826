#!/usr/bin/env bash
# The command's old name, kept working: benchmark/iserve/grid.sh.
exec bash "$(dirname "$0")/iserve/grid.sh" "$@"
