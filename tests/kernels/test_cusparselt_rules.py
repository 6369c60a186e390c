"""Tests of kernels/cusparselt/rules.py: what cuSPARSELt 0.10 accepts, written down once.

Each rule is checked on hand-made GEMMs on both sides of it (accepted just inside, refused
just outside, with the rule named), the compressed size on hand-computed cases (values: half
of A; metadata: 2 bits per kept value), and the HLO audit on a hand-written custom-call line
and on lines that break a rule. That the stand-in and `Gemm.check` enforce these rules:
tests/kernels/test_cusparselt_library.py.
"""
import pytest

from s24jax.kernels.cusparselt import rules

TN = dict(trans_a=True, trans_b=False)


def _check(**kw):
  args = dict(m=64, n=64, k=64, a_type="bf16", b_type="bf16", d_type="bf16", **TN)
  args.update(kw)
  rules.check("gemm", **args)


def test_accepted_gemms_pass():
  _check()                                                         # bf16 TN
  _check(trans_a=False, trans_b=True)                              # bf16 takes any layout
  _check(a_type="e4m3", b_type="e4m3", d_type="f32")               # FP8 TN, f32 out
  _check(a_type="e5m2", b_type="e5m2", d_type="bf16")              # e5m2 x e5m2 exists
  _check(m=16, k=16, n=8)                                          # the bf16 minima


@pytest.mark.parametrize("kw,rule", [
    (dict(a_type="e4m3", b_type="e5m2", d_type="f32"), "R1"),      # mixed FP8
    (dict(d_type="f32"), "R2"),                                    # bf16 -> f32
    (dict(a_type="e4m3", b_type="e4m3", d_type="e4m3"), "R2"),     # FP8 out (C = D here)
    (dict(a_type="e4m3", b_type="e4m3", d_type="f32", trans_a=False), "R3"),   # NN
    (dict(a_type="e5m2", b_type="e5m2", d_type="f32", trans_b=True), "R3"),    # TT
    (dict(a_type="f32", b_type="f32", d_type="f32"), "R7"),        # float32 is 1:2
    (dict(k=40), "R5"),                                            # bf16 sparse: 16
    (dict(m=48, a_type="e4m3", b_type="e4m3", d_type="f32"), "R5"),  # FP8 sparse: 32
    (dict(n=36), "R5"),                                            # bf16 dense: 8
    (dict(n=rules.MAX_MN + 8), "R6"),
])
def test_refused_gemms_name_their_rule(kw, rule):
  with pytest.raises(rules.RuleError, match=rule):
    _check(**kw)


def test_compressed_bytes_hand_computed():
  # 16-bit: values 2 bytes x 32 kept of 64, metadata 64 / 8 bytes: 72 = 128 * 9 / 16
  assert rules.rule("bf16").compressed_bytes(64) == 64 + 8 == 128 * 9 // 16
  # 8-bit: values 32 bytes, metadata 8 bytes: 40 = 64 * 10 / 16
  assert rules.rule("e4m3").compressed_bytes(64) == 32 + 8 == 64 * 10 // 16


def test_compute_capability_gates():
  assert rules.check_compute_capability("bf16", (8, 0), "A100") is None
  assert rules.check_compute_capability("e4m3", (8, 9), "L4") is None     # since 0.8.0
  assert rules.check_compute_capability("e5m2", (9, 0), "H100") is None
  why = rules.check_compute_capability("e4m3", (8, 0), "A100")
  assert why and "8.9" in why and "R8" in why


_LINE = ('%ffi_call.7 = {out}[1024,512]{{1,0}} custom-call(%c, %x), custom_call_target='
         '"cusparselt_spmm", operand_layout_constraints={{u8[{size}]{{0}}, {b}[1024,256]{{1,0}}}}, '
         'api_version=API_VERSION_TYPED_FFI, metadata={{op_name="f"}}, backend_config={{a_dtype = '
         '"{a}", d_row_major = false, k = 256 : i64, m = 512 : i64, n = 1024 : i64, trans_a = '
         '{ta}, trans_b = false}}')
_COMPRESS = ('%ffi_call.6 = u8[{size}]{{0}} custom-call(%w), custom_call_target='
             '"cusparselt_compress", operand_layout_constraints={{{a}[512,256]{{1,0}}}}, '
             'api_version=API_VERSION_TYPED_FFI, metadata={{op_name="f"}}, backend_config={{'
             'b_dtype = "{b}", d_dtype = "f32", d_row_major = false, k = 256 : i64, m = 512 : '
             'i64, n = 1024 : i64, trans_a = true, trans_b = false}}')


def test_audit_reads_calls_back_from_hlo_text():
  good = "\n".join([_COMPRESS.format(size=512 * 256 * 10 // 16, a="f8e4m3fn", b="e4m3"),
                    _LINE.format(out="f32", size=81920, b="f8e4m3fn", a="e4m3", ta="true")])
  calls = rules.audit_hlo("HloModule m\n" + good + "\nROOT %t = tuple()")
  assert [c["target"] for c in calls] == ["cusparselt_compress", "cusparselt_spmm"]
  assert all(c["violation"] is None for c in calls), calls
  assert calls[1]["a_type"] == calls[1]["b_type"] == "e4m3" and calls[1]["d_type"] == "f32"
  assert (calls[1]["m"], calls[1]["n"], calls[1]["k"]) == (512, 1024, 256)

  mixed = _LINE.format(out="f32", size=81920, b="f8e5m2", a="e4m3", ta="true")
  nn = _LINE.format(out="f32", size=81920, b="f8e4m3fn", a="e4m3", ta="false")
  dense_size = _COMPRESS.format(size=512 * 256, a="f8e4m3fn", b="e4m3")
  bad = rules.audit_hlo("\n".join([mixed, nn, dense_size]))
  assert ["R1" in bad[0]["violation"], "R3" in bad[1]["violation"],
          "R9" in bad[2]["violation"]] == [True, True, True], bad
