"""A run's model as a Hugging Face `transformers` directory: `python -m s24jax.cli.export`.

    python -m s24jax.cli.export --workdir runs/demo --out runs/demo/hf [--step N]

writes a directory `transformers.AutoModelForCausalLM.from_pretrained` loads (no torch needed
to write it; the MaxText / levanter way): GPT2LMHeadModel for the 'gpt2' family,
LlamaForCausalLM (gated FFN) or ArceeForCausalLM (ungated, e.g. Squared-ReLU) for 'llama'
(s24jax/nn/hf_layouts.py: names, layouts, conventions):
  - config.json: the class's fields; GPT-2: gelu -> 'gelu_new' (s24jax's gelu is the tanh
    form, jax.nn.gelu(approximate=True): s24jax/nn/activations.py), relu -> 'relu', relu2 ->
    'relu2', layer_norm_epsilon 1e-6 (flax's LayerNorm, not GPT-2's 1e-5); no dropout;
  - model.safetensors (safetensors.numpy.save_file(..., metadata={'format': 'pt'}), float32):
    the weights the model computes with at that step (s24jax/training/trained.py, computed_params):
    W~ = S(W) of a 2:4 method, beta S(W) of S-STE, the mask times W of MST, the dense W after
    dense fine-tuning; 2:4-pruned entries are exact zeros. Embeddings keep the model's padded
    rows (50304 for GPT-2's 50257 ids, 320 for the 257 byte ids), so logits and
    log-probabilities are exactly the model's; no token maps to a padded row;
  - the GPT-2 BPE's tokenizer files (s24jax/data/hf_tokenizer.py). UTF-8 bytes have no
    transformers tokenizer: none is written, and s24jax_export.json says how ids are made;
  - s24jax_export.json: the run, the step, which weights, the sparse layers' zero fractions,
    the vocabulary padding, what the export does not carry (FP8 simulation).
Refused, with the reason: what the class's config cannot express (MST's strided /
local_strided attention, V:N:M activation sparsity, GPT-2 with a gated FFN). Such a run's model
at another step (after dense fine-tuning, outside MST's sparse-attention window) may export.

Where it writes is checked before the checkpoint is read (s24jax/destinations.py): never the
workdir, a folder holding it, or one of the run's own folders (its checkpoints); a non-empty
--out only with --overwrite and only if it is an earlier export (it holds s24jax_export.json);
a folder this process can write, with the space the weights need. The directory is written
beside --out and renamed into place at the end (an earlier export is renamed aside first and
removed last): a failure (a full disk: exit code 5, one line) leaves what was there intact.

Two exports to one --out: the second to finish refuses (exit code 3, one line), --out left
as the first wrote it: what --out was at the check is compared with what it is when the
export is renamed into place, under a lock of its folder (`_replace_dir`).

The way back (`--config.init_from`): s24jax/training/init_from.py. Exit codes (README, "Exit
codes"): 0; 2 a user error (an argument, the workdir, --out), one line, nothing written; 3
another command wrote --out meanwhile; 5 a write failed (a full disk), --out as it was; 75
Ctrl-C, --out as it was; 1 a bug.
"""
from __future__ import annotations

from s24jax.cli import command

NAME = "s24jax.cli.export"
if __name__ == "__main__":
  command.guard_startup(NAME)

# pylint: disable=wrong-import-position  (after the guard: Ctrl-C during imports is one line)
import contextlib
import fcntl
import json
import os
import pathlib
import re
import shutil
import tempfile
import uuid
from typing import Any

import numpy as np
from safetensors import numpy as safetensors_np

import s24jax
from s24jax import destinations
from s24jax import errors
from s24jax.cli import args as args_lib
from s24jax.kernels import aot
from s24jax.nn import hf_layouts
from s24jax.nn import model as model_lib
from s24jax import state as state_lib
from s24jax.training import trained as trained_lib
from s24jax.training import workdir as workdir_lib
from s24jax.data import hf_tokenizer
from s24jax.data import tokenizer as tokenizer_lib
from s24jax.methods import base as methods_base
from s24jax.training import init_from

MARKER = hf_tokenizer.MARKER
ExportError = hf_layouts.ExportError


# ---------------------------------------------------------------------------------------------
# Export.


def write_hf_dir(out: str | os.PathLike[str], model_cfg: model_lib.ModelConfig, params: Any,
                 sparsity: Any, tokenizer: str, about: dict[str, Any] | None = None, *,
                 overwrite: bool = False) -> pathlib.Path:
  """Writes the Hugging Face directory of `model_cfg` with the weights `computed_params` gives.
  Written to a temporary folder beside `out`, renamed at the end: a failure leaves nothing."""
  layout = hf_layouts.layout(model_cfg)
  problems = layout.unsupported(model_cfg)
  if problems:
    raise ExportError(f"{layout.architecture(model_cfg)}'s config cannot express this model: "
                      + "; ".join(problems) + ". Nothing was written.")
  out = pathlib.Path(out).expanduser().absolute()
  check_out(out, overwrite)
  seen = _identity(out)   # what --out is now: compared before the rename (module docstring)
  tok = tokenizer_lib.by_name(tokenizer)
  weights = trained_lib.computed_params(model_cfg, params, sparsity)
  state = layout.to_hf(model_cfg, weights)
  paths = state_lib.sparse_layer_paths(sparsity) if model_cfg.sparsity.method.sparse else []
  sparse = {state_lib.layer_name(p): {"zeros": float(np.mean(np.asarray(
      methods_base.kernel_at(weights, p)) == 0))} for p in paths}
  info = {
      **(about or {}), "s24jax_version": s24jax.__version__, "tokenizer": tok.name,
      "tokenizer_files": tokenizer == "gpt2",
      "vocab": {"model_rows": model_cfg.vocab_size, "tokenizer_ids": tok.n_vocab,
                "note": "rows >= tokenizer_ids are the model's padding; no token maps to them"},
      "sparse_layers": sparse, "architecture": layout.architecture(model_cfg),
  }
  if tokenizer == "bytes":
    info["token_ids"] = ("UTF-8 bytes: id = byte value 0-255 (list(text.encode('utf-8'))), "
                         "256 = the document separator; transformers has no such tokenizer, "
                         "none is written")
  need = (sum(np.asarray(v).nbytes for v in state.values()) + (1 << 20)
          + (TOKENIZER_BYTES if tokenizer == "gpt2" else 0))
  destinations.check_folder(str(out.parent), what="the export", flag="--out", need_bytes=need)
  intact = ("The earlier export there is intact." if out.exists() else
            "Nothing was left there.") + " Free space or choose another --out, then run again"
  with destinations.writing(f"the export {out}", intact, str(out.parent)):
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
      os.chmod(tmp, 0o755)   # mkdtemp's 0700 would stay on the renamed directory
      (tmp / "config.json").write_text(json.dumps(layout.config(model_cfg, tok.eot_token),
                                                  indent=2))
      _save_safetensors(state, tmp / init_from.WEIGHTS)
      if tokenizer == "gpt2":
        hf_tokenizer.write_gpt2(tmp, model_cfg.seq_len)
      (tmp / MARKER).write_text(json.dumps(info, indent=2))
      for f in tmp.iterdir():
        os.chmod(f, 0o644)
      _replace_dir(tmp, out, seen)
    finally:
      if tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)
  return out


TOKENIZER_BYTES = 4 << 20   # GPT-2's tokenizer files: 3.1 MB (vocab, merges, tokenizer.json)


def check_out(out: pathlib.Path, overwrite: bool) -> None:
  """--out can take the export (module docstring): not a file; if not empty, replaced only
  with `overwrite` and only if it is an earlier export; its folder writable."""
  if out.is_symlink():   # renamed over, the link (the user's) would be gone, its target kept
    gone = "" if out.exists() else ", which does not exist"
    raise destinations.DestinationError(
        f"--out {out} is a symbolic link to {os.readlink(out)}{gone}: an export replaces a "
        "folder, never a link; give the folder itself or choose another --out (nothing was "
        "written)")
  if out.exists() and not out.is_dir():
    raise destinations.DestinationError(f"--out {out} is a file, not a folder; choose "
                                        "another --out (nothing was written)")
  if out.is_dir() and any(out.iterdir()):
    if not overwrite:
      raise ExportError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    if not (out / MARKER).is_file():
      raise destinations.DestinationError(
          f"--out {out} is not an earlier export (it has no {MARKER}): --overwrite replaces "
          "only those, so it is left as it is; choose another --out (nothing was written)")
  destinations.check_folder(str(out.parent), what="the export", flag="--out")


def _save_safetensors(state: dict[str, np.ndarray], path: pathlib.Path) -> None:
  """safetensors' save_file, a failed write as the OSError it is (the library raises a
  SafetensorError naming it: "I/O error: No space left on device (os error 28)")."""
  try:
    safetensors_np.save_file(state, str(path), metadata={"format": "pt"})
  except Exception as e:  # pylint: disable=broad-except
    code = re.search(r"\(os error (\d+)\)", str(e))
    if code is None:
      raise
    raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from e


class OutChanged(errors.KnownError):
  """Another command wrote --out while this export ran: --out is left as that one made it."""
  exit_code = errors.EXIT_LOCKED


def _identity(out: pathlib.Path) -> tuple[int, int, int] | None:
  """None if `out` does not exist, else its (device, inode, mtime): an export renamed over it,
  or an entry added to or removed from it, changes them."""
  try:
    st = os.stat(out)
  except FileNotFoundError:
    return None
  return st.st_dev, st.st_ino, st.st_mtime_ns


@contextlib.contextmanager
def _locked(folder: pathlib.Path):
  """An exclusive lock of `folder` (flock; released when the block ends, or by the kernel if
  the process dies): exports into one folder place their directories one at a time. On a
  filesystem without locks the comparison in `_replace_dir` stands alone."""
  fd = os.open(folder, os.O_RDONLY)
  try:
    with contextlib.suppress(OSError):
      fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)


def _replace_dir(new: pathlib.Path, out: pathlib.Path, seen: Any) -> None:
  """Renames `new` to `out` if `out` is still what it was at the check (`seen`, _identity's),
  else OutChanged; an existing `out` is renamed aside first (and back if the rename fails)
  and removed last, so one of them is whole at every moment."""
  with _locked(out.parent):
    if _identity(out) != seen:
      raise OutChanged(f"--out {out} was written by another command while this export ran: "
                       "it is left as that one made it and this export was not written; run "
                       "it again (with --overwrite to replace an export) or choose another --out")
    aside = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}") if out.exists() else None
    if aside is not None:
      os.replace(out, aside)
    try:
      os.replace(new, out)
    except BaseException:
      if aside is not None:
        os.replace(aside, out)
      raise
  if aside is not None:
    shutil.rmtree(aside, ignore_errors=True)


def export_run(workdir: str, out: str, step: int | None = None, *,
               overwrite: bool = False) -> dict[str, Any]:
  """Exports the checkpoint of `step` (default: the newest) of a run's workdir to `out`."""
  # Where it writes, before the checkpoint is read: never the run itself.
  destinations.check_apart(out, workdir, flag="--out", keep=workdir_lib.RUN_FOLDERS)
  check_out(pathlib.Path(out).expanduser().absolute(), overwrite)
  trained = trained_lib.load_run(workdir, step)
  about = {"workdir": trained.workdir, "step": trained.step,
           "method": trained.spec.method.name, "model": trained.model_cfg.describe(),
           "weights": trained_lib.weights_statement(trained)}
  try:
    path = write_hf_dir(out, trained.model_cfg, trained.params, trained.sparsity,
                        trained.tokenizer, about, overwrite=overwrite)
  except ExportError as e:
    raise ExportError(f"{trained.workdir} at step {trained.step}: {e}") from None
  return {**about, "out": str(path)}


# ---------------------------------------------------------------------------------------------
# The command line.


def main(argv: list[str] | None = None) -> int:
  """The command (module docstring) under the shared error path: its exit code (a bad
  argument: one line and SystemExit 2)."""
  return command.run(_main, argv, name=NAME, stopped="--out is as it was (an export is "
                     "written whole or not at all): run it again")


def _main(argv: list[str] | None) -> int:
  p = command.Parser(prog=NAME, usage="python -m %(prog)s --workdir W --out DIR [--step N] "
                     "[--overwrite]",
                     description="Writes a run's model as a Hugging Face transformers directory.")
  p.add_argument("--workdir", required=True, type=args_lib.input_folder("a run's workdir"),
                 help="the run's workdir")
  p.add_argument("--out", required=True, help="the directory to write (new or empty)")
  p.add_argument("--step", type=args_lib.integer(minimum=0), default=None,
                 help="the checkpoint (default: the newest)")
  p.add_argument("--overwrite", action="store_true", help="replace an earlier export at --out")
  args = p.parse_args(argv)
  aot.cpu_unless_gpu()   # no CUDA start-up noise where the optional compile plugin sits idle
  info = export_run(args.workdir, args.out, args.step, overwrite=args.overwrite)
  print(f"wrote {info['out']}: {info['model']}, step {info['step']}\n"
        f"weights: {info['weights']}")
  return errors.EXIT_OK


if __name__ == "__main__":
  command.exit_with(main())
