#!/bin/bash
# Second device call (2026-11-27): the quick tests the first call's report did not reach, the
# four that failed there (fixed), the tcgen05 skips; then the S-STE and Hu et al. 124m steps,
# 'xla' against 'cusparselt' (default choice), with their programs and timing rounds.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false S24JAX_CACHE=/tmp/s24cache
say() { echo "[plan2 $(date +%T)] $*"; }
say "start"
mapfile -t TESTS < .gpu_host/tests2.txt
S24JAX_GPU_REPORT_JSONL=$OUT/tests2.jsonl S24JAX_GPU_REPORT_SECTION=tests2 \
  timeout -k 5 105 python -m pytest -q -rfEs --tb=short -n 12 -p no:cacheprovider \
  -p s24jax.gpu_report.pytest_rows "${TESTS[@]}" > $OUT/tests2.log 2>&1
say "tests exit $?"; tail -3 $OUT/tests2.log
timeout -k 5 100 python - <<'PY' > $OUT/steps2.log 2>&1
import os, time
from s24jax.gpu_report import rows, steps
path = os.path.join(os.environ["OUT"], "steps2.jsonl")
section = rows.Section(path, "steps")
steps.run(section, deadline=time.time() + 92, smoke=False, rows=(
    ("124m", "s_ste", "xla", None), ("124m", "s_ste", "cusparselt", None),
    ("124m", "hu2024", "cusparselt", None), ("124m", "hu2024", "xla", None)))
PY
say "steps exit $?"
tar czf $OUT/cache2.tgz -C /tmp s24cache/gemm_choice 2>/dev/null
say "done"
