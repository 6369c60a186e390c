"""Training FLOP accounting: what each step needs given the masks and the attention pattern.

Counted per step (a multiply-add is 2 FLOPs; tokens = batch_size * seq_len):
- linear layers (every `SparseLinear` kernel W (out, in), nnz of its entries active):
  forward x W~^T 2 nnz, input gradient dY W~ 2 nnz, weight gradient dY^T x at the active
  entries 2 nnz, per token: 6 nnz tokens (dense: nnz = out * in, the usual 6 N tokens);
- attention scores Q K^T and values A V, per layer and sequence: 2 C FLOPs per allowed
  (query, key) pair for each of the two matmuls, forward 4 C pairs, with the backward
  (twice the forward) 12 C pairs; pairs = T (T + 1) / 2 for dense causal attention (only the
  pairs a causal kernel needs, not the T^2 of the usual 6N + 12 L T C estimate), fewer for
  the strided patterns (s24jax/methods/mst/attention_masks.py);
- the tied lm head: 6 V C tokens, or 6 nnz tokens when the tied embedding 'wte' is a sparse
  layer (MST's reference set: the head is then a sparse (V, C) weight; the embedding lookup
  is a gather and costs nothing either way);
- a step that needs the dense weight gradient of its sparse layers (an MST topology update,
  s24jax/methods/mst/: growth reads dL/dW~ at the pruned entries too) computes it instead
  of the active part: per token 4 nnz + 2 out*in instead of 6 nnz, for the linear layers
  and a sparse head alike. There is no extra pass: the update step's forward/backward is
  the growth gradient (and its optimizer step is skipped, or taken with the same gradient).
Not counted: layer norms, softmax, activations, residual adds, embedding gathers and the
optimizer (all O(params) or O(tokens * C), not O(tokens * params)).

The dense reference of a run is the same config with every kernel dense, dense causal
attention at every step and no topology updates. MFU (s24jax/metrics.py) divides by the
dense count of this same model (`dense_flops_per_token`): there is one FLOP model.

`python -m s24jax.cli.flops CONFIG` prints the planned totals of a config without training
(s24jax/cli/flops.py).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from s24jax.methods.mst import attention_masks
from s24jax.training import model_schedule
from s24jax.methods import base as methods_base
from s24jax.training.run_spec import RunSpec


@dataclasses.dataclass(frozen=True)
class StepFlops:
  """FLOPs by part; `total` = linear + attention + head. The dense weight gradients of MST's
  update steps are included in linear and head; `update` says how much of the total they
  add over the sparse (active-entry) weight gradient."""
  linear: float = 0.0
  attention: float = 0.0
  head: float = 0.0
  update: float = 0.0     # of the above: dense instead of sparse weight gradients

  @property
  def total(self) -> float:
    return self.linear + self.attention + self.head

  def __add__(self, other: "StepFlops") -> "StepFlops":
    return StepFlops(*(getattr(self, f.name) + getattr(other, f.name)
                       for f in dataclasses.fields(self)))


def attention_flops(model_cfg, attention: str, *, batch_size: int, seq_len: int) -> float:
  """12 C pairs per layer and sequence: score and value matmuls, forward and backward."""
  pairs = attention_masks.allowed_pairs(attention, seq_len, model_cfg.attention_stride)
  return 12.0 * model_cfg.num_layers * model_cfg.d_model * pairs * batch_size


def step_flops(model_cfg, shapes: Mapping[str, tuple[int, int]], nnz: Mapping[str, int], *,
               batch_size: int, seq_len: int, attention: str,
               dense_weight_gradient: bool = False) -> StepFlops:
  """FLOPs of one training step. `nnz` maps kernel names, and the LM head's name
  (`model_cfg.head_name`: GPT-2's tied 'wte', Llama's 'lm_head') for a sparse head, to their
  active count (the others are dense); `dense_weight_gradient`: the step computes the sparse
  layers' weight gradient densely (an MST topology update). A head among `shapes` (Llama's
  untied kernel) counts as the head, not as a linear layer."""
  head_name = model_cfg.head_name
  shapes = {k: v for k, v in shapes.items() if k != head_name}
  unknown = set(nnz) - set(shapes) - {head_name}
  if unknown:
    raise ValueError(f"nnz given for unknown linear layers {sorted(unknown)}; the model's are "
                     f"{sorted(shapes)} (and {head_name!r}, the LM head)")
  tokens = batch_size * seq_len
  active = sum(int(nnz.get(k, o * i)) for k, (o, i) in shapes.items())
  size = sum(o * i for o, i in shapes.values())
  att = attention_flops(model_cfg, attention, batch_size=batch_size, seq_len=seq_len)
  vc = model_cfg.vocab_size * model_cfg.d_model
  head_active = int(nnz.get(head_name, vc))
  extra_linear = extra_head = 0.0
  if dense_weight_gradient:
    extra_linear = 2.0 * (size - active) * tokens
    extra_head = 2.0 * (vc - head_active) * tokens
  return StepFlops(linear=6.0 * active * tokens + extra_linear, attention=att,
                   head=6.0 * head_active * tokens + extra_head,
                   update=extra_linear + extra_head)


class Accountant:
  """Accumulates the training FLOPs of a run and of its dense reference, step by step."""

  def __init__(self, model_cfg, shapes: Mapping[str, tuple[int, int]], *, batch_size: int,
               seq_len: int):
    self.model_cfg = model_cfg
    self.shapes = dict(shapes)
    self.batch_size, self.seq_len = batch_size, seq_len
    self.total = StepFlops()
    self.dense_total = StepFlops()
    self.last = StepFlops()
    self.steps = 0
    self.nnz: dict[str, int] = {}
    self._cache: dict[Any, StepFlops] = {}

  def _step(self, nnz: Mapping[str, int], attention: str, dense_dw: bool) -> StepFlops:
    key = (tuple(sorted(nnz.items())), attention, dense_dw)
    if key not in self._cache:
      self._cache[key] = step_flops(self.model_cfg, self.shapes, nnz, batch_size=self.batch_size,
                                    seq_len=self.seq_len, attention=attention,
                                    dense_weight_gradient=dense_dw)
    return self._cache[key]

  def add_step(self, step_cfg, step: int, masked: Mapping[str, tuple[int, int]]) -> None:
    """Counts `step`, trained by the model `step_cfg` (its attention pattern, and its
    method's active weights if they change: `DynamicDensity`; else the layers count dense,
    as the xla backend multiplies 2:4 weights densely); `masked` are the sparse layers'
    shapes."""
    method = step_cfg.sparsity.method
    nnz, dense_dw = {}, False
    if isinstance(method, methods_base.DynamicDensity):
      nnz, dense_dw = method.active_weights(step, masked)
    self.add(nnz, step_cfg.attention, dense_weight_gradient=dense_dw)

  def add(self, nnz: Mapping[str, int] | None, attention: str, *,
          dense_weight_gradient: bool = False) -> None:
    """Counts one step with these active counts (None: those of the previous step) and
    attention pattern."""
    if nnz is not None:
      self.nnz = dict(nnz)
    self.last = self._step(self.nnz, attention, dense_weight_gradient)
    self.total = self.total + self.last
    self.dense_total = self.dense_total + self._step({}, "causal", False)
    self.steps += 1

  def scalars(self) -> dict[str, float]:
    """For the metrics log: cumulative totals, the dense reference and their ratio."""
    dense = self.dense_total.total
    return {"flops/step": self.last.total, "flops/total": self.total.total,
            "flops/dense_total": dense,
            "flops/fraction_of_dense": self.total.total / dense if dense else float("nan")}


def sparse_gemm_share(spec) -> float:
  """The share of a dense training step's FLOPs (the model's, causal attention) in the GEMMs
  of the run's sparse layers: what 2:4 GEMMs can speed up, at most, for this model and
  `sparsity.sparse_layers` (the rest: the other linear layers, attention, a dense head)."""
  cfg = spec.model_cfg
  batch, seq = spec.config.batch_size, cfg.seq_len
  step = step_flops(cfg, spec.kernel_shapes, {}, batch_size=batch, seq_len=seq,
                    attention="causal")
  sparse = sum(6.0 * math.prod(shape) * batch * seq for shape in spec.sparse_shapes.values())
  return sparse / step.total


def summary(acct: Accountant) -> dict[str, float]:
  """Totals by part and the reduction factor dense / run (the '4x fewer FLOPs' number), also
  without the lm head (dense unless 'wte' is a sparse layer, as in MST's reference set)."""
  t, d = acct.total, acct.dense_total
  no_head = (t.total - t.head)
  return {"flops_total": t.total, "flops_dense_total": d.total,
          "flops_reduction": d.total / t.total if t.total else float("nan"),
          "flops_reduction_no_head": (d.total - d.head) / no_head if no_head else float("nan"),
          "flops_linear": t.linear, "flops_attention": t.attention, "flops_head": t.head,
          "flops_update": t.update, "flops_steps": acct.steps}


def dense_flops_per_token(model_cfg, shapes: Mapping[str, tuple[int, int]]) -> float:
  """Training FLOPs per token of the dense model with causal attention (for MFU)."""
  step = step_flops(model_cfg, shapes, {}, batch_size=1, seq_len=model_cfg.seq_len,
                    attention="causal")
  return step.total / model_cfg.seq_len


def planned(spec: RunSpec, upto: int | None = None) -> Accountant:
  """The accountant of steps [0, upto) of the run `spec` (default: all), from the method's
  schedule alone (`model_schedule.model_at`, `DynamicDensity.active_weights`). MST's active counts
  follow from its plan, so this is what the loop logs; a resumed run starts its accountant
  from here."""
  config = spec.config
  acct = Accountant(spec.model_cfg, spec.kernel_shapes, batch_size=config.batch_size,
                    seq_len=spec.model_cfg.seq_len)
  total = spec.facts.total_steps
  upto = total if upto is None else min(upto, total)
  masked = spec.sparse_shapes
  for step in range(upto):
    acct.add_step(model_schedule.model_at(step, spec.model_cfg, spec.facts), step, masked)
  return acct
