"""GPU evidence in one time-capped command, for a GPU host lent for minutes:

  python -m s24jax.perf.gpu_report                       # --budget 420 (seconds), into docs/
  python -m s24jax.perf.gpu_report --budget 840 --out runs/report
  python -m s24jax.perf.gpu_report --sections gemms,steps
  python -m s24jax.perf.gpu_report --markdown-from docs/gpu_report_latest.jsonl
  python -m s24jax.perf.gpu_report --smoke --out /tmp/r  # a CPU: tiny shapes, the stand-in

Sections, in this order (sections.py: why, and each one's share of the budget):
  environment   device, driver, compute capability, every version, the commit, and which
                libcusparseLt serves s24jax and torch (env.py, libraries.py)
  layouts       s24jax's compressed bytes against the library's for every type and shape the
                steps compress; the probe and the library's bytes kept where they differ
                (layouts.py)
  gpu_tests     `pytest -m gpu`, cuSPARSELt's error log on (CUSPARSELT_LOG_LEVEL=1)
  gemms         one row per cuSPARSELt GEMM (forward, dgrad, wgrad; bf16, FP8; widths
                768-8192 and Llama 7B's FFN): the 2:4 GEMM under the default and the searched
                algorithm, s24jax's and the library's compressions alone and with it, the
                dense XLA GEMM, all in one compiled program, and PyTorch's cuSPARSELt; the
                compression's bandwidth against the device's peak (gemms.py, gemm_plan.py,
                gemm_program.py, bandwidth.py, torch_peer.py)
  steps         the train step of dense / Hu et al. / S-STE on 'xla' and 'cusparselt' at
                Llama 7B's width (2 layers), 124m and 1.5B's width (2 layers), and the step's
                anatomy (steps.py)
  quick_suite   `pytest -m "not slow and not gpu" -n <k>`, per-test outcomes

Every GPU row records the libcusparseLt its process mapped and the one serving s24jax
(libraries.py); a report made on another version than requirements-cusparselt.txt pins says
so in its markdown's first lines and in the command's output.

Every row is appended to NAME.jsonl the moment it exists, whole or not at all (rows.py; the
pytest sections through the plugin pytest_rows.py), so a failure, the budget or a kill loses
at most the row in progress; NAME.md is regenerated from it after each section, at the end
and when stopped (markdown.py), written whole (files.py). A new report replaces only an
earlier report's files (recognised by their content), never another file of those names;
a bad argument is one line and exit code 2 before anything is written, a write that fails
during the report one line and exit code 5 (cli.py). Each section runs in its own process with a time cap (cli.py, children.py);
a row that cannot finish in its section's time is recorded as skipped, a failing row with its
error, and the rest go on. Logs, JUnit XML, cuSPARSELt's log and the layouts' probes go to
the folder NAME/.

The output is docs/gpu_report_latest.{md,jsonl} by default, never docs/gpu_report.md: that
file holds the records of the first two GPU runs (an H100 and an H200, 2026-11-27), written
by hand, which include runs this command does not make. Without a GPU it says so and exits 2,
unless --smoke: the test suite runs that, so the script stays working; its figures say
nothing about a GPU.

What has run on a GPU: this command as of commit 00573dc, once, on one H200 on 2026-11-27
(`--budget 420`, every section written in 412 s: docs/gpu_report.md, the H200 section; its
files in docs/gpu_runs/h200-2026-11-27/): the record and its markdown, the time caps and the
child processes, the environment, the `gpu` tests and the quick suite per test, the 124m and
1.5B-width steps (one round each), the bf16 GEMM rows at width 768 and PyTorch's peer, in
their form of then. Never run on a GPU (written since, 2026-11-28 and after, on a CPU): the
layouts section, the GEMM rows of one compiled program each with the algorithm search and
the bandwidth (gemms.py, gemm_plan.py, gemm_program.py, bandwidth.py), the libraries each row
records (libraries.py), the steps' rounds, program digests and Llama slice, the version
warning, and the checks and write path of issue 41 (cli.py, files.py, rows.py's whole rows).
"""
