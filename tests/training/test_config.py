"""Tests for s24jax/training/config.py and s24jax/config_files.py: the base config's generated blocks
against the frozen dataclasses they are turned into (field by field, and against GPT-2 124M's
published sizes written out here), the size variants against the GPT-2 paper's (layers,
heads, width), and `path.to.field=value` overrides against hand-written expected values and
errors. Also: importing the config and the model pulls in no data pipeline (a fresh
subprocess's sys.modules)."""
import dataclasses
import os
import subprocess
import sys

import ml_collections
import pytest

from s24jax.nn import act_sparsity
from s24jax.training import config as config_lib
from s24jax import config_files
from s24jax.nn import model as model_lib
from s24jax.nn import sparse_linear

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# GPT-2 sizes (Radford et al. 2019, Table 2; the sizes Hu et al. 2024 train): (layers, heads,
# width), written out here rather than read from config.GPT2_SIZES.
PAPER_SIZES = {"124m": (12, 12, 768), "350m": (24, 16, 1024), "774m": (36, 20, 1280),
               "1558m": (48, 25, 1600)}


def _fields(cls, exclude=()):
  return {f.name: f for f in dataclasses.fields(cls) if f.name not in exclude}


def _default(f):
  return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_config_and_model_do_not_import_the_data_pipeline():
  code = ("import sys, s24jax.nn.model, s24jax.training.config; "
          "assert 'tensorflow_datasets' not in sys.modules; "
          "assert [m for m in sys.modules if m.startswith('s24jax.data')] == ['s24jax.data', "
          "'s24jax.data.defaults'] and 's24jax.training.train' not in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


def test_model_block_is_model_config_field_by_field():
  block = config_lib.base_config().model
  fields = _fields(model_lib.ModelConfig, exclude=("sparsity", "act"))
  assert set(block.keys()) == set(fields)              # no field missing, none extra
  default = model_lib.ModelConfig()
  for name, f in fields.items():
    assert block[name] == _default(f) == getattr(default, name), name
    assert type(block[name]) is type(getattr(default, name)), name   # pylint: disable=unidiomatic-typecheck
  # GPT-2 124M, written out (the base config's documented default)
  assert (block.vocab_size, block.seq_len, block.num_layers, block.num_heads,
          block.d_model) == (50304, 1024, 12, 12, 768)
  assert block.mlp_ratio == 4.0 and block.activation == "gelu"
  # the compute dtype: 'auto' in both (bfloat16 on accelerators, float32 on the CPU)
  assert block.dtype == default.dtype == "auto"
  assert block.remat == "none" and block.scan_layers is False and block.loss_chunk == 0


def test_sparsity_block_is_sparsity_config_field_by_field():
  block = config_lib.base_config().sparsity
  default = sparse_linear.SparsityConfig()
  fields = _fields(sparse_linear.SparsityConfig, exclude=("method",))
  for name, f in fields.items():
    assert name in block, name
    value = block[name]
    assert value == _default(f) == getattr(default, name), name
    assert type(value) is type(getattr(default, name)), name   # pylint: disable=unidiomatic-typecheck
  # the method is there by name; the other keys are the methods' own blocks
  assert block.method == "dense" == default.method.name
  others = set(block.keys()) - set(fields) - {"method"}
  assert all(isinstance(block[k], ml_collections.ConfigDict) for k in others), others
  assert {"sr_ste", "t_sr_ste", "s_ste", "mst"} <= others
  # a few defaults written out (README / the field comments)
  assert block.sparse_layers == ("*/mlp/*",) and block.backend == "xla"
  assert block.mvue is False and block.fp8 is False and block.fp8_backward_operands == "auto"
  assert block.dense_finetune_fraction == 0.0 and block.dense_finetune_init == "latent"
  assert block.flip_rate_warn == 0.05 and block.flip_rate_warn_patience == 5


def test_act_sparsity_block_is_act_sparsity_config_field_by_field():
  block = config_lib.base_config().act_sparsity
  default = act_sparsity.ActSparsityConfig()
  fields = _fields(act_sparsity.ActSparsityConfig)
  assert set(block.keys()) == set(fields) | {"stats_sequences"}
  for name, f in fields.items():
    assert block[name] == _default(f) == getattr(default, name), name
  assert block.stats_sequences == 0                    # statistics off
  assert (block.kind, block.v, block.n, block.m, block.backend) == ("none", 64, 2, 8, "xla")


def test_model_config_of_the_base_config_is_the_default_model_config():
  built = model_lib.model_config(config_lib.base_config())
  default = model_lib.ModelConfig()
  assert built.sparsity.method.name == default.sparsity.method.name == "dense"
  assert not built.sparsity.method.sparse
  # everything else, field by field: the same frozen config
  same_method = dataclasses.replace(
      built, sparsity=dataclasses.replace(built.sparsity, method=default.sparsity.method))
  assert same_method == default
  for f in dataclasses.fields(model_lib.ModelConfig):
    if f.name != "sparsity":
      assert getattr(built, f.name) == getattr(default, f.name), f.name


@pytest.mark.parametrize("variant", [None, "124m", "350m", "774m", "1558m"])
def test_gpt2_variants_have_the_paper_sizes(variant):
  c = config_lib.apply_variant(config_lib.base_config(), variant)
  assert (c.model.num_layers, c.model.num_heads, c.model.d_model) == PAPER_SIZES[
      variant or "124m"]
  assert c.model.d_model % c.model.num_heads == 0
  assert c.model.scan_layers and c.grad_accum_steps == 8


def test_cpu_variants_and_the_list_of_variants():
  assert config_lib.VARIANTS == ("tiny", "small", "124m", "350m", "774m", "1558m")
  tiny = config_lib.apply_variant(config_lib.base_config(), "tiny")
  assert (tiny.model.num_layers, tiny.model.num_heads, tiny.model.d_model) == (2, 4, 128)
  assert (tiny.batch_size, tiny.model.seq_len) == (16, 64)
  small = config_lib.apply_variant(config_lib.base_config(), "small")
  assert (small.model.num_layers, small.model.num_heads, small.model.d_model) == (4, 4, 128)
  assert small.data.tokenizer == "bytes" and small.model.vocab_size == 320
  assert small.model.vocab_size % 64 == 0 and small.model.vocab_size >= 257
  with pytest.raises(ValueError) as e:
    config_lib.apply_variant(config_lib.base_config(), "125m")
  for name in ("tiny", "small", "124m", "350m", "774m", "1558m"):
    assert name in str(e.value)
  assert "'125m'" in str(e.value)


# -- config_files: path.to.field=value ----------------------------------------------------------


@pytest.fixture
def locked():
  c = config_lib.base_config()
  c.lock()
  return c


@pytest.mark.parametrize("item,key,want", [
    ("optim.lr=1e-4", "optim.lr", 1e-4),                                   # a Python literal
    ("sparsity.sparse_layers=('*/attn/*','*/mlp/*')", "sparsity.sparse_layers",
     ("*/attn/*", "*/mlp/*")),                                             # a tuple literal
    ("data.name=lm1b", "data.name", "lm1b"),                               # a bare string
    ("data.name=123", "data.name", "123"),                                 # str: as written
    ("data.path=/data/txt", "data.path", "/data/txt"),                     # str placeholder
    ("sparsity.mvue=true", "sparsity.mvue", True),                         # a bool as true
    ("sparsity.mvue=False", "sparsity.mvue", False),
    ("optim.lr=1", "optim.lr", 1.0),                                       # int -> float field
    ("sparsity.sparse_layers=wte", "sparsity.sparse_layers", ("wte",)),    # one bare element
    ("sparsity.sparse_layers='wte'", "sparsity.sparse_layers", ("wte",)),  # one str literal
    ("data.max_docs=5", "data.max_docs", 5),                               # int placeholder
])
def test_parse_overrides(locked, item, key, want):
  got = config_files.parse_overrides(locked, [item])
  assert list(got) == [key]
  assert got[key] == want and type(got[key]) is type(want)   # pylint: disable=unidiomatic-typecheck
  config_files.apply_overrides(locked, got)
  node = locked
  for part in key.split("."):
    node = node[part]
  assert node == want and type(node) is type(want)   # pylint: disable=unidiomatic-typecheck


def test_an_unknown_field_names_the_valid_ones(locked):
  with pytest.raises(config_files.OverrideError) as e:
    config_files.parse_overrides(locked, ["optim.lrr=1"])
  msg = str(e.value)
  for name in ("b1", "b2", "eps", "grad_clip", "lr", "min_lr", "warmup_steps", "weight_decay"):
    assert name in msg
  assert "did you mean optim.lr" in msg
  with pytest.raises(config_files.OverrideError, match="no such field"):
    config_files.apply_overrides(locked, {"model.widht": 3})
  with pytest.raises(config_files.OverrideError, match="not a group of fields"):
    config_files.parse_overrides(locked, ["data.name.x=1"])


@pytest.mark.parametrize("item", [
    "total_steps=1.5",          # a float into an int field
    "total_steps=True",         # a bool is no int here
    "sparsity.mvue=3",          # an int into a bool field
    "total_steps=abc",          # no literal for an int field
    "seed=None",                # None only sets a placeholder
    "optim=1",                  # a group of fields
    "no_equals_sign",           # not path=value
])
def test_a_wrong_value_is_an_override_error(locked, item):
  before = locked.to_dict()
  with pytest.raises(config_files.OverrideError):
    config_files.apply_overrides(locked, config_files.parse_overrides(locked, [item]))
  assert issubclass(config_files.OverrideError, ValueError)
  assert locked.to_dict() == before                  # nothing was set


def test_python_values_are_checked_like_the_command_line(locked):
  config_files.apply_overrides(locked, {"optim.lr": 2, "sparsity.sparse_layers": ["wte"]})
  assert locked.optim.lr == 2.0 and isinstance(locked.optim.lr, float)
  assert locked.sparsity.sparse_layers == ("wte",)
  with pytest.raises(config_files.OverrideError, match="the field is int"):
    config_files.apply_overrides(locked, {"batch_size": "8"})


def test_load_config_applies_overrides_then_args_and_locks():
  path = os.path.join(REPO, "experiments", "gpt2_s_ste.py")
  c = config_files.load_config(f"{path}:tiny", {"total_steps": 7, "seed": 3},
                               args=["total_steps=9", "sparsity.mvue=false"])
  assert c.sparsity.method == "s_ste"
  assert c.total_steps == 9 and c.seed == 3 and c.sparsity.mvue is False
  assert c.model.d_model == 128                       # the tiny variant
  with pytest.raises(AttributeError):
    c.new_field = 1                                   # locked: nothing adds a field
  with pytest.raises(ValueError, match="tiny.*small.*124m.*1558m"):
    config_files.load_config(f"{path}:125m")
