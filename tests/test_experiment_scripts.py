"""The experiments/ scripts on the one error path of every command (s24jax/cli/command.py):
Ctrl-C from the first instant (exit 75, one line), numbers and names out of range refused in
one line (exit 2), the places they write checked before any run (a read-only or full disk, a
folder or a user's file where a table goes: left as they are), a run already in a script's
folder reused only if made with the config asked for (s24jax/cli/compare.py), whole-or-nothing
writes (exit 5 on a full disk, the earlier file intact), a failed child run's exit
code. Each case runs the script's `main` as its command line does (`command.run`), in this
process, with the runs stubbed where the case is about what comes before them; the Ctrl-C
case and one comparison (a real tiny run) are the processes' own. Files are compared before
and after (tests/faults.py `snapshot`)."""
from __future__ import annotations

import ast
import importlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from s24jax import errors
from s24jax.cli import command
from s24jax.cli import compare
from s24jax.training import loop
from s24jax.training import validate
from s24jax.training import workdir as workdir_lib

from faults import Faults, snapshot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(REPO, "experiments")
SCRIPTS = ("compare_hu2024", "compare_mst", "compare_recipes", "compare_s_ste",
           "compare_venom", "plan_table", "pystdlib_corpus", "quickstart_band", "step_time")


@pytest.fixture
def script(monkeypatch):
  """script(name): the module experiments/<name>.py (experiments/ is no package: its scripts
  import their neighbours by name)."""
  monkeypatch.syspath_prepend(EXPERIMENTS)
  return importlib.import_module


def _run(module, argv, capsys) -> tuple[int, str, str]:
  """(exit code, stdout, stderr) of the script's command line, in this process."""
  try:
    code = command.run(module.main, argv, name=module.NAME)
  except SystemExit as e:   # argparse's, and compare.script_main's
    code = e.code
  out = capsys.readouterr()
  return code, out.out, out.err


def _one_line(err: str, says: str) -> None:
  assert err.count("\n") == 1 and says in err and "Traceback" not in err, err


def _no_runs(*args, **kwargs):
  raise AssertionError("a run started before the checks were done")


# ---------------------------------------------------------------------------------------------
# Ctrl-C from the first instant


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_is_guarded_before_its_imports_and_ends_in_command_run(name):
  """The guard is installed before any import but command.py's (a Ctrl-C during the imports
  is then one line), and the script's process ends through command.run."""
  with open(os.path.join(EXPERIMENTS, f"{name}.py"), encoding="utf-8") as f:
    body = ast.parse(f.read()).body
  imports_before = []
  for node in body:
    if isinstance(node, ast.If) and "guard_startup" in ast.unparse(node):
      break
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      imports_before.append(ast.unparse(node))
  else:
    raise AssertionError(f"{name}: no command.guard_startup at the top")
  assert imports_before == ["from __future__ import annotations",
                            "from s24jax.cli import command"], imports_before
  last = body[-1]
  assert isinstance(last, ast.If) and "__main__" in ast.unparse(last.test)
  assert "command.exit_with(command.run(main" in ast.unparse(last), ast.unparse(last)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc to see the imports")
def test_ctrl_c_while_importing_is_one_line_and_75(tmp_path):
  """SIGINT once jaxlib is loaded (inside the imports) into every script that imports jax:
  one line, exit 75, nothing written. The scripts start together (about 3 s in all)."""
  procs = {}
  for name in [n for n in SCRIPTS if n != "pystdlib_corpus"]:   # no jax: its start is instant
    flag = "--json" if name == "step_time" else "--root"
    procs[name] = subprocess.Popen(
        [sys.executable, os.path.join(EXPERIMENTS, f"{name}.py"), flag,
         str(tmp_path / name / "out.json")], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
  waiting, deadline = dict(procs), time.time() + 120
  while waiting and time.time() < deadline:
    for name, proc in list(waiting.items()):
      with open(f"/proc/{proc.pid}/maps", encoding="utf-8", errors="replace") as f:
        if "jaxlib" in f.read():
          proc.send_signal(signal.SIGINT)
          del waiting[name]
    time.sleep(0.01)
  for name, proc in procs.items():
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == errors.EXIT_PREEMPTED, (name, out, err[-3000:])
    assert err == (f"experiments/{name}.py: stopped by SIGINT while starting; nothing was "
                   "written. Run it again (exit code 75)\n"), (name, err[-3000:])
  assert snapshot(tmp_path) == {".": "<dir>"}


# ---------------------------------------------------------------------------------------------
# Arguments: numbers and names in range, files of the right kind


def test_bad_arguments_are_one_line_and_write_nothing(script, tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(REPO)
  folder, notes = tmp_path / "folder", tmp_path / "notes.json"
  folder.mkdir()
  notes.write_text("my notes\n")
  root = str(tmp_path / "root")
  before = snapshot(tmp_path)
  cores = len(os.sched_getaffinity(0))
  for name, argv, says in (
      ("compare_s_ste", ["--steps", "0"], "argument --steps: 0 is below the minimum, 1"),
      ("compare_hu2024", ["--steps", "-3"], "argument --steps: -3 is below the minimum, 1"),
      ("compare_venom", ["--steps", "2.5"], "argument --steps: '2.5' is not an integer"),
      ("compare_venom", ["--only", "venom_recipe,nope"], "unknown runs 'nope'; valid: gelu_dense"),
      ("compare_mst", ["--variant", "7b"], "argument --variant: invalid choice: '7b'"),
      ("compare_mst", ["--root", str(notes)], f"{notes} is a file, not a folder"),
      ("compare_recipes", ["--seeds", "0,-1"], "argument --seeds: -1 is below the minimum, 0"),
      ("compare_recipes", ["--jobs", "0"], "argument --jobs: 0 is below the minimum, 1"),
      ("compare_recipes", ["--steps", "0"], "argument --steps: 0 is below the minimum, 1"),
      ("compare_recipes", ["--only", "sste"], "unknown runs 'sste'; valid: dense, ste"),
      ("compare_recipes", ["--results", str(tmp_path / "none.md")], "none.md does not exist"),
      ("compare_recipes", ["--results", str(folder)], f"{folder} is a folder, not a Markdown"),
      ("compare_recipes", ["--variant", "7b", "--table_only"], "unknown config variant '7b'"),
      ("compare_recipes", ["--corpus", "mine=" + str(tmp_path / "none")], "is not a folder"),
      ("compare_recipes", ["--corpus", "a/b=" + str(folder)], "give 'shakespeare', 'pystdlib'"),
      ("compare_recipes", ["--corpus", f"x={folder},x={folder}"], "a corpus named twice"),
      ("quickstart_band", ["--seeds", "-1"], "argument --seeds: -1 is below the minimum, 0"),
      ("quickstart_band", ["--threads", "0"], "argument --threads: 0 is below the minimum, 1"),
      ("quickstart_band", ["--threads", str(cores + 1)], f"is above the maximum, {cores}"),
      ("plan_table", ["--sizes", "124m,125m"], "unknown sizes '125m'; valid: 124m, 350m"),
      ("plan_table", ["--gpu", "v100"], "argument --gpu: invalid choice: 'v100'"),
      ("step_time", ["--steps", "0", "--allow-cpu"], "argument --steps: 0 is below the minimum"),
      ("step_time", ["--variants", "tiny,7b"], "unknown variants '7b'; valid: 124m"),
      ("step_time", ["--json", str(folder)], f"{folder} is a folder, not a step-time report"),
      ("step_time", ["--json", str(notes)], f"{notes} exists and is not a step-time report"),
      ("pystdlib_corpus", [str(notes)], f"{notes} is a file, not a folder")):
    module = script(name)
    monkeypatch.setattr(compare, "run_all", _no_runs)
    flags = [] if name in ("step_time", "pystdlib_corpus") or "--root" in argv else ["--root", root]
    code, out, err = _run(module, [*flags, *argv], capsys)
    assert code == errors.EXIT_USER and out == "", (name, argv, out, err)
    _one_line(err, says)
    assert snapshot(tmp_path) == before, (name, argv)


@pytest.mark.parametrize("fault", ["readonly", "full"])
def test_a_root_that_cannot_be_written_is_refused_before_any_run(script, tmp_path, capsys,
                                                                 monkeypatch, fault):
  monkeypatch.chdir(REPO)
  before = snapshot(tmp_path)
  says = {"readonly": "the filesystem is read-only", "full": "no space left on the device"}
  for name in ("compare_s_ste", "compare_mst", "compare_recipes", "quickstart_band",
               "plan_table", "pystdlib_corpus"):
    module = script(name)
    with monkeypatch.context() as m:
      m.setattr(compare, "run_all", _no_runs)
      getattr(Faults(m), fault)(tmp_path)
      argv = [str(tmp_path / "new")] if name == "pystdlib_corpus" else [
          "--root", str(tmp_path / "new")]
      code, out, err = _run(module, argv, capsys)
    assert code == errors.EXIT_USER and out == "", (name, err)
    _one_line(err, says[fault])
    assert snapshot(tmp_path) == before, name


def test_a_table_goes_only_where_the_scripts_own_table_was(script, tmp_path, capsys,
                                                           monkeypatch):
  """A folder or a user's file where a table goes: refused before any run (compare_mst wrote
  over it with open('w'), compare_recipes and plan_table too), left as it is."""
  monkeypatch.chdir(REPO)
  (tmp_path / "mst" / "table.md").mkdir(parents=True)
  (tmp_path / "recipes" / "steps5").mkdir(parents=True)
  (tmp_path / "recipes" / "steps5" / "table.md").write_text("| run | my notes |\n")
  (tmp_path / "plans").mkdir()
  (tmp_path / "plans" / "table_h100.md").write_text("my plan\n")
  before = snapshot(tmp_path)
  plan_table = script("plan_table")
  monkeypatch.setattr(plan_table, "check_cell", lambda *a: True)   # every cell planned
  for name, argv, says in (
      ("compare_mst", ["--root", str(tmp_path / "mst")], "table.md is a folder, not a comparison"),
      ("compare_recipes", ["--root", str(tmp_path / "recipes"), "--steps", "5", "--table_only"],
       "table.md exists and is not a table of this script"),
      ("plan_table", ["--root", str(tmp_path / "plans")],
       "table_h100.md exists and is not a plan table")):
    monkeypatch.setattr(compare, "run_all", _no_runs)
    code, out, err = _run(script(name), argv, capsys)
    assert code == errors.EXIT_USER and out == "", (name, err)
    _one_line(err, says)
  assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# A run already there is reused only if made with the config asked for


@pytest.mark.slow
def test_a_finished_run_of_another_config_is_not_tabulated_as_this_one(script, tmp_path, capsys,
                                                                        monkeypatch, data_cache):
  """The issue's case: --steps 2 after --steps 1 in the same root tabulated the 1-step run
  labelled total_steps=2. Now refused in one line, nothing changed; the same command again
  reuses its run without training (a real tiny run, about 10 s)."""
  monkeypatch.chdir(REPO)
  monkeypatch.setenv("S24JAX_CACHE", data_cache)
  compare_s_ste = script("compare_s_ste")
  root = tmp_path / "root"
  code, out, err = _run(compare_s_ste, ["--root", str(root), "--only", "dense", "--steps", "1"],
                        capsys)
  assert code == 0 and "| dense | `experiments/gpt2_dense.py:tiny` total_steps=1 |" in out, err
  ran = snapshot(root)
  monkeypatch.setattr(loop, "train_and_evaluate", _no_runs)
  code, out, err = _run(compare_s_ste, ["--root", str(root), "--only", "dense", "--steps", "2"],
                        capsys)
  assert code == errors.EXIT_USER and out == ""
  _one_line(err, f"{root / 'dense'} holds a run of another config (total_steps: 1 there, 2 "
                 "asked): reusing it would label its results with this command's.")
  assert snapshot(root) == ran
  code, out, err = _run(compare_s_ste, ["--root", str(root), "--only", "dense", "--steps", "1"],
                        capsys)
  assert code == 0 and "total_steps=1 |" in out and "(cached)" in out, err


# ---------------------------------------------------------------------------------------------
# compare_recipes.py: runs through launch.py, the --results block


def _tiny_recipes(tmp_path, folder, *extra) -> list[str]:
  return ["--root", str(tmp_path / "root"), "--variant", "tiny", "--steps", "5", "--seeds", "0",
          "--only", "dense", "--corpus", f"mine={folder}", *extra]


def test_compare_recipes_refuses_a_run_of_another_corpus_and_an_open_results_block(
    script, tmp_path, capsys, monkeypatch):
  compare_recipes = script("compare_recipes")
  monkeypatch.setattr(compare_recipes, "run_all", _no_runs)
  a, b = tmp_path / "a", tmp_path / "b"
  a.mkdir()
  b.mkdir()
  # A run of corpus 'mine' from folder a, as launch.py records it.
  workdir = compare_recipes.workdir_of(str(tmp_path / "root" / "steps5"), "mine", "dense", 0)
  spec, _ = compare_recipes.run_config("dense", "tiny")
  data = {"data.name": "text_folder", "data.path": str(a)}
  os.makedirs(workdir)
  with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(workdir_lib.as_json(validate.load_config(
        spec, compare_recipes.run_overrides("dense", 0, data, 5))), f)
  results = tmp_path / "results.md"
  results.write_text("# results\n<!-- generated by: python experiments/compare_recipes.py "
                     "--table_only --variant tiny --seeds 0 --corpus mine=" + str(a) +
                     " --steps 5 --only dense -->\nold table, no end line\n")
  before = snapshot(tmp_path)
  code, out, err = _run(compare_recipes, _tiny_recipes(tmp_path, b), capsys)
  assert code == errors.EXIT_USER and out == ""
  _one_line(err, f"holds a run of another config (data.path: '{a}' there, '{b}' asked)")
  code, out, err = _run(compare_recipes, _tiny_recipes(tmp_path, a, "--results", str(results)),
                        capsys)
  assert code == errors.EXIT_USER and out == ""
  _one_line(err, "has no <!-- end generated --> line after it")
  assert snapshot(tmp_path) == before


def test_compare_recipes_reports_a_failed_run_and_writes_its_tables(script, tmp_path, capsys,
                                                                    monkeypatch):
  """A run that fails (here: exit code 4): the table of the others and the --results block
  are written, then one line naming the run, and the run's exit code; the user's text in the
  --results file is kept."""
  compare_recipes = script("compare_recipes")
  monkeypatch.setattr(compare_recipes, "launch_command", lambda *a, **k: [
      sys.executable, "-c", "print('run output'); raise SystemExit(4)"])
  folder = tmp_path / "corpus"
  folder.mkdir()
  results = tmp_path / "results.md"
  results.write_text("# my results\n\nkept\n")
  code, out, err = _run(compare_recipes, _tiny_recipes(tmp_path, folder, "--results",
                                                       str(results)), capsys)
  workdir = tmp_path / "root" / "steps5" / "mine" / "dense_seed0"
  assert code == 4, err
  _one_line(err, f"1 run(s) failed, the table holds the others: {workdir} with exit code 4")
  assert "FAILED (exit 4)" in out and (workdir / "launch.out").read_text() == "run output\n"
  table = (tmp_path / "root" / "steps5" / "table.md").read_text()
  assert table.startswith("**mine** (tiny, 5 steps)") and "| dense |" not in table
  text = results.read_text()
  assert text.startswith("# my results\n\nkept\n\n<!-- generated by: ") and table in text


def test_a_stopped_script_stops_its_runs_and_waits_for_them(script, tmp_path):
  """Ctrl-C in the script (KeyboardInterrupt): each child still running gets SIGTERM and is
  waited for (a training run saves its step and exits 75), none is killed."""
  command_line = script("command_line")
  done = tmp_path / "done"
  child = subprocess.Popen([sys.executable, "-c", (
      "import signal, sys, time\n"
      "def stop(*a):\n"
      f"  open({str(done)!r}, 'w').write('saved'); sys.exit(75)\n"
      "signal.signal(signal.SIGTERM, stop)\n"
      "print('ready', flush=True)\n"
      "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
  assert child.stdout.readline() == "ready\n"
  with pytest.raises(KeyboardInterrupt):
    with command_line.stopping_children([child]):
      raise KeyboardInterrupt
  assert child.returncode == 75 and done.read_text() == "saved"
  child.stdout.close()


def test_a_child_is_pinned_to_its_cores_from_the_parent(script):
  """compare_recipes' and quickstart_band's runs: their cores set once started (no Python code
  between fork and exec in a process running JAX's threads); what the child sees after."""
  command_line = script("command_line")
  core = sorted(os.sched_getaffinity(0))[-1]
  child = subprocess.Popen([sys.executable, "-c", "import os, sys\nsys.stdin.readline()\n"
                            "print(sorted(os.sched_getaffinity(0)))"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  command_line.pin(child, {core})
  out, _ = child.communicate("go\n", timeout=60)
  assert out == f"[{core}]\n"


# ---------------------------------------------------------------------------------------------
# step_time.py, plan_table.py, quickstart_band.py, pystdlib_corpus.py


def test_step_time_times_the_llama_recipes_for_llama7b_and_keeps_a_users_file(
    script, tmp_path, capsys, monkeypatch):
  step_time = script("step_time")
  timed = []

  def step_seconds(path, variant, backend, steps, overrides):
    timed.append((os.path.basename(path), variant, backend, steps))
    return {"micro_batch": 2, "step_ms": 10.0 * len(timed), "tokens_per_sec": 1.0}
  monkeypatch.setattr(step_time.steps_lib, "step_seconds", step_seconds)
  report = tmp_path / "out" / "report.json"
  code, out, err = _run(step_time, ["--variants", "llama7b/2", "--steps", "3", "--allow-cpu",
                                    "--json", str(report)], capsys)
  assert code == 0, err
  # Off a GPU the cusparselt rows are skipped: dense, Hu et al. and S-STE, each 'xla'.
  assert timed == [("llama_dense.py", "7b", "xla", 3), ("llama_t_sr_ste_df.py", "7b", "xla", 3),
                   ("llama_s_ste.py", "7b", "xla", 3)]
  rows = json.loads(report.read_text())["rows"]
  assert [r["speedup_vs_dense"] for r in rows] == [1.0, 10.0 / 20.0, 10.0 / 30.0]
  earlier = report.read_text()
  with monkeypatch.context() as m:   # the disk fills during the runs: exit 5, the report intact
    def disk_fills(*args):
      Faults(m).full(tmp_path / "out")
      return step_seconds(*args)
    m.setattr(step_time.steps_lib, "step_seconds", disk_fills)
    code, out, err = _run(step_time, ["--variants", "tiny", "--allow-cpu", "--json",
                                      str(report)], capsys)
  assert code == errors.EXIT_STORAGE and "| tiny | dense xla |" in out
  _one_line(err, f"cannot write the report {report}: no space left on the device")
  assert report.read_text() == earlier and os.listdir(tmp_path / "out") == ["report.json"]
  monkeypatch.setattr(step_time.jax, "default_backend", lambda: "cpu")
  code, out, err = _run(step_time, ["--variants", "tiny"], capsys)
  assert code == errors.EXIT_USER and out == ""
  _one_line(err, "no GPU here (jax.default_backend() = 'cpu'): step times are only meaningful")


def _plan_report(gpu: str, devices: int, fits: bool) -> dict:
  return {"fits": fits, "gpu": gpu, "devices": devices, "params": 124.4e6, "config": "s_ste",
          "mesh": {"data": devices, "fsdp": 1}, "micro_batch": 4, "grad_accum_steps": 8,
          "argument_size_in_bytes": 3 * 2**30, "temp_size_in_bytes": 2**29,
          "total_bytes_per_device": 7 * 2**29, "xla_rematerialized": False,
          "flops_per_step": 1.5e15, "largest_fitting_micro_batch": 2,
          "grad_accum_steps_at_largest": 16}


def test_plan_table_reuses_its_cells_and_stops_on_a_failed_plan(script, tmp_path, capsys,
                                                                monkeypatch):
  plan_table = script("plan_table")
  popen = subprocess.Popen
  root = tmp_path / "plans"
  root.mkdir()
  for devices, fits in ((1, False), (8, True)):
    path = plan_table.cell_path(str(root), "h100", "124m", "s_ste", devices)
    with open(path, "w", encoding="utf-8") as f:
      json.dump(_plan_report("h100", devices, fits), f)
  monkeypatch.setattr(subprocess, "Popen", _no_runs)
  argv = ["--root", str(root), "--sizes", "124m", "--methods", "s_ste"]
  code, out, err = _run(plan_table, argv, capsys)
  assert code == 0, err
  table = (root / "table_h100.md").read_text()
  assert out == table   # 3.0 GiB of arguments, 0.5 of temporaries, 3.5 in all (7 * 2^29 B)
  assert "| 124M | s_ste | 1 | 1x1 | 4 x 8 | 3.0 | 0.5 | 3.5 | NO | no | 1.5e+15 | 2 (accum 16) |" in table
  assert "| 124M | s_ste | 8 | 8x1 | 4 x 8 | 3.0 | 0.5 | 3.5 | yes | no | 1.5e+15 | - |" in table
  # Another cell's report there: refused before any plan.
  with open(plan_table.cell_path(str(root), "h100", "124m", "s_ste", 8), "w") as f:
    json.dump(_plan_report("a100", 8, True), f)
  before = snapshot(tmp_path)
  code, out, err = _run(plan_table, argv, capsys)
  assert code == errors.EXIT_USER and out == ""
  _one_line(err, "h100_s_ste_124m_8.json is not this planner's report of 8 h100 GPU(s)")
  # A plan that fails: its exit code, one line; the cells planned so far are kept.
  monkeypatch.setattr(subprocess, "Popen", lambda cmd: popen(
      [sys.executable, "-c", "raise SystemExit(2)"]))
  monkeypatch.setattr(plan_table.aot, "check_plugin", lambda: None)
  code, out, err = _run(plan_table, [*argv, "--gpu", "a100"], capsys)
  assert code == errors.EXIT_USER, err
  _one_line(err, f"the plan of s_ste 124m on 1 a100 GPU(s) failed with exit code 2 (its line "
                 f"above says why); the cells planned so far are kept in {root}")
  assert snapshot(tmp_path) == before


def test_quickstart_band_stops_on_a_failed_run_with_its_exit_code(script, tmp_path, capsys,
                                                                 monkeypatch):
  quickstart_band = script("quickstart_band")
  monkeypatch.setattr(quickstart_band.sys, "executable", os.path.join(tmp_path, "python"))
  with open(tmp_path / "python", "w", encoding="utf-8") as f:   # a launch.py that fails
    f.write("#!/bin/sh\necho 'a run error' >&2\nexit 5\n")
  os.chmod(tmp_path / "python", 0o755)
  code, out, err = _run(quickstart_band, ["--root", str(tmp_path / "r"), "--seeds", "0",
                                          "--threads", "1"], capsys)
  log = tmp_path / "r" / "seed0_threads1" / "launch.out"
  assert code == errors.EXIT_STORAGE and out == ""
  _one_line(err, f"the quick start of seed 0 on 1 thread(s) failed with exit code 5: {log} "
                 "says why")
  assert log.read_text() == "a run error\n"
  # A run of another seed in the workdir of seed 1: refused before any run.
  other = tmp_path / "r" / "seed1_threads1"
  other.mkdir()
  (other / "config.json").write_text(json.dumps(workdir_lib.as_json(
      validate.load_config(quickstart_band.QUICK_START, {"seed": 0}))))
  before = snapshot(tmp_path)
  code, out, err = _run(quickstart_band, ["--root", str(tmp_path / "r"), "--seeds", "1",
                                          "--threads", "1"], capsys)
  assert code == errors.EXIT_USER and snapshot(tmp_path) == before
  _one_line(err, f"{other} holds a run of another config (seed: 0 there, 1 asked)")


def test_the_corpus_is_written_whole_and_never_over_a_users_folder(script, tmp_path, capsys,
                                                                  monkeypatch):
  corpus = script("pystdlib_corpus")
  stdlib = corpus.sysconfig.get_paths()["stdlib"]
  files = [os.path.join(stdlib, p) for p in ("abc.py", "json/decoder.py", "this.py")]
  monkeypatch.setattr(corpus, "modules", lambda: [corpus.pathlib.Path(p) for p in files])
  out = tmp_path / "corpus"
  code, printed, err = _run(corpus, [str(out)], capsys)
  assert code == 0 and printed == f"{out}\n", err
  for name, src in (("abc.py.txt", files[0]), ("json__decoder.py.txt", files[1])):
    with open(src, encoding="utf-8") as f:
      assert (out / name).read_text() == f.read()
  version = sys.version.split()[0]
  assert sorted(os.listdir(out)) == ["PYTHON_VERSION", "abc.py.txt", "json__decoder.py.txt",
                                     "this.py.txt"]
  assert (out / "PYTHON_VERSION").read_text() == version
  # Another Python's corpus is replaced; with the disk full it stays as it was.
  (out / "PYTHON_VERSION").write_text("3.0.0")
  (out / "gone.py.txt").write_text("x")
  earlier = snapshot(tmp_path)
  with monkeypatch.context() as m:
    Faults(m).full(tmp_path, free_bytes=4096 + 3000)   # the check's probe fits, not the corpus
    code, printed, err = _run(corpus, [str(out)], capsys)
  assert code == errors.EXIT_STORAGE, err
  _one_line(err, f"cannot write the corpus {out}")
  assert snapshot(tmp_path) == earlier
  assert _run(corpus, [str(out)], capsys)[0] == 0
  assert "gone.py.txt" not in os.listdir(out) and (out / "PYTHON_VERSION").read_text() == version
  # A user's folder of files is left alone.
  users = tmp_path / "mine"
  users.mkdir()
  (users / "notes.txt").write_text("mine")
  code, printed, err = _run(corpus, [str(users)], capsys)
  assert code == errors.EXIT_USER
  _one_line(err, f"{users} holds files and is not a corpus this script wrote")
  assert os.listdir(users) == ["notes.txt"] and os.listdir(tmp_path) == ["corpus", "mine"]
