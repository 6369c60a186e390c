"""s24jax's compression against the memory bandwidth: its effective bandwidth, the device's
peak, and how far it is from one read of the operand and one write of the compressed bytes
at that peak (the issue's criterion: within CRITERION, 1.3x).

  bytes      m k s (op(A), s bytes a value) read + compressed_bytes(m, k, s) written
             (9/16 of A's bytes for 16-bit values, 10/16 for 8-bit: layout.py)
  GB/s       bytes / the compression's seconds per call / 1e9
  ideal      bytes / the peak: the time of one read and one write at the datasheet's peak
  ratio      seconds / ideal = peak / effective bandwidth (1.0: at the peak)

Peaks (PEAKS, HBM bandwidth from NVIDIA's datasheets): a device is matched by the words in its
`device_kind` ("NVIDIA H100 80GB HBM3"); an unknown device gets no peak and no ratio.
"""
from __future__ import annotations

from s24jax.kernels.cusparselt import layout

CRITERION = 1.3
# (words all in the device kind, bytes/s, source), first match wins.
PEAKS = (
    (("H200",), 4.8e12, "NVIDIA H200 datasheet: 4.8 TB/s (H200 SXM and NVL)"),
    (("H100", "HBM3"), 3.35e12, "NVIDIA H100 datasheet: 3.35 TB/s (H100 SXM)"),
    (("A100", "80GB"), 2.0e12, "NVIDIA A100 datasheet: 2.0 TB/s (A100 80GB; SXM 2,039 GB/s)"),
)


def peak(device_kind: str) -> tuple[float, str] | None:
  """(bytes/s, source) of the device's HBM, or None for a device not in PEAKS."""
  for words, value, source in PEAKS:
    if all(w in device_kind for w in words):
      return value, source
  return None


def compression_bytes(m: int, k: int, itemsize: int) -> tuple[int, int]:
  """(bytes read, bytes written) by one compression of op(A) (m, k) of `itemsize` bytes."""
  return m * k * itemsize, layout.compressed_bytes(m, k, itemsize)


def compression(ms: float | None, m: int, k: int, itemsize: int, device_kind: str) -> dict:
  """The row's bandwidth fields for a compression taking `ms` milliseconds per call (None:
  not timed): bytes, GB/s and, on a device with a known peak, the peak, the ideal time and the
  ratio with whether it meets CRITERION."""
  read, written = compression_bytes(m, k, itemsize)
  out = {"bytes_read": read, "bytes_written": written, "gb_per_s": None, "peak_gb_per_s": None,
         "peak_source": None, "ideal_ms": None, "ratio_to_ideal": None, "within_criterion": None}
  known = peak(device_kind)
  if known:
    out["peak_gb_per_s"], out["peak_source"] = known[0] / 1e9, known[1]
    out["ideal_ms"] = 1e3 * (read + written) / known[0]
  if ms is None or ms <= 0:
    return out
  out["gb_per_s"] = (read + written) / (ms / 1e3) / 1e9
  if known:
    out["ratio_to_ideal"] = ms / out["ideal_ms"]
    out["within_criterion"] = out["ratio_to_ideal"] <= CRITERION
  return out
