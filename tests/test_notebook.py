"""Tests for notebooks/new_method.ipynb: it runs top to bottom in a real Jupyter kernel
(nbclient + ipykernel) on a few steps, so a broken notebook fails CI; both methods it
defines train by name to the end, and the stateful one's scale reaches the log within the
bounds derived here (1 < beta <= sqrt(2))."""
import json
import os

import nbclient
import nbformat
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "new_method.ipynb")


@pytest.mark.slow
def test_notebook_executes_in_a_jupyter_kernel(tmp_path, data_cache, monkeypatch):
  monkeypatch.setenv("S24JAX_CACHE", data_cache)   # the kernel inherits the environment
  nb = nbformat.read(NOTEBOOK, as_version=4)
  params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(params) == 1, "the notebook needs one cell tagged 'parameters'"
  params[0].source = f"STEPS = 4\nWORKDIR = {str(tmp_path)!r}\n"
  client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()   # raises CellExecutionError on any failing cell

  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.output_type == "error"]
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) == 2, "both loss-curve plots are shown inline"
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "one_of_four" in text and "scaled_ste" not in text.split("one_of_four")[0]

  # Both runs trained by name to the end, and the stateful method's scale reached the log.
  for name in ("one_of_four", "scaled_ste"):
    with open(tmp_path / name / "final_metrics.json") as f:
      final = json.load(f)
    assert final["step"] == 4 and final["train/loss"] < 11.0
    with open(tmp_path / name / "config.json") as f:
      assert json.load(f)["sparsity"]["method"] == name
  with open(tmp_path / "scaled_ste" / "final_metrics.json") as f:
    scale = json.load(f)["train/method/scale"]
  # beta = ||W|| / ||m W||: above 1, and at most sqrt(2) since 2:4 keeps the larger half.
  assert 1.0 < scale <= 2 ** 0.5
