"""The public descriptions of cuSPARSELt's metadata order, emulated thread by thread in NumPy:
the independent reference of kernels/cusparselt/layout.py (which writes each order as one
reshape and transpose). Each function takes the nibble array N (rows, cols/4) (group g of row i
keeps positions i0 < i1: N = i0 | i1 << 2) and returns the metadata bytes the described GPU
kernel writes, by running its threads' index arithmetic and warp shuffles literally: lane by
lane, shuffle by shuffle, store by store. Nothing here is shared with layout.py.

  pytorch_sm80    PyTorch's `_sparse_semi_structured_tile` with `MetadataCuSparseLt`
                  (SparseSemiStructuredTile.cu, SparseSemiStructuredPack.h): warps of 32 x 64,
                  threads of 8 x 8, `warp_shuffle_meta` and `_get_meta_offset`.
  torchao_sm90    torchao's `sparse24_sm90_sparsify(..., "cusparselt")`: blocks of 64 x 64,
                  two warps, the metadata bytes through shared memory, then
                  `store_metadata_reordered` (warp_tensor.h).
  torchao_cutlass8  torchao's `MetadataCutlass8bits` store (blocks of 32 x 128).
"""
from __future__ import annotations

import numpy as np


def _byte_of_8_cols(nib: np.ndarray, row: int, col: int) -> int:
  """What a sparsifier writes for 8 dense columns of one row: its two groups' nibbles."""
  return int(nib[row, col // 4]) | (int(nib[row, col // 4 + 1]) << 4)


def _put(buf: np.ndarray, byte_offset: int, value: int, nbytes: int) -> None:
  for b in range(nbytes):                               # little-endian, as the GPU stores
    buf[byte_offset + b] = (value >> (8 * b)) & 0xFF


def pytorch_sm80(nib: np.ndarray) -> np.ndarray:
  rows, groups = nib.shape
  cols = 4 * groups
  buf = np.full(rows * cols // 8, -1, np.int64)
  stride32 = 32 * 32 // 16                              # kStrideBlock32x32 (uint16 units)

  def offset(warp_row, thread_row, warp_col, thread_col, total_rows):   # uint16 units
    o = (warp_row // 128) * (stride32 * 8)
    o += (warp_col // 64) * (stride32 * 8) * (total_rows // 128)
    o += (((warp_row + thread_row) % 128) // 32) * stride32
    o += (((warp_col + thread_col) % 64) // 32) * (stride32 * 4)
    o += (warp_row % 32) * 2
    o += ((thread_row % 32) // 16) * 4
    o += ((thread_col % 32) // 16) * 2
    return o

  for bx in range(rows // 32):
    for by in range(cols // 64):
      lanes = [(lane % 4, lane // 4) for lane in range(32)]     # (threadIdx.x, threadIdx.y)
      meta = {}
      for lane, (tx, ty) in enumerate(lanes):
        x, y = bx * 32 + tx * 8, by * 64 + ty * 8
        ab = sum(_byte_of_8_cols(nib, x + r, y) << (8 * r) for r in range(4))
        cd = sum(_byte_of_8_cols(nib, x + 4 + r, y) << (8 * r) for r in range(4))
        meta[lane] = (ab, cd)
      for which, extra in ((0, 0), (1, 32)):                    # meta_ab, then meta_cd at +32
        left = {l: lanes[l][1] % 2 == 0 for l in range(32)}
        bottom = {l: lanes[l][0] % 2 == 1 for l in range(32)}
        m = {l: meta[l][which] for l in range(32)}
        s0 = {l: [(m[l] >> (8 * left[l])) & 0xFF, (m[l] >> (8 * (left[l] + 2))) & 0xFF]
              for l in range(32)}
        r0 = {l: s0[l ^ 4] for l in range(32)}                   # __shfl_xor_sync(.., 4)
        line = {}
        for l in range(32):
          tl = int(left[l])
          line0 = (((m[l] >> (8 * (1 - tl))) & 0xFF) << ((1 - tl) * 8)) | (r0[l][0] << (tl * 8))
          line1 = (((m[l] >> (8 * (3 - tl))) & 0xFF) << ((1 - tl) * 8)) | (r0[l][1] << (tl * 8))
          line[l] = (line0, line1)
        s1 = {l: line[l][0] if bottom[l] else line[l][1] for l in range(32)}
        r1 = {l: s1[l ^ 1] for l in range(32)}                   # __shfl_xor_sync(.., 1)
        for l, (tx, ty) in enumerate(lanes):
          final = (r1[l] | (line[l][1] << 16)) if bottom[l] else ((r1[l] << 16) | line[l][0])
          base = offset(bx * 32, tx * 8, by * 64, ty * 8, rows) + extra
          index = (int(not left[l]) + 2 * int(bottom[l])) * 4     # uint32 units
          _put(buf, 2 * base + 4 * index, final, 4)
  assert (buf >= 0).all(), "a metadata byte was never written"
  return buf.astype(np.uint8)


def torchao_sm90(nib: np.ndarray) -> np.ndarray:
  rows, groups = nib.shape
  cols = 4 * groups
  buf = np.full(rows * cols // 8, -1, np.int64)
  for block_id in range((rows // 64) * (cols // 64)):
    block_row = (block_id // (cols // 64)) * 64
    block_col = (block_id % (cols // 64)) * 64
    smem = np.zeros(64 * 9, np.int64)                            # kSmemStride0 = 64 / 8 + 1
    for warp in range(2):
      warp_row = warp * 4                                        # WarpTensor<E, 4, 64>
      for it_row in range(0, 64, 8):
        for lane in range(32):
          r, c8 = lane // 8, lane % 8                            # thread_row, thread_col / 8
          smem[(warp_row + it_row + r) * 9 + c8] = _byte_of_8_cols(
              nib, block_row + it_row + warp_row + r, block_col + 8 * c8)
    for warp in range(2):
      warp_col = warp * 32                                       # WarpTensor<uint8, 16, 4>
      for it_row in range(0, 64, 16):
        data = {l: [smem[(it_row + l // 2) * 9 + warp_col // 8 + 2 * (l % 2) + j]
                    for j in range(2)] for l in range(32)}
        row, col = it_row + block_row, warp_col + block_col
        idx = ((col // 32) * 256 + (row % 8) * 8 + ((row % 64) // 16) * 64
               + (row // 64) * 8 * cols)
        step0 = {l: data[l][0] | (data[l][1] << 8) for l in range(32)}
        step1 = {}
        for l in range(32):
          other = step0[l ^ 16]
          step1[l] = (((step0[l] & 0xF0F0) | ((other >> 4) & 0x0F0F)) if l & 16 else
                      ((step0[l] & 0x0F0F) | ((other << 4) & 0xF0F0))) & 0xFFFF
        for l in range(32):
          other = step1[l ^ 1]
          gmem = (((step1[l] & 0xFF00) | ((other >> 8) & 0x00FF)) if l & 1 else
                  ((step1[l] & 0x00FF) | ((other << 8) & 0xFF00))) & 0xFFFF
          _put(buf, idx + (l % 2) * 4 + ((l % 16) // 2) * 8 + (l // 16) * 2, gmem, 2)
  assert (buf >= 0).all(), "a metadata byte was never written"
  return buf.astype(np.uint8)


def torchao_cutlass8(nib: np.ndarray) -> np.ndarray:
  rows, groups = nib.shape
  cols = 4 * groups
  buf = np.full(rows * cols // 8, -1, np.int64)
  for block_id in range((rows // 32) * (cols // 128)):
    block_row = (block_id // (cols // 128)) * 32
    block_col = (block_id % (cols // 128)) * 128
    for warp in range(2):
      warp_row = warp * 2                                        # WarpTensor<E, 2, 128>
      for it_row in range(0, 32, 4):
        row0 = it_row + warp_row + block_row
        base = row0 * 16 + (block_col // 128) * rows * 16 + (block_col % 128) // 8
        for lane in range(32):
          r, c = lane // 16, lane % 16                           # mdata: thread_row, col
          buf[base + 16 * r + c] = _byte_of_8_cols(nib, row0 + r, block_col + 8 * c)
  assert (buf >= 0).all(), "a metadata byte was never written"
  return buf.astype(np.uint8)
