"""Benchmark every kernel against its XLA reference: `python -m s24jax.kernels.bench`.

Per kernel and shape (GPT-2 124M..1.5B FFN shapes: d in {768, 1024, 1280,
1600}, hidden 4d; token counts 16..16384; bf16) it prints the median time of
the Pallas kernel and of the XLA path it would replace (warm-up, then many
reps, each fenced by `jax.block_until_ready`), their ratio (xla / kernel: > 1
means the kernel is faster), and the achieved bandwidth (GB/s) or FLOP rate
(TFLOP/s) with their share of the running GPU's datasheet peaks (`PEAKS` in
kernels/bench_harness.py: A100, H100, B200; sources in kernels/BENCHMARKS.md).

It refuses to run on CPU (interpret-mode timings are meaningless) unless
asked for a smoke run: `python -m s24jax.kernels.bench --interpret --small`.
Options: --only name[,name] (sparsify24, transposable, mvue24, matmul,
matmul_bwd, venom, gated, tcgen05 (Blackwell only), cusparselt (A100 / H100)),
--backend cusparselt (the same as --only cusparselt), --reps N, --json PATH (rows as JSON),
--full (all d x all token counts; the default trims the sweep to fit one
10-minute GPU call), --markdown (print a table for kernels/BENCHMARKS.md).

The rows of each family are defined in its kernel file (`BENCHMARKS`), which
runs them alone as `python -m s24jax.kernels.<family>`; the shapes, the timing
and the table are in kernels/bench_harness.py.
"""
from __future__ import annotations

import sys

from . import compressed_matmul
from . import gated_activation
from . import mvue24
from . import sparsify24
from . import tcgen05
from . import bench_harness
from . import transposable_mask
from . import venom
from .cusparselt import benchmark as cusparselt_benchmark

# Every family's rows, in the order they run and print.
BENCHMARKS: dict[str, bench_harness.Benchmark] = {
    **sparsify24.BENCHMARKS, **transposable_mask.BENCHMARKS, **mvue24.BENCHMARKS,
    **compressed_matmul.BENCHMARKS, **venom.BENCHMARKS, **gated_activation.BENCHMARKS,
    **tcgen05.BENCHMARKS, **cusparselt_benchmark.BENCHMARKS,
}
KERNELS = tuple(BENCHMARKS)


def main(argv=None) -> int:
  return bench_harness.main(BENCHMARKS, argv, prog="python -m s24jax.kernels.bench",
                     description=__doc__.split("\n")[0])


if __name__ == "__main__":
  sys.exit(main())
