"""What `python -m s24jax.perf.<module>` answers for the perf modules that are parts of a tool,
not commands of their own (plan_gemms, step_census, roofline, hlo_text): `--help` prints the
module's docstring and the command that runs it (exit code 0); anything else is one line
naming that command (exit code 2). Without it, `python -m` would import the module, print
nothing and exit 0."""
from __future__ import annotations

import sys

from s24jax import errors


def answer(module: str, doc: str | None, command: str, argv=None) -> int:
  """The answer of `python -m <module>` (the module docstring); `command`: the usage of the
  tool that runs the module."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] in (["-h"], ["--help"]):
    print((doc or "").strip() + f"\n\nusage: {command}\n({module} is a part of that command, "
          "not a command of its own)")
    return errors.EXIT_OK
  sys.stderr.write(f"{module}: a part of another command, not a command of its own: run "
                   f"`{command}` (python -m {module} --help says what it does) "
                   f"(exit code {errors.EXIT_USER})\n")
  return errors.EXIT_USER
