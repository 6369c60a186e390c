"""The argument checks every s24jax command shares (argparse `type=` functions): numbers in
range, files and folders of the right kind, places to write. Each raises
argparse.ArgumentTypeError with the reason, which `command.Parser` prints as one line (exit
code 2). Places to write are checked as destinations.py checks them (before any work: a
folder that exists or can be made, writable; an existing file only if it is the command's own
output, recognised by its content).
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Callable

from s24jax import destinations


def integer(*, minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
  """An integer in [minimum, maximum]."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if minimum is not None and value < minimum:
      raise argparse.ArgumentTypeError(f"{value} is below the minimum, {minimum}")
    if maximum is not None and value > maximum:
      raise argparse.ArgumentTypeError(f"{value} is above the maximum, {maximum}")
    return value
  return parse


def number(*, above: float | None = None, minimum: float | None = None) -> Callable[[str], float]:
  """A finite number, greater than `above` and at least `minimum` (NaN and infinities are
  refused: no budget or time is either)."""
  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
      raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    if above is not None and value <= above:
      raise argparse.ArgumentTypeError(f"{value:g} must be greater than {above:g}")
    if minimum is not None and value < minimum:
      raise argparse.ArgumentTypeError(f"{value:g} is below the minimum, {minimum:g}")
    return value
  return parse


def _exists(path: str) -> str:
  if os.path.islink(path) and not os.path.exists(path):
    raise argparse.ArgumentTypeError(f"{path} is a symbolic link to "
                                     f"{os.readlink(path)}, which does not exist")
  if not os.path.exists(path):
    raise argparse.ArgumentTypeError(f"{path} does not exist")
  return path


def input_file(what: str, kind: Callable[[str], str | None] | None = None
               ) -> Callable[[str], str]:
  """An existing, readable file (not a folder); `kind(path)`: None if it is `what`, else why
  not (e.g. 'not JSON', 'another format')."""
  def parse(path: str) -> str:
    _exists(path)
    if os.path.isdir(path):
      raise argparse.ArgumentTypeError(f"{path} is a folder, not {what}")
    if not os.access(path, os.R_OK):
      raise argparse.ArgumentTypeError(f"{path} cannot be read (permission denied)")
    why = kind(path) if kind is not None else None
    if why:
      raise argparse.ArgumentTypeError(f"{path} is not {what}: {why}")
    return path
  return parse


def input_folder(what: str, kind: Callable[[str], str | None] | None = None
                 ) -> Callable[[str], str]:
  """An existing folder (a file, a dangling link: said as such); `kind` as for input_file."""
  def parse(path: str) -> str:
    _exists(path)
    if not os.path.isdir(path):
      raise argparse.ArgumentTypeError(f"{path} is a file, not {what}")
    why = kind(path) if kind is not None else None
    if why:
      raise argparse.ArgumentTypeError(f"{path} is not {what}: {why}")
    return path
  return parse


def output_file(what: str, flag: str, replaces: Callable[[str], bool] | None = None
                ) -> Callable[[str], str]:
  """A file the command may write: its folder writable (made if missing), never a folder,
  and an existing file only if `replaces(path)` recognises it as the command's own output
  (destinations.check_file). Nothing is written by the check."""
  def parse(path: str) -> str:
    try:
      destinations.check_file(path, what=what, flag=flag,
                              replaces=replaces or (lambda p: False))
    except destinations.DestinationError as e:
      raise argparse.ArgumentTypeError(str(e)) from None
    return path
  return parse


def output_folder(what: str, flag: str) -> Callable[[str], str]:
  """A folder the command may write in (existing or to be made), writable."""
  def parse(path: str) -> str:
    try:
      destinations.check_folder(path, what=what, flag=flag)
    except destinations.DestinationError as e:
      raise argparse.ArgumentTypeError(str(e)) from None
    return path
  return parse
