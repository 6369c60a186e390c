"""Tests for experiments/: every experiment file and variant builds its config and its
RunSpec (method, model, abstract train state) without running, with GPT-2's published
parameter counts as the reference for the paper sizes; the comparison script's table and
overrides against values computed here, and the keys of the blocks it generated in
docs/results.md. The scripts' command lines (errors, destinations, reuse of runs):
tests/test_experiment_scripts.py."""
import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax import config_files
from s24jax.training import config as config_lib
from s24jax.methods import registry
from s24jax.nn.model import GPT2
from s24jax.training.run_spec import RunSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(REPO, "experiments", "gpt2_*.py")))
# Paper-scale parameter counts (tied embeddings, padded vocab): a wrong size would show here.
EXPECTED_PARAMS_M = {"124m": 124, "350m": 354, "774m": 773, "1558m": 1556}


def test_the_four_foundation_recipes_exist():
  names = {os.path.basename(f) for f in FILES}
  assert {"gpt2_dense.py", "gpt2_ste.py", "gpt2_sr_ste.py", "gpt2_s_ste.py"} <= names


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
@pytest.mark.parametrize("variant", config_lib.VARIANTS)
def test_builds_config_and_abstract_state(path, variant):
  """Traces one block of the model (blocks are identical, or scanned) to keep this fast."""
  config = config_files.load_config(f"{path}:{variant}")
  assert config.seed == 0 and config.total_steps > 0
  num_layers = config.model.num_layers
  scanned = config.model.scan_layers
  if not scanned:
    config.model.num_layers = 1
  spec = RunSpec.build(config)
  model, dense_model = GPT2(spec.model_cfg), GPT2(spec.model_cfg.dense_twin())
  abstract = spec.abstract_state
  count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
  if scanned:
    assert abstract.params["h"]["mlp"]["fc"]["kernel"].shape[0] == num_layers
    n = count(abstract.params)
  else:
    n = count(abstract.params) + (num_layers - 1) * count(abstract.params["h_0"])
  if variant in EXPECTED_PARAMS_M and model.config.activation in ("gelu", "relu", "relu2") \
      and model.config.mlp_ratio == 4.0:
    assert abs(n / 1e6 - EXPECTED_PARAMS_M[variant]) < 0.01 * EXPECTED_PARAMS_M[variant], n
  # the dense twin (fine-tuning phase) has the same parameters
  dense_params = jax.eval_shape(
      lambda: dense_model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  assert jax.tree.structure(dense_params) == jax.tree.structure(abstract.params)


def test_unknown_variant_lists_valid():
  with pytest.raises(ValueError, match="tiny.*124m.*1558m"):
    config_files.load_config(f"{FILES[0]}:125m")


def test_compare_recipes_table_pairs_gaps_by_seed(tmp_path, monkeypatch):
  """The README's table: per-seed relative gaps to the same seed's baseline, mean ± sd."""
  monkeypatch.syspath_prepend(os.path.join(REPO, "experiments"))
  import compare_recipes   # pylint: disable=g-import-not-at-top  (experiments/ is no package)
  vals = {("dense", 0): 2.0, ("dense", 1): 2.2, ("ste", 0): 2.02, ("ste", 1): 2.2,
          ("ste", 2): 9.0}                      # seed 2 has no baseline: not paired
  for (name, seed), val in vals.items():
    w = tmp_path / "c" / f"{name}_seed{seed}"
    w.mkdir(parents=True)
    (w / "final_metrics.json").write_text(f'{{"val/loss": {val}}}')
  text = compare_recipes.table(str(tmp_path), "c", ["dense", "ste"], [0, 1, 2], "small")
  gaps = [100 * (2.02 / 2.0 - 1), 0.0]           # +1 %, 0 %
  want = f"{np.mean(gaps):+.2f} ± {np.std(gaps, ddof=1):.2f} %"
  ste = next(line for line in text.splitlines() if line.startswith("| ste |"))
  assert ste.startswith(f"| ste | 3 | {np.mean([2.02, 2.2, 9.0]):.3f}") and want in ste
  dense = next(line for line in text.splitlines() if line.startswith("| dense |"))
  assert f"sd {100 * np.std([2.0, 2.2], ddof=1) / 2.1:.2f} %" in dense


def test_compare_recipes_steps_stretch_every_schedule(monkeypatch):
  """--steps N: N steps, and MST's topology updates as many per run as at the default length."""
  monkeypatch.syspath_prepend(os.path.join(REPO, "experiments"))
  import compare_recipes   # pylint: disable=g-import-not-at-top
  def loaded(name, steps):
    spec, overrides = compare_recipes.run_config(name, "small")
    return config_files.load_config(spec, {**overrides,
                                           **compare_recipes.length_overrides(name, steps)})
  default = loaded("mst", 0)
  longer = loaded("mst", 3 * default.total_steps)
  assert longer.total_steps == 3 * default.total_steps
  assert longer.sparsity.mst.update_every == 3 * default.sparsity.mst.update_every
  assert loaded("ste", 1234).total_steps == 1234
  assert loaded("ste", 0).total_steps == default.total_steps


def test_compare_recipes_every_run_sets_the_fields_it_names(monkeypatch):
  """Each recipe and ablation builds its config, with every override in place (a typo'd key
  or an invalid value such as an unknown attention pattern fails here, not after a run)."""
  monkeypatch.syspath_prepend(os.path.join(REPO, "experiments"))
  import compare_recipes   # pylint: disable=g-import-not-at-top
  for name in compare_recipes.RUNS:
    spec, overrides = compare_recipes.run_config(name, "small")
    cfg = config_files.load_config(spec, overrides)
    registry.from_config(cfg)   # the method's own checks (e.g. the attention pattern)
    for key, value in overrides.items():
      got = cfg
      for part in key.split("."):
        got = getattr(got, part)
      assert tuple(got) == value if isinstance(value, tuple) else got == value, (name, key)


def test_compare_recipes_keys_every_results_block_it_generated(monkeypatch, tmp_path):
  """Each `generated by:` line of docs/results.md is what results_command gives for its own
  arguments: the blocks stay found (a changed default or form would append a second copy)."""
  monkeypatch.syspath_prepend(os.path.join(REPO, "experiments"))
  import compare_recipes   # pylint: disable=g-import-not-at-top
  with open(os.path.join(REPO, "docs", "results.md"), encoding="utf-8") as f:
    commands = [line[len("<!-- generated by: "):-len(" -->")] for line in f.read().splitlines()
                if line.startswith("<!-- generated by: python experiments/compare_recipes.py")]
  assert len(commands) >= 4
  for command in commands:
    argv = command.split()[2:]
    parsed = compare_recipes.parser().parse_args([*argv, "--root", str(tmp_path)])
    assert compare_recipes.results_command(parsed) == command
