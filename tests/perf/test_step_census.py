"""Tests for s24jax/perf/step_census.py: the kernels of optimized HLO text, against hand counts.

A hand-written module (HLO below) holds one of each thing the census must get right: a GEMM
fusion (FLOPs 2*M*N*K and bytes from the shapes, counted by hand), a while loop whose body
runs `TRIPS` times and one without a known trip count, an in-place dynamic-update-slice
(only the update moves), a conditional (each branch marked, left out of the common step),
the cuSPARSELt FFI calls, cuDNN attention, a copy, an FP8 GEMM, and kernels whose category
comes from Python stack frames or from a named scope. Then a scan of matmuls compiled for the
CPU (FLOPs and launches against the hand count), and for an H100 (deviceless, `aot`).
"""
import math
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from s24jax.perf import step_census as sc

M, K, N = 64, 32, 16
TRIPS = 7
HLO = textwrap.dedent(f"""\
HloModule test, is_scheduled=true

FileNames
1 "/src/s24jax/training/train.py"
2 "/src/s24jax/fp8.py"

FunctionNames
1 "train_step"
2 "quantize"

FileLocations
1 {{file_name_id=1 function_name_id=1 line=110 end_line=110 column=1 end_column=9}}
2 {{file_name_id=2 function_name_id=2 line=80 end_line=80 column=1 end_column=9}}

StackFrames
1 {{file_location_id=1 parent_frame_id=1}}
2 {{file_location_id=2 parent_frame_id=2}}

%gemm_computation (p0: bf16[{M},{K}], p1: bf16[{K},{N}]) -> bf16[{M},{N}] {{
  %p0 = bf16[{M},{K}]{{1,0}} parameter(0)
  %p1 = bf16[{K},{N}]{{1,0}} parameter(1)
  ROOT %dot.1 = bf16[{M},{N}]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%fp8_gemm_computation (p0: f8e4m3fn[{M},{K}], p1: f8e4m3fn[{K},{N}]) -> f32[{M},{N}] {{
  %p0 = f8e4m3fn[{M},{K}]{{1,0}} parameter(0)
  %p1 = f8e4m3fn[{K},{N}]{{1,0}} parameter(1)
  ROOT %dot.2 = f32[{M},{N}]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%quantize_computation (q0: f32[{M},{N}]) -> f8e4m3fn[{M},{N}] {{
  %q0 = f32[{M},{N}]{{1,0}} parameter(0)
  ROOT %convert.1 = f8e4m3fn[{M},{N}]{{1,0}} convert(%q0), metadata={{op_name="jit(step)/convert" stack_frame_id=2}}
}}

%update_computation (u0: f32[{TRIPS},{M},{N}], u1: f32[1,{M},{N}], u2: s32[]) -> f32[{TRIPS},{M},{N}] {{
  %u0 = f32[{TRIPS},{M},{N}]{{2,1,0}} parameter(0)
  %u1 = f32[1,{M},{N}]{{2,1,0}} parameter(1)
  %u2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[{TRIPS},{M},{N}]{{2,1,0}} dynamic-update-slice(%u0, %u1, %u2, %zero, %zero)
}}

%scale_computation (s0: f32[1,{M},{N}]) -> f32[1,{M},{N}] {{
  %s0 = f32[1,{M},{N}]{{2,1,0}} parameter(0)
  %two = f32[] constant(2)
  %b = f32[1,{M},{N}]{{2,1,0}} broadcast(%two), dimensions={{}}
  ROOT %mul = f32[1,{M},{N}]{{2,1,0}} multiply(%s0, %b), metadata={{op_name="jit(step)/transpose(jvp(f))/mlp/mvue/mul"}}
}}

%body (arg: (s32[], f32[{TRIPS},{M},{N}], f32[1,{M},{N}])) -> (s32[], f32[{TRIPS},{M},{N}], f32[1,{M},{N}]) {{
  %arg = (s32[], f32[{TRIPS},{M},{N}]{{2,1,0}}, f32[1,{M},{N}]{{2,1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %buf = f32[{TRIPS},{M},{N}]{{2,1,0}} get-tuple-element(%arg), index=1
  %upd = f32[1,{M},{N}]{{2,1,0}} get-tuple-element(%arg), index=2
  %scaled = f32[1,{M},{N}]{{2,1,0}} fusion(%upd), kind=kLoop, calls=%scale_computation
  %updated = f32[{TRIPS},{M},{N}]{{2,1,0}} fusion(%buf, %scaled, %i), kind=kLoop, calls=%update_computation
  ROOT %out = (s32[], f32[{TRIPS},{M},{N}]{{2,1,0}}, f32[1,{M},{N}]{{2,1,0}}) tuple(%i, %updated, %scaled)
}}

%cond (carg: (s32[], f32[{TRIPS},{M},{N}], f32[1,{M},{N}])) -> pred[] {{
  %carg = (s32[], f32[{TRIPS},{M},{N}]{{2,1,0}}, f32[1,{M},{N}]{{2,1,0}}) parameter(0)
  %ci = s32[] get-tuple-element(%carg), index=0
  %limit = s32[] constant({TRIPS})
  ROOT %lt = pred[] compare(%ci, %limit), direction=LT
}}

%on_true (t: f32[{M},{N}]) -> f32[{M},{N}] {{
  %t = f32[{M},{N}]{{1,0}} parameter(0)
  ROOT %neg = f32[{M},{N}]{{1,0}} negate(%t)
}}

%on_false (f: f32[{M},{N}]) -> f32[{M},{N}] {{
  %f = f32[{M},{N}]{{1,0}} parameter(0)
  ROOT %copy.2 = f32[{M},{N}]{{1,0}} copy(%f)
}}

ENTRY %main (a: bf16[{M},{K}], b: bf16[{K},{N}], qa: f8e4m3fn[{M},{K}], qb: f8e4m3fn[{K},{N}], x: f32[{M},{N}], w: bf16[3072,768], s: bf16[65536,768], att: bf16[4,128,2,64], p: pred[]) -> f32[{M},{N}] {{
  %a = bf16[{M},{K}]{{1,0}} parameter(0)
  %b = bf16[{K},{N}]{{1,0}} parameter(1)
  %qa = f8e4m3fn[{M},{K}]{{1,0}} parameter(2)
  %qb = f8e4m3fn[{K},{N}]{{1,0}} parameter(3)
  %x = f32[{M},{N}]{{1,0}} parameter(4)
  %w = bf16[3072,768]{{1,0}} parameter(5)
  %s = bf16[65536,768]{{1,0}} parameter(6)
  %att = bf16[4,128,2,64]{{3,2,1,0}} parameter(7)
  %p = pred[] parameter(8)
  %gemm = bf16[{M},{N}]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%gemm_computation, metadata={{op_name="jit(step)/mlp/fc/dot_general"}}, backend_config={{"fusion_backend_config":{{"kind":"__triton_nested_gemm_fusion"}}}}
  %fp8gemm = f32[{M},{N}]{{1,0}} fusion(%qa, %qb), kind=kCustom, calls=%fp8_gemm_computation, backend_config={{"fusion_backend_config":{{"kind":"__triton_nested_gemm_fusion"}}}}
  %quant = f8e4m3fn[{M},{N}]{{1,0}} fusion(%x), kind=kLoop, calls=%quantize_computation, metadata={{op_name="jit(step)/convert" stack_frame_id=2}}
  %adam = f32[{M},{N}]{{1,0}} multiply(%x, %x), metadata={{op_name="jit(step)/mul" stack_frame_id=1}}
  %copy.1 = f32[{M},{N}]{{0,1}} copy(%x)
  %compressed = u8[2654208]{{0}} custom-call(%w), custom_call_target="cusparselt_compress", api_version=API_VERSION_TYPED_FFI, backend_config={{b_dtype = "bf16", d_dtype = "bf16", d_row_major = false, k = 768 : i64, m = 3072 : i64, n = 65536 : i64, trans_a = true, trans_b = false}}
  %spmm = bf16[65536,3072]{{1,0}} custom-call(%compressed, %s), custom_call_target="cusparselt_spmm", api_version=API_VERSION_TYPED_FFI, metadata={{op_name="jit(step)/jvp(f)/mlp/fc/ffi_call"}}, backend_config={{a_dtype = "bf16", d_row_major = false, k = 768 : i64, m = 3072 : i64, n = 65536 : i64, trans_a = true, trans_b = false}}
  %attn = (bf16[4,2,128,64]{{3,1,2,0}}, f32[4,2,128]{{2,1,0}}, u8[0]{{0}}) custom-call(%att, %att, %att), custom_call_target="__cudnn$fmhaSoftmax", backend_config={{"cudnn_fmha_backend_config": {{"intermediate_tensor_shape": {{"element_type": "BF16", "dimensions": ["4", "2", "128", "128"]}}, "mask_type": "CAUSAL"}}}}
  %zeros = f32[{TRIPS},{M},{N}]{{2,1,0}} broadcast(%x), dimensions={{1,2}}
  %x1 = f32[1,{M},{N}]{{2,1,0}} bitcast(%x)
  %zero_i = s32[] constant(0)
  %init = (s32[], f32[{TRIPS},{M},{N}]{{2,1,0}}, f32[1,{M},{N}]{{2,1,0}}) tuple(%zero_i, %zeros, %x1)
  %loop = (s32[], f32[{TRIPS},{M},{N}]{{2,1,0}}, f32[1,{M},{N}]{{2,1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"{TRIPS}"}}}}
  %loop2 = (s32[], f32[{TRIPS},{M},{N}]{{2,1,0}}, f32[1,{M},{N}]{{2,1,0}}) while(%init), condition=%cond, body=%body
  ROOT %branch = f32[{M},{N}]{{1,0}} conditional(%p, %x, %x), true_computation=%on_true, false_computation=%on_false
}}
""")


@pytest.fixture(scope="module")
def kernels():
  return {k.name: k for k in sc.census(HLO)}


def _all(name):
  return [k for k in sc.census(HLO) if k.name == name]


def test_gemm_flops_and_bytes_from_shapes(kernels):
  g = kernels["gemm"]
  assert g.category == sc.DENSE_GEMM and g.count == 1 and not g.fp8_gemm
  assert g.flops == 2 * M * N * K
  assert g.bytes == 2 * (M * K + K * N + M * N)          # bf16 operands and output
  f = kernels["fp8gemm"]
  assert f.category == sc.DENSE_GEMM and f.fp8_gemm and f.flops == 2 * M * N * K
  assert f.bytes == M * K + K * N + 4 * M * N              # 1-byte operands, f32 output


def test_while_body_counted_times_its_trip_count():
  # Both loops share the body: the annotated one runs it TRIPS times, the other once (and
  # its condition, whose compare is then counted).
  scaled = _all("scaled")
  assert sorted(k.count for k in scaled) == [1, TRIPS]
  assert {k.trips_known for k in scaled if k.count == TRIPS} == {True}
  assert {k.trips_known for k in scaled if k.count == 1} == {False}
  assert [k.count for k in _all("lt")] == [1]      # only the unannotated loop's


def test_in_place_update_moves_only_the_update(kernels):
  u = kernels["updated"]
  update = 4 * M * N                                       # f32[1, M, N]
  assert u.bytes == update + 4 + update                    # read update and index, write it
  assert u.flops == 0


def test_categories_of_known_kernels(kernels):
  assert kernels["quant"].category == sc.FP8               # frames: s24jax/sparse_ops/fp8.py quantize
  assert kernels["adam"].category == sc.OPTIMIZER          # frames: train_step only
  assert kernels["copy.1"].category == sc.TRANSPOSE
  assert kernels["scaled"].category == sc.MVUE             # named scope .../mvue/...
  assert kernels["attn"].category == sc.ATTENTION
  assert kernels["compressed"].category == sc.COMPRESSION
  s = kernels["spmm"]
  assert s.category == sc.SPARSE_GEMM and s.gemm_mnk == (3072, 65536, 768)
  assert s.flops == 2 * 3072 * 65536 * 768
  assert s.attributes["a_dtype"] == "bf16" and s.attributes["d_row_major"] == "false"
  assert s.bytes == 2654208 + 2 * 65536 * 768 + 2 * 65536 * 3072
  # cuDNN attention: 4 B H Sq Sk D, halved for the causal mask
  assert kernels["attn"].flops == 4 * 4 * 2 * 128 * 128 * 64 / 2
  # bookkeeping launches nothing
  assert not {"a", "x1", "init", "zero_i", "loop"} & set(kernels)


def test_conditional_branches_marked_and_left_out_of_the_step(kernels):
  assert kernels["neg"].branch == "branch:true" and kernels["copy.2"].branch == "branch:false"
  common = sc.summarize(sc.census(HLO))
  both = sc.summarize(sc.census(HLO), branches="include")
  assert common[sc.TRANSPOSE].launches == 1                # copy.1 only
  assert both[sc.TRANSPOSE].launches == 2                  # and the false branch's copy
  assert both[sc.OTHER].launches == common[sc.OTHER].launches + 1   # the true branch's negate


def test_summary_totals_count_times_per_launch():
  ks = sc.census(HLO)
  rows = sc.summarize(ks)
  assert sum(r.launches for r in rows.values()) == sum(k.count for k in ks if not k.branch)
  assert math.isclose(sum(r.bytes for r in rows.values()),
                      sum(k.count * k.bytes for k in ks if not k.branch))


def test_no_entry_is_an_error():
  with pytest.raises(ValueError, match="ENTRY"):
    sc.census("HloModule empty\n")


def _scan_of_matmuls(layers, m, k):
  def f(x, ws):                                            # x (m, k), ws (layers, k, k)
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return h
  return f, jnp.ones((m, k), jnp.float32), jnp.ones((layers, k, k), jnp.float32)


def test_scan_compiled_for_the_cpu():
  """The scanned layers' dots: `layers` launches of 2*m*k*k FLOPs each."""
  layers, m, k = 3, 32, 16
  f, x, ws = _scan_of_matmuls(layers, m, k)
  x, ws = jax.device_put((x, ws), jax.devices("cpu")[0])   # XLA:CPU's dots on a GPU host too
  ks = sc.census(jax.jit(f).lower(x, ws).compile().as_text())
  gemms = [g for g in ks if g.category == sc.DENSE_GEMM]
  assert sum(g.count for g in gemms) == layers
  assert sum(g.count * g.flops for g in gemms) == layers * 2 * m * k * k
  assert all(g.trips_known for g in ks)


@pytest.mark.aot
def test_scan_compiled_for_an_h100():
  """The same scan compiled devicelessly for an H100 (XLA:GPU's GEMM fusions), in a
  subprocess: aot.start must come before jax starts a backend."""
  code = textwrap.dedent("""
      import json, jax, jax.numpy as jnp
      from s24jax.kernels import aot
      aot.start()
      from s24jax.perf import step_census as sc
      def f(x, ws):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return h
      x = aot.spec((256, 128), jnp.bfloat16, "h100")
      ws = aot.spec((5, 128, 128), jnp.bfloat16, "h100")
      _, compiled = aot.compile_for_gpu(f, x, ws, gpu="h100")
      gemms = [k for k in sc.census(compiled.as_text()) if k.category == sc.DENSE_GEMM]
      print(json.dumps([sum(g.count for g in gemms), sum(g.count * g.flops for g in gemms)]))
  """)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, timeout=600)
  launches, flops = eval(out.stdout.strip().splitlines()[-1])   # pylint: disable=eval-used
  assert launches == 5 and flops == 5 * 2 * 256 * 128 * 128
