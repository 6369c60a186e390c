"""Speed without a GPU: the kernel census of a compiled train step, and a step-time model
calibrated on the H100 run of 2026-11-27 (`python -m s24jax.step_model`, cli.py).

    python -m s24jax.step_model census --config experiments/gpt2_s_ste.py:124m \\
        [--backend cusparselt] [--micro 64] [--set FIELD=VALUE ...] [--kernels 20] \\
        [--hlo FILE_OR_DUMP_DIR] [--save CENSUS.json --name NAME] [--cache DIR]
    python -m s24jax.step_model report [--json docs/step_model_predictions.json] \\
        [--rows 124m,350m] [--cache DIR]

`census` compiles the real `train.train_step` for one compile-only H100 as the GPU report
times it (s24jax/gpu_report/steps.py: one device, the config's micro-batch, one micro-batch
per step, bfloat16, `sparsity.backend`; cuSPARSELt with every GEMM on its 2:4 kernel, as on
2026-11-27), by the planner's path (s24jax/plan.py; on its 16x-memory copy of the GPU, so XLA
never rematerializes to fit), or reads optimized HLO text (`--hlo`: a file, or a folder of
XLA dumps, `XLA_FLAGS=--xla_dump_to=DIR`), and prints the step's kernels per category
(s24jax/step_census.py): launches, FLOPs, bytes, and the model's milliseconds.

`report` fits the model's three constants (s24jax/roofline.py) to the measured step times of
the run (calibration.RUN: dense, Hu et al. and S-STE at 124M on 'xla' and 'cusparselt') on
the censuses of the code that ran there (calibration.CALIBRATION, saved by `census --save`
at that commit), prints each row's error, then compiles and predicts the rows of
cli.PREDICTIONS and writes them (--json) for the next GPU run to check. Nothing here is
measured: every time it gives for a row the run did not time is a prediction.

Modules: build.py (compiling a step; the named scopes the census relies on), calibration.py
(the measured run, saved censuses), tables.py (markdown), cli.py (the commands).
"""
