"""Tests for s24jax/nn/losses.py: the plain cross-entropy against NumPy (-log softmax at the
targets, summed), and the chunked one against the plain one on the full logits, for chunk
sizes that divide the tokens, do not (the last chunk padded), and exceed them."""
import jax
import numpy as np
import pytest

from s24jax.nn import losses

# float32 math against float32 / float64 references: full float32 dots on every platform
# (a GPU's default is TF32), see conftest.f32_dots.
pytestmark = pytest.mark.usefixtures("f32_dots")


def test_chunked_cross_entropy_pads_the_last_chunk():
  x = jax.random.normal(jax.random.key(0), (3, 5, 8))
  w = jax.random.normal(jax.random.key(1), (11, 8))
  t = jax.random.randint(jax.random.key(2), (3, 5), 0, 11)
  head = lambda h, i=None: h @ w.T   # pylint: disable=unnecessary-lambda-assignment
  plain = losses.cross_entropy_sum(head(x), t)
  logits = np.asarray(head(x), np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  want = np.sum(logz - np.take_along_axis(logits, np.asarray(t)[..., None], -1)[..., 0])
  np.testing.assert_allclose(float(plain), want, rtol=1e-5)
  for chunk in (1, 4, 15, 16, 64):
    np.testing.assert_allclose(float(losses.chunked_cross_entropy_sum(x, t, head, chunk)),
                               float(plain), rtol=1e-6)
