#!/bin/sh
# The long fuzz run of issue 19 (CI runs tests/hostile/test_fuzz.py: seed 19, 150 executions).
# Findings are kept in fuzz-findings/ (each to become a corpus case in tests/hostile/corpus.py).
# Usage: bench/fuzz.sh [BUDGET] [SEED]
set -e
cd "$(dirname "$0")/.."
exec python tests/hostile/fuzz.py --budget "${1:-3000}" --seed "${2:-1}" --findings fuzz-findings
