"""Each model family as a Hugging Face `transformers` class sees it: the config.json it writes
and reads, its tensor names and layouts, and what that class cannot express
(s24jax/cli/export.py writes and reads the directories through `LAYOUTS[model.family]`).

- 'gpt2' -> GPT2LMHeadModel: kernels are stored (out, in) here, (in, out) in GPT-2's Conv1D
  (each is transposed); qkv is one (3C, C) matrix in both (q, k, v, each head's columns
  contiguous: model.py's reshape (B, T, 3, nh, hd) is GPT-2's split then view); the embedding
  is tied (no lm_head.weight). s24jax's gelu is the tanh form: 'gelu_new'.
- 'llama' -> LlamaForCausalLM (gated FFNs: swiglu = silu, geglu = the tanh GELU) or, for an
  ungated FFN (Haziza et al.'s Squared-ReLU: up, down), ArceeForCausalLM, transformers'
  Llama-style decoder with `down(act(up(x)))`. nn.Linear stores (out, in) like s24jax: nothing
  is transposed. Rotary embeddings are transformers' `rotate_half` convention in both
  (s24jax/nn/llama.py); the head is untied (lm_head.weight).
Embeddings (and Llama's head) keep the model's padded rows (50304 for GPT-2's 50257 ids), so
logits are exactly the model's; no token maps to a padded row. On import a smaller vocabulary
is padded with its mean row.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax
import jax
import numpy as np

from s24jax.nn import activations
from s24jax import errors
from s24jax import state as state_lib

GPT2_ACTIVATIONS = {"gelu": "gelu_new", "relu": "relu", "relu2": "relu2"}
# What s24jax computes of GPT-2's activations: the tanh GELU (three names), relu, relu2.
HF_TO_ACTIVATION = {**{k: "gelu" for k in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")},
                    "relu": "relu", "relu2": "relu2"}
# Llama-style: the gate's activation (LlamaForCausalLM) or the ungated one (ArceeForCausalLM).
LLAMA_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh",
                     "gelu": "gelu_pytorch_tanh", "relu": "relu", "relu2": "relu2"}
LAYER_NORM_EPS = 1e-6            # flax.linen.LayerNorm's default, what model.py uses


class ExportError(errors.UserError):
  """A run or directory that cannot be exported or imported (the message says why)."""


def np32(x) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(x, dtype=np.float32))


def _blocks(model_cfg: Any, params: Any, name: str) -> list[Any]:
  """Each layer's params: slices of the scanned stack, or the unrolled `<name>_<i>`."""
  if model_cfg.scan_layers:
    return [jax.tree.map(lambda x, i=i: x[i], params[name]) for i in range(model_cfg.num_layers)]
  return [params[f"{name}_{i}"] for i in range(model_cfg.num_layers)]


def _shared_problems(model_cfg: Any, architecture: str) -> list[str]:
  problems = []
  if model_cfg.attention != "causal":
    problems.append(f"the attention pattern {model_cfg.attention!r} (MST's hybrid sparse "
                    f"attention, stride {model_cfg.attention_stride}); {architecture} attends "
                    "causally to every earlier token")
  if model_cfg.act.enabled:
    problems.append(f"V:N:M activation sparsity ({model_cfg.act.describe()}) before the FFN's "
                    f"second matmul; {architecture} has dense activations")
  return problems


@dataclasses.dataclass(frozen=True)
class Layout:
  """One family's mapping. Block tensors: (HF name inside a block, path inside an s24jax
  block, transposed). Top tensors: (HF name, s24jax path, embedding rows to pad?)."""
  prefix: str                     # HF's prefix of the body's tensors ('transformer.', 'model.')
  block_hf: str                   # HF's name of the block list ('h', 'layers')
  block_ours: str                 # s24jax's ('h' scanned, 'h_<i>' unrolled)
  top: tuple[tuple[str, tuple[str, ...], bool], ...]
  block_tensors: Callable[[Any], tuple[tuple[str, tuple[str, ...], bool], ...]]
  unsupported: Callable[[Any], list[str]]
  config: Callable[[Any, int], dict[str, Any]]
  config_problems: Callable[[dict[str, Any], Any], list[str]]
  truncate: tuple[str, ...] = ()   # top tensors with more rows than the run keeps (positions)

  def architecture(self, model_cfg: Any) -> str:
    return self.config(model_cfg, 0)["architectures"][0]

  def to_hf(self, model_cfg: Any, params: Any) -> dict[str, np.ndarray]:
    """s24jax params -> the HF class's state dict (float32 numpy)."""
    out = {}
    for name, path, _ in self.top:
      out[name] = np32(state_lib.get_path(params, path))
    for i, block in enumerate(_blocks(model_cfg, params, self.block_ours)):
      for name, path, transpose in self.block_tensors(model_cfg):
        x = np32(state_lib.get_path(block, path))
        out[f"{self.prefix}{self.block_hf}.{i}.{name}"] = np.ascontiguousarray(x.T) if transpose else x
    return out

  def from_hf(self, model_cfg: Any, hf: dict[str, np.ndarray], template: Any,
              where: str) -> Any:
    """The HF state dict -> s24jax params of the shapes of `template` (arrays or
    ShapeDtypeStructs). Embeddings may have fewer rows (padded with their mean), positions
    more (the first seq_len are kept)."""
    shapes = {k: tuple(v.shape) for k, v in
              flax.traverse_util.flatten_dict(flax.core.unfreeze(template)).items()}
    out = {}

    def put(key: tuple[str, ...], name: str, x: np.ndarray) -> None:
      if key not in shapes or tuple(x.shape) != shapes[key]:
        raise ExportError(f"{where}: {name} gives {tuple(x.shape)}, the run needs "
                          f"{shapes.get(key)} at {'/'.join(key)}")
      out[key] = np.ascontiguousarray(x, dtype=np.float32)

    def get(name: str) -> np.ndarray:
      x = hf.get(name, hf.get(name[len(self.prefix):] if name.startswith(self.prefix) else name))
      if x is None:
        raise ExportError(f"{where}: no tensor {name!r} (a {self.architecture(model_cfg)} "
                          "has it)")
      return np.asarray(x, dtype=np.float32)

    for name, path, pad in self.top:
      x = get(name)
      rows = shapes.get(path, (0,))[0]
      if pad and x.ndim == 2 and x.shape[0] < rows:   # the run's padded rows: the mean row
        x = np.concatenate([x, np.repeat(x.mean(0, keepdims=True), rows - x.shape[0], 0)])
      if name in self.truncate and x.ndim == 2:
        x = x[:model_cfg.seq_len]
      put(path, name, x)
    for name, path, transpose in self.block_tensors(model_cfg):
      hf_name = lambda i, name=name: f"{self.prefix}{self.block_hf}.{i}.{name}"  # pylint: disable=unnecessary-lambda-assignment
      per_layer = [get(hf_name(i)) for i in range(model_cfg.num_layers)]
      per_layer = [x.T if transpose else x for x in per_layer]
      if model_cfg.scan_layers:
        put((self.block_ours, *path), hf_name("*"), np.stack(per_layer))
      else:
        for i, x in enumerate(per_layer):
          put((f"{self.block_ours}_{i}", *path), hf_name(i), x)
    first = self.block_tensors(model_cfg)[0][0]
    extra = f"{self.prefix}{self.block_hf}.{model_cfg.num_layers}.{first}"
    if extra in hf or extra[len(self.prefix):] in hf:
      raise ExportError(f"{where}: has more than the run's {model_cfg.num_layers} layers")
    missing = sorted("/".join(k) for k in set(shapes) - set(out))
    if missing:
      raise ExportError(f"{where}: nothing in a {self.architecture(model_cfg)} for the run's "
                        f"{', '.join(missing)}")
    return flax.traverse_util.unflatten_dict(out)


# ---------------------------------------------------------------------------------------------
# GPT-2.


def _gpt2_unsupported(model_cfg: Any) -> list[str]:
  problems = []
  if model_cfg.activation not in GPT2_ACTIVATIONS:
    problems.append(f"the {model_cfg.activation!r} FFN is gated (value * act(gate)); GPT-2's "
                    "MLP has no gate")
  return problems + _shared_problems(model_cfg, "GPT-2")


def _gpt2_config(model_cfg: Any, eot: int) -> dict[str, Any]:
  return {
      "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
      "vocab_size": model_cfg.vocab_size, "n_positions": model_cfg.seq_len,
      "n_embd": model_cfg.d_model, "n_layer": model_cfg.num_layers,
      "n_head": model_cfg.num_heads, "n_inner": model_cfg.mlp_hidden,
      "activation_function": GPT2_ACTIVATIONS.get(model_cfg.activation),
      "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
      "layer_norm_epsilon": LAYER_NORM_EPS, "initializer_range": 0.02,
      "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
      "reorder_and_upcast_attn": False, "add_cross_attention": False,
      "tie_word_embeddings": True, "use_cache": True,
      "bos_token_id": eot, "eos_token_id": eot, "dtype": "float32", "torch_dtype": "float32",
  }


def _gpt2_config_problems(cfg: dict[str, Any], model_cfg: Any) -> list[str]:
  want = {"model_type": "gpt2", "n_layer": model_cfg.num_layers, "n_head": model_cfg.num_heads,
          "n_embd": model_cfg.d_model}
  wrong = [f"{k}={cfg.get(k)!r} (the run: {v!r})" for k, v in want.items() if cfg.get(k) != v]
  have_inner = cfg.get("n_inner") or 4 * cfg.get("n_embd", 0)
  if have_inner != model_cfg.mlp_hidden:
    wrong.append(f"n_inner={have_inner} (the run: {model_cfg.mlp_hidden})")
  act = HF_TO_ACTIVATION.get(cfg.get("activation_function", "gelu_new"))
  if act != model_cfg.activation:
    wrong.append(f"activation_function={cfg.get('activation_function')!r} (the run: "
                 f"{model_cfg.activation!r}, i.e. {GPT2_ACTIVATIONS.get(model_cfg.activation)!r})")
  for flag, value in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
    if cfg.get(flag, value) != value:
      wrong.append(f"{flag}={cfg.get(flag)!r} (s24jax's attention: {value})")
  return wrong


_GPT2_BLOCK = (
    ("ln_1.weight", ("ln_1", "scale"), False), ("ln_1.bias", ("ln_1", "bias"), False),
    ("attn.c_attn.weight", ("attn", "qkv", "kernel"), True),
    ("attn.c_attn.bias", ("attn", "qkv", "bias"), False),
    ("attn.c_proj.weight", ("attn", "out", "kernel"), True),
    ("attn.c_proj.bias", ("attn", "out", "bias"), False),
    ("ln_2.weight", ("ln_2", "scale"), False), ("ln_2.bias", ("ln_2", "bias"), False),
    ("mlp.c_fc.weight", ("mlp", "fc", "kernel"), True),
    ("mlp.c_fc.bias", ("mlp", "fc", "bias"), False),
    ("mlp.c_proj.weight", ("mlp", "proj", "kernel"), True),
    ("mlp.c_proj.bias", ("mlp", "proj", "bias"), False),
)

GPT2 = Layout(
    prefix="transformer.", block_hf="h", block_ours="h",
    top=(("transformer.wte.weight", ("wte", "embedding"), True),
         ("transformer.wpe.weight", ("wpe",), False),
         ("transformer.ln_f.weight", ("ln_f", "scale"), False),
         ("transformer.ln_f.bias", ("ln_f", "bias"), False)),
    block_tensors=lambda _: _GPT2_BLOCK, unsupported=_gpt2_unsupported, config=_gpt2_config,
    config_problems=_gpt2_config_problems, truncate=("transformer.wpe.weight",))


# ---------------------------------------------------------------------------------------------
# Llama-style (LlamaForCausalLM, or ArceeForCausalLM for an ungated FFN).


def _llama_unsupported(model_cfg: Any) -> list[str]:
  problems = []
  if model_cfg.activation not in LLAMA_ACTIVATIONS:
    problems.append(f"the FFN activation {model_cfg.activation!r}: transformers' Llama "
                    f"classes are written for {sorted(LLAMA_ACTIVATIONS)} here")
  return problems + _shared_problems(model_cfg, "a Llama-style model")


def _llama_config(model_cfg: Any, eot: int) -> dict[str, Any]:
  gated = model_cfg.activation in activations.GATED
  arch, kind = ("LlamaForCausalLM", "llama") if gated else ("ArceeForCausalLM", "arcee")
  return {
      "architectures": [arch], "model_type": kind,
      "vocab_size": model_cfg.vocab_size, "hidden_size": model_cfg.d_model,
      "intermediate_size": model_cfg.mlp_hidden, "num_hidden_layers": model_cfg.num_layers,
      "num_attention_heads": model_cfg.num_heads, "num_key_value_heads": model_cfg.kv_heads,
      "head_dim": model_cfg.d_model // model_cfg.num_heads,
      "hidden_act": LLAMA_ACTIVATIONS.get(model_cfg.activation),
      "max_position_embeddings": model_cfg.seq_len, "rms_norm_eps": model_cfg.norm_eps,
      "rope_theta": model_cfg.rope_base,
      "rope_parameters": {"rope_type": "default", "rope_theta": model_cfg.rope_base},
      "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
      "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
      "bos_token_id": eot, "eos_token_id": eot, "dtype": "float32", "torch_dtype": "float32",
  }


def _llama_config_problems(cfg: dict[str, Any], model_cfg: Any) -> list[str]:
  ours = _llama_config(model_cfg, 0)
  keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "hidden_act", "rms_norm_eps")
  wrong = [f"{k}={cfg.get(k)!r} (the run: {ours[k]!r})" for k in keys if cfg.get(k) != ours[k]]
  kv = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
  if kv != model_cfg.kv_heads:
    wrong.append(f"num_key_value_heads={kv} (the run: {model_cfg.kv_heads})")
  theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
  rope_type = (cfg.get("rope_parameters") or {}).get("rope_type", "default")
  if theta != model_cfg.rope_base or rope_type != "default":
    wrong.append(f"rope {rope_type!r} theta={theta} (the run: 'default', "
                 f"model.rope_base={model_cfg.rope_base})")
  for flag in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
    if cfg.get(flag):
      wrong.append(f"{flag}=true (s24jax's Llama-style model has none)")
  return wrong


def _llama_block(model_cfg: Any) -> tuple[tuple[str, tuple[str, ...], bool], ...]:
  gate = ((("mlp.gate_proj.weight", ("mlp", "gate", "kernel"), False),)
          if model_cfg.activation in activations.GATED else ())
  return (
      ("input_layernorm.weight", ("attn_norm", "scale"), False),
      ("self_attn.q_proj.weight", ("attn", "q", "kernel"), False),
      ("self_attn.k_proj.weight", ("attn", "k", "kernel"), False),
      ("self_attn.v_proj.weight", ("attn", "v", "kernel"), False),
      ("self_attn.o_proj.weight", ("attn", "o", "kernel"), False),
      ("post_attention_layernorm.weight", ("mlp_norm", "scale"), False),
      *gate,
      ("mlp.up_proj.weight", ("mlp", "up", "kernel"), False),
      ("mlp.down_proj.weight", ("mlp", "down", "kernel"), False),
  )


LLAMA = Layout(
    prefix="model.", block_hf="layers", block_ours="h",
    top=(("model.embed_tokens.weight", ("embed", "embedding"), True),
         ("model.norm.weight", ("norm", "scale"), False),
         ("lm_head.weight", ("lm_head", "kernel"), True)),
    block_tensors=_llama_block, unsupported=_llama_unsupported, config=_llama_config,
    config_problems=_llama_config_problems)

LAYOUTS = {"gpt2": GPT2, "llama": LLAMA}


def layout(model_cfg: Any) -> Layout:
  if model_cfg.family not in LAYOUTS:
    raise ExportError(f"model.family={model_cfg.family!r} has no Hugging Face layout; "
                      f"valid: {sorted(LAYOUTS)}")
  return LAYOUTS[model_cfg.family]
