"""Builds, loads and registers the cuSPARSELt FFI handlers (cusparselt_ffi.cc) on first use.

Built where it runs, with the system C++ compiler (no nvcc: cuSPARSELt is a host API working
on XLA's stream), against this jaxlib's FFI headers (`jax.ffi.include_dir()`) and the
cuSPARSELt and CUDA runtime headers and libraries of the `nvidia-*` wheels
(`pip install -r requirements-gpu.txt`, or `requirements-cusparselt.txt` alone). The shared
library is cached under the s24jax cache (`$S24JAX_CACHE`, else `~/.cache/s24jax`) in
`cusparselt/`, keyed by the jaxlib and cuSPARSELt versions and the hash of the source and the
headers it includes (scratch.h), so an upgrade or an edit rebuilds. The build needs no GPU.

`register()` preloads the wheel's libcudart and libcusparseLt (so the handler's sonames
resolve) and registers the FFI targets of TARGETS for the CUDA platform. Anything missing
raises `Unavailable` with the command that fixes it.

Which cuSPARSELt serves: `serving()` asks the handler library itself (its plain C function
S24jaxCusparseltLibrary: the version cusparseLtGetProperty reports and the file dladdr names
for it), `mapped_files()` lists every libcusparseLt file mapped into the process (two means a
second copy, e.g. torch's, of which only the first loaded serves), and `pinned_version()` is
the version the repository pins (requirements-cusparselt.txt). None of them needs a GPU.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess

import jax
import jaxlib

SOURCE = pathlib.Path(__file__).with_name("cusparselt_ffi.cc")
# The headers SOURCE includes from this folder: part of the cache key.
HEADERS = (pathlib.Path(__file__).with_name("scratch.h"),
           pathlib.Path(__file__).with_name("ffi_support.h"))
# FFI target name -> the handler's symbol in the library. Every target starts with PREFIX:
# kernels.aot.hlo_census counts custom calls by it (the planner's cusparselt_custom_calls).
TARGETS = {"cusparselt_compress": "CusparseltCompress", "cusparselt_spmm": "CusparseltSpmm",
           "cusparselt_search": "CusparseltSearch"}
PREFIX = "cusparselt"
# spmm's algorithm attributes and the values that leave each at the library's own choice
# (cusparselt_ffi.cc's kDefault): algorithms.Algorithm's fields, and its DEFAULT.
ALGORITHM_DEFAULTS = {"alg_id": -1, "split_k": 1, "split_k_mode": 0, "split_k_buffers": 1}
# The handler library's plain C function naming the libcusparseLt that serves it (serving()).
SERVING_SYMBOL = "S24jaxCusparseltLibrary"
# The repository root's pins (a source checkout: the project is installed editable).
REQUIREMENTS = pathlib.Path(__file__).resolve().parents[2] / "requirements-cusparselt.txt"
_PIN = re.compile(r"^\s*nvidia[-_.]+cusparselt[-_.]+cu13\s*==\s*([^\s;#]+)", re.I)
INSTALL_HINT = ("pip install -r requirements-gpu.txt (a GPU host; or requirements-cusparselt.txt: "
                "the wheels alone, e.g. to build on a machine without a GPU)")


class Unavailable(RuntimeError):
  """The cuSPARSELt backend cannot be built or loaded here; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
  """Where the build finds everything: the wheel's CUDA folder (include/, lib/), jaxlib's FFI
  headers, the C++ compiler, and the cuSPARSELt version from its header."""
  cuda_root: pathlib.Path
  ffi_include: pathlib.Path
  compiler: str
  cusparselt_version: str

  @property
  def lib_dir(self) -> pathlib.Path:
    return self.cuda_root / "lib"


def _cuda_root() -> pathlib.Path:
  """The `nvidia/cu13` folder of the installed wheels that has cuSPARSELt and the runtime."""
  spec = importlib.util.find_spec("nvidia")
  roots = [pathlib.Path(p) / "cu13" for p in (spec.submodule_search_locations or [])] if spec else []
  need = ("include/cusparseLt.h", "include/cuda_runtime_api.h", "include/crt/host_defines.h",
          "lib/libcusparseLt.so.0", "lib/libcudart.so.13")
  for root in roots:
    if all((root / n).exists() for n in need):
      return root
  found = [str(r / n) for r in roots for n in need if (r / n).exists()]
  raise Unavailable(
      "sparsity.backend='cusparselt' needs the cuSPARSELt and CUDA runtime wheels "
      f"(nvidia-cusparselt-cu13, nvidia-cuda-runtime, nvidia-cuda-crt): {INSTALL_HINT}. "
      f"Looked for {', '.join(need)} under {[str(r) for r in roots] or 'no nvidia package'}"
      f"{'; found only ' + ', '.join(found) if found else ''}.")


def compiler() -> str:
  """The C++17 compiler the handlers are built with: $CXX, else g++, else c++."""
  found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if not found:
    raise Unavailable("sparsity.backend='cusparselt' builds its FFI handlers with a C++17 "
                      "compiler on first use, and none was found (set CXX, or install g++: "
                      "`apt-get install g++`).")
  return found


def toolchain() -> Toolchain:
  root = _cuda_root()
  cxx = compiler()
  header = (root / "include" / "cusparseLt.h").read_text(errors="replace")
  parts = [re.search(rf"#define CUSPARSELT_VER_{p}\s+(\d+)", header) for p in
           ("MAJOR", "MINOR", "PATCH")]
  version = ".".join(m.group(1) for m in parts) if all(parts) else "unknown"
  return Toolchain(root, pathlib.Path(jax.ffi.include_dir()), cxx, version)


def cache_dir() -> pathlib.Path:
  base = os.environ.get("S24JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                        "s24jax")
  return pathlib.Path(base) / "cusparselt"


def library_path(tools: Toolchain) -> pathlib.Path:
  """The cached library for this jaxlib, this cuSPARSELt, this source and its headers."""
  digest = source_digest()
  return cache_dir() / (f"s24jax_cusparselt_jaxlib{jaxlib.__version__}_"
                        f"cusparselt{tools.cusparselt_version}_{digest}.so")


def source_digest() -> str:
  """A hash of the handlers' source and the headers it includes (the cache key's part)."""
  sha = hashlib.sha256()
  for path in (SOURCE, *HEADERS):
    sha.update(path.name.encode() + b"\0" + path.read_bytes())
  return sha.hexdigest()[:12]


def build_command(tools: Toolchain, out: pathlib.Path) -> list[str]:
  return [tools.compiler, "-std=c++17", "-O2", "-shared", "-fPIC", "-w",
          f"-I{tools.ffi_include}", f"-I{tools.cuda_root / 'include'}", str(SOURCE),
          "-o", str(out), f"-L{tools.lib_dir}", "-l:libcusparseLt.so.0", "-l:libcudart.so.13",
          "-ldl", f"-Wl,-rpath,{tools.lib_dir}"]


def build(*, force: bool = False) -> pathlib.Path:
  """The compiled library, built into the cache if it is not there (atomic: a temporary file
  renamed, so concurrent processes never load half a library)."""
  tools = toolchain()
  out = library_path(tools)
  if out.exists() and not force:
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
  proc = subprocess.run(build_command(tools, tmp), capture_output=True, text=True, check=False)
  if proc.returncode:
    raise Unavailable(f"building the cuSPARSELt FFI handlers failed ({' '.join(proc.args)}):\n"
                      f"{proc.stderr[-4000:]}")
  os.replace(tmp, out)
  return out


@functools.cache
def register() -> pathlib.Path:
  """Builds (if needed), loads and registers the handlers for the CUDA platform, once per
  process. Registration works without a GPU (the deviceless compiles use it)."""
  path = build()
  tools = toolchain()
  for name in ("libcudart.so.13", "libcusparseLt.so.0"):   # the handler's NEEDED sonames
    ctypes.CDLL(str(tools.lib_dir / name), mode=ctypes.RTLD_GLOBAL)
  lib = ctypes.cdll.LoadLibrary(str(path))
  for target, symbol in TARGETS.items():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                platform="CUDA")
  return path


def serving() -> dict[str, str]:
  """The libcusparseLt that serves s24jax's cuSPARSELt calls in this process: {"path": its
  file (symlinks resolved), "version": "MAJOR.MINOR.PATCH" as the library itself reports}.
  Registers the handlers first. No GPU needed: cusparseLtGetProperty is a static query. In
  one process the first libcusparseLt.so.0 loaded serves everything that links it, e.g.
  torch's own copy if torch loaded it before register() ran."""
  query = getattr(ctypes.CDLL(str(register())), SERVING_SYMBOL)
  query.restype = ctypes.c_int
  query.argtypes = [ctypes.c_char_p, ctypes.c_int, *[ctypes.POINTER(ctypes.c_int)] * 3]
  path, version = ctypes.create_string_buffer(4096), [ctypes.c_int() for _ in range(3)]
  status = query(path, len(path), *version)
  if status:
    why = {-1: "dladdr names no file for cusparseLtGetProperty",
           -2: f"the file's path is longer than {len(path) - 1} bytes"}.get(
               status, f"cusparseLtGetProperty failed with status {status}")
    raise Unavailable(f"cannot tell which libcusparseLt serves s24jax: {why}.")
  return {"path": os.path.realpath(path.value.decode()),
          "version": ".".join(str(v.value) for v in version)}


def mapped_files() -> list[str]:
  """Every libcusparseLt* file mapped into this process (Linux's /proc/self/maps), sorted;
  [] without /proc/self/maps (not Linux)."""
  try:
    maps = pathlib.Path("/proc/self/maps").read_text()
  except OSError:
    return []
  return files_in_maps(maps, "libcusparseLt")


def files_in_maps(maps: str, name_prefix: str) -> list[str]:
  """The files of a /proc/<pid>/maps text whose name starts with `name_prefix`, each once,
  sorted. A line is address, permissions, offset, device, inode and, for a file, its path
  (which may hold spaces; a deleted file's ends in " (deleted)")."""
  found = set()
  for line in maps.splitlines():
    fields = line.split(maxsplit=5)
    if len(fields) == 6 and fields[5].startswith("/"):
      path = fields[5].removesuffix(" (deleted)")
      if os.path.basename(path).startswith(name_prefix):
        found.add(path)
  return sorted(found)


def pinned_version(requirements: str | os.PathLike = REQUIREMENTS) -> str:
  """The cuSPARSELt version the repository pins: X of the line `nvidia-cusparselt-cu13==X` in
  `requirements` (the repository root's requirements-cusparselt.txt)."""
  path = pathlib.Path(requirements)
  want = "a line `nvidia-cusparselt-cu13==X.Y.Z`"
  try:
    lines = path.read_text().splitlines()
  except OSError as e:
    raise ValueError(f"{path}: cannot read the pinned cuSPARSELt version ({e.strerror}); the "
                     f"file should hold {want}.") from None
  pins = {m.group(1) for m in map(_PIN.match, lines) if m}
  if len(pins) != 1:
    found = f"pins {sorted(pins)}" if pins else "has no such pin"
    raise ValueError(f"{path}: needs exactly one pinned cuSPARSELt version ({want}); it {found}.")
  return pins.pop()
