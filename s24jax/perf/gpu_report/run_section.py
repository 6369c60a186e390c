"""One in-process section in its own process (the report starts it with a time cap):

  python -m s24jax.perf.gpu_report.run_section NAME --jsonl PATH --deadline EPOCH_SECONDS
                                      [--files FOLDER] [--smoke]

It appends its rows to PATH as they end and starts no row it cannot finish by the deadline;
files a row keeps (the layouts section's probes) go to FOLDER, the report's folder of files.
"""
from __future__ import annotations

import argparse
import os
import sys

from s24jax.perf.gpu_report import rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m s24jax.perf.gpu_report.run_section")
  p.add_argument("name", choices=("environment", "layouts", "gemms", "steps"))
  p.add_argument("--jsonl", required=True)
  p.add_argument("--deadline", type=float, required=True)
  p.add_argument("--files", default="")
  p.add_argument("--smoke", action="store_true")
  args = p.parse_args(argv)
  section = rows.Section(args.jsonl, args.name)
  # Imported here: each pulls in jax and the model, which only a section's process needs.
  if args.name == "environment":
    from s24jax.perf.gpu_report import env  # pylint: disable=g-import-not-at-top
    section.guarded("environment", env.environment)
  elif args.name == "layouts":
    from s24jax.perf.gpu_report import layouts  # pylint: disable=g-import-not-at-top
    layouts.run(section, args.deadline, args.smoke,
                args.files or os.path.splitext(args.jsonl)[0])
  elif args.name == "gemms":
    from s24jax.perf.gpu_report import gemms  # pylint: disable=g-import-not-at-top
    gemms.run(section, args.deadline, args.smoke)
  else:
    from s24jax.perf.gpu_report import steps  # pylint: disable=g-import-not-at-top
    steps.run(section, args.deadline, args.smoke)
  return 0


if __name__ == "__main__":
  sys.exit(main())
