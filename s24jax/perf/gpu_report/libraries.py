"""Which libcusparseLt each of the report's processes used (markdown.py warns when it is not
the version the repository pins).

A process may map more than one libcusparseLt file (s24jax's wheel and torch's own), but the
first libcusparseLt.so.0 the dynamic loader loaded serves every later user of that soname,
torch included: so a row records the files mapped, the loader's order (the first one serves),
the one serving s24jax (library.serving: the file and the version the library reports), and,
where torch is loaded, torch's own cuSPARSELt version and the files mapped after it loaded.

  {"pid": 123, "cusparselt_mapped": [paths], "cusparselt_load_order": [paths],
   "cusparselt_serving": {"path": ..., "version": "0.10.0"} or None,
   "cusparselt_serving_error": "..." (only when it cannot be told),
   "torch": {"cusparselt_version": 800, "mapped_after_torch": [paths],
             "load_order_after_torch": [paths]} (only where torch is loaded; "error" in place
             of the version when it cannot be read)}

The load order is glibc's link map (dlinfo RTLD_DI_LINKMAP), [] where it cannot be read.
Runs on a CPU (the CPU suite checks it there); on a GPU host, not yet.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

from s24jax.kernels.cusparselt import library

NAME_PREFIX = "libcusparseLt"
_RTLD_DI_LINKMAP = 2     # <dlfcn.h>


class _LinkMap(ctypes.Structure):
  """The public head of glibc's struct link_map (<link.h>): one loaded object, in load order."""


_LinkMap._fields_ = [   # pylint: disable=protected-access  (ctypes: a self-referencing struct)
    ("l_addr", ctypes.c_void_p), ("l_name", ctypes.c_char_p), ("l_ld", ctypes.c_void_p),
    ("l_next", ctypes.POINTER(_LinkMap)), ("l_prev", ctypes.POINTER(_LinkMap))]


def load_order(name_prefix: str = NAME_PREFIX) -> list[str]:
  """The loaded files whose name starts with `name_prefix`, in the order the dynamic loader
  loaded them (symlinks resolved); [] where the link map cannot be read (not glibc)."""
  try:
    libc = ctypes.CDLL(None)
    head = ctypes.POINTER(_LinkMap)()
    handle = ctypes.c_void_p(libc._handle)   # pylint: disable=protected-access  (dlopen(NULL))
    if libc.dlinfo(handle, _RTLD_DI_LINKMAP, ctypes.byref(head)):
      return []
  except (AttributeError, OSError):
    return []
  out, node = [], head
  while node:
    name = node.contents.l_name
    if name and os.path.basename(name.decode(errors="replace")).startswith(name_prefix):
      path = os.path.realpath(name.decode(errors="replace"))
      if path not in out:
        out.append(path)
    node = node.contents.l_next
  return out


def snapshot(*, register: bool) -> dict[str, Any]:
  """This process's libcusparseLt facts (module docstring). `register`: load s24jax's
  handlers if they are not loaded yet (a section's own process, before torch); else the
  serving library is named only where they already are (a test process, left as it is)."""
  out: dict[str, Any] = {"pid": os.getpid(), "cusparselt_serving": None}
  if register or library.register.cache_info().currsize:
    try:
      out["cusparselt_serving"] = library.serving()
    except Exception as e:  # pylint: disable=broad-except  (a fact to record: no wheel, no g++)
      out["cusparselt_serving_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  out["cusparselt_mapped"] = library.mapped_files()
  out["cusparselt_load_order"] = load_order()
  if "torch" in sys.modules:
    out["torch"] = torch_side()
  return out


def torch_side() -> dict[str, Any]:
  """torch's own cuSPARSELt version (torch.backends.cusparselt.version(): the one torch was
  built with, e.g. 800 for 0.8.0; None without it), the files mapped once torch loaded its
  own and the loader's order then (its first serves both). Imports torch."""
  try:
    import torch  # pylint: disable=g-import-not-at-top  (optional: the host image's peer)
    version = torch.backends.cusparselt.version()
  except Exception as e:  # pylint: disable=broad-except  (a fact to record, not a failure)
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
            "mapped_after_torch": library.mapped_files(), "load_order_after_torch": load_order()}
  return {"cusparselt_version": version, "mapped_after_torch": library.mapped_files(),
          "load_order_after_torch": load_order()}
