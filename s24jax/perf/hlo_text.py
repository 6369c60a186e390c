"""Optimized HLO text, parsed: the computations and their instructions, the Python stack
frames XLA keeps per instruction, and the shapes, sizes and attributes s24jax/perf/step_census.py
reads from them; and the program of a module without its names (`canonical`). Pure text
processing (no JAX), but `module_text`, which prints a compiled executable."""
from __future__ import annotations

if __name__ == "__main__":   # before the imports: Ctrl-C while starting is one line, exit 75
  from s24jax.cli import command
  command.guard_startup("s24jax.perf.hlo_text")

import dataclasses
import hashlib
import json
import math
import re
from typing import Any, Iterable

FP8_TYPES = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e5m2fnuz", "f8e4m3fnuz", "f8e4m3b11fnuz")
BYTES_PER_ELEMENT = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                     "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                     "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25, "token": 0,
                     **{t: 1 for t in FP8_TYPES}}


@dataclasses.dataclass(frozen=True)
class Instr:
  name: str
  type: str                     # the result type text, tuples included
  opcode: str
  operands: tuple[str, ...]     # instruction names
  attrs: str                    # everything after the operand list
  args: str = ""                # the operand list as written (a parameter's number)
  op_name: str = ""
  frame: int = 0                # stack_frame_id (0: none)


@dataclasses.dataclass
class Computation:
  name: str
  instrs: dict[str, Instr]      # in program order
  root: str


_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
ARRAY = re.compile(r"\b([a-z]+\d*(?:e\dm\d\w*)?)\[([\d,]*)\]")
NAME = re.compile(r"%([\w.\-]+)")
# The tables after the computations: source files, functions, locations, and the stack frames
# that instructions name by stack_frame_id.
STACK_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


# The attributes naming the computations an instruction calls.
CALL_KEYS = ("calls", "to_apply", "body", "condition", "true_computation",
             "false_computation", "branch_computations")


class NotHlo(ValueError):
  """Text `parse` cannot read as an HLO module (another file, or one cut short): the message
  says where."""


def _matching(text: str, start: int) -> int:
  """Index just past the bracket closing the one at text[start]."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack = []
  i = start
  while i < len(text):
    c = text[i]
    if c == '"':
      i = text.index('"', i + 1) if '"' in text[i + 1:] else len(text)
    elif c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
    i += 1
  raise ValueError(f"unbalanced brackets in HLO line: {text[:200]}")


def _parse_instr(line: str) -> Instr | None:
  body = line.strip()
  if body.startswith("ROOT "):
    body = body[5:]
  if not body.startswith("%") or " = " not in body:
    return None
  name, rest = body[1:].split(" = ", 1)
  end = _matching(rest, 0) if rest.startswith("(") else rest.index(" ")
  type_text, rest = rest[:end], rest[end:].lstrip()
  paren = rest.index("(")
  opcode = rest[:paren]
  close = _matching(rest, paren)
  operands = tuple(NAME.findall(rest[paren:close]))
  attrs = rest[close:]
  op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', attrs)
  frame = re.search(r"stack_frame_id=(\d+)", attrs)
  return Instr(name, type_text, opcode, operands, attrs, rest[paren + 1:close - 1],
               op_name.group(1) if op_name else "", int(frame.group(1)) if frame else 0)


@dataclasses.dataclass
class Module:
  computations: dict[str, Computation]
  entry: str
  frames: dict[int, tuple[str, str]]       # stack frame id -> (file, function) of its chain...
  parents: dict[int, int]                  # ... and its caller (0: none)

  def frame_chain(self, frame: int) -> list[tuple[str, str]]:
    """(file, function) of a stack frame and its callers, innermost first."""
    out, seen = [], set()
    while frame and frame not in seen and frame in self.frames:
      seen.add(frame)
      out.append(self.frames[frame])
      frame = self.parents.get(frame, 0)
    return out


def parse(text: str) -> Module:
  """The computations and the stack-frame table of an HLO module's text (NotHlo if it is
  not one)."""
  comps: dict[str, Computation] = {}
  entry, cur, root = "", None, ""
  tables: dict[str, dict[int, str]] = {name: {} for name in STACK_TABLES}
  table = None
  for number, line in enumerate(text.splitlines(), 1):
    if line in tables:
      table = line
      continue
    if table is not None:
      m = re.match(r"^(\d+) (.*)$", line)
      if m:
        tables[table][int(m.group(1))] = m.group(2)
        continue
      table = None
    if cur is None:
      m = _HEADER.match(line)
      if m:
        cur, root = {}, ""
        name = m.group(2)
        if m.group(1):
          entry = name
      continue
    if line.startswith("}"):
      comps[name] = Computation(name, cur, root or (list(cur)[-1] if cur else ""))
      cur = None
      continue
    try:
      instr = _parse_instr(line)
    except ValueError as e:   # str.index's and _matching's: not an instruction's syntax
      raise NotHlo(f"line {number}: not an HLO instruction ({e}): {line.strip()[:120]}") from e
    if instr is not None:
      cur[instr.name] = instr
      if line.lstrip().startswith("ROOT "):
        root = instr.name
  if cur is not None:
    raise NotHlo(f"the text ends inside computation {name!r} (cut short?)")
  if not entry:
    raise NotHlo("no ENTRY computation in it")
  for comp in comps.values():   # a module cut or edited: what it calls is not in the text
    for instr in comp.instrs.values():
      missing = [c for c in callees(instr.attrs, CALL_KEYS) if c not in comps]
      if missing:
        raise NotHlo(f"{instr.name} in {comp.name!r} calls {missing[0]!r}, which the text "
                     "does not hold")
  files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
  funcs = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
  locs = {}
  for k, v in tables["FileLocations"].items():
    f = re.search(r"file_name_id=(\d+)", v)
    fn = re.search(r"function_name_id=(\d+)", v)
    locs[k] = (files.get(int(f.group(1)), "") if f else "",
               funcs.get(int(fn.group(1)), "") if fn else "")
  frames, parents = {}, {}
  for k, v in tables["StackFrames"].items():
    loc = re.search(r"file_location_id=(\d+)", v)
    parent = re.search(r"parent_frame_id=(\d+)", v)
    frames[k] = locs.get(int(loc.group(1)), ("", "")) if loc else ("", "")
    # XLA prints the parent's id plus one (1: no parent).
    parents[k] = int(parent.group(1)) - 1 if parent else 0
  return Module(comps, entry, frames, parents)


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """(element type, dimensions) of every array in a type (a tuple's elements in order)."""
  return [(t, tuple(int(d) for d in dims.split(",") if d))
          for t, dims in ARRAY.findall(type_text) if t in BYTES_PER_ELEMENT]


def nbytes(type_text: str) -> float:
  return float(sum(BYTES_PER_ELEMENT[t] * math.prod(dims) for t, dims in arrays(type_text)))


def elements(type_text: str) -> int:
  return sum(math.prod(dims) for _, dims in arrays(type_text))


def int_list(attrs: str, key: str) -> tuple[int, ...]:
  """`key={1,2}` (HLO attribute) or `"key":["1","2"]` (JSON backend config)."""
  m = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs) or re.search(
      rf'"{key}":\s*\[([\d",\s]*)\]', attrs)
  return tuple(int(d.strip(' "')) for d in m.group(1).split(",") if d.strip(' "')) if m else ()


def callees(attrs: str, keys: Iterable[str]) -> list[str]:
  out = []
  for key in keys:
    for m in re.finditer(rf"\b{key}=(\{{[^}}]*\}}|%[\w.\-]+)", attrs):
      out.extend(NAME.findall(m.group(1)))
  return out


def known_trip_count(attrs: str) -> int | None:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', attrs)
  return int(m.group(1)) if m else None


def ffi_attributes(attrs: str) -> dict[str, str]:
  """An FFI call's backend config, `backend_config={k = 768 : i64, a_dtype = "bf16"}`, as
  {"k": "768", "a_dtype": "bf16"} ({} for a JSON backend config)."""
  m = re.search(r"backend_config=\{([^{}]*)\}", attrs)
  if not m or m.group(1).lstrip().startswith('"'):
    return {}
  out = {}
  for item in m.group(1).split(","):
    if "=" in item:
      key, value = item.split("=", 1)
      out[key.strip()] = value.split(":")[0].strip().strip('"')
  return out


def is_fp8(type_text: str) -> bool:
  return any(t in FP8_TYPES for t, _ in arrays(type_text))


# A constant literal longer than this (characters) is kept as a digest of its text.
LITERAL_DIGEST_OVER = 64
ELIDED = "{...}"   # how XLA prints a large literal unless asked for its values
_METADATA = re.compile(r', metadata=\{(?:[^}"]|"(?:[^"\\]|\\.)*")*\}')


def module_text(compiled: Any) -> str:
  """The optimized HLO text of a compiled jax function (`jax.jit(f).lower(...).compile()`,
  deviceless ones included) as `compiled.as_text()` prints it, but with every constant's
  value: as_text prints a large literal as {...}, so two programs that differ only there
  print alike. (jax's print options are private: jax's own `Lowered.as_text` uses them.)"""
  from jax._src.lib import hlo   # pylint: disable=g-import-not-at-top
  options = hlo.HloPrintOptions()
  options.print_large_constants = True
  return "\n\n".join(m.to_string(options)
                      for m in compiled.runtime_executable().hlo_modules())


def _constants(line: str) -> str:
  """The line with each long constant literal replaced by its digest (LITERAL_DIGEST_OVER);
  raises ValueError at a literal printed without its values (ELIDED)."""
  out, at = [], 0
  for m in re.finditer(r"\bconstant\(", line):
    if m.start() < at:
      continue
    end = _matching(line, m.end() - 1)
    literal = line[m.end():end - 1]
    if literal == ELIDED:
      raise ValueError("HLO text with a constant printed as {...}: its value is not in the "
                       "text, so two programs that differ there would compare equal; print "
                       "the module with hlo_text.module_text(compiled)")
    if len(literal) > LITERAL_DIGEST_OVER:
      literal = "sha256:" + hashlib.sha256(literal.encode()).hexdigest()[:16]
    out.append(line[at:m.end()] + literal + ")")
    at = end
  return "".join(out) + line[at:]


def _backend_config(line: str) -> str:
  """The line with a JSON backend config's keys sorted: XLA's two printers (as_text's and
  module_text's) order them differently."""
  m = re.search(r"backend_config=\{", line)
  if not m:
    return line
  end = _matching(line, m.end() - 1)
  try:
    config = json.loads(line[m.end() - 1:end])
  except ValueError:                              # an FFI call's `{k = 768 : i64, ...}`
    return line
  return (line[:m.end() - 1] + json.dumps(config, sort_keys=True, separators=(",", ":")) +
          line[end:])


def canonical(text: str) -> str:
  """The program of an optimized HLO module's text without what names and source positions
  change: the module's name, metadata, stack frames and their tables, instruction,
  parameter and computation names and numbering, the order of a JSON backend config's keys.
  What runs stays, constants included (a long literal as a digest of its values). Two
  compiles of the same program give the same text, so equal texts mean the same kernels
  (what `python -m s24jax.perf.gpu_report` checks per train step, and tests/sparse_ops/
  test_gemm_choice.py of a step whose GEMMs all run dense).

  Give it `module_text(compiled)`: `compiled.as_text()` prints a large constant as {...},
  without the values that could tell two programs apart, and canonical raises ValueError at
  one rather than call them equal."""
  text = _METADATA.sub("", text)
  text = re.sub(r",? ?stack_frame_id=\d+", "", text)
  lines, table = [], False
  for line in text.splitlines():
    if line in STACK_TABLES:                      # a table, then its rows "1 ..."
      table = True
      continue
    if table and re.match(r"^\d+ ", line):
      continue
    table = False
    if line.startswith("HloModule "):
      line = re.sub(r"^HloModule [^,\s]+", "HloModule m", line)
    elif _HEADER.match(line):                     # its parameters' names, by position
      count = iter(range(line.count(":")))
      line = re.sub(r"([(,] ?)[\w.\-]+: ", lambda m: f"{m.group(1)}p{next(count)}: ", line)
    lines.append(_backend_config(_constants(line)))
  text = re.sub(r"\b(param_\d+)\.\d+", r"\1", "\n".join(lines))
  names: dict[str, str] = {}
  return NAME.sub(lambda m: names.setdefault(m.group(1), f"%v{len(names)}"), text)


if __name__ == "__main__":   # a part of a tool: --help says which (not_a_command.py)
  from s24jax.perf import not_a_command
  raise SystemExit(not_a_command.answer(
      "s24jax.perf.hlo_text", __doc__,
      "python -m s24jax.perf.step_time census --hlo FILE_OR_DUMP_DIR"))
