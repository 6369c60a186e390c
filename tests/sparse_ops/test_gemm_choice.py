"""Tests of s24jax/sparse_ops/gemm_choice.py (`sparsity.gemm_choice`) as the 'cusparselt'
backend consults it, on CPU with the library's stand-in (`cusparselt.standin()`).

What is checked: the values and their errors; a table's rows select the GEMMs they describe
(the keys written here by hand from the GEMMs of docs/backends.md, not from the code) and the
cost counts the compressions (W~ once per step over the micro-batches, the MVUE estimate per
call: hand-computed cases); a GEMM marked slower runs the dense XLA GEMM, bit-identical to the
forced dense choice and to the 'xla' backend, a GEMM marked faster runs the stand-in (a spy
on the compressions, by the GEMM's contraction dimension); `prepare` compresses only for a
chosen 2:4 GEMM; off a GPU with no time the choice is dense, said in one warning; a
measurement (of the stand-in: there is no GPU here) goes to the cache and comes back from it;
the 2:4 kernel must win by more than the measurements' spread (hand-computed); a cache that
cannot be written is one warning and the run goes on; evaluation looks up and measures only
forward GEMMs; a table or value that the backend would ignore is one warning at validation;
two processes (real ones, on CPU) make process 0's choice from different caches.
"""
import json
import logging
import os
import socket
import subprocess
import sys

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.perf import hlo_text
from s24jax.nn import model as model_lib
from s24jax.nn import sparse_linear
from s24jax import sparse_ops
from s24jax.training import train
from s24jax.training import validate
from s24jax.kernels import masks
from s24jax.kernels.cusparselt import compression
from s24jax.kernels.cusparselt import ops as cusparselt
from s24jax.methods import registry
from s24jax.training.run_spec import RunSpec
from s24jax.sparse_ops import cusparselt as cslt_backend
from s24jax.sparse_ops import gemm_choice
from s24jax.sparse_ops import gemm_times
from s24jax.sparse_ops.options import GemmOptions

from tiny import tiny_config

# A layer W~ (OUT, IN) at TOKENS tokens: its GEMMs' contraction dimensions tell them apart
# in the spy (forward k = IN, dX k = OUT, dW k = TOKENS).
TOKENS, OUT, IN = 96, 64, 32


@pytest.fixture(autouse=True)
def _fresh_policy(tmp_path, monkeypatch):
  """Each test as a new process on a machine with an empty measurement cache."""
  monkeypatch.setenv("S24JAX_CACHE", str(tmp_path / "cache"))
  gemm_choice.forget()
  yield
  gemm_choice.forget()


def _table(path, rows):
  path.write_text(json.dumps({"format": gemm_times.TABLE_FORMAT, "rows": rows}))
  return str(path)


def _bf16_rows(t, n, k, forward, dgrad, wgrad):
  """Table rows for a bf16 layer W~ (n, k) at t tokens, each GEMM given as (sparse_ms,
  compress_ms, dense_ms), keyed as docs/backends.md lays them out: forward TN on W~ (m = n,
  n = t, k = k), dX on W~^T (m = k, n = t, k = n; its layout left out: NN on W~ where the
  library compresses it, TN on W~^T where s24jax does, kernels/cusparselt/compression.py),
  dW TT (m = n, n = k, k = t) with a row-major D. No device or version fields: they match
  any."""
  shapes = {"forward": (n, t, k, "TN", "col"), "dgrad": (k, t, n, None, "col"),
            "wgrad": (n, k, t, "TT", "row")}
  rows = []
  for gemm, times in (("forward", forward), ("dgrad", dgrad), ("wgrad", wgrad)):
    if times is None:
      continue
    m, nn, kk, layout, order = shapes[gemm]
    rows.append({"gemm": gemm, "m": m, "n": nn, "k": kk, "d_order": order,
                 **({"layout": layout} if layout else {}),
                 "a_type": "bf16", "b_type": "bf16", "d_type": "bf16",
                 **dict(zip(gemm_times.TIME_FIELDS, times))})
  return rows


def _spy(monkeypatch):
  """The contraction dimension k of every compression (which GEMM it is for), by s24jax or
  by the library's stand-in (kernels/cusparselt/compression.py)."""
  seen = []
  real = compression.compress

  def spy(a, gemm, **kw):
    seen.append(gemm.k)
    return real(a, gemm, **kw)

  monkeypatch.setattr(compression, "compress", spy)
  return seen


def _op(backend, tokens=TOKENS, **kw):
  """y, dX, dW~ of the op on a transposable W~ with MVUE (float32 arrays)."""
  x = jax.random.normal(jax.random.key(4), (tokens, IN), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(3), (OUT, IN))
  w = jnp.where(masks.transposable_mask(w), w, 0)
  dy = jax.random.normal(jax.random.key(5), (tokens, OUT), jnp.bfloat16)
  opts = GemmOptions(mvue=True, transposable=True, backend=backend, **kw)

  def f(x, w):
    y = sparse_ops.sparse_linear(x, w, jax.random.key(7), opts)
    return jnp.sum((y * dy).astype(jnp.float32)), y

  (_, y), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, w)
  return [np.asarray(a, np.float32) for a in (y, *grads)]


# ---------------------------------------------------------------------------------------------
# Values.


@pytest.mark.parametrize("value", ["fwd", "forward+", "forward+forward", "", "Sparse",
                                   "sparse+dense"])
def test_an_unknown_value_is_one_line_naming_the_valid_ones(value):
  ste = registry.get_method("ste")
  with pytest.raises(ValueError) as e:
    sparse_linear.SparsityConfig(method=ste, backend="cusparselt", gemm_choice=value)
  msg = str(e.value)
  assert "\n" not in msg and repr(value) in msg, msg
  for valid in gemm_choice.MODES + gemm_choice.KINDS:
    assert valid in msg, (valid, msg)
  with pytest.raises(ValueError, match="unknown sparsity.gemm_choice"):
    GemmOptions(gemm_choice=value)


def test_valid_values_and_backends_that_cannot_honour_them():
  ste = registry.get_method("ste")
  for value in ("measured", "sparse", "dense", "wgrad", "forward+dgrad", "dgrad+wgrad+forward"):
    cfg = sparse_linear.SparsityConfig(method=ste, backend="cusparselt", gemm_choice=value)
    assert cfg.gemm.gemm_choice == value
  # The run's default measures; a direct call of the op runs what it asks for.
  assert sparse_linear.SparsityConfig().gemm_choice == "measured"
  assert GemmOptions().gemm_choice == "sparse"
  # 'xla' has no 2:4 kernel (every value means its dense GEMMs); 'tcgen05' runs its kernel
  # wherever it can and would ignore a GEMM forced dense: refused.
  sparse_linear.SparsityConfig(method=ste, backend="xla", gemm_choice="dense")
  sparse_linear.SparsityConfig(method=ste, backend="tcgen05", gemm_choice="sparse")
  with pytest.raises(ValueError, match="consulted by sparsity.backend='cusparselt' only"):
    sparse_linear.SparsityConfig(method=ste, backend="tcgen05", gemm_choice="forward")


# ---------------------------------------------------------------------------------------------
# The choice, from forced values and tables.


@pytest.mark.parametrize("value,sparse", [("sparse", {"forward", "dgrad", "wgrad"}),
                                          ("dense", set()), ("forward+dgrad", {"forward", "dgrad"}),
                                          ("wgrad", {"wgrad"})])
def test_forced_values_pick_the_kernels_and_keep_the_math(monkeypatch, value, sparse):
  """The GEMMs forced sparse run on the stand-in (and only they are compressed); each GEMM
  equals the 'xla' backend's bit for bit (y and dX: the stand-in's sum is exact here too),
  but dW on the stand-in, which cuSPARSELt writes in bf16 (R2) where XLA keeps float32."""
  want = _op("xla")
  seen = _spy(monkeypatch)
  with cusparselt.standin():
    got = _op("cusparselt", gemm_choice=value)
  by_k = {IN: "forward", OUT: "dgrad", TOKENS: "wgrad"}
  assert {by_k[k] for k in seen} == sparse and len(seen) == len(sparse), seen
  for name, a, b in zip(("y", "dX", "dW"), got, want):
    if name == "dW" and "wgrad" in sparse:
      np.testing.assert_allclose(a, b, rtol=2 ** -8, atol=1e-6)
      assert np.any(a != b), "dW came from the stand-in's bf16 output"
    else:
      np.testing.assert_array_equal(a, b, err_msg=name)


def test_a_table_row_selects_its_gemm_and_counts_the_compressions(tmp_path):
  """Hand-computed: the forward (kernel 1.0, compression 2.0, dense 1.5 ms) pays for itself
  only when W~'s compression is shared by more than 4 micro-batches (1 + 2/8 = 1.25 < 1.5;
  1 + 2/4 = 1.5 is not below 1.5); dX (0.5, 4.0, 1.0) beyond 8; dW (0.1, 1.0, 1.0) never:
  its MVUE estimate is compressed in every call. On the CPU device on every host: a GPU
  would measure the rows the table lacks (below) at first use."""
  with jax.default_device(jax.devices("cpu")[0]):
    _table_row_selects_its_gemm(tmp_path)


def _table_row_selects_its_gemm(tmp_path):
  table = _table(tmp_path / "t.json", _bf16_rows(TOKENS, OUT, IN, forward=(1.0, 2.0, 1.5),
                                                 dgrad=(0.5, 4.0, 1.0), wgrad=(0.1, 1.0, 1.0)))
  opts = GemmOptions(mvue=True, transposable=True, backend="cusparselt", gemm_choice="measured",
                     gemm_table=table)
  choices = sparse_ops.get_backend("cusparselt").choices

  def picked(micro_batches):
    cs = choices(opts, (OUT, IN), TOKENS, jnp.bfloat16, micro_batches)
    assert [c.gemm for c in cs] == list(gemm_choice.KINDS)
    assert all(c.times is not None and c.times.source.startswith("table") for c in cs), cs
    return {c.gemm for c in cs if c.sparse}, cs

  assert picked(1)[0] == set()
  assert picked(4)[0] == set()
  got, cs = picked(8)
  assert got == {"forward"}
  assert cs[0].saving_ms() == pytest.approx(1.5 - 1.25) and cs[1].saving_ms() == 0.0
  assert picked(16)[0] == {"forward", "dgrad"}
  assert picked(1000)[0] == {"forward", "dgrad"}
  # The same rows do not describe another shape, nor the FP8 GEMMs (e4m3 / e5m2, all TN).
  other = choices(opts, (OUT, IN), 2 * TOKENS, jnp.bfloat16, 1000)
  fp8 = choices(GemmOptions(mvue=True, transposable=True, backend="cusparselt", fp8=True,
                            fp8_backward_operands="e5m2", gemm_table=table,
                            gemm_choice="measured"), (OUT, IN), TOKENS, jnp.bfloat16, 1000)
  for c in other + fp8:
    assert not c.sparse and c.times is None, c


def test_the_most_specific_row_wins(tmp_path):
  """A row naming this device beats one that names none, whatever their order."""
  generic = _bf16_rows(TOKENS, OUT, IN, forward=(1.0, 0.0, 2.0), dgrad=None, wgrad=None)[0]
  kind = jax.devices()[0].device_kind
  specific = {**generic, "device_kind": kind, "sparse_ms": 3.0}
  other_device = {**generic, "device_kind": kind + " (another)", "compute_capability": "9.9",
                  "sparse_ms": 0.5}
  opts = dict(mvue=True, transposable=True, backend="cusparselt", gemm_choice="measured")
  for i, rows in enumerate(([generic, specific, other_device], [specific, other_device, generic])):
    table = _table(tmp_path / f"t{i}.json", rows)
    gemm_choice.forget()
    c = cslt_backend.choices(GemmOptions(gemm_table=table, **opts), (OUT, IN), TOKENS,
                             jnp.bfloat16, 1)[0]
    assert c.times.sparse_ms == 3.0 and not c.sparse, c


def test_the_2_4_kernel_must_win_by_more_than_the_spreads(tmp_path):
  """Hand-computed, the forward (kernel 1.0, compression 2.0, dense 1.5 ms; spreads 0.05,
  0.4, 0.05): at 1/8 of a compression per call 1.25 + margin 0.15 < 1.5, the 2:4 kernel; at
  1/5, 1.4 is faster but 1.4 + 0.18 is not below 1.5: dense, where the same times without
  spreads choose the 2:4 kernel; at 1/4, 1.5 is not faster at all."""
  (row,) = _bf16_rows(TOKENS, OUT, IN, forward=(1.0, 2.0, 1.5), dgrad=None, wgrad=None)
  spreads = {"sparse_spread_ms": 0.05, "compress_spread_ms": 0.4, "dense_spread_ms": 0.05}
  with_spreads = _table(tmp_path / "spreads.json", [{**row, **spreads}])
  without = _table(tmp_path / "without.json", [row])
  opts = GemmOptions(mvue=True, transposable=True, backend="cusparselt", gemm_choice="measured")
  key = cslt_backend.gemm_key("forward", TOKENS, OUT, IN, jnp.bfloat16, opts)

  def choice(table, share):
    return gemm_choice.choose("measured", table, key, compress_share=share)

  c = choice(with_spreads, 1 / 8)
  assert c.sparse and c.reason == "measured faster", c
  assert "margin 0.15 ms" in c.describe(), c.describe()
  c = choice(with_spreads, 1 / 5)
  assert not c.sparse and c.reason == "measured faster by less than the margin", c
  assert "margin 0.18 ms" in c.describe(), c.describe()
  assert choice(without, 1 / 5).sparse
  c = choice(with_spreads, 1 / 4)
  assert not c.sparse and c.reason == "measured slower", c


def test_a_cache_that_cannot_be_written_is_one_warning_and_the_run_goes_on(
    tmp_path, monkeypatch, caplog):
  """The cache's folder under a file (mkdir fails): each GEMM measured is chosen from its
  measurement; one warning for the process naming the cache; nothing raised."""
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  monkeypatch.setenv("S24JAX_CACHE", str(blocker))
  opts = GemmOptions(mvue=True, transposable=True, backend="cusparselt", gemm_choice="measured")
  fast = gemm_times.Times(0.1, 0.0, 1.0, "fake measurement")
  with caplog.at_level(logging.WARNING):
    choices = [gemm_choice.choose("measured", "", cslt_backend.gemm_key(
        kind, TOKENS, OUT, IN, jnp.bfloat16, opts), compress_share=1.0, measure=lambda: fast)
               for kind in gemm_choice.KINDS]
  assert all(c.sparse and c.times == fast for c in choices), choices
  said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(said) == 1 and "cannot be written" in said[0] and str(blocker) in said[0], said
  assert "\n" not in said[0]


def test_nothing_measured_is_dense_said_once(monkeypatch, caplog):
  """'measured' without a time for the GEMM, where nothing can be measured (the CPU; the
  stand-in on any machine): the dense GEMMs, exactly the 'xla' backend, no compression, and
  one warning for the process however many GEMMs."""
  want = _op("xla")
  seen = _spy(monkeypatch)
  with caplog.at_level(logging.INFO), cusparselt.standin():
    got = _op("cusparselt", gemm_choice="measured")
    _op("cusparselt", tokens=2 * TOKENS, gemm_choice="measured")   # 3 more GEMMs
  assert seen == []
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  warnings = [r for r in caplog.records if r.levelno == logging.WARNING
              and "gemm_choice='measured'" in r.getMessage()]
  assert len(warnings) == 1, [r.getMessage() for r in warnings]
  infos = [r.getMessage() for r in caplog.records if "sparse GEMM choice" in r.getMessage()]
  assert len(infos) == 6 and all("dense XLA GEMM" in m for m in infos), infos


def test_a_measurement_goes_to_the_cache_and_comes_back(tmp_path):
  """The on-device measurement, run here on the stand-in (jnp on the CPU: it times the
  plumbing, not cuSPARSELt) from inside a traced function as a step would: its times are
  cached under the GEMM's key and found there by the next process, which measures nothing."""
  opts = GemmOptions(mvue=True, transposable=True, backend="cusparselt", gemm_choice="measured")
  key = cslt_backend.gemm_key("wgrad", TOKENS, OUT, IN, jnp.bfloat16, opts)
  measured = []

  def measure():
    measured.append(cslt_backend.measure_times("wgrad", TOKENS, OUT, IN, jnp.bfloat16, opts))
    return measured[-1]

  def traced(x):   # choose() while a step is traced, as the backend does
    gemm_choice.choose("measured", "", key, compress_share=1.0, measure=measure)
    return x

  with cusparselt.standin():
    jax.jit(traced)(jnp.zeros(3))
  (times,) = measured
  assert min(times.sparse_ms, times.compress_ms, times.dense_ms) > 0, times
  assert min(times.sparse_spread_ms, times.compress_spread_ms, times.dense_spread_ms) >= 0
  # The stand-in's algorithm search (kernels/cusparselt/algorithms.py: alg 0, no split-K),
  # agreed with the default, is kept with the times.
  assert times.algorithm == (0, 1, 0, 1), times
  path = gemm_times.cache_file()
  assert path.parent.parent == tmp_path / "cache"
  (row,) = gemm_times.parse_rows(json.loads(path.read_text()), path)
  assert {f: row[f] for f in gemm_times.KEY_FIELDS} == key.row()
  assert key.device_kind == jax.devices()[0].device_kind and key.gemm == "wgrad"
  assert (key.m, key.n, key.k, key.layout, key.d_order) == (OUT, IN, TOKENS, "TT", "row")
  assert [row[f] for f in gemm_times.TIME_FIELDS] == [times.sparse_ms, times.compress_ms,
                                                      times.dense_ms]

  gemm_choice.forget()   # a new process: found in the cache, not measured again
  def fail():
    raise AssertionError("measured again")
  again = gemm_choice.choose("measured", "", key, compress_share=1.0, measure=fail)
  assert again.times.source.startswith("cache")
  assert (again.times.sparse_ms, again.times.dense_ms) == (times.sparse_ms, times.dense_ms)
  assert again.times.algorithm == times.algorithm
  assert again.sparse == (times.sparse_ms + times.compress_ms + times.sparse_spread_ms
                          + times.compress_spread_ms + times.dense_spread_ms < times.dense_ms)


# ---------------------------------------------------------------------------------------------
# Training: the table against the forced choice.


def _tiny(backend, **sparsity):
  cfg = tiny_config("t_sr_ste", steps=2, overrides={
      "batch_size": 8, "grad_accum_steps": 2, "sparsity.backend": backend,
      "sparsity.mvue": True, "sparsity.t_sr_ste.decay": 6e-5, "model.dtype": "bfloat16",
      **{f"sparsity.{k}": v for k, v in sparsity.items()}})
  spec = RunSpec.build(cfg)
  return cfg, spec, model_lib.GPT2(spec.model_cfg)


def _losses(backend, steps=2, **sparsity):
  cfg, spec, model = _tiny(backend, **sparsity)
  state = train.fresh_state(model, spec.tx, 0)
  tx = spec.tx(state.params, state.sparsity)
  rng, out = np.random.default_rng(0), []
  for _ in range(steps):
    tok = jnp.asarray(rng.integers(0, 256, (8, 16)), jnp.int32)
    state, m = train.train_step(state, {"inputs": tok, "targets": tok}, model=model, tx=tx,
                                accum_steps=int(cfg.grad_accum_steps))
    out.append(float(m["loss"] / m["count"]))
  return out


def _tiny_rows(**gemms):
  """Rows for both FFN layers of the tiny model (d 32, hidden 128; 8 x 16 tokens in 2
  micro-batches: 64 per GEMM)."""
  return (_bf16_rows(64, 128, 32, **gemms) + _bf16_rows(64, 32, 128, **gemms))


@pytest.mark.slow
def test_training_gemms_marked_slower_equal_the_forced_dense_choice(tmp_path, monkeypatch):
  """A few train steps of the tiny Hu et al. recipe (transposable masks, MVUE, 2
  micro-batches): with every GEMM marked slower in the table, the losses are bit-identical
  to gemm_choice='dense' and to the 'xla' backend, and nothing is compressed; with dX marked
  faster (its W~^T compression shared by the 2 micro-batches: 0.5 + 1.0 / 2 < 1.2), they are
  bit-identical to gemm_choice='dgrad', and only dX's W~^T is compressed."""
  slower = _table(tmp_path / "slower.json", _tiny_rows(
      forward=(1.0, 0.1, 0.5), dgrad=(1.0, 0.1, 0.5), wgrad=(1.0, 0.1, 0.5)))
  dgrad = _table(tmp_path / "dgrad.json", _tiny_rows(
      forward=(1.0, 0.1, 0.5), dgrad=(0.5, 1.0, 1.2), wgrad=(1.0, 0.1, 0.5)))
  want = _losses("xla")
  seen = _spy(monkeypatch)
  with cusparselt.standin():
    dense = _losses("cusparselt", gemm_choice="dense")
    by_table = _losses("cusparselt", gemm_choice="measured", gemm_table=slower)
    assert seen == []
    forced = _losses("cusparselt", gemm_choice="dgrad")
    n_forced = len(seen)
    dx_table = _losses("cusparselt", gemm_choice="measured", gemm_table=dgrad)
  assert dense == by_table == want, (dense, by_table, want)
  assert dx_table == forced, (dx_table, forced)
  # dX's contraction is over `out`: 128 (fc) and 32 (proj); once per layer per traced step.
  assert n_forced and sorted(set(seen)) == [32, 128] and len(seen) == 2 * n_forced, seen


def _compiled_step(backend, method, **sparsity) -> str:
  cfg = tiny_config(method, overrides={
      "batch_size": 8, "grad_accum_steps": 2, "sparsity.backend": backend,
      "model.dtype": "bfloat16", **{f"sparsity.{k}": v for k, v in sparsity.items()}})
  spec = RunSpec.build(cfg)
  model = model_lib.GPT2(spec.model_cfg)
  state = train.fresh_state(model, spec.tx, 0)
  tok = jnp.zeros((8, 16), jnp.int32)
  compiled = train.train_step.lower(state, {"inputs": tok, "targets": tok}, model=model,
                                    tx=spec.tx(state.params, state.sparsity),
                                    accum_steps=2).compile()
  return hlo_text.module_text(compiled)


@pytest.mark.parametrize("method,sparsity", [
    ("t_sr_ste", {"mvue": True}),                                          # Hu et al.
    ("s_ste", {"mvue": True, "fp8": True, "fp8_backward_operands": "e5m2"})])  # S-STE, FP8
def test_every_gemm_dense_compiles_the_xla_step(method, sparsity, tmp_path):
  """Where the choice puts every GEMM dense (forced, or every one measured slower in a
  table), the step XLA compiles is the 'xla' backend's, kernel for kernel (the optimized HLO
  without names and source positions): it cannot be slower. (FP8 on 'cusparselt' quantizes
  dX's and dW's operands in e5m2, what its 'auto' picks: the same product on 'xla' is its
  step with e5m2 backward operands.)"""
  want = hlo_text.canonical(_compiled_step("xla", method, **sparsity))
  with cusparselt.standin():
    dense = hlo_text.canonical(_compiled_step("cusparselt", method, gemm_choice="dense",
                                              **sparsity))
    if not sparsity.get("fp8"):
      slower = _table(tmp_path / "slower.json", _tiny_rows(
          forward=(1.0, 0.1, 0.5), dgrad=(1.0, 0.1, 0.5), wgrad=(1.0, 0.1, 0.5)))
      measured = hlo_text.canonical(_compiled_step("cusparselt", method, gemm_choice="measured",
                                                   gemm_table=slower, **sparsity))
      assert measured == want
  assert dense == want         # (that the comparison sees a changed kernel: test_hlo_text.py)


def test_prepare_compresses_only_for_a_chosen_gemm(tmp_path):
  """`prepare` holds W~ compressed for the forward only where the forward runs on
  cuSPARSELt, and W~^T for dX only where dX does: per layer, from the table."""
  rows = (_bf16_rows(64, 128, 32, forward=(0.1, 0.1, 1.0), dgrad=(1.0, 0.1, 0.5), wgrad=None)
          + _bf16_rows(64, 32, 128, forward=(1.0, 0.1, 0.5), dgrad=(0.1, 0.1, 1.0), wgrad=None))
  table = _table(tmp_path / "t.json", rows)
  _, spec, model = _tiny("cusparselt", gemm_choice="measured", gemm_table=table)
  state = train.fresh_state(model, spec.tx, 0)
  with cusparselt.standin():
    prepared = sparse_linear.prepare(spec.model_cfg, state.params, state.sparsity, tokens=64,
                                     dtype=jnp.bfloat16, micro_batches=2)
  flat = flax.traverse_util.flatten_dict(prepared)
  got = {"/".join(k[:-1]): [n for p, n in ((q[:-1], q[-1]) for q in flat) if p == k[:-1]]
         for k in flat}
  assert got == {"h_0/mlp/fc": ["fwd"], "h_0/mlp/proj": ["dx"]}, got


def test_a_failed_measurement_runs_dense_and_says_why(caplog):
  """A 2:4 kernel that cannot even be timed (a library error on the device) never stops the
  run: its GEMM runs dense, with the error in one warning; nothing is cached for it."""
  opts = GemmOptions(mvue=True, transposable=True, backend="cusparselt", gemm_choice="measured")
  key = cslt_backend.gemm_key("wgrad", TOKENS, OUT, IN, jnp.bfloat16, opts)

  def measure():
    raise RuntimeError("INTERNAL: cuSPARSELt: no algorithm\nsecond line")

  with caplog.at_level(logging.WARNING):
    choice = gemm_choice.choose("measured", "", key, compress_share=1.0, measure=measure)
  assert not choice.sparse and "RuntimeError: INTERNAL: cuSPARSELt: no algorithm" in choice.reason
  [warning] = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
  assert "dense XLA GEMM runs" in warning and "second line" not in warning
  assert gemm_times.find_times("", key) is None


# ---------------------------------------------------------------------------------------------
# Evaluation, validation, several processes.


def test_evaluation_looks_up_and_measures_only_the_forward(monkeypatch):
  """Tracing the eval step of the tiny Hu et al. model (transposable masks, MVUE): with a
  measurement possible (faked: every GEMM measured slower), only forward GEMMs are looked
  up or measured; tracing the train step of the same model measures all three kinds."""
  measured, looked_up = [], []
  real_choose, real_find = gemm_choice.choose, gemm_times.find_times

  def with_fake_measure(value, table, key, **kw):
    def measure():
      measured.append(key.gemm)
      return gemm_times.Times(1.0, 0.1, 0.5, "fake measurement")
    return real_choose(value, table, key, **{**kw, "measure": measure})

  monkeypatch.setattr(gemm_choice, "choose", with_fake_measure)
  monkeypatch.setattr(gemm_times, "find_times",
                      lambda table, key: looked_up.append(key.gemm) or real_find(table, key))
  cfg, spec, model = _tiny("cusparselt", gemm_choice="measured")
  state = train.fresh_state(model, spec.tx, 0)
  tok = jnp.zeros((8, 16), jnp.int32)
  batch = {"inputs": tok, "targets": tok}
  with cusparselt.standin():
    train.eval_step.lower(state.params, state.sparsity, batch, model=model)
    assert measured and set(measured) == set(looked_up) == {"forward"}, (measured, looked_up)
    gemm_choice.forget()
    measured.clear()
    train.train_step.lower(state, batch, model=model, tx=spec.tx(state.params, state.sparsity),
                           accum_steps=int(cfg.grad_accum_steps))
  assert set(measured) == set(gemm_choice.KINDS), measured


@pytest.mark.parametrize("backend,sparsity,said", [
    ("xla", {"gemm_table": True}, ["sparsity.gemm_table="]),
    ("xla", {"gemm_choice": "dense"}, ["sparsity.gemm_choice='dense'"]),
    ("pallas", {"gemm_choice": "sparse", "gemm_table": True},
     ["sparsity.gemm_table=", "sparsity.gemm_choice='sparse'"]),
    ("xla", {}, None),
    ("cusparselt", {"gemm_choice": "dense", "gemm_table": True}, None)])
def test_a_table_or_choice_the_backend_ignores_is_one_warning(tmp_path, caplog, backend,
                                                             sparsity, said):
  """At validation: one line naming the settings and the backend that would use them; none
  where nothing is set or the backend consults the choice."""
  if sparsity.get("gemm_table"):
    sparsity["gemm_table"] = _table(tmp_path / "t.json", _tiny_rows(
        forward=(1.0, 0.1, 0.5), dgrad=None, wgrad=None))
  cfg = tiny_config("t_sr_ste", overrides={
      "sparsity.backend": backend, "model.dtype": "bfloat16",
      **{f"sparsity.{k}": v for k, v in sparsity.items()}})
  with caplog.at_level(logging.WARNING):
    validate.check_config(cfg)
  warnings = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and "not used" in r.getMessage()]
  if said is None:
    assert warnings == []
    return
  (message,) = warnings
  assert "\n" not in message and f"sparsity.backend={backend!r}" in message, message
  assert "used by sparsity.backend='cusparselt'" in message, message
  for setting in said:
    assert setting in message, (setting, message)


_CHOOSE_ON_PROCESS = """
import json, sys
import jax
pid, port, keys = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=120)
from s24jax.sparse_ops import gemm_choice
from s24jax.sparse_ops import gemm_times

def traced(x):   # while a step is traced, as a backend chooses
  for fields in keys:
    c = gemm_choice.choose("measured", "", gemm_times.Key(**fields), compress_share=1.0)
    t = c.times
    print("CHOICE", json.dumps([c.sparse, c.reason, t and [t.sparse_ms, t.compress_ms,
          t.dense_ms, t.dense_spread_ms, t.algorithm, t.source]]), flush=True)
  return x

jax.make_jaxpr(traced)(0.0)
jax.distributed.shutdown()
"""


@pytest.mark.slow
def test_two_processes_make_process_0s_choice(tmp_path, monkeypatch):
  """Two CPU processes of one run (jax.distributed on localhost), each with its own cache:
  for GEMM A process 0's cache says faster (with a spread and an algorithm), process 1's
  slower; for GEMM B process 0 has nothing, process 1 says faster. Both processes choose
  from process 0's: A on the 2:4 kernel with its times, B dense."""
  opts = GemmOptions(mvue=True, transposable=True, backend="cusparselt", gemm_choice="measured")
  key_a, key_b = (cslt_backend.gemm_key("forward", t, OUT, IN, jnp.bfloat16, opts)
                  for t in (TOKENS, 2 * TOKENS))
  fast = gemm_times.Times(1.0, 0.0, 2.0, "process 0's", dense_spread_ms=0.25,
                          algorithm=(7, 1, 0, 1))
  slow = gemm_times.Times(3.0, 0.0, 2.0, "process 1's")
  for pid, rows in ((0, [(key_a, fast)]), (1, [(key_a, slow), (key_b, fast)])):
    monkeypatch.setenv("S24JAX_CACHE", str(tmp_path / f"cache{pid}"))
    for key, times in rows:
      gemm_times.store(key, times)
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  keys = json.dumps([key_a.row(), key_b.row()])
  procs = [subprocess.Popen(
      [sys.executable, "-c", _CHOOSE_ON_PROCESS, str(pid), str(port), keys],
      env={**os.environ, "JAX_PLATFORMS": "cpu", "S24JAX_CACHE": str(tmp_path / f"cache{pid}")},
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
  outs = [p.communicate(timeout=240)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  got = [[json.loads(line[len("CHOICE "):]) for line in out.splitlines()
          if line.startswith("CHOICE ")] for out in outs]
  a_times = [1.0, 0.0, 2.0, 0.25, [7, 1, 0, 1]]
  assert got[0] == [[True, "measured faster", a_times + [got[0][0][2][-1]]],
                    [False, "nothing measured for it here", None]], got[0]
  assert got[0][0][2][-1].startswith("cache") and "process 0's" in got[0][0][2][-1]
  assert got[1] == [[True, "measured faster", a_times + ["process 0 (broadcast)"]],
                    [False, "nothing measured for it here", None]], got[1]
