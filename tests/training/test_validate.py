"""Tests for s24jax/training/validate.py, the checks of a whole run before it writes anything, through
`loop.train_and_evaluate` (launch.py's entry; the command line itself: tests/test_errors.py):
a table of bad inputs, each a `UserError` of one line naming the field, with a new workdir
never created and an existing one unchanged byte for byte; sparse-layer patterns that match
no layer (an error listing the layers that exist, a warning with the opt-out); a checkpoint
of another config named by its config fields; the data (a split shorter than one window, ids
outside the vocabulary); free disk space against one checkpoint's size; the config loader's
errors (a file that does not run, has no get_config, raises inside it); a compute dtype the
device cannot train in; a resume that ignores init_from or runs on changed data; the data
messages (a foreign token-file header, a mixed folder, a cache folder that is a file). The
references are the fields and values written out here, the model's layer paths as the test's
own config builds them, the train state's byte count computed by hand, and each dtype's
attention gradient run on the backend."""
import json
import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s24jax.training import checkpoint as ckpt_lib
from s24jax import errors
from s24jax.training import loop
from s24jax.training import platform_dtypes
from s24jax.training import validate
from s24jax.training import workdir as workdir_lib
from s24jax.data import cache

from tiny import tiny_config
from train_helpers import digest, run_config

# (overrides of the tiny STE config, text the message must hold: the field, and the value or
# the reason where it tells the user something).
BAD_CONFIGS = [
    ({"optim.lr": -1e-3}, "config.optim.lr=-0.001"),
    ({"optim.lr": float("nan")}, "config.optim.lr=nan"),
    ({"optim.min_lr": 1.0}, "config.optim.min_lr=1.0 is above config.optim.lr"),
    ({"optim.b2": 1.5}, "config.optim.b2=1.5"),
    ({"total_steps": -5}, "config.total_steps=-5"),
    ({"total_steps": 0}, "config.total_steps=0"),
    ({"batch_size": 0}, "config.batch_size=0"),
    ({"model.seq_len": 0}, "config.model.seq_len=0"),
    ({"sparsity.dense_finetune_fraction": 1.5}, "config.sparsity.dense_finetune_fraction=1.5"),
    ({"data.val_fraction": 1.0}, "config.data.val_fraction=1.0"),
    ({"log_every": 0}, "config.log_every=0"),
    ({"checkpoint_every": 0}, "config.checkpoint_every=0"),
    ({"seed": -1}, "config.seed=-1"),
    ({"stop_at_step": 0}, "config.stop_at_step=0"),
    ({"model.dtype": "float13"}, "config.model.dtype='float13'"),
    ({"grad_accum_steps": 3}, "config.grad_accum_steps=3 must divide config.batch_size=4"),
    ({"mesh.data": 64}, "mesh.data x mesh.fsdp must use the"),
    ({"sparsity.method": "nope"}, "sparsity.method"),
    ({"model.activation": "nope"}, "model.activation"),
    ({"model.d_model": 30}, "config.model.d_model=30"),   # FFN input width 30: not 2:4
    ({"act_sparsity.kind": "venom", "act_sparsity.m": 6}, "act_sparsity.m=6"),
    ({"sparsity.mvue": True, "model.seq_len": 15, "batch_size": 1}, "config.sparsity.mvue"),
    ({"sparsity.sparse_layers": ("*/nothing/*",)}, "['*/nothing/*']"),
]


def _config(overrides, data_cache, method="ste"):
  return tiny_config(method, steps=4, workdir_cache=data_cache, overrides=overrides)


@pytest.fixture(scope="module")
def resumable(tmp_path_factory, data_cache):
  """A workdir as a run of the tiny STE config leaves it at its start: config.json and the
  step-0 checkpoint (no training needed)."""
  workdir = str(tmp_path_factory.mktemp("resumable"))
  config = _config({}, data_cache)
  spec = validate.check_config(config)
  ckpt = ckpt_lib.Checkpointer(workdir)
  ckpt.save(0, jax.jit(spec.fresh_state)(), force=True)
  ckpt.close()
  workdir_lib.write_config(workdir, config, 0)
  return workdir


@pytest.mark.parametrize("overrides,named", BAD_CONFIGS,
                         ids=[",".join(o) for o, _ in BAD_CONFIGS])
def test_a_bad_config_is_one_line_naming_the_field_and_writes_nothing(
    overrides, named, tmp_path, resumable, data_cache):
  config = _config(overrides, data_cache)
  new = str(tmp_path / "runs" / "new")
  with pytest.raises(errors.UserError) as e:
    loop.train_and_evaluate(config, new)
  assert named in str(e.value), str(e.value)
  assert "\n" not in str(e.value) and e.value.exit_code == errors.EXIT_USER
  assert not os.path.exists(tmp_path / "runs"), "a refused run created its workdir"
  before = digest(resumable)
  with pytest.raises(errors.UserError):
    loop.train_and_evaluate(config, resumable)
  assert digest(resumable) == before


def test_sparse_layer_patterns_that_match_no_layer(tmp_path, data_cache, caplog):
  layers = ["h_0/attn/out", "h_0/attn/qkv", "h_0/mlp/fc", "h_0/mlp/proj", "wte"]
  config = _config({"sparsity.sparse_layers": ("*/mlp/*", "h_3/attn/*")}, data_cache)
  with pytest.raises(errors.UserError) as e:
    validate.check_config(config)
  message = str(e.value)
  assert "['h_3/attn/*']" in message and "--allow_unmatched_sparse_layers" in message
  assert "only ['h_0/mlp/fc', 'h_0/mlp/proj'] would be sparse" in message
  assert f"The layers are: {', '.join(layers)}" in message
  # The opt-out: a warning, and the run trains with the layers that do match.
  with caplog.at_level(logging.WARNING):
    spec = validate.check_config(config, allow_unmatched_layers=True)
  assert "UNMATCHED SPARSE LAYERS" in caplog.text and "h_3/attn/*" in caplog.text
  assert sorted(spec.sparse_shapes) == ["h_0/mlp/fc", "h_0/mlp/proj"]
  # Scanned blocks are one module 'h': 'h_0/...' matches nothing there.
  scanned = _config({"model.scan_layers": True, "sparsity.sparse_layers": ("h_0/mlp/*",)},
                    data_cache)
  with pytest.raises(errors.UserError, match=r"no layer would be sparse.*h/mlp/fc"):
    validate.check_config(scanned)
  # A dense method has no sparse layers to match: no check.
  validate.check_config(_config({"sparsity.sparse_layers": ("*/nothing/*",)}, data_cache,
                                method="dense"))


def test_a_checkpoint_of_another_config_names_the_fields_that_differ(resumable, data_cache):
  before = digest(resumable)
  config = _config({"model.d_model": 64, "optim.lr": 3e-3}, data_cache)
  with pytest.raises(ckpt_lib.CheckpointMismatchError) as e:
    loop.train_and_evaluate(config, resumable)
  message = str(e.value)
  assert "the checkpoint at step 0" in message and "does not match this config" in message
  assert "model.d_model: 32 -> 64" in message and "optim.lr: 0.01 -> 0.003" in message
  assert "params/h_0/attn/out/kernel: checkpoint (32, 32) vs config (64, 64)" in message
  assert isinstance(e.value, errors.UserError) and "\n" not in message
  assert digest(resumable) == before


def test_too_little_disk_space_is_refused_and_little_warned(tmp_path, data_cache, monkeypatch,
                                                            caplog):
  config = _config({}, data_cache)
  spec = validate.check_config(config)
  # By hand: every leaf of the train state, its elements times its bytes per element.
  nbytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(spec.abstract_state))
  assert ckpt_lib.checkpoint_bytes(spec.abstract_state) == nbytes
  workdir = str(tmp_path / "w")
  monkeypatch.setattr(ckpt_lib, "free_bytes", lambda path: nbytes - 1)
  with pytest.raises(errors.UserError, match="one checkpoint of this run takes about"):
    loop.train_and_evaluate(config, workdir)
  assert not os.path.exists(workdir)
  monkeypatch.setattr(ckpt_lib, "free_bytes", lambda path: 2 * nbytes)
  with caplog.at_level(logging.WARNING):
    validate.check_run(config, workdir)
  assert "LOW DISK SPACE" in caplog.text and "room for 2 checkpoint(s)" in caplog.text
  assert not os.path.exists(workdir)


def test_a_validation_split_shorter_than_one_window(tmp_path):
  folder = tmp_path / "corpus"   # five short documents: the held-out one is a few tokens
  folder.mkdir()
  for i in range(5):
    (folder / f"doc{i}.txt").write_text(f"Document number {i} has a few words. " * 3)
  config = tiny_config("ste", steps=4, overrides={"data.path": str(folder),
                                                  "data.cache_dir": str(tmp_path / "cache")})
  data = validate.load_tokens(config)   # the window of the tiny config (16 + 1) fits
  assert len(data.val) < 40
  config.model.seq_len = len(data.val)   # one token short of a window
  with pytest.raises(errors.UserError) as e:
    loop.train_and_evaluate(config, str(tmp_path / "w"))
  assert (f"the val split of {data.name} has {len(data.val)} tokens, fewer than one window of "
          f"config.model.seq_len + 1 = {len(data.val) + 1}") in str(e.value)
  assert not os.path.exists(tmp_path / "w")


def test_ids_outside_the_vocabulary_and_a_small_vocabulary(data_cache):
  config = _config({}, data_cache)
  tokens = np.arange(100, dtype=np.uint16)
  data = cache.TokenData(train=tokens, val=tokens, vocab_size=50257, name="t", max_id=50303)
  validate.check_data(config, data)          # model.vocab_size 50304: every id inside
  with pytest.raises(errors.UserError, match="holds id 50304, outside config.model.vocab_size"):
    validate.check_data(config, cache.TokenData(tokens, tokens, 50257, "t", max_id=50304))
  config.model.vocab_size = 320
  with pytest.raises(errors.UserError, match="50257 token ids but config.model.vocab_size is 320"):
    validate.check_data(config, data)


def test_the_config_loader_names_the_file_variant_or_field(tmp_path):
  with pytest.raises(errors.UserError, match="config file 'nope.py' not found"):
    validate.load_config("nope.py")
  with pytest.raises(errors.UserError, match="unknown config variant 'huge'"):
    validate.load_config("experiments/gpt2_ste.py:huge")
  with pytest.raises(errors.UserError,
                     match="override 'model.d_modle'.*did you mean model.d_model"):
    validate.load_config("experiments/gpt2_ste.py:tiny", args=["model.d_modle=3"])
  # A file that cannot run: one line naming the file, and the line where it failed.
  files = {   # name: (its text, what the message says)
      "bad.py": ("def get_config(variant=None):\n  return (\n", "bad.py:2: "),
      "no_get_config.py": ("from s24jax.training.config import base_config\n",
                           "no_get_config.py defines no get_config(variant=None)"),
      "crash.py": ("def get_config(variant=None):\n  raise KeyError('oops')\n",
                   "crash.py: get_config(None) raised KeyError: 'oops' (at "),
      "bad_import.py": ("import s24jax.no_such_module\n",
                        "bad_import.py: running it raised ModuleNotFoundError: No module named "
                        "'s24jax.no_such_module' (at "),
      "not_a_config.py": ("def get_config(variant=None):\n  return {'lr': 1}\n",
                          "get_config() returned dict, not a ConfigDict"),
  }
  for name, (text, says) in files.items():
    (tmp_path / name).write_text(text)
    with pytest.raises(errors.UserError) as e:
      validate.load_config(str(tmp_path / name))
    assert says in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    assert e.value.exit_code == errors.EXIT_USER
  crash = str(tmp_path / "crash.py")
  with pytest.raises(errors.UserError, match=f"at {crash}:2\\)"):   # the line that raised
    validate.load_config(crash)


def test_a_workdir_that_is_a_file_or_under_a_file(tmp_path, data_cache):
  config = _config({}, data_cache)
  path = tmp_path / "a_file"
  path.write_text("x")
  for workdir in (path, path / "w"):
    with pytest.raises(errors.UserError, match="is a file"):
      loop.train_and_evaluate(config, str(workdir))
  assert path.read_text() == "x"
  assert json.loads(json.dumps(sorted(os.listdir(tmp_path)))) == ["a_file"]


def test_a_dtype_this_backend_cannot_train_in_is_refused_before_anything(tmp_path, data_cache):
  """config.model.dtype is checked against what the backend computes (the issue's case:
  float16 passed the checks on a CPU, wrote config.json and checkpoint 0, and crashed at step
  1). The reference: the gradient of causal attention compiled and run in each dtype."""
  def runs(dtype):
    q = jnp.ones((1, 8, 1, 8), dtype)                                           # (B, T, N, hd)
    loss = lambda q: jnp.sum(jax.nn.dot_product_attention(q, q, q, is_causal=True)
                             .astype(jnp.float32))
    try:
      jax.block_until_ready(jax.jit(jax.grad(loss))(q))
      return True
    except Exception:  # pylint: disable=broad-except
      return False

  works = [d for d in platform_dtypes.FLOATS if runs(d)]
  assert platform_dtypes.working() == works
  for dtype in platform_dtypes.FLOATS:
    config = _config({"model.dtype": dtype}, data_cache)
    if dtype in works:
      platform_dtypes.check(dtype)
      continue
    with pytest.raises(errors.UserError) as e:
      loop.train_and_evaluate(config, str(tmp_path / "w"))
    message = str(e.value)
    assert message.startswith(f"config.model.dtype='{dtype}': the {jax.devices()[0].platform} "
                              f"device cannot train in {dtype} (") and "\n" not in message
    assert message.endswith(f"dtypes that work here: {', '.join(works)} ('auto' picks one)")
    assert not os.path.exists(tmp_path / "w")


def test_a_resume_says_when_init_from_or_the_data_changed(undisturbed, tmp_path, data_cache,
                                                          caplog):
  """A resumed run starts from its checkpoint: a new init_from is said to be unused; data
  whose tokens differ from those the checkpoints were trained on (the token cache's
  fingerprint, recorded by the first start) are named. Neither changes the workdir."""
  history = workdir_lib.data_history(undisturbed)
  assert [(r["source"], r["step"]) for r in history] == [("shakespeare", 0)]
  for overrides, says in (({}, None),
                          ({"init_from": "/some/hf_dir"}, "config.init_from='/some/hf_dir' is "
                           "not used: the run resumes from its checkpoint at step 24"),
                          ({"data.max_docs": 30}, "DATA CHANGED: the run resumes at step 24 on "
                           "other data than its checkpoints were trained on (shakespeare, "
                           f"whose tokens changed; fingerprint {history[0]['fingerprint']} -> ")):
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      checked = validate.check_run(run_config(data_cache, **overrides), undisturbed)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if says is None:
      assert checked.data.fingerprint == history[0]["fingerprint"] and not warned, warned
    else:
      assert len([w for w in warned if says in w]) == 1, warned


def test_data_messages_say_what_is_wrong_and_what_to_do(tmp_path, caplog):
  """A token file whose header is llm.c's but whose magic is not (read before as raw ids
  "from another tokenizer"), llm.c's LLaMA 3 files; a folder of .txt and .jsonl files; a
  cache folder that is a file (read before as a damaged cache entry, "TOKEN CACHE REBUILT")."""
  folder = tmp_path / "bins"
  folder.mkdir()
  for name, magic, says in (
      ("train.bin", 20240521, "its first 1024 bytes are an llm.c header (version 1, 100 "
       "tokens, which is the file's size) but its magic is 20240521, not llm.c's 20240520"),
      ("train.bin", 20240801, "llm.c's LLaMA 3 layout (magic 20240801, uint32 ids)")):
    header = np.zeros(256, "<i4")
    header[:3] = magic, 1, 100
    (folder / name).write_bytes(header.tobytes() + np.arange(100, dtype="<u2").tobytes())
    config = tiny_config("ste", overrides={"data.path": str(folder),
                                           "data.cache_dir": str(tmp_path / "cache")})
    with pytest.raises(errors.UserError, match=re.escape(says)):
      validate.load_tokens(config)
  mixed = tmp_path / "mixed"
  mixed.mkdir()
  (mixed / "a.txt").write_text("A document. " * 40)
  (mixed / "b.txt").write_text("Another one. " * 40)
  (mixed / "c.jsonl").write_text(json.dumps({"text": "left out"}) + "\n")
  config = tiny_config("ste", overrides={"data.path": str(mixed),
                                         "data.cache_dir": str(tmp_path / "cache")})
  with caplog.at_level(logging.WARNING):
    validate.load_tokens(config)
  assert f"config.data.path={str(mixed)!r} holds .txt files and jsonl files: reading the .txt " \
         "files only" in caplog.text and "config.data.name to jsonl" in caplog.text
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  caplog.clear()
  config.data.cache_dir = str(a_file)
  with caplog.at_level(logging.WARNING):
    with pytest.raises(errors.UserError) as e:
      validate.load_tokens(config)
  assert str(e.value) == (f"the token cache folder {a_file}: {a_file} is a file, not a folder; "
                          f"choose another {cache.CACHE_FLAG}")
  assert "TOKEN CACHE REBUILT" not in caplog.text and a_file.read_text() == "x"
