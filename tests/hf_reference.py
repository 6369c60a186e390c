"""Helpers of the export and evaluation tests (tests/cli/test_export.py, tests/cli/test_evaluate.py):
a tiny run's state with every parameter perturbed (so biases, norms and scales all matter),
and the independent reference, the exported model run by `transformers` in torch (CPU) with
a plain, unbatched loop."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from s24jax.training.run_spec import RunSpec

from tiny import tiny_config

torch = pytest.importorskip("torch", reason="the reference needs torch (pip install -e .[test])")
transformers = pytest.importorskip("transformers", reason="needs transformers (test extras)")


def perturbed(method: str = "dense", overrides=None, seed: int = 1, scale: float = 0.05):
  """(spec, params, sparsity) of the tiny model of `method` with `overrides`: the fresh
  state, every parameter plus N(0, scale^2) noise (biases and LayerNorms away from 0 and 1),
  S-STE's scales times 1.3 (so a scale that is dropped shows)."""
  spec = RunSpec.build(tiny_config(method, overrides=overrides or {}))
  state = jax.jit(spec.fresh_state)()
  leaves, treedef = jax.tree.flatten(state.params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  params = jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                        for x, k in zip(leaves, keys)])
  sparsity = jax.tree_util.tree_map_with_path(
      lambda p, x: x * 1.3 if getattr(p[-1], "key", None) == "scale" else x, state.sparsity)
  return spec, params, sparsity


def load(path):
  """The exported directory as transformers loads it (float32, eval mode): the class its
  config.json names (GPT2LMHeadModel, LlamaForCausalLM, ArceeForCausalLM)."""
  return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def logits(model, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def loglikelihood(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
  """lm-eval's loop for one request: input (context + continuation)[-(n_positions + 1):][:-1],
  the last len(continuation) positions' log-softmax at the continuation tokens, summed (in
  float64), and whether each continuation token is the argmax."""
  max_len = model.config.max_position_embeddings   # GPT-2: n_positions (an alias)
  assert len(continuation) <= max_len
  inp = (context + continuation)[-(max_len + 1):][:-1]
  with torch.no_grad():
    out = model(torch.tensor([inp])).logits[0].double()
  out = out[len(inp) - len(continuation):]
  logp = torch.log_softmax(out, dim=-1)
  cont = torch.tensor(continuation)
  ll = float(logp[torch.arange(len(continuation)), cont].sum())
  return ll, bool((out.argmax(-1) == cont).all())
