"""GPU evidence in one time-capped command, for a GPU host lent for minutes:

  python -m s24jax.gpu_report                       # --budget 420 (seconds), into docs/
  python -m s24jax.gpu_report --budget 840 --out runs/report
  python -m s24jax.gpu_report --sections gemms,steps
  python -m s24jax.gpu_report --markdown-from docs/gpu_report_latest.jsonl
  python -m s24jax.gpu_report --smoke --out /tmp/r  # a CPU: tiny shapes, the stand-in

Sections, in this order (sections.py: why, and each one's share of the budget):
  environment   device, driver, compute capability, every version, the commit (env.py)
  gpu_tests     `pytest -m gpu`, cuSPARSELt's error log on (CUSPARSELT_LOG_LEVEL=1)
  gemms         each cuSPARSELt GEMM (forward, dgrad, wgrad; bf16, FP8; with and without
                compression) against the dense XLA GEMM and PyTorch's cuSPARSELt, n calls
                per jitted loop; the op's error against 'xla' (gemms.py, torch_peer.py)
  steps         the train step of dense / Hu et al. / S-STE on 'xla' and 'cusparselt' at
                124m, 1.5B's width (2 layers) and 350m, and the step's anatomy (steps.py)
  quick_suite   `pytest -m "not slow and not gpu" -n <k>`, per-test outcomes

Every row is appended to NAME.jsonl the moment it exists (rows.py; the pytest sections
through the plugin pytest_rows.py), so a failure, the budget or a kill loses at most the row
in progress; NAME.md is regenerated from it after each section, at the end and when stopped
(markdown.py). Each section runs in its own process with a time cap (cli.py, children.py);
a row that cannot finish in its section's time is recorded as skipped, a failing row with its
error, and the rest go on. Logs, JUnit XML and cuSPARSELt's log go to the folder NAME/.

The output is docs/gpu_report_latest.{md,jsonl} by default, never docs/gpu_report.md: that
file holds the record of the first GPU run (H100, 2026-11-27), which included runs this
command does not make. Without a GPU it says so and exits 2, unless --smoke: the test suite
runs that, so the script stays working; its figures say nothing about a GPU.

Not yet run on a GPU in this form (written 2026-11 after the first H100 run, on a CPU).
"""
