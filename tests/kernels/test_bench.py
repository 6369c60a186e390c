"""Tests of s24jax.kernels.bench (the benchmark command line): it refuses CPU timing by default,
the interpret-mode smoke run prints every gated row without a failure, and bad arguments exit
2. The references are the command's documented exit codes and row names."""
import jax
import pytest

from s24jax.kernels import bench


@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="on a GPU this would run the whole benchmark")
def test_no_gpu_prints_a_message_and_exits_zero(capsys):
  assert bench.main([]) == 0
  assert "no GPU backend" in capsys.readouterr().out


def test_interpret_small_smoke_run(capsys):
  assert bench.main(["--interpret", "--small", "--only", "gated",
                     "--reps", "1"]) == 0
  out = capsys.readouterr().out
  assert "geglu_fwd" in out and "swiglu_bwd" in out and "FAILED" not in out


def test_bad_arguments():
  assert bench.main(["--interpret"]) == 2          # needs --small
  assert bench.main(["--interpret", "--small", "--only", "nope"]) == 2
