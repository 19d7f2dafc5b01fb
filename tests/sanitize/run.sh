#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over tests/sanitize/representative.py.
# Needs a GPU and kernels on FLASHGEN_KERNEL_PATH:
#   FLASHGEN_KERNEL_PATH=build/kernels bash tests/sanitize/run.sh
# Prints one "ERROR SUMMARY" line per tool and exits non-zero if any tool found an error.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export PYTHONPATH="${PYTHONPATH:-$(cd "$here/../.." && pwd)}"
# CuPy's memory pool hands out sub-ranges of larger allocations: padding bytes between arrays
# are legitimately never written, so initcheck tracks the kernels' own reads only.
status=0
for tool in memcheck racecheck initcheck synccheck; do
  log="${OUT:-/tmp}/sanitizer-$tool.log"
  compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 python3 "$here/representative.py" > "$log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
  echo "$tool: exit $rc; ${summary:-no summary line (see $log)}"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
