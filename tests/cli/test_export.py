"""Tests for s24jax/cli/export.py: a run's model as a Hugging Face GPT-2 and back. References:
`transformers.GPT2LMHeadModel` (torch, CPU) loading the written directory (its logits against
s24jax's), a GPT-2 that transformers builds and saves itself (import, then export, gives its
tensors back), the 2:4 pattern counted in the written tensors against masks.* recomputed, and
S-STE's scale recomputed after an import. (The tokenizer files: tests/data/test_hf_tokenizer.py;
the run read back: tests/training/test_trained.py.)"""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import numpy as safetensors_np

from s24jax import errors
from s24jax.cli import export
from s24jax.training import init_from
from s24jax.training import loop
from s24jax.training import trained as trained_lib
from s24jax.nn import model as model_lib
from s24jax.data import tokenizer as tokenizer_lib
from s24jax.kernels import masks
from s24jax.methods import s_ste
from s24jax.training.run_spec import RunSpec
from s24jax.training import train
from s24jax.step_info import StepInfo

import hf_reference
from hf_reference import torch, transformers
from tiny import tiny_config

# float32 math against float32 / float64 references: full float32 dots on every platform
# (a GPU's default is TF32), see conftest.f32_dots.
pytestmark = pytest.mark.usefixtures("f32_dots")

TOKENS = np.random.default_rng(0).integers(0, tokenizer_lib.VOCAB_SIZE, (2, 16))


def s24jax_logits(cfg, params, sparsity, tokens=TOKENS):
  """What the run's own model computes (its sparse layers projecting inside the forward)."""
  variables = {"params": params, **({"sparsity": sparsity} if sparsity else {})}
  return np.asarray(model_lib.build(cfg).apply(variables, jnp.asarray(tokens)))


# dense GELU; 2:4 (STE) with relu2; S-STE (beta S(W)) in scanned blocks (the stacked layout).
CASES = {
    "dense_gelu": ("dense", {}),
    "ste_24_relu2": ("ste", {"model.activation": "relu2"}),
    "s_ste_scanned_2_layers": ("s_ste", {"model.scan_layers": True, "model.num_layers": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_gives_s24jax_logits(case, tmp_path):
  """transformers' GPT-2 on the written directory computes the run's own logits; the written
  FFN weights are GPT-2's (in, out) Conv1D layout of W~: the 2:4 groups of s24jax's (out, in)
  kernel are 4 consecutive rows of one column, at least 2 of each 4 exactly 0, the kept entries
  W (STE) or beta times the soft-thresholded W (S-STE), against masks.* recomputed here."""
  method, overrides = CASES[case]
  spec, params, sparsity = hf_reference.perturbed(method, overrides)
  out = export.write_hf_dir(tmp_path / "hf", spec.model_cfg, params, sparsity, "gpt2")
  theirs = hf_reference.logits(hf_reference.load(out), TOKENS)
  ours = s24jax_logits(spec.model_cfg, params, sparsity)
  assert theirs.shape == ours.shape == (2, 16, spec.model_cfg.vocab_size)
  assert np.abs(theirs - ours).max() <= 1e-4
  tensors = safetensors_np.load_file(str(out / "model.safetensors"))
  block = params["h"] if spec.model_cfg.scan_layers else params["h_0"]
  layer = (lambda x: x[0]) if spec.model_cfg.scan_layers else (lambda x: x)
  np.testing.assert_array_equal(tensors["transformer.h.0.attn.c_attn.weight"],
                                np.asarray(layer(block["attn"]["qkv"]["kernel"])).T)
  for name, module in (("mlp.c_fc.weight", "fc"), ("mlp.c_proj.weight", "proj")):
    w = tensors[f"transformer.h.0.{name}"]                          # (in, out)
    kernel = np.asarray(layer(block["mlp"][module]["kernel"]))      # (out, in)
    assert w.shape == kernel.T.shape
    if method == "dense":
      np.testing.assert_array_equal(w.T, kernel)
      continue
    assert ((w.T.reshape(w.shape[1], -1, 4) == 0).sum(-1) >= 2).all()   # zeros per group
    if method == "ste":
      expected = np.where(np.asarray(masks.nm_mask(kernel)), kernel, 0.0)
    else:
      scale = sparsity["h"]["mlp"][module]["scale"][0]
      expected = float(scale) * np.asarray(masks.soft_threshold24(kernel))
    np.testing.assert_allclose(w.T, expected, rtol=1e-6, atol=0)
  if method != "dense":
    about = json.loads((out / "s24jax_export.json").read_text())
    assert about["sparse_layers"]["h/mlp/fc" if spec.model_cfg.scan_layers
                                  else "h_0/mlp/fc"]["zeros"] >= 0.5


# The Llama-style family: 2 layers, grouped-query attention (4 query heads, 2 key/value
# heads), RoPE at a non-default base; SwiGLU (LlamaForCausalLM) and Squared-ReLU
# (ArceeForCausalLM), dense, 2:4 and S-STE (scanned).
LLAMA = {"model.family": "llama", "model.num_layers": 2, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.ffn_multiple_of": 16, "model.rope_base": 500.0}
LLAMA_CASES = {
    "swiglu_dense": ("dense", {"model.activation": "swiglu"}, "LlamaForCausalLM"),
    "swiglu_s_ste_scanned": ("s_ste", {"model.activation": "swiglu", "model.scan_layers": True},
                             "LlamaForCausalLM"),
    "relu2_ste": ("ste", {"model.activation": "relu2"}, "ArceeForCausalLM"),
}


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_transformers_llama_gives_s24jax_logits(case, tmp_path):
  """transformers' own Llama-style classes on the written directory compute the run's logits
  (RoPE's half-split convention, GQA's head grouping, RMSNorm, the untied head all theirs);
  the FFN matrices written are W~ (2:4 zeros) and import gives back the written weights."""
  method, overrides, arch = LLAMA_CASES[case]
  spec, params, sparsity = hf_reference.perturbed(method, {**LLAMA, **overrides})
  cfg = spec.model_cfg
  out = export.write_hf_dir(tmp_path / "hf", cfg, params, sparsity, "gpt2")
  model = hf_reference.load(out)
  assert type(model).__name__ == arch
  theirs = hf_reference.logits(model, TOKENS)
  ours = s24jax_logits(cfg, params, sparsity)
  assert theirs.shape == ours.shape == (2, 16, cfg.vocab_size)
  assert np.abs(theirs - ours).max() <= 1e-4
  tensors = safetensors_np.load_file(str(out / "model.safetensors"))
  assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 32)   # 2 kv heads
  assert ("model.layers.0.mlp.gate_proj.weight" in tensors) == (arch == "LlamaForCausalLM")
  if method != "dense":
    w = tensors["model.layers.1.mlp.down_proj.weight"]               # (out, in), as s24jax
    assert ((w.reshape(w.shape[0], -1, 4) == 0).sum(-1) >= 2).all()
  back = init_from.load_hf_params(cfg, params, str(out), "gpt2")
  written = trained_lib.computed_params(cfg, params, sparsity)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               back, written)


def test_llama_import_refuses_another_shape(tmp_path):
  spec, params, sparsity = hf_reference.perturbed("dense", {**LLAMA, "model.activation": "swiglu"})
  out = export.write_hf_dir(tmp_path / "hf", spec.model_cfg, params, sparsity, "gpt2")
  other = model_lib.model_config(tiny_config("dense", overrides={
      **LLAMA, "model.activation": "swiglu", "model.num_kv_heads": 4}))
  with pytest.raises(export.ExportError, match=r"num_key_value_heads=2 \(the run: 4\)"):
    init_from.read_hf_dir(out, other, "gpt2")


def test_bytes_run_writes_weights_and_says_there_is_no_tokenizer(tmp_path):
  spec, params, sparsity = hf_reference.perturbed(
      "s_ste", {"data.tokenizer": "bytes", "model.vocab_size": 320})
  out = export.write_hf_dir(tmp_path / "hf", spec.model_cfg, params, sparsity, "bytes")
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "s24jax_export.json"]
  about = json.loads((out / "s24jax_export.json").read_text())
  assert about["tokenizer"] == "utf8-bytes-257" and not about["tokenizer_files"]
  assert "UTF-8 bytes" in about["token_ids"]
  tokens = np.frombuffer("To be, or not".encode(), np.uint8).astype(np.int64)[None]
  ours = s24jax_logits(spec.model_cfg, params, sparsity, tokens)
  assert np.abs(hf_reference.logits(hf_reference.load(out), tokens) - ours).max() <= 1e-4


@pytest.mark.parametrize("overrides, says", [
    ({"sparsity.method": "mst", "model.attention": "local_strided", "model.attention_stride": 4},
     "attention pattern 'local_strided'"),
    ({"act_sparsity.kind": "venom", "model.activation": "relu2"}, "V:N:M activation sparsity"),
    ({"model.activation": "swiglu"}, "GPT-2's MLP has no gate"),
])
def test_refuses_what_gpt2_cannot_express(overrides, says, tmp_path):
  cfg = model_lib.model_config(tiny_config("dense", overrides=overrides))
  with pytest.raises(export.ExportError, match=says):
    export.write_hf_dir(tmp_path / "hf", cfg, {}, {}, "gpt2")
  assert not os.listdir(tmp_path)


def test_refuses_a_non_empty_out_and_leaves_it(tmp_path):
  cfg = model_lib.model_config(tiny_config("dense"))
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "mine.txt").write_text("keep")
  with pytest.raises(export.ExportError, match="not empty"):
    export.write_hf_dir(tmp_path / "hf", cfg, {}, {}, "gpt2")
  assert os.listdir(tmp_path / "hf") == ["mine.txt"] and len(os.listdir(tmp_path)) == 1


# ---------------------------------------------------------------------------------------------
# Import.


def transformers_gpt2(path, *, vocab=tokenizer_lib.VOCAB_SIZE, layers=1, width=32, heads=2,
                      positions=16, activation="gelu_new", eps=1e-5, seed=0):
  """A GPT-2 that transformers builds (random weights) and saves with GPT-2's tokenizer,
  made with vocab=/merges= (transformers 5's GPT2Tokenizer with vocab_file=/merges_file=
  tokenizes every text to nothing)."""
  torch.manual_seed(seed)
  config = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=width,
                                   n_layer=layers, n_head=heads, activation_function=activation,
                                   layer_norm_epsilon=eps)
  model = transformers.GPT2LMHeadModel(config).eval()
  with torch.no_grad():   # biases and norms away from 0 and 1
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  model.save_pretrained(str(path))
  encoder_json, vocab_bpe = tokenizer_lib.gpt2_bpe_files()
  merges = [tuple(line.split()) for line in vocab_bpe.read_text("utf-8").split("\n")[1:]
            if line.strip()]
  tok = transformers.GPT2Tokenizer(vocab=json.loads(encoder_json.read_text("utf-8")),
                                   merges=merges)
  assert tok("Hello world")["input_ids"] == [15496, 995]
  tok.save_pretrained(str(path))
  return model


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
  """(directory, model) of a 1-layer, 32-wide GPT-2 of the tiny run's sizes (vocab 50304,
  16 positions, s24jax's LayerNorm epsilon 1e-6), as transformers saves it."""
  path = tmp_path_factory.mktemp("hf") / "gpt2"
  return path, transformers_gpt2(path, vocab=50304, eps=1e-6)


@pytest.fixture(scope="module")
def dense_cfg_params():
  cfg = model_lib.model_config(tiny_config("dense"))
  fresh = jax.jit(model_lib.GPT2(cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))
  return cfg, fresh["params"]


def test_import_then_export_is_the_identity(gpt2_dir, dense_cfg_params, tmp_path):
  """A dense run of the directory's sizes: import, then export, gives every tensor back
  bit for bit, and the imported s24jax model computes transformers' logits (with s24jax's
  LayerNorm epsilon, 1e-6: GPT-2's 1e-5 changes logits by ~1e-3 here, a logged warning)."""
  path, theirs = gpt2_dir
  cfg, fresh = dense_cfg_params
  params = init_from.load_hf_params(cfg, fresh, str(path))
  out = export.write_hf_dir(tmp_path / "back", cfg, params, {}, "gpt2")
  original = {k: v.numpy() for k, v in theirs.state_dict().items() if k != "lm_head.weight"}
  written = safetensors_np.load_file(str(out / "model.safetensors"))
  assert set(written) == set(original)
  for k, v in original.items():
    np.testing.assert_array_equal(written[k], v, err_msg=k)
  ours = s24jax_logits(cfg, params, {})
  assert np.abs(hf_reference.logits(theirs, TOKENS) - ours).max() <= 1e-4


def test_import_pads_the_vocabulary_with_the_mean_row(dense_cfg_params, tmp_path):
  """GPT-2's 50257 rows into the run's 50304: the first rows as they are, the padding rows the
  mean row, hence each padded id's logit the mean logit; positions beyond seq_len dropped."""
  theirs = transformers_gpt2(tmp_path / "gpt2", positions=32)
  cfg, fresh = dense_cfg_params
  params = init_from.load_hf_params(cfg, fresh, str(tmp_path / "gpt2"))
  wte = theirs.transformer.wte.weight.detach().numpy()
  got = np.asarray(params["wte"]["embedding"])
  np.testing.assert_array_equal(got[:50257], wte)
  np.testing.assert_allclose(got[50257:], np.broadcast_to(wte.mean(0), (47, 32)), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(params["wpe"]),
                                theirs.transformer.wpe.weight.detach().numpy()[:16])
  ours = s24jax_logits(cfg, params, {})
  for i in (50257, 50303):
    np.testing.assert_allclose(ours[..., i], ours[..., :50257].mean(-1), atol=1e-5)


def test_import_refuses_another_tokenizer_or_model(gpt2_dir, dense_cfg_params, tmp_path):
  cfg, fresh = dense_cfg_params
  path = tmp_path / "gpt2"
  shutil.copytree(gpt2_dir[0], path)
  with pytest.raises(export.ExportError, match="UTF-8 bytes"):       # a bytes run
    init_from.load_hf_params(cfg, fresh, str(path), tokenizer="bytes")
  wider = model_lib.model_config(tiny_config("dense", overrides={"model.num_layers": 2}))
  with pytest.raises(export.ExportError, match="n_layer=1 .the run: 2."):
    init_from.load_hf_params(wider, {}, str(path))
  relu2 = model_lib.model_config(tiny_config("dense", overrides={"model.activation": "relu2"}))
  with pytest.raises(export.ExportError, match="activation_function='gelu_new'"):
    init_from.load_hf_params(relu2, {}, str(path))
  tok = json.loads((path / "tokenizer.json").read_text())
  vocab = tok["model"]["vocab"]
  vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]   # two ids swapped
  (path / "tokenizer.json").write_text(json.dumps(tok))
  with pytest.raises(export.ExportError, match="not GPT-2's BPE"):
    init_from.load_hf_params(cfg, fresh, str(path))


def test_init_from_rebuilds_what_init_derives_from_the_weights(gpt2_dir):
  """An S-STE run started from a GPT-2 directory: its latent weights are the directory's, each
  sparse layer's mask and frozen scale are those of the new weights (s_ste_scale, nm_mask
  recomputed here), the optimizer's moments are fresh, and a train step runs from it."""
  path = str(gpt2_dir[0])
  spec = RunSpec.build(tiny_config("s_ste", overrides={"init_from": path}))
  init_from.check_init_from(spec)      # the validation's check: shapes only, nothing allocated
  wider = RunSpec.build(tiny_config("s_ste", overrides={"init_from": path, "model.seq_len": 32}))
  with pytest.raises(export.ExportError, match="wpe.weight gives .16, 32., the run needs .32, 32."):
    init_from.check_init_from(wider)
  fresh = jax.jit(spec.fresh_state)()
  state = init_from.init_from_hf(spec, fresh, path)
  written = safetensors_np.load_file(f"{path}/model.safetensors")
  fc = np.asarray(state.params["h_0"]["mlp"]["fc"]["kernel"])
  np.testing.assert_array_equal(fc, written["transformer.h.0.mlp.c_fc.weight"].T)
  layer = state.sparsity["h_0"]["mlp"]["fc"]
  np.testing.assert_allclose(float(layer["scale"]), float(s_ste.s_ste_scale(fc)), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(layer["mask"]), np.asarray(masks.nm_mask(fc)))
  assert float(fresh.sparsity["h_0"]["mlp"]["fc"]["scale"]) != float(layer["scale"])
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(state.opt_state)
             if x.dtype == jnp.float32)
  assert int(state.step) == 0
  tokens = np.random.default_rng(0).integers(0, 1000, (4, 17))
  batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
  new, metrics = train.train_step(state, batch, StepInfo.at(0, log_every=1, total=2),
                                  model=model_lib.GPT2(spec.model_cfg),
                                  tx=spec.tx(state.params, state.sparsity))
  assert np.isfinite(float(metrics["loss"])) and int(new.step) == 1


def test_a_run_with_init_from_starts_from_the_directory(gpt2_dir, tmp_path):
  """Through the loop: the run's step-0 checkpoint holds the directory's weights; a directory
  the run cannot start from stops it before anything is written."""
  path = str(gpt2_dir[0])
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(tiny_config("s_ste", steps=2, overrides={"init_from": path}), workdir)
  at0 = trained_lib.load_run(workdir, 0)
  written = safetensors_np.load_file(f"{path}/model.safetensors")
  np.testing.assert_array_equal(np.asarray(at0.params["h_0"]["mlp"]["fc"]["kernel"]),
                                written["transformer.h.0.mlp.c_fc.weight"].T)
  wider = tiny_config("s_ste", steps=2, overrides={"init_from": path, "model.seq_len": 32})
  with pytest.raises(errors.UserError, match="wpe.weight gives"):
    loop.train_and_evaluate(wider, str(tmp_path / "other"))
  assert not os.path.exists(tmp_path / "other") or not os.listdir(tmp_path / "other")


# ---------------------------------------------------------------------------------------------
# The command line, on the session's trained run (read-only: the fixture checks its digest).


def test_cli_exports_the_trained_run(undisturbed, tmp_path):
  out = tmp_path / "hf"
  assert export.main(["--workdir", undisturbed, "--out", str(out)]) == 0
  about = json.loads((out / "s24jax_export.json").read_text())
  assert about["step"] == 24 and about["method"] == "s_ste" and "beta * S(W)" in about["weights"]
  trained = trained_lib.load_run(undisturbed)
  ours = s24jax_logits(trained.model_cfg, trained.params, trained.sparsity)
  assert np.abs(hf_reference.logits(hf_reference.load(out), TOKENS) - ours).max() <= 1e-4
  assert export.main(["--workdir", undisturbed, "--out", str(tmp_path / "at0"),
                      "--step", "0"]) == 0
  assert json.loads((tmp_path / "at0" / "s24jax_export.json").read_text())["step"] == 0


def test_cli_errors_change_nothing(undisturbed, tmp_path, capsys):
  before = sorted(os.listdir(tmp_path))
  with pytest.raises(SystemExit) as stop:   # an argument's check (tests/cli/test_export_errors.py)
    export.main(["--workdir", str(tmp_path / "none"), "--out", str(tmp_path / "a")])
  assert stop.value.code == errors.EXIT_USER
  assert f"{tmp_path / 'none'} does not exist" in capsys.readouterr().err
  (tmp_path / "empty").mkdir()
  assert export.main(["--workdir", str(tmp_path / "empty"),
                      "--out", str(tmp_path / "a")]) == errors.EXIT_USER
  assert "no config.json" in capsys.readouterr().err
  assert export.main(["--workdir", undisturbed, "--out", str(tmp_path / "a"),
                      "--step", "7"]) == errors.EXIT_USER
  assert "no checkpoint of step 7" in capsys.readouterr().err
  assert sorted(os.listdir(tmp_path)) == sorted(before + ["empty"])
  assert not os.listdir(tmp_path / "empty")
