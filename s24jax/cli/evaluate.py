"""Zero-shot evaluation of a run, offline: `python -m s24jax.cli.evaluate`.

    python -m s24jax.cli.evaluate --workdir runs/demo --tasks piqa,hellaswag,lambada [--step N]
        [--limit K] [--json OUT]

scores the checkpoint of step N (default: the newest) on log-likelihood tasks: OLMo's request
files (s24jax/data/olmo_tasks.py: arc_easy, arc_challenge, boolq, csqa, hellaswag,
openbookqa, piqa, sciq, socialiqa, winogrande in their zero-shot `rc_0shot` form, lambada;
'task:format' for another format, or a path to a requests file). `--limit K` scores the first
K documents of each task. It prints a table and writes JSON (every request's log-likelihood
included) to --json, default <workdir>/zero_shot/step_<N>.json: checked first (a folder this
process can write; an existing file only if it is an earlier report; none of the run's own
entries, e.g. checkpoints/, which its next save prunes), printed before it is written, written
whole (s24jax/destinations.py; a failed write: exit code 5, the table stays; README, "Exit
codes").

The model is the one the run computes with at that step (trained_lib.computed_params, which the
JSON names): W~ = S(W) of a 2:4 method, beta S(W) of S-STE, the dense W after dense
fine-tuning; as float32 GEMMs (--dtype), without the FP8 simulation of training, so the scores
are those of the model `python -m s24jax.cli.export` writes.

What is scored. Context and continuation are tokenized separately (OLMo's way, olmo_eval
tasks.py `OEEvalTask.prep_examples`) with the run's tokenizer (GPT-2 BPE or bytes); no token is
put before the context (lm-eval's and OLMo's GPT-2 setting; --prefix_eot puts the document
separator there, and an empty context always gets it). The log-likelihood of a continuation is
the sum of log p(token | everything before it) over its tokens, the log-softmax taken over the
model's whole (padded) vocabulary, as in training. A request longer than the model's seq_len
keeps the tokens nearest the continuation (left truncation, as lm-eval and OLMo do); a
continuation longer than seq_len is scored in windows of at most seq_len predicted tokens, each
with as much preceding context as fits.

Metrics, per task: `DEFINITIONS` below, each with its source (also in every report); acc is
greedy decoding's for documents with one continuation (LAMBADA).

Batching: requests become rows of at most seq_len tokens, grouped by length into buckets of
powers of two and batched by --batch_tokens (one batch shape per bucket: one compilation
each), padded on the right, where causal attention cannot see the padding and a mask leaves it
out of every sum: a request's score does not depend on its batch (tests/cli/test_evaluate.py
checks it alone against in a padded batch).
"""
from __future__ import annotations

from s24jax.cli import command

NAME = "s24jax.cli.evaluate"
if __name__ == "__main__":
  command.guard_startup(NAME)

# pylint: disable=wrong-import-position  (after the guard: Ctrl-C during imports is one line)
import argparse
import dataclasses
import functools
import json
import math
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from s24jax import destinations
from s24jax import errors
from s24jax.cli import args as args_lib
from s24jax.kernels import aot
from s24jax.training import platform_dtypes
from s24jax.training import trained as trained_lib
from s24jax.training import workdir as workdir_lib
from s24jax.nn import model as model_lib
from s24jax.data import olmo_tasks
from s24jax.data import tokenizer as tokenizer_lib

DEFINITIONS = {
    "acc": "argmax of the summed continuation log-likelihoods (ll) is the gold one (OLMo "
           "acc_raw, lm-eval acc); one continuation: greedy decoding gives it, each token the "
           "argmax of its logits (lm-eval is_greedy, LAMBADA's last-word accuracy)",
    "acc_per_char": "argmax of ll / characters of the continuation, its leading space included "
                    "(OLMo/OLMES acc_per_char: olmo_eval/metrics.py, ICLMetric 'len_norm')",
    "acc_norm": "argmax of ll / characters without the leading space (lm-eval acc_norm: "
                "lm_eval/api/task.py process_results, len(choice) without the delimiter ' ')",
    "acc_per_token": "argmax of ll / continuation tokens (OLMES acc_per_token)",
    "bpb": "bits per UTF-8 byte of the gold continuation, -ll / ln 2 / bytes, mean over "
           "documents (OLMo bpb, ICLMetric.compute; LAMBADA's primary, logits_per_byte)",
    "perplexity": "exp(-mean ll over documents) (lm-eval lambada perplexity)",
    "chance": "random guess: mean over documents of 1 / number of continuations",
}
PRIMARY = {"acc_raw": "acc", "acc_per_char": "acc_per_char", "acc_per_token": "acc_per_token",
           "logits_per_byte": "bpb", "acc_uncond": "acc"}
MIN_BUCKET = 8
_a_report = destinations.json_with_keys("definitions", "tasks")   # an earlier report's keys


class EvalError(errors.UserError):
  """Bad input to the evaluation (the message says what)."""


# ---------------------------------------------------------------------------------------------
# Rows: what one forward pass scores.


@dataclasses.dataclass(frozen=True)
class Row:
  request: int         # index of the request it scores (part of)
  inputs: np.ndarray   # (n,) token ids, n <= seq_len
  targets: np.ndarray  # (n,) the next token of each input position
  first: int           # positions >= first predict continuation tokens


def rows_of(request: int, context: Sequence[int], continuation: Sequence[int],
            seq_len: int) -> list[Row]:
  """The rows scoring `continuation` after `context` (module docstring: truncation and
  windows). `context` must not be empty."""
  full = list(context) + list(continuation)
  c, end_all = len(context), len(full)
  out = []
  for start in range(c, end_all, seq_len):     # predict positions [start, end)
    end = min(start + seq_len, end_all)
    s = max(0, end - 1 - seq_len)              # the input window full[s:end-1]
    out.append(Row(request, np.asarray(full[s:end - 1], np.int32),
                   np.asarray(full[s + 1:end], np.int32), start - 1 - s))
  return out


def bucket(n: int, seq_len: int) -> int:
  """The length a row of `n` tokens is padded to: a power of two, >= MIN_BUCKET, <= seq_len."""
  return min(max(MIN_BUCKET, 1 << (n - 1).bit_length()), seq_len)


# ---------------------------------------------------------------------------------------------
# The scorer.


@functools.partial(jax.jit, static_argnames=("model",))
def score_batch(params: Any, tokens: jax.Array, targets: jax.Array, mask: jax.Array, *,
                model: Any) -> tuple[jax.Array, jax.Array]:
  """(summed log-likelihood of the masked targets, whether each is the argmax) per row."""
  logits = model.apply({"params": params}, tokens).astype(jnp.float32)      # (B, L, V)
  logp = jax.nn.log_softmax(logits, axis=-1)
  picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]   # (B, L)
  ll = jnp.sum(jnp.where(mask, picked, 0.0), axis=-1)
  greedy = jnp.all(jnp.where(mask, jnp.argmax(logits, axis=-1) == targets, True), axis=-1)
  return ll, greedy


@dataclasses.dataclass
class Scorer:
  """Scores (context, continuation) token pairs with a model (model_lib.build's) and its
  (computed) params."""
  model: Any
  params: Any
  batch_tokens: int = 0     # tokens per batch (rows x bucket length); 0: by vocabulary size

  @property
  def seq_len(self) -> int:
    return self.model.config.seq_len

  def tokens_per_batch(self) -> int:
    if self.batch_tokens:
      return self.batch_tokens
    # ~256 MB of float32 logits per batch, at least one full row.
    budget = 2 ** int(math.log2(max(1, (1 << 26) // self.model.config.vocab_size)))
    return max(self.seq_len, min(16384, budget))

  def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
            desc: str = "", progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(log-likelihood, greedy) of each pair's continuation, float64 and bool arrays."""
    rows = [r for i, (ctx, cont) in enumerate(pairs) for r in rows_of(i, ctx, cont, self.seq_len)]
    ll, greedy = np.zeros(len(pairs), np.float64), np.ones(len(pairs), bool)
    groups: dict[int, list[Row]] = {}
    for r in rows:
      groups.setdefault(bucket(len(r.inputs), self.seq_len), []).append(r)
    bar = tqdm(total=len(rows), desc=desc, unit="row", disable=not progress, leave=False,
               dynamic_ncols=True, mininterval=1.0)
    for length in sorted(groups, reverse=True):
      group = groups[length]
      # Rows per batch: the budget's, or for a small group the next power of two (one shape
      # per bucket: a single compilation each).
      per = max(1, min(self.tokens_per_batch() // length, 1 << (len(group) - 1).bit_length()))
      for i in range(0, len(group), per):
        batch = group[i:i + per]
        tokens, targets = np.zeros((2, per, length), np.int32)
        mask = np.zeros((per, length), bool)
        for j, r in enumerate(batch):
          n = len(r.inputs)
          tokens[j, :n], targets[j, :n] = r.inputs, r.targets
          mask[j, r.first:n] = True
        b_ll, b_greedy = jax.device_get(score_batch(self.params, tokens, targets, mask,
                                                    model=self.model))
        for j, r in enumerate(batch):
          ll[r.request] += float(b_ll[j])
          greedy[r.request] &= bool(b_greedy[j])
        bar.update(len(batch))
    bar.close()
    return ll, greedy


def scorer_for(model_cfg: model_lib.ModelConfig, params: Any, sparsity: Any, *,
               dtype: str = "float32", batch_tokens: int = 0) -> Scorer:
  """The scorer of a model: its computed weights (trained_lib.computed_params) in its dense
  twin (trained_lib.dense_config)."""
  cfg = trained_lib.dense_config(model_cfg, dtype)
  weights = trained_lib.computed_params(model_cfg, params, sparsity)
  return Scorer(model_lib.build(cfg), jax.device_put(weights), batch_tokens)


# ---------------------------------------------------------------------------------------------
# Tasks.


def encode(task: olmo_tasks.Task, tok: tokenizer_lib.Tokenizer, prefix_eot: bool = False
           ) -> list[tuple[list[int], list[int]]]:
  """(context ids, continuation ids) of every request of the task, in document order."""
  reqs = [r for d in task.docs for r in d.requests]
  contexts = sorted({r.context for r in reqs})
  ctx_ids = dict(zip(contexts, tok.encode_ordinary_batch(contexts)))
  conts = tok.encode_ordinary_batch([r.continuation for r in reqs])
  out = []
  for r, cont in zip(reqs, conts):
    ctx = list(ctx_ids[r.context])
    if prefix_eot or not ctx:
      ctx = [tok.eot_token] + ctx
    if not cont:
      raise EvalError(f"{task.key}: document {r.doc_id}'s continuation {r.idx} "
                      f"({r.continuation!r}) has no tokens")
    out.append((ctx, list(cont)))
  return out


def task_metrics(task: olmo_tasks.Task, ll: np.ndarray, greedy: np.ndarray,
                 n_tokens: Sequence[int]) -> dict[str, float]:
  """The task's metrics from its requests' scores (in document order; module docstring)."""
  mc = {k: [] for k in ("acc", "acc_per_char", "acc_norm", "acc_per_token")}
  bpb, single_ll, single_acc, chance = [], [], [], []
  i = 0
  for doc in task.docs:
    k = len(doc.requests)
    lls = ll[i:i + k]
    conts, gold = [r.continuation for r in doc.requests], doc.gold
    bpb.append(-lls[gold] / math.log(2) / max(1, len(conts[gold].encode("utf-8"))))
    if k == 1:
      single_ll.append(lls[0])
      single_acc.append(float(greedy[i]))
    else:
      chars = np.array([max(1, len(c)) for c in conts], np.float64)
      chars_nls = np.array([max(1, len(c) - c.startswith(" ")) for c in conts], np.float64)
      toks = np.array(n_tokens[i:i + k], np.float64)
      for name, norm in (("acc", 1.0), ("acc_per_char", chars), ("acc_norm", chars_nls),
                         ("acc_per_token", toks)):
        mc[name].append(float(np.argmax(lls / norm) == gold))
      chance.append(1.0 / k)
    i += k
  out: dict[str, float] = {}
  if chance:
    out.update({name: float(np.mean(v)) for name, v in mc.items()})
    out["chance"] = float(np.mean(chance))
  if single_ll:
    out["acc" if not chance else "acc_single"] = float(np.mean(single_acc))
    out["perplexity"] = float(math.exp(-np.mean(single_ll)))
  out["bpb"] = float(np.mean(bpb))
  return out


def primary_metric(task: olmo_tasks.Task) -> str:
  name = PRIMARY.get(task.primary_metric or "")
  return name or ("acc_per_char" if task.multiple_choice else "acc")


def evaluate_task(scorer: Scorer, task: olmo_tasks.Task, tok: tokenizer_lib.Tokenizer, *,
                  prefix_eot: bool = False, progress: bool = True) -> dict[str, Any]:
  pairs = encode(task, tok, prefix_eot)
  ll, greedy = scorer.score(pairs, desc=task.key, progress=progress)
  metrics = task_metrics(task, ll, greedy, [len(c) for _, c in pairs])
  truncated = sum(len(ctx) + len(cont) - 1 > scorer.seq_len for ctx, cont in pairs)
  reqs = [r for d in task.docs for r in d.requests]
  return {
      "task": task.name, "format": task.format, "source": task.source,
      "docs": len(task.docs), "requests": len(reqs), "primary": primary_metric(task),
      "metrics": metrics, "truncated_requests": int(truncated),
      "per_request": [{"doc_id": r.doc_id, "idx": r.idx, "ll": float(l), "greedy": bool(g),
                       "tokens": len(c)}
                      for r, l, g, (_, c) in zip(reqs, ll, greedy, pairs)],
  }


def evaluate(trained: trained_lib.Trained, tasks: Sequence[olmo_tasks.Task], *,
             dtype: str = "float32", batch_tokens: int = 0, prefix_eot: bool = False,
             progress: bool = True) -> dict[str, Any]:
  """The report of the (loaded) `tasks` on a restored run (JSON-ready)."""
  tok = tokenizer_lib.by_name(trained.tokenizer)
  scorer = scorer_for(trained.model_cfg, trained.params, trained.sparsity, dtype=dtype,
                      batch_tokens=batch_tokens)
  start = time.perf_counter()
  results = {t.key: evaluate_task(scorer, t, tok, prefix_eot=prefix_eot, progress=progress)
             for t in tasks}
  return {
      "workdir": trained.workdir, "step": trained.step, "method": trained.spec.method.name,
      "model": trained.model_cfg.describe(), "weights": trained_lib.weights_statement(trained),
      "tokenizer": tok.name, "dtype": dtype, "prefix_eot": prefix_eot,
      "seconds": round(time.perf_counter() - start, 2), "definitions": DEFINITIONS,
      "tasks": results,
  }


COLUMNS = ("acc", "acc_per_char", "acc_norm", "bpb", "chance")


def format_table(report: dict[str, Any]) -> str:
  lines = [f"{report['workdir']} step {report['step']} ({report['model']})",
           f"weights: {report['weights']}",
           "| task | docs | " + " | ".join(COLUMNS) + " | primary |",
           "|---|---:|" + "---:|" * len(COLUMNS) + "---|"]
  for key, r in report["tasks"].items():
    m = r["metrics"]
    cells = [f"{m[c]:.4f}" if c in m else "" for c in COLUMNS]
    lines.append(f"| {key} | {r['docs']} | " + " | ".join(cells) + f" | {r['primary']} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  """The command under the shared error path: its exit code (a bad argument: SystemExit 2)."""
  return command.run(_main, argv, name=NAME, stopped="no report was written (--json is as it "
                     "was): run it again")


def _main(argv: list[str] | None) -> int:
  p = command.Parser(prog=NAME, usage="python -m %(prog)s --workdir W --tasks T [options]",
                     description="Zero-shot log-likelihood tasks on a run's checkpoint.")
  add = p.add_argument
  add("--workdir", required=True, type=args_lib.input_folder("a run's workdir"))
  add("--tasks", required=True, type=_tasks,
      help="comma-separated: piqa,hellaswag,lambada,... (task:format, or a requests.jsonl(.gz))")
  add("--step", type=args_lib.integer(minimum=0), help="the checkpoint (default: the newest)")
  add("--limit", type=args_lib.integer(minimum=1), help="the first K documents of each task")
  add("--json", help="where to write the report (default <workdir>/zero_shot/step_<N>.json)")
  add("--dtype", default="float32", choices=("auto",) + platform_dtypes.FLOATS)
  add("--batch_tokens", type=args_lib.integer(minimum=0), default=0, help="0: ~256 MB of logits")
  add("--prefix_eot", action="store_true", help="the document separator before every context")
  add("--cache_dir", help="the OLMo requests' cache (default $S24JAX_CACHE or ~/.cache/s24jax)")
  add("--no_progress", action="store_true")
  args = p.parse_args(argv)
  aot.cpu_unless_gpu()   # no CUDA start-up noise where the optional compile plugin sits idle
  platform_dtypes.check(args.dtype, field="--dtype")   # the run's check, naming the flag
  _check_report_path(args.json, args.workdir)   # first: no scores that could not be saved
  # Unknown tasks fail before the checkpoint is read (the requests may be fetched once).
  with destinations.writing("the request files' cache", "Nothing was written; give "
                            "--cache_dir a folder this process can write",
                            str(olmo_tasks.cached_wheel(args.cache_dir).parent),
                            destinations.DestinationError):
    loaded = [olmo_tasks.load_task(t, limit=args.limit, cache_dir=args.cache_dir)
              for t in args.tasks]
  trained = trained_lib.load_run(args.workdir, args.step)
  path = args.json or os.path.join(trained.workdir, "zero_shot", f"step_{trained.step}.json")
  _check_report_path(path, trained.workdir)
  report = evaluate(trained, loaded, dtype=args.dtype, batch_tokens=args.batch_tokens,
                    prefix_eot=args.prefix_eot, progress=not args.no_progress)
  report["limit"] = args.limit
  print(format_table(report))   # the scores on the terminal before any write
  with destinations.writing(f"the report {path}", "The table above holds the scores; the "
                            "file is as it was", os.path.dirname(os.path.abspath(path))):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    destinations.write_atomic(path, json.dumps(report, indent=1), replaces=_a_report,
                              what="an evaluation report")
  print(f"wrote {path}")
  return errors.EXIT_OK


def _tasks(text: str) -> list[str]:
  """--tasks: names, or paths to request files (a folder, a dangling link: said as such)."""
  names = [t.strip() for t in text.split(",") if t.strip()]
  for path in (t for t in names if os.sep in t and os.path.lexists(t)):
    args_lib.input_file("a requests file")(path)
  if not names:
    raise argparse.ArgumentTypeError("names no task; e.g. --tasks piqa,hellaswag,lambada")
  return names


def _check_report_path(path: str | None, workdir: str) -> None:
  """The report's file (None: the default's folder) can be written, replaces at most an earlier
  report, and is none of the run's own entries (its next save prunes checkpoints/)."""
  if path is None:
    return destinations.check_folder(os.path.join(workdir, "zero_shot"),
                                     what="the evaluation report", flag="--json")
  for name in workdir_lib.RUN_FOLDERS + workdir_lib.RUN_FILES:
    if destinations.inside(path, os.path.join(workdir, name)):
      where = f"in the run's {name}/" if name in workdir_lib.RUN_FOLDERS else f"the run's {name}"
      raise destinations.DestinationError(
          f"--json {path} is {where}, which the run manages; choose another --json, e.g. "
          f"{os.path.join(workdir, 'zero_shot', 'report.json')} (nothing was written)")
  destinations.check_file(path, what="an evaluation report", flag="--json", replaces=_a_report)


if __name__ == "__main__":
  command.exit_with(main())
