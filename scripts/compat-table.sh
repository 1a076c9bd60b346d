#!/usr/bin/env bash
# Writes `hpc-train compat` (the table of src/plan/compat.rs) into docs/combinations.md between its markers,
# which a unit test compares with the table: run it after changing the table.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$HPC_TRAIN_ROOT"
table=$(mktemp)
trap 'rm -f "$table"' EXIT
"$HPC_TRAIN_BIN" compat > "$table"
python3 - "$table" <<'PY'
import sys
begin, end = "<!-- compat:begin (hpc-train compat) -->\n", "<!-- compat:end -->"
readme = open("docs/combinations.md").read()
start = readme.index(begin) + len(begin)
stop = readme.index(end, start)
open("docs/combinations.md", "w").write(readme[:start] + open(sys.argv[1]).read() + readme[stop:])
PY
echo "docs/combinations.md: compatibility table updated"
