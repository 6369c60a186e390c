"""Speed without a GPU: the kernel census of a compiled train step, and a step-time model
fitted per device to every GPU run's measured steps (`python -m s24jax.perf.step_time`, cli.py).

    python -m s24jax.perf.step_time census --config experiments/gpt2_s_ste.py:124m \\
        [--backend cusparselt] [--micro 64] [--set FIELD=VALUE ...] [--kernels 20] \\
        [--hlo FILE_OR_DUMP_DIR] [--save CENSUS.json --name NAME] [--cache DIR]
    python -m s24jax.perf.step_time report [--json FILE] [--rows 124m,350m] \\
        [--calibration CENSUS.json] [--cache DIR]
    python -m s24jax.perf.step_time predict --out docs/step_model_predictions.json \\
        [--rows 124m,350m | --config X.py:variant [--backend B] [--micro N] [--set F=V ...]] \\
        [--calibration CENSUS.json] [--cache DIR]

`census` compiles the real `train.train_step` for one compile-only H100 as the GPU report
times it (s24jax/perf/gpu_report/steps.py: one device, the config's micro-batch, one micro-batch
per step, bfloat16, `sparsity.backend`, a step the loop does not log; cuSPARSELt with every
GEMM on its 2:4 kernel unless `--set sparsity.gemm_choice=...`), by the planner's path
(s24jax/perf/plan.py; on its 16x-memory copy of the GPU, so XLA never rematerializes to fit), or
reads optimized HLO text (`--hlo`: a file, or a folder of XLA dumps,
`XLA_FLAGS=--xla_dump_to=DIR`), and prints the step's kernels per category
(s24jax/perf/step_census.py): launches, FLOPs, bytes, and the model's milliseconds.

`report` fits the model's three constants (s24jax/perf/roofline.py) per device to the measured
step times of its runs (calibration.RUNS: docs/gpu_runs/*) on the censuses of the code that
ran there (calibration.CALIBRATION, saved by `census --save`), prints each row's error
in-sample and left out (the model refitted without the row), the ranking (Kendall's tau),
then compiles and predicts the rows of predict.PREDICTIONS; `predict` writes the
predictions file (predict.py), a function of the code and the calibration alone, which
`report --json` writes too. Nothing here is measured: every time it gives for a row no run
timed is a prediction, and none of it has been checked on a GPU yet.

Modules: build.py (compiling a step), calibration.py (the measured runs, saved censuses),
validation.py (the fit per device, leave-one-out, ranking), predict.py (the predictions
file), tables.py (markdown), cli.py (the commands).
"""
