"""KDA prefill on a Hopper GPU: the Mosaic GPU kernel vs FLA's ``chunk_kda`` (PyTorch/Triton) on the same inputs.

Times, throughput and roofline fraction per shape, a bf16 state pool and checkpoints, and a cross-check of our
output against FLA's; columns and method: pallas_kernels/kda/README.md, "Benchmarks". Results go to stdout and,
as JSON, to ``--json``.

Usage (on the GPU machine, FLA installed): ``PYTHONPATH=. python3 benchmarks/kda_prefill.py --json out.json``
(``--quick --shapes 0 3``: two shapes without the bf16-state and checkpoint rows, as ``make gpu-check`` runs it)
"""

import argparse
import contextlib
import faulthandler
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._harness import COPY_BYTES_PER_S, PEAK_BF16_FLOPS, gpu_timeline, timeline_summary
from pallas_kernels import kda
from pallas_kernels.kda.config import CHUNK_SIZE as C
from pallas_kernels.testing import kda_gate_params, kda_inputs, rel_rmse

# FLA's chunk_kda hands its call to FlashKDA when that is importable (its backend dispatch): the FLA column
# measures FLA's own Triton kernels, and FlashKDA has its own column.
os.environ["FLA_FLASH_KDA"] = "0"

K = V = 128
LB = -5.0
SHAPES = [("N=1 T=8192 H=96", (8192,), 96), ("N=1 T=32768 H=32", (32768,), 32),
          ("N=8x1024 H=96", (1024,) * 8, 96), ("N=1 T=8192 H=11", (8192,), 11)]


def flops(T: int, H: int) -> float:
  return T * H * (6 * K * K + 3 * C * K + C * C)


def min_bytes(T: int, H: int, N: int, state_bytes: int) -> float:
  """q, k, v, g_raw read and o written in bf16, β read, one state read and written per sequence."""
  return T * H * (5 * K * 2 + 2) + 2 * N * H * V * K * state_bytes


def make_inputs(lens, H: int, seed: int = 0):
  """Raw inputs (``kda_inputs`` with ``g_raw`` of std 2, the model's gate parameters), ``cu`` and initial states."""
  rng = np.random.default_rng(seed)
  x = kda_inputs(rng, (int(sum(lens)),), H, K, V, g_scale=2.0)
  x["A_log"], x["dt_bias"] = kda_gate_params(rng, H, K)
  x["cu"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  x["h0"] = (rng.normal(size=(len(lens), H, V, K)) * 0.1).astype(np.float32)
  return x


def checkpoints(lens, per_seq: int):
  """``per_seq`` checkpoints per sequence at evenly spaced multiples of 64, each into its own slot."""
  offsets, indptr = [], [0]
  for n in lens:
    step = (n // (per_seq + 1)) // C * C
    offsets += [step * (i + 1) for i in range(per_seq)]
    indptr.append(len(offsets))
  N = len(lens)
  return (np.asarray(indptr, np.int32), np.asarray(offsets, np.int32),
          np.arange(N, N + len(offsets), dtype=np.int32))


def _wall_ms(fn, n: int) -> float:
  """Wall time of ``fn(n)`` (n back-to-back calls that block at the end), in ms."""
  t = time.perf_counter()
  fn(n)
  return (time.perf_counter() - t) * 1e3


def bench(fn, iters: int, reps: int = 5) -> float:
  """Median over ``reps`` of the mean wall time of ``iters`` back-to-back calls (ms); fn blocks at the end."""
  fn(1)
  return float(np.median([_wall_ms(fn, iters) / iters for _ in range(reps)]))


FIT_COUNTS = (4, 8, 16, 32, 64)


def bench_fit(fn, counts=FIT_COUNTS, reps: int = 5) -> dict:
  """A least-squares line through the median wall time of ``n`` back-to-back calls against ``n`` (``counts``):
  ``per_call_ms``, its slope, is what one more call adds to a stream of calls; ``fixed_ms``, its intercept, what a
  stream costs once (dispatching its first call, waking the host after its last), which ``bench`` spreads over
  its ``iters`` calls. fn blocks at the end."""
  fn(1)
  med = [float(np.median([_wall_ms(fn, n) for _ in range(reps)])) for n in counts]
  slope, intercept = np.polyfit(np.asarray(counts, float), np.asarray(med), 1)
  return dict(per_call_ms=float(slope), fixed_ms=float(intercept))


def ours_runner(x, lens, H: int, *, state_dtype=jnp.float32, per_seq_ckpt: int = 0,
                lower_bound: float | None = LB, segments: int | None = None):
  """``(run, o)``: ``run(n)`` makes n back-to-back jitted ``kda_prefill`` calls (the pool donated and threaded
  through) and blocks; ``o`` is the first call's output (f32 NumPy). ``lower_bound`` None: the softplus gate.
  ``segments``: ``KdaTuning.prefill_segments`` (None: the heuristic)."""
  N = len(lens)
  ind, off, slots = checkpoints(lens, per_seq_ckpt) if per_seq_ckpt else (
      np.zeros(N + 1, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))
  P = N + len(off)
  pool = np.zeros((P, H, V, K), np.float32)
  pool[:N] = x["h0"]
  cfg = kda.KdaConfig(lower_bound=lower_bound, state_dtype=state_dtype, impl="pallas",
                      tuning=kda.KdaTuning(prefill_segments=segments))
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  args = (bf(x["q"]), bf(x["k"]), bf(x["v"]), bf(x["g_raw"]), bf(x["beta_raw"]), jnp.asarray(x["A_log"]),
          jnp.asarray(x["dt_bias"]), jnp.asarray(x["cu"]))
  tail = (jnp.arange(N, dtype=jnp.int32), jnp.ones(N, bool), jnp.asarray(ind), jnp.asarray(off),
          jnp.asarray(slots))

  def call(q, k, v, g, b, a, d, cu, pool, si, hi, ci, co, cs):
    return kda.kda_prefill(q, k, v, g, b, A_log=a, dt_bias=d, cu_seqlens=cu, state_pool=pool,
                           state_indices=si, has_initial_state=hi, checkpoint_indptr=ci, checkpoint_offsets=co,
                           checkpoint_slots=cs, config=cfg)

  f = jax.jit(call, donate_argnums=(8,))
  state = {"pool": jnp.asarray(pool, state_dtype)}
  o, state["pool"] = f(*args, jnp.asarray(pool, state_dtype), *tail)
  o = np.asarray(o, np.float32)

  def run(n):
    out = None
    for _ in range(n):
      out, state["pool"] = f(*args, state["pool"], *tail)
    jax.block_until_ready(out)

  return run, o


def ours(x, lens, H: int, *, iters: int = 20, **variant):
  run, o = ours_runner(x, lens, H, **variant)
  return bench(run, iters), o


def paired_overheads(runs: dict, rounds: int = 9, iters: int = 20) -> dict:
  """Wall time and overhead of each variant in ``runs`` (name -> ``run(n)``; the first is the base).

  Each round times every variant once (``iters`` back-to-back calls after one warm-up call, the order rotated
  from round to round) and divides each variant's time by the base's of the same round; the overhead is the
  median of those ratios minus 1. The GPU's speed drifts by several percent between runs a minute apart (clock
  and power state), which swamps a 3% overhead measured from separate runs; a ratio within one round cancels it.
  Returns ``{name: dict(ms=median wall ms per call, overhead=..., ratio_lo=..., ratio_hi=...)}``, the ratio
  range over the rounds (the base has no ratio entries)."""
  names = list(runs)
  times = {n: [] for n in names}
  for r in range(rounds):
    for n in names[r % len(names):] + names[:r % len(names)]:
      times[n].append(bench(runs[n], iters, reps=1))
  out = {names[0]: dict(ms=float(np.median(times[names[0]])))}
  for n in names[1:]:
    ratios = np.asarray(times[n]) / np.asarray(times[names[0]])
    out[n] = dict(ms=float(np.median(times[n])), overhead=float(np.median(ratios) - 1),
                  ratio_lo=float(ratios.min()), ratio_hi=float(ratios.max()))
  return out


def _torch_inputs(x):
  """The shared inputs as torch tensors on the GPU: q, k, v, g_raw, β logits ``[1, T, H, ...]`` bf16, the gate
  parameters in f32, int64 ``cu_seqlens`` and the f32 initial states ``[N, H, V, K]``."""
  import torch

  t = lambda a, dt=torch.bfloat16: torch.from_numpy(np.ascontiguousarray(a)).to("cuda").to(dt)
  return dict(q=t(x["q"])[None], k=t(x["k"])[None], v=t(x["v"])[None], g=t(x["g_raw"])[None],
              beta=t(x["beta_raw"])[None], A_log=t(x["A_log"], torch.float32),
              dt_bias=t(x["dt_bias"], torch.float32), cu=t(x["cu"], torch.int64), h0=t(x["h0"], torch.float32))


def _time_torch(call, name: str, iters: int):
  """Times a torch peer (``call() -> o [T, H, V]``) as called back to back and replayed from a CUDA graph.
  Returns (times, ``o`` as f32 numpy); times: ``called_ms`` and ``graph_ms`` (``bench``) and the ``bench_fit``
  lines ``called_fit`` and ``graph_fit`` (the graph's None when capture fails)."""
  import torch

  with torch.no_grad():
    o = call().float().cpu().numpy()

    def run(n):
      for _ in range(n):
        call()
      torch.cuda.synchronize()

    times = dict(called_ms=bench(run, iters), called_fit=bench_fit(run), graph_ms=None, graph_fit=None)
    try:
      s = torch.cuda.Stream()
      s.wait_stream(torch.cuda.current_stream())
      with torch.cuda.stream(s):
        for _ in range(3):
          call()
      torch.cuda.current_stream().wait_stream(s)
      graph = torch.cuda.CUDAGraph()
      with torch.cuda.graph(graph):
        call()

      def replay(n):
        for _ in range(n):
          graph.replay()
        torch.cuda.synchronize()

      times.update(graph_ms=bench(replay, iters), graph_fit=bench_fit(replay))
    except Exception as e:  # a capture failure leaves the as-called time as the peer's number
      print(f"  {name} CUDA graph capture failed: {type(e).__name__}: {e}", flush=True)
  return times, o


def fla(x, lower_bound: float | None, iters: int = 20):
  """FLA's ``chunk_kda`` with the gate, β sigmoid and q/k L2 norm in its kernel, V-first f32 state (its safe
  gate for a lower bound, its softplus gate for None)."""
  import torch
  from fla.ops.kda import chunk_kda

  a = _torch_inputs(x)
  cu_cpu = torch.from_numpy(x["cu"].astype(np.int64))

  def call():
    o, _ = chunk_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"], output_final_state=True,
                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     safe_gate=lower_bound is not None, lower_bound=lower_bound, A_log=a["A_log"],
                     dt_bias=a["dt_bias"].reshape(-1),
                     state_v_first=True, cu_seqlens=a["cu"], cu_seqlens_cpu=cu_cpu)
    return o[0]

  return _time_torch(call, "FLA", iters)


def flashkda(x, lower_bound: float | None, iters: int = 20):
  """FlashKDA's forward (CUTLASS; built by tools/peers/build_flashkda.sh): the same gate formula, β sigmoid
  and q/k L2 norm inside, f32 state in and out in our ``[N, H, V, K]`` layout. Each call allocates its
  output, final state and workspace, as its Python API does. It has the lower-bound gate only."""
  if lower_bound is None:
    raise NotImplementedError("FlashKDA has no softplus gate")
  import torch
  import flash_kda

  a = _torch_inputs(x)

  def call():
    out, final = torch.empty_like(a["v"]), torch.empty_like(a["h0"])
    flash_kda.fwd(a["q"], a["k"], a["v"], a["g"], a["beta"], K ** -0.5, out, a["A_log"], a["dt_bias"], lower_bound,
                  initial_state=a["h0"], final_state=final, cu_seqlens=a["cu"])
    return out[0]

  return _time_torch(call, "FlashKDA", iters)


PEERS = (("fla", fla), ("flashkda", flashkda))


@contextlib.contextmanager
def padded_smem(extra_bytes: int):
  """Every Mosaic GPU kernel traced inside asks for ``extra_bytes`` more SMEM that it never touches: timing the
  prep with fewer programs per SM tells whether its speed follows the number of programs an SM interleaves
  (latency bound: more of them would help) or not (bound by issue or a unit: fewer instructions would)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  real = plgpu.kernel

  def kernel(body, *, scratch_types, **kw):
    pad = plgpu.SMEM((extra_bytes // 4,), jnp.float32)
    return real(lambda *refs: body(*refs[:-1]), scratch_types=[*scratch_types, pad], **kw)

  plgpu.kernel = kernel
  try:
    yield
  finally:
    plgpu.kernel = real


def prep_executables(count: int, lower_bound: float | None = LB) -> list:
  """``count`` jitted preps (K = 128; ``lower_bound`` None: the softplus gate), each a function object of its own,
  so each compiles to, and loads, an executable of its own."""
  from pallas_kernels.kda import prefill_prep

  return [jax.jit(functools.partial(prefill_prep.prep, scale=K ** -0.5, lower_bound=lower_bound,
                                    smem_operands=False))
          for _ in range(count)]


def prep_setup(lens, H: int, lower_bound: float | None = LB):
  """The prep alone: ``(x, jitted prep, its arguments, index table)`` at these lengths and heads, the table being
  ``prefill_kernel.index_table``'s (each sequence into the slot of its index, with an initial state)."""
  from pallas_kernels.kda import prefill_kernel

  x = make_inputs(lens, H)
  T, N = int(sum(lens)), len(lens)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  q, k, v, g = (bf(x[n]) for n in ("q", "k", "v", "g_raw"))
  beta_p = jnp.pad(jnp.asarray(x["beta_raw"]), ((0, C), (0, 0)))
  num_slots = -(-T // C) + N
  table = prefill_kernel.index_table(jnp.asarray(x["cu"]), jnp.arange(N, dtype=jnp.int32), jnp.ones(N, bool),
                                     jnp.zeros(N + 1, jnp.int32), num_slots)
  prep, = prep_executables(1, lower_bound)
  pargs = (q, k, v, g, beta_p, jnp.asarray(x["A_log"]), jnp.asarray(x["dt_bias"]), table)
  return x, prep, pargs, table


def profile(lens, H: int, iters: int = 10) -> dict:
  """Times stage 1 (prep, also with one program per SM: ``padded_smem``) and stage 2 (state pass) of our kernel
  separately (ms): stage 2 with each ``v_blocks`` (``v_blocks`` names the default) and, at the default, with one
  checkpoint per sequence (``state_ckpt1_ms``: what the checkpoints cost inside the kernel, against the whole
  call's overhead from ``paired_overheads``)."""
  from pallas_kernels.kda import prefill_kernel, prefill_state

  x, prep, pargs, _ = prep_setup(lens, H)
  T, N = int(sum(lens)), len(lens)
  cu = jnp.asarray(x["cu"])
  prep_one, = prep_executables(1)  # a second jitted prep, traced with padded SMEM (below)
  work = prep(*pargs)

  default_v_blocks = kda.default_tuning(num_seqs=N, num_heads=H, key_dim=K, value_dim=V,
                                        state_dtype=jnp.float32).prefill_v_blocks

  def state_runner(per_seq_ckpt: int, v_blocks: int = default_v_blocks):
    ind, off, slots = (jnp.asarray(a) for a in checkpoints(lens, per_seq_ckpt)) if per_seq_ckpt else (
        jnp.zeros(N + 1, jnp.int32), jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.int32))
    table = prefill_kernel.index_table(cu, jnp.arange(N, dtype=jnp.int32), jnp.ones(N, bool), ind, -(-T // C) + N)
    ck = prefill_state.checkpoint_lists(off, slots)
    pool = jnp.zeros((N + off.shape[0], H, V, K), jnp.float32).at[:N].set(x["h0"])

    @jax.jit
    def state(work, pool):
      pool_ref = jax.new_ref(pool)
      o = prefill_state.state_pass(*work, pool_ref, table, ck, T=T, out_dtype=jnp.bfloat16, v_blocks=v_blocks,
                                   num_seqs=N)
      return o, pool_ref[...]

    return lambda n: jax.block_until_ready([state(work, pool) for _ in range(n)])

  def run_prep(n, f=prep):
    jax.block_until_ready([f(*pargs) for _ in range(n)])

  # The prep's SMEM holds two programs per SM; 40 KB more each leaves room for one.
  with padded_smem(40 << 10):
    run_prep(1, prep_one)

  return dict(T=T, H=H, N=N, prep_ms=bench(run_prep, iters),
              prep_one_per_sm_ms=bench(functools.partial(run_prep, f=prep_one), iters), v_blocks=default_v_blocks,
              state_ckpt1_ms=bench(state_runner(1), iters),
              **{f"state_v{b}_ms": bench(state_runner(0, b), iters) for b in (1, 2)})


def kernel_overheads(tables: dict) -> dict:
  """Each variant's cost from its kernels (``call_kernels`` tables, name -> table; the first is the base).

  The prep's code and inputs are the same in every variant (the state dtype and the checkpoints enter only
  stage 2 and the index arithmetic), yet its time depends on the executable it was loaded with (RESULTS.md,
  session 16), which whole-call ratios mix into every overhead. So a variant's overhead here is its other
  kernels' time (stage 2 and the XLA ops: ``rest``) less the base's, over the base's rest plus the fastest prep
  of all the executables. Returns ``{name}_prep_ms`` and ``{name}_rest_ms`` per variant and
  ``{name}_kernel_overhead`` per variant other than the base."""
  parts = {}
  for name, table in tables.items():
    prep = next(ms for kernel, ms in table if kernel.startswith("kda_prefill_prep"))
    parts[name] = (prep, sum(ms for _, ms in table) - prep)
  base = next(iter(tables))
  total = min(prep for prep, _ in parts.values()) + parts[base][1]
  out = {}
  for name, (prep, rest) in parts.items():
    out[f"{name}_prep_ms"], out[f"{name}_rest_ms"] = prep, rest
    if name != base:
      out[f"{name}_kernel_overhead"] = (rest - parts[base][1]) / total
  return out


def call_kernels(run, calls: int = 5) -> list[tuple[str, float]]:
  """Every GPU kernel of one call of ``run`` (CUPTI), in launch order, as ``(name, mean ms over calls)``. The
  Pallas kernels are ``kda_prefill_prep_mosaic_gpu_kernel`` and ``kda_prefill_state_mosaic_gpu_kernel``."""
  from benchmarks._harness import cupti_kernels

  run(2)
  with cupti_kernels() as records:
    run(calls)
  per_call = len(records) // calls
  assert per_call * calls == len(records), (len(records), calls)
  return [(records[i][0], float(np.mean([records[c * per_call + i][1] for c in range(calls)])))
          for i in range(per_call)]


def kernel_table(lens, H: int) -> dict:
  """``call_kernels`` of a whole ``kda_prefill`` call for the base and the one-checkpoint variant: where the
  checkpoints' end-to-end overhead goes."""
  x = make_inputs(lens, H)
  return {variant: call_kernels(ours_runner(x, lens, H, **kw)[0])
          for variant, kw in (("base", {}), ("ckpt1", dict(per_seq_ckpt=1)))}


def runner_modes(lens, H: int, runners: int = 6) -> dict:
  """Whether a runner's speed is its own (session 15 saw the same inputs run 15% slower through a second jitted
  runner of the base): ``paired_overheads`` of ``runners`` runners of the base, each with its own executable and
  buffers (ratios against the first), and the kernels of the fastest and the slowest, to place a slow mode."""
  x = make_inputs(lens, H)
  runs = {f"runner{i}": ours_runner(x, lens, H)[0] for i in range(runners)}
  out = paired_overheads(runs)
  by_ms = sorted(runs, key=lambda n: out[n]["ms"])
  for label, n in (("fastest", by_ms[0]), ("slowest", by_ms[-1])):
    out[label] = [n] + [(name[:40], round(ms, 4)) for name, ms in call_kernels(runs[n])]
  return out


def input_placement(lens, H: int, copies: int = 6, lower_bound: float | None = LB) -> dict:
  """The prep alone, one executable, on ``copies`` separately allocated copies of the same inputs, timed in
  ``paired_overheads`` rounds (ratios against the first copy): does where the inputs lie set the prep's speed
  (``--runners`` placed a runner's slow mode in the prep)? Each copy also reports its inputs' addresses modulo
  2 MiB; ``as_temporaries_prep_kernel_ms`` then times the prep kernel in ``copies`` executables that keep its
  workspaces as temporaries, and ``own_executable_prep_kernel_ms`` in ``copies`` executables of the prep alone
  (outputs allocated apart, as for the copies). ``lower_bound`` None: the softplus gate."""
  _, prep, pargs, _ = prep_setup(lens, H, lower_bound)
  runs, where = {}, {}
  for i in range(copies):
    args = tuple(jnp.array(a, copy=True) for a in pargs)
    runs[f"copy{i}"] = lambda n, args=args: jax.block_until_ready([prep(*args) for _ in range(n)])
    where[f"copy{i}"] = {name: a.unsafe_buffer_pointer() % (2 << 20) for name, a in zip("qkvg", args)}
  out = paired_overheads(runs)
  for name in runs:
    out[name]["addr_mod_2mib"] = where[name]

  def prep_kernel_ms(fns) -> list[float]:
    """The prep kernel's time (CUPTI) in each of ``fns``, called on the original arguments."""
    return [round(next(ms for name, ms in call_kernels(lambda n, f=f: jax.block_until_ready(
        [f(*pargs) for _ in range(n)])) if name.startswith("kda_prefill_prep")), 4) for f in fns]

  # The same prep with its workspaces as temporaries of an executable (reduced to sums), as inside a whole
  # call, one executable per copy (a function object of its own each), where whole-call runners differ; then
  # standalone outputs again, allocated apart as for the copies, but one executable per copy: separates the
  # executable from where its workspaces lie.
  sums = lambda *a: [jnp.sum(o.astype(jnp.float32)) for o in prep(*a)]
  out["as_temporaries_prep_kernel_ms"] = prep_kernel_ms([jax.jit(functools.partial(sums)) for _ in range(copies)])
  out["own_executable_prep_kernel_ms"] = prep_kernel_ms(prep_executables(copies, lower_bound))
  return out


def check_vs_xla(lens=(0, 300, 700), H: int = 4) -> float:
  x = make_inputs(lens, H)
  N = len(lens)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  outs = []
  for impl in ("pallas", "xla"):
    o, _ = kda.kda_prefill(bf(x["q"]), bf(x["k"]), bf(x["v"]), bf(x["g_raw"]), bf(x["beta_raw"]),
                           A_log=jnp.asarray(x["A_log"]), dt_bias=jnp.asarray(x["dt_bias"]),
                           cu_seqlens=jnp.asarray(x["cu"]), state_pool=jnp.asarray(x["h0"]),
                           state_indices=jnp.arange(N, dtype=jnp.int32), has_initial_state=jnp.ones(N, bool),
                           config=kda.KdaConfig(lower_bound=LB, impl=impl))
    outs.append(np.asarray(o, np.float64))
  return rel_rmse(outs[0], outs[1])


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--json", default=None)
  parser.add_argument("--commit", default="unknown")
  parser.add_argument("--skip", nargs="*", default=[], choices=[p for p, _ in PEERS], help="peers not to run")
  parser.add_argument("--watchdog", type=float, default=500.0)
  parser.add_argument("--profile", action="store_true",
                      help="only time the two stages separately (stage 2 also with checkpoints) and list every "
                      "kernel of a whole call with and without a checkpoint")
  parser.add_argument("--timeline", action="store_true",
                      help="only trace back-to-back calls of the base (8 x 1024 and T=8192, H=96) with jax.profiler: "
                      "a call's wall time split into its kernels and the idle time between and around them")
  parser.add_argument("--runners", type=int, default=0,
                      help="only time this many runners of the base (T=8192 H=96) and list the kernels of the "
                      "fastest and slowest: does a runner have a speed of its own, and in which kernel")
  parser.add_argument("--placement", type=int, default=0,
                      help="only time the prep (T=8192 H=96) on this many separately allocated copies of its "
                      "inputs: does a buffer's placement set its speed")
  parser.add_argument("--executables", type=int, default=0,
                      help="only compile this many executables of the prep (T=8192 H=96) and call each once: "
                      "a target for ncu, to compare the launches of a fast and a slow executable")
  parser.add_argument("--softplus", action="store_true",
                      help="the softplus gate (Kimi-Linear's) instead of the lower-bound gate: the whole call "
                      "against FLA (FlashKDA has no such gate), or with --placement or --executables the prep")
  parser.add_argument("--quick", action="store_true", help="no bf16-state and checkpoint rows (make gpu-check)")
  parser.add_argument("--segments", type=int, nargs="*", default=[],
                      help="also time ours with KdaTuning.prefill_segments set to each of these (ours_seg{G}_* "
                      "columns, and o's rel RMSE against the default's)")
  parser.add_argument("--shapes", type=int, nargs="+", default=list(range(len(SHAPES))),
                      help="indices into SHAPES, in the order to run them")
  parser.add_argument("--overhead-shapes", type=int, nargs="*", default=[0, 2],
                      help="the shapes (indices into SHAPES) that also time the bf16-state and checkpoint variants")
  args = parser.parse_args()
  faulthandler.dump_traceback_later(args.watchdog, exit=True)
  print(f"devices: {jax.devices()}  commit: {args.commit}", flush=True)
  gate_bound = None if args.softplus else LB
  if args.timeline:
    calls = 6
    for name, lens, H in (SHAPES[2], SHAPES[0]):
      run, _ = ours_runner(make_inputs(lens, H), lens, H, lower_bound=gate_bound)
      row = dict(wall_ms=bench(run, 20), **timeline_summary(gpu_timeline(run, calls), calls))
      print(name, json.dumps(row), flush=True)
    return 0
  if args.runners:
    name, lens, H = SHAPES[0]
    print(name, json.dumps(runner_modes(lens, H, args.runners)), flush=True)
    return 0
  if args.executables:
    _, lens, H = SHAPES[0]
    pargs = prep_setup(lens, H, gate_bound)[2]
    for f in prep_executables(args.executables, gate_bound):
      jax.block_until_ready(f(*pargs))
    return 0
  if args.placement:
    name, lens, H = SHAPES[0]
    print(name, json.dumps(input_placement(lens, H, args.placement, gate_bound)), flush=True)
    return 0
  if args.profile:
    for name, lens, H in (SHAPES[0], SHAPES[2], SHAPES[3]):
      print(name, json.dumps(profile(lens, H)), flush=True)
    for name, lens, H in (SHAPES[0], SHAPES[2]):
      for variant, table in kernel_table(lens, H).items():
        print(name, variant, f"{sum(ms for _, ms in table):.4f} ms in kernels:", flush=True)
        for kernel, ms in table:
          print(f"  {ms:9.4f}  {kernel[:100]}", flush=True)
    print("rel RMSE of o vs impl='xla' (T=1000 varlen, H=4):", check_vs_xla(), flush=True)
    return 0
  results, skip = [], set(args.skip)
  for i in args.shapes:
    name, lens, H = SHAPES[i]
    x = make_inputs(lens, H)
    T, N = int(sum(lens)), len(lens)
    run, o = ours_runner(x, lens, H, lower_bound=gate_bound)
    t_ours, fit_ours = bench(run, 20), bench_fit(run)
    row = dict(shape=name, T=T, H=H, N=N, ours_ms=t_ours, ours_per_call_ms=fit_ours["per_call_ms"],
               ours_fixed_ms=fit_ours["fixed_ms"], mtok_s=T / t_ours / 1e3,
               tflops=flops(T, H) / t_ours / 1e9,
               roofline_ms=max(flops(T, H) / PEAK_BF16_FLOPS, min_bytes(T, H, N, 4) / COPY_BYTES_PER_S) * 1e3)
    row["roofline_frac"] = row["roofline_ms"] / t_ours
    for G in args.segments:
      run_g, o_g = ours_runner(x, lens, H, lower_bound=gate_bound, segments=G)
      row.update({f"ours_seg{G}_ms": bench(run_g, 20), f"ours_seg{G}_per_call_ms": bench_fit(run_g)["per_call_ms"],
                  f"rel_rmse_seg{G}_vs_ours": rel_rmse(o_g, o)})
    for peer, fn in PEERS:
      if peer in skip:
        continue
      try:
        times, o_peer = fn(x, gate_bound)
      except Exception as e:  # keep our numbers when the peer is missing or fails
        print(f"  {peer} failed: {type(e).__name__}: {e}", flush=True)
        skip.add(peer)
        continue
      best = min(t for t in (times["called_ms"], times["graph_ms"]) if t is not None)
      best_fit = min((f for f in (times["called_fit"], times["graph_fit"]) if f is not None),
                     key=lambda f: f["per_call_ms"])
      row.update({f"{peer}_called_ms": times["called_ms"], f"{peer}_graph_ms": times["graph_ms"],
                  f"ratio_{peer}": best / t_ours, f"{peer}_per_call_ms": best_fit["per_call_ms"],
                  f"{peer}_fixed_ms": best_fit["fixed_ms"],
                  f"ratio_{peer}_per_call": best_fit["per_call_ms"] / fit_ours["per_call_ms"],
                  f"rel_rmse_vs_{peer}": rel_rmse(o, o_peer)})
    if i in args.overhead_shapes and not args.quick:
      # Every variant timed in the same rounds as the base: the overheads are medians of paired ratios.
      # base_again is the base once more with its own jitted executable and buffers: the control for what a
      # runner's own allocation does to its speed, which a variant's overhead must exceed to mean anything
      # (variants have measured steadily faster than the base while adding work: RESULTS.md, session 14).
      variants = dict(base=dict(), base_again=dict(), bf16_state=dict(state_dtype=jnp.bfloat16),
                      ckpt1=dict(per_seq_ckpt=1), ckpt4=dict(per_seq_ckpt=4))
      runs = {v: ours_runner(x, lens, H, lower_bound=gate_bound, **kw)[0] for v, kw in variants.items()}
      for v, m in paired_overheads(runs).items():
        row.update({f"{v}_{key}": val for key, val in m.items()})
      row.update(kernel_overheads({v: call_kernels(run) for v, run in runs.items()}))
    results.append(row)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(commit=args.commit, results=results), f, indent=1)
  faulthandler.cancel_dump_traceback_later()
  return 0


if __name__ == "__main__":
  sys.exit(main())
