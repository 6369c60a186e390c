"""Tests for s24jax/methods/ste.py (docs/algorithms.md, "STE"): the hard-threshold 2:4
projection with the straight-through backward, against a NumPy statement of the rule
(the 2 largest |w| of every 4 along `in`, ties to the lower index; dL/dW := dL/dW~).
"""
import numpy as np

from method_helpers import fwd_bwd, np_mask24, rand


def test_ste_forward_hard_threshold_backward_identity():
  w = rand(0)
  y, dw, g, _ = fwd_bwd("ste", w)
  np.testing.assert_array_equal(y, np.where(np_mask24(w), w, 0))
  np.testing.assert_array_equal(dw, g)
  assert ((y != 0).reshape(-1, 4).sum(1) == 2).all()


def test_ste_ties_keep_the_lower_index():
  """Equal magnitudes (of either sign) in a group: the lower indices are kept, as NumPy's
  stable sort of -|w| does."""
  w = np.array([[0.5, -0.5, 0.5, 0.1, 0.0, 0.0, 0.0, 0.0],
                [-1.0, 1.0, 1.0, -1.0, 0.2, -0.3, 0.3, 0.2]], np.float32)
  y, _, _, layer = fwd_bwd("ste", w)
  np.testing.assert_array_equal(y != 0, np_mask24(w) & (w != 0))
  np.testing.assert_array_equal(np.asarray(layer["mask"]), np_mask24(w))
