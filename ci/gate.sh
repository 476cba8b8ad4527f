#!/usr/bin/env bash
# Gate a change on refcheck's golden traces: verify hashes, then diff every golden case against the
# live reference (replay + free-run). Exit codes: 0 pass, 1 mismatch, 3 missing/stale golden,
# 4 corrupt golden, 5 nothing compared, 7 a worker process died (no verdict). Writes the JSON report to ${REFCHECK_REPORT:-gate-report.json}.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/refcheck ] || ./scripts/setup.sh
. .venv/bin/activate
refcheck golden verify
refcheck gate --json > "${REFCHECK_REPORT:-gate-report.json}"
