"""Every kernel compiled for the H200 (sm_90a) on this CPU machine, through XLA's GPU compiler and ptxas.

The CUDA lowering tests stop at StableHLO; ``tools/sm90_compile.py`` goes on to PTX and ptxas against a
compile-only H200 (``make aot`` installs the CUDA plugin it needs into ``.aot/``). What ptxas reports is what
interpret mode cannot see: registers spilled to local memory (a persistent KDA prep spilled 900 bytes and ran a
third slower, ``benchmarks/RESULTS.md``, session 31). The spill budgets and the XLA kernel counts are those of
the code as measured; a change that raises one must say why (and lower the budget when it lowers one).
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from support import users_xla_env
from tools import sm90_compile

ROOT = pathlib.Path(__file__).resolve().parents[1]
AOT = ROOT / ".aot"

# (spill store bytes, spill load bytes) that ptxas may report per kernel; a kernel not listed may not spill.
SPILL_BUDGET = {
    "kda_prefill_prep": (132, 136),  # the largest over the cases (T = 32768)
    "kda_prefill_combine": (88, 88),
    "mla_decode_narrow_fp8": (8, 4),
    "mla_prefill": (36, 100),
}
# The 64-row MLA kernels' page loop that runs on every full page (the shortest loop holding a page's QK, 36
# ``HGMMA.64x64x16``, and ``P @ V``, ``HGMMA.64x256x16``): at most this many spill reloads (``LDL``) a page, and
# no spill store (``STL``): a spill there is paid on every page, not once per program.
HOT_LOOP_SPILL_LOADS = {"mla-decode-hq128-bf16": 0, "mla-decode-hq128-fp8": 0}
# The Mosaic GPU kernels of each case, and at most how many XLA kernels run beside them.
EXPECTED = {
    "kda-prefill-8x1024-h96": (("kda_prefill_prep", "kda_prefill_state"), 2),
    "kda-prefill-8x1024-h96-ckpt4": (("kda_prefill_prep", "kda_prefill_state"), 2),  # as without checkpoints
    "kda-prefill-8x1024-h96-bf16-state": (("kda_prefill_prep", "kda_prefill_state"), 2),
    # T = 8192 H = 11: the segmented state pass (prefill_state.choose_segments takes 6 runs).
    "kda-prefill-8192-h11": (("kda_prefill_prep", "kda_prefill_transition", "kda_prefill_combine",
                              "kda_prefill_state"), 3),
    "kda-prefill-8192-h96": (("kda_prefill_prep", "kda_prefill_state"), 2),
    "kda-prefill-32768-h32": (("kda_prefill_prep", "kda_prefill_state"), 2),
    "kda-decode-64-h96": (("kda_decode",), 0),
    "mla-decode-hq16-bf16": (("mla_decode_narrow",), 2),
    "mla-decode-hq128-bf16": (("mla_decode_wide",), 2),
    "mla-decode-hq16-fp8": (("mla_decode_narrow_fp8",), 3),
    # fp8 pages in registers: q's two e4m3 parts take two small XLA kernels (its row maxima, then both parts:
    # kernel.split_e4m3), the merge three (the partials' column pairs transposed back, then the merge).
    "mla-decode-hq16-fp8-regs": (("mla_decode_narrow_fp8_regs",), 5),
    "mla-decode-hq128-fp8": (("mla_decode_wide_fp8",), 2),
    "short-conv-prefill": (("short_conv_prefill",), 3),
    "mla-prefill-8192-h16": (("mla_prefill",), 6),
}
SUFFIX = "_mosaic_gpu_kernel"  # what Mosaic GPU appends to a kernel's name

PTXAS_SAMPLE = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kda_prefill_prep_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for kda_prefill_prep_mosaic_gpu_kernel
    128 bytes stack frame, 124 bytes spill stores, 128 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers, 128 bytes cumulative stack size, 1 bytes smem
ptxas info    : Compiling entry function 'k_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for k_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers
"""


def test_ptxas_report_is_parsed():
  kernels = sm90_compile.parse_ptxas(PTXAS_SAMPLE)
  assert kernels == (
      sm90_compile.Kernel("kda_prefill_prep_mosaic_gpu_kernel", "sm_90a", 255, 124, 128, 128),
      sm90_compile.Kernel("k_mosaic_gpu_kernel", "sm_90a", 40, 0, 0, 0))


def test_entry_kernels_are_the_entry_computations_launches():
  hlo = """HloModule m
%fused_add (p: s32[8]) -> s32[8] {
  %inner = s32[8]{0} fusion(%p), kind=kLoop, calls=%x
}

ENTRY %main (a: s32[8], b: f32[4]) -> f32[4] {
  %a = s32[8]{0} parameter(0)
  %copy.1 = f32[4]{0} copy(%b)
  %loop_add_fusion = s32[8]{0} fusion(%a), kind=kLoop, calls=%fused_add
  %get-tuple-element.2 = s32[8]{0} get-tuple-element(%t), index=0
  ROOT %mpmd_map.0 = f32[4]{0} custom-call(%loop_add_fusion, %copy.1), custom_call_target="mosaic_gpu_v2"
}
"""
  report = sm90_compile.Report("c", (), sm90_compile.entry_kernels(hlo))
  assert report.xla_kernels == ("copy.1: copy", "loop_add_fusion: fusion", "mpmd_map.0: custom-call")
  assert report.xla_only() == ("loop_add_fusion: fusion",)


@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="on a GPU machine the kernels compile and run for real (make gpu-check)")
def test_every_kernel_compiles_for_sm90a_within_its_spill_budget(tmp_path):
  if not (AOT / "jax_plugins").is_dir():
    pytest.fail(f"the CUDA plugin is not installed in {AOT}: run `make aot` (make test does)")
  out, sass = tmp_path / "reports.json", tmp_path / "sass"
  env = dict(os.environ, PYTHONPATH=f"{AOT}{os.pathsep}{ROOT}", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(ROOT / "tools" / "sm90_compile.py"), "--json", str(out), "--sass",
                         str(sass)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  reports = {r["case"]: r for r in json.loads(out.read_text())}
  assert set(reports) == set(EXPECTED)
  for case, (names, max_xla) in EXPECTED.items():
    kernels = reports[case]["kernels"]
    assert [k["name"] for k in kernels] == [n + SUFFIX for n in names], case
    for k in kernels:
      assert k["arch"] == "sm_90a", (case, k)
      assert 0 < k["registers"] <= 255, (case, k)
      stores, loads = SPILL_BUDGET.get(k["name"].removesuffix(SUFFIX), (0, 0))
      assert k["spill_stores"] <= stores and k["spill_loads"] <= loads, (case, k)
    assert len(reports[case]["xla_only"]) <= max_xla, (case, reports[case]["xla_only"])
  for case, most in HOT_LOOP_SPILL_LOADS.items():  # here, not in a test of its own: one compile for both
    loops = [body for body in sm90_compile.sass_loops((sass / f"{case}.txt").read_text())
             if sum("HGMMA.64x64x16" in i for i in body) >= 36 and any("HGMMA.64x256x16" in i for i in body)]
    assert loops, case
    ops = [sm90_compile.opcode(i) for i in loops[0]]
    loads, stores = (sum(op.startswith(kind) for op in ops) for kind in ("LDL", "STL"))
    assert loads <= most and stores == 0, (case, "spills in the full pages' loop", loads, stores)


def test_sass_loops_are_the_branches_back():
  sass = """.text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDL R2, [R1] ;
.L_x_1:
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R4], R5 ;
        /*0030*/              @!P1 BRA `(.L_x_1) ;
        /*0040*/               @P2 BRA `(.L_x_0) ;
        /*0050*/                   EXIT ;
"""
  loops = sm90_compile.sass_loops(sass)
  assert [[sm90_compile.opcode(i) for i in body] for body in loops] == [
      ["SYNCS.PHASECHK.TRANS64.TRYWAIT", "BRA"], ["LDL", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "BRA", "BRA"]]


# Compiles q's e4m3 split (the fp8-registers MLA path) for the H200 at XLA's default flags, not the tests'
# (conftest disables excess precision), and prints the optimized HLO.
_SPLIT_HLO = """
import jax, jax.numpy as jnp
from tools import sm90_compile
from pallas_kernels.mla import kernel
device = sm90_compile.compile_only_device()
q = jax.ShapeDtypeStruct((2, 16, 576), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(device))
print(jax.jit(kernel.split_e4m3).trace(q).lower().compile().as_text())
"""


@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="on a GPU machine the split runs for real (test_mla_fp8_cache.py)")
def test_q_split_leaves_xlas_gpu_compiler_no_e4m3_round_trip_to_fold():
  """q_lo is the remainder of q after q_hi's rounding to e4m3. XLA's GPU compiler, allowed excess precision (its
  default, which users run with), folds f32 -> e4m3 -> f32 into the f32 value, which would leave q_lo without that
  remainder; so ``split_e4m3`` rounds by integer operations, and the optimized HLO at those flags must keep them
  (the mask of f32's top 12 bits), narrow to e4m3 and never widen an e4m3 value back to f32."""
  if not (AOT / "jax_plugins").is_dir():
    pytest.fail(f"the CUDA plugin is not installed in {AOT}: run `make aot` (make test does)")
  env = users_xla_env(PYTHONPATH=f"{AOT}{os.pathsep}{ROOT}", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _SPLIT_HLO], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  fp8_values = set(re.findall(r"(%\S+) = f8e4m3fn\[", proc.stdout))
  widened = [name for name in re.findall(r"= f32\[[^\]]*\]\S* convert\((%[^)\s,]+)\)", proc.stdout)]
  assert fp8_values and not any(name in fp8_values for name in widened), proc.stdout[-3000:]
  assert re.search(r"= u32\[\] constant\(4293918720\)", proc.stdout), proc.stdout[-3000:]  # 0xFFF00000
