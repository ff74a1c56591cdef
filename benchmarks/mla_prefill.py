"""Causal MLA prefill attention on one Hopper GPU: ``mla_prefill_attention`` against cuDNN (JAX) and PyTorch SDPA.

Shapes (K3's MLA heads: q and k 192 = 128 nope + 64 rope, the rope key shared by all heads, v 128): T packed
tokens of N equal sequences (L = T / N each), H heads; by default T in {4K, 32K, 128K}, N in {1, 8}, H in
{96, 11} (96: K3 on one device, 11: on 9). Inputs are bf16 ~ N(0, 1) (q, k_nope, the shared k_rope [T, 64],
v), scale ``192 ** -0.5``. Every implementation runs in the same process on the same inputs:

* ``ours``: ``mla_prefill_attention`` with the op's default impl (printed; the Mosaic GPU kernel on Hopper,
  ``--impl xla`` for the blockwise path), packed varlen (``cu_seqlens``), k_rope never broadcast.
* ``jax-cudnn``: ``jax.nn.dot_product_attention(..., implementation="cudnn", is_causal=True)``. Its API needs
  ``value.shape == key.shape``, so v is zero-padded from 128 to 192 (the extra 64 output columns are dropped).
  Packed varlen is not expressible there (``query_seq_lengths`` / ``key_value_seq_lengths`` describe padding
  of a batch, not packing), so the equal sequences run as a batch ``[N, L, H, 192]``.
* ``jax-cudnn-mla``: the same cuDNN kernel through JAX's private entry
  ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``, which accepts v's 128 (cuDNN's MLA
  mode, cuDNN >= 9.10 on Hopper) where the public API refuses it. Private: it may move between JAX versions.
* ``torch-flash`` / ``torch-cudnn``: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``
  under ``sdpa_kernel([SDPBackend.FLASH_ATTENTION])`` / ``[SDPBackend.CUDNN_ATTENTION]``, batch layout
  ``[N, H, L, D]`` (SDPA has no packed varlen form). v is tried at 128 first, then padded to 192 when the
  backend refuses unequal head dims; the row's ``v_dim`` says which ran. The inputs reach torch through
  DLPack (no host copy). Skipped with a printed reason without torch or CUDA.

For the peers, k = ``[k_nope | k_rope broadcast to every head]`` and the layout changes are built once outside
the timed calls: only the attention call is timed.

Times: the first call compiles (warm-up), one more call sizes the repetitions to ``--budget-s``, then the
median over ``--reps`` runs of back-to-back calls (wall time, ms). FLOPs are the causal FLOPs of the useful
work, ``2 * sum_n L_n (L_n + 1) / 2 * H * (Dqk + Dv)`` with Dqk = 192 and Dv = 128 (QK^T and PV over the visible
pairs), the same for every implementation: a peer that pads v to 192 does 1.2x that and is not credited for it.
``of peak`` is TFLOP/s over ``benchmarks._harness.PEAK_BF16_FLOPS`` (the bf16 MMA rate measured on the H200).
``rel RMSE`` is each output's RMSE against ours (the first of ``--tunings``) over its RMS, on up to 8192 evenly
spaced token rows (all heads, the 128 real v columns).

JSON (``--json``): one line per (shape, implementation), appended as soon as it is measured, with the keys
``ROW_KEYS``; ``ms``, ``tflops``, ``peak_frac`` and ``rel_rmse`` are null where the implementation did not run
(``status``: "ok", "skipped: ...", "unsupported: ...", "failed: ..."), ``rel_rmse`` also on our own rows.

Usage (on the GPU machine, torch installed)::

  PYTHONPATH=. python3 benchmarks/mla_prefill.py --json mla_prefill.jsonl
  PYTHONPATH=. python3 benchmarks/mla_prefill.py --quick              # T = 4K only
  PYTHONPATH=. python3 benchmarks/mla_prefill.py --T 131072 --N 1 --H 96 --reps 1
  PYTHONPATH=. python3 benchmarks/mla_prefill.py --T 32768 --H 96 --tunings 64x2 64x4 128x2   # the kernel's knobs
  PYTHONPATH=. python3 benchmarks/mla_prefill.py --smoke              # T = 256, H = 2 (a CPU runs it)
"""

from __future__ import annotations

import argparse
import faulthandler
import itertools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._harness import PEAK_BF16_FLOPS
from pallas_kernels import testing
from pallas_kernels.mla_prefill import MlaPrefillConfig, MlaPrefillTuning, mla_prefill_attention

DN, DR, DV = 128, 64, 128
DQK = DN + DR
SCALE = DQK ** -0.5
CHECK_ROWS = 8192
ROW_KEYS = ("shape", "T", "N", "seq_len", "H", "dqk", "dv", "impl", "layout", "v_dim", "ms", "tflops", "peak_frac",
            "rel_rmse", "status")
PEERS = ("jax-cudnn", "jax-cudnn-mla", "torch-flash", "torch-cudnn")
# Not run by default: XLA's dense attention ([N, H, L, L] scores), the smoke test's check of the peers' layouts.
EXTRA_PEERS = ("jax-xla",)


def causal_flops(lens, H: int, dqk: int = DQK, dv: int = DV) -> float:
  """``2 * sum_n L_n (L_n + 1) / 2 * H * (Dqk + Dv)``: QK^T and PV over the visible (causal) pairs."""
  return float(sum(2 * n * (n + 1) / 2 for n in lens) * H * (dqk + dv))


def time_ms(run, *, budget_s: float, reps: int) -> float:
  """Median ms per call. ``run(n)`` makes n back-to-back calls and waits for them; the first call compiles, the
  second sizes the repetitions to ``budget_s`` (and is one of the samples when a call alone exceeds it)."""
  run(1)
  t = time.perf_counter()
  run(1)
  probe = time.perf_counter() - t
  iters = int(np.clip(budget_s / max(probe, 1e-6), 1, 200))
  samples = [probe] if iters == 1 else []
  while len(samples) < reps:
    t = time.perf_counter()
    run(iters)
    samples.append((time.perf_counter() - t) / iters)
  return float(np.median(samples)) * 1e3


def make_inputs(T: int, H: int, dtype, seed: int = 0):
  """``q [T, H, 192]``, ``k_nope [T, H, 128]``, ``k_rope [T, 64]`` (one row per token, shared by the heads) and
  ``v [T, H, 128]``, ~ N(0, 1) in ``dtype``, drawn on the default device (a host copy of 128K tokens is 13 GB)."""
  kq, kn, kr, kv = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(kq, (T, H, DQK), dtype), jax.random.normal(kn, (T, H, DN), dtype),
          jax.random.normal(kr, (T, DR), dtype), jax.random.normal(kv, (T, H, DV), dtype))


def check_rows(T: int) -> np.ndarray:
  return np.unique(np.linspace(0, T - 1, min(T, CHECK_ROWS)).round().astype(np.int64))


def tuning_arg(text: str) -> MlaPrefillTuning:
  """``--tunings`` entry ``BKxSTAGES`` (e.g. ``64x4``): the kernel's key rows per step and K/V ring slots."""
  try:
    block_k, stages = (int(x) for x in text.split("x"))
  except ValueError:
    raise argparse.ArgumentTypeError(f"a tuning is BLOCK_KxSTAGES, e.g. 64x4, got {text!r}") from None
  return MlaPrefillTuning(kernel_block_k=block_k, num_stages=stages)


def run_ours(inputs, N: int, impl: str | None, *, budget_s: float, reps: int,
             tuning: MlaPrefillTuning | None = None):
  """``(impl, ms, sampled rows of o [rows, H, 128] f32)`` of ``mla_prefill_attention``."""
  config = MlaPrefillConfig(scale=SCALE, tuning=tuning, **({} if impl is None else dict(impl=impl)))
  T = inputs[0].shape[0]
  cu = jnp.asarray(np.arange(N + 1) * (T // N), jnp.int32)
  # Jitted whole so that the op's host check of a concrete cu_seqlens (a device-to-host copy) stays out of the
  # timed calls; the op itself is the same.
  f = jax.jit(lambda q, kn, kr, v, cu: mla_prefill_attention(q, kn, kr, v, cu_seqlens=cu, config=config)[0])

  def run(n):
    out = None
    for _ in range(n):
      out = f(*inputs, cu)
    jax.block_until_ready(out)

  ms = time_ms(run, budget_s=budget_s, reps=reps)
  o = np.asarray(f(*inputs, cu)[check_rows(T)], np.float32)
  return config.impl, ms, o


def run_jax(inputs, N: int, name: str, *, budget_s: float, reps: int):
  """``(v_dim, ms, sampled rows of o)`` of a JAX peer (``name`` in "jax-cudnn", "jax-cudnn-mla", "jax-xla"),
  batch layout ``[N, L, H, D]``."""
  private_mla = name == "jax-cudnn-mla"
  q, k_nope, k_rope, v = inputs
  T, H, _ = q.shape
  L = T // N
  k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, None, :], (T, H, DR))], axis=-1)
  if not private_mla:
    v = jnp.pad(v, ((0, 0), (0, 0), (0, DQK - DV)))  # the public API needs value.shape == key.shape
  q4, k4, v4 = (x.reshape(N, L, H, x.shape[-1]) for x in (q, k, v))
  if private_mla:
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention as cudnn_attention

    f = jax.jit(lambda q, k, v: cudnn_attention(q, k, v, scale=SCALE, mask_type=MaskType.CAUSAL))
  else:
    implementation = "xla" if name == "jax-xla" else "cudnn"
    f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=SCALE, is_causal=True,
                                                             implementation=implementation))

  def run(n):
    out = None
    for _ in range(n):
      out = f(q4, k4, v4)
    jax.block_until_ready(out)

  ms = time_ms(run, budget_s=budget_s, reps=reps)
  o = f(q4, k4, v4).reshape(T, H, -1)
  return v4.shape[-1], ms, np.asarray(o[check_rows(T), :, :DV], np.float32)


def _to_torch(x):
  """A JAX device array as a torch CUDA tensor, through DLPack (no copy), else through the host (bf16 as uint16)."""
  import torch

  try:
    return torch.from_dlpack(x)
  except Exception:  # an exporter that refuses: the host path is slower but always works
    a = np.asarray(x)
    if a.dtype == jnp.bfloat16:  # NumPy's bf16 (ml_dtypes) is unknown to torch: move the bits
      return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(a).cuda()


def run_torch(inputs, N: int, backend_name: str, *, budget_s: float, reps: int):
  """``(v_dim, ms, sampled rows of o)`` of torch SDPA with one backend, batch layout ``[N, H, L, D]``."""
  import torch
  import torch.nn.functional as F
  from torch.nn.attention import SDPBackend, sdpa_kernel

  backend = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
  q, k_nope, k_rope, v = (_to_torch(x) for x in inputs)
  if q.dtype not in (torch.float16, torch.bfloat16):  # both backends; otherwise SDPA finds "no available kernel"
    raise NotImplementedError(f"{backend_name} takes fp16/bf16 inputs, got {q.dtype}")
  T, H, _ = q.shape
  L = T // N
  to4 = lambda x: x.reshape(N, L, H, x.shape[-1]).transpose(1, 2).contiguous()
  q4 = to4(q)
  k4 = to4(torch.cat([k_nope, k_rope[:, None, :].expand(T, H, DR)], dim=-1))
  v4 = to4(v)
  del q, k_nope, k_rope, v

  def call(v4):
    with sdpa_kernel([backend]):
      return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=SCALE)

  with torch.no_grad():
    try:
      call(v4)
    except RuntimeError as e:  # the backend refuses Dv != Dqk: pad v as the public JAX API needs
      print(f"  {backend_name}: v {DV} refused ({str(e).splitlines()[0][:160]}); padding v to {DQK}", flush=True)
      v4 = torch.nn.functional.pad(v4, (0, DQK - DV)).contiguous()
      call(v4)

    def run(n):
      for _ in range(n):
        call(v4)
      torch.cuda.synchronize()

    ms = time_ms(run, budget_s=budget_s, reps=reps)
    rows = torch.from_numpy(check_rows(T)).to(q4.device)
    o = call(v4).transpose(1, 2).reshape(T, H, -1)[rows, :, :DV]
    o = o.float().cpu().numpy()
  return v4.shape[-1], ms, o


def peer_skip_reason(name: str) -> str | None:
  """Why a peer cannot run in this process (None: try it)."""
  if name == "jax-xla":
    return None
  if jax.devices()[0].platform != "gpu":
    return f"skipped: {jax.devices()[0].platform} backend (cuDNN and torch's CUDA kernels need a GPU)"
  if name.startswith("torch"):
    try:
      import torch
    except ImportError:
      return "skipped: torch is not installed"
    if not torch.cuda.is_available():
      return "skipped: torch sees no CUDA device"
  return None


def fmt_row(row: dict) -> str:
  num = lambda v, spec: "-" if v is None else format(v, spec)
  return (f"{row['shape']:>22} {row['impl']:>14} {row['layout']:>14} {num(row['v_dim'], 'd'):>5} "
          f"{num(row['ms'], '10.3f'):>10} {num(row['tflops'], '8.1f'):>8} {num(row['peak_frac'], '7.1%'):>7} "
          f"{num(row['rel_rmse'], '9.2e'):>9}  {row['status']}")


HEADER = (f"{'shape':>22} {'impl':>14} {'layout':>14} {'v dim':>5} {'ms':>10} {'TFLOP/s':>8} {'of peak':>7} "
          f"{'rel RMSE':>9}  status")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="benchmarks/mla_prefill.py", description=__doc__.splitlines()[0])
  add = parser.add_argument
  add("--T", type=int, nargs="+", default=[4096, 32768, 131072], help="packed tokens per call")
  add("--N", type=int, nargs="+", default=[1, 8], help="equal sequences per call (each T / N tokens)")
  add("--H", type=int, nargs="+", default=[96, 11], help="heads")
  add("--quick", action="store_true", help="T = 4096 only")
  add("--smoke", action="store_true", help="T = 256, N 1 and 2, H = 2, f32, impl xla, 1 rep: a CPU smoke test")
  add("--impl", default=None, help="mla_prefill_attention's impl (default: the op's default)")
  add("--tunings", nargs="+", type=tuning_arg, default=[None],
      help="kernel tunings to time, each BLOCK_KxSTAGES (e.g. 64x4 128x2; default: the op's default_tuning)")
  add("--peers", nargs="*", choices=PEERS + EXTRA_PEERS, default=None,
      help=f"peers to run (default: {' '.join(PEERS)}; with --smoke also jax-xla; empty: ours only)")
  add("--reps", type=int, default=3, help="timed runs of back-to-back calls; the median is reported")
  add("--budget-s", type=float, default=0.5, help="about this long per timed run")
  add("--json", default=None, help="append one JSON line per measurement to this file")
  add("--commit", default="unknown")
  add("--watchdog", type=float, default=600.0, help="dump every thread's stack every this many seconds (0: off)")
  return parser


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  # Before JAX starts its backends (no effect once they run): JAX would take 75% of the GPU up front, leaving
  # torch too little for the 128K-token peers in the same process.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if args.smoke:
    args.T, args.N, args.H, args.reps, args.budget_s = [256], [1, 2], [2], 1, 0.0
    args.impl = args.impl or "xla"
  elif args.quick:
    args.T = [4096]
  if args.peers is None:
    args.peers = list(PEERS + EXTRA_PEERS if args.smoke else PEERS)
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  if args.watchdog > 0:
    faulthandler.dump_traceback_later(args.watchdog, repeat=True)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, commit {args.commit}; peak "
        f"{PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s (bf16 MMA, measured); {jnp.dtype(dtype).name} inputs", flush=True)
  out = open(args.json, "a") if args.json else None
  skip = {name: peer_skip_reason(name) for name in args.peers}
  try:
    print(HEADER, flush=True)
    for T, N, H in itertools.product(args.T, args.N, args.H):
      if T % N:
        print(f"T={T} N={N}: T is not a multiple of N; skipped", flush=True)
        continue
      L = T // N
      flops = causal_flops([L] * N, H)
      shape = f"T={T} N={N}x{L} H={H}"
      inputs = make_inputs(T, H, dtype)
      base = dict(shape=shape, T=T, N=N, seq_len=L, H=H, dqk=DQK, dv=DV)

      def emit(impl, layout, v_dim=None, ms=None, o=None, ref=None, status="ok"):
        row = dict(base, impl=impl, layout=layout, v_dim=v_dim, ms=ms,
                   tflops=None if ms is None else flops / ms / 1e9,
                   peak_frac=None if ms is None else flops / (ms * 1e-3) / PEAK_BF16_FLOPS,
                   rel_rmse=None if o is None or ref is None else testing.rel_rmse(o, ref), status=status)
        print(fmt_row(row), flush=True)
        if out:
          out.write(json.dumps(row) + "\n")
          out.flush()

      ours_o = None
      for tuning in args.tunings:
        label = "" if tuning is None else f", {tuning.kernel_block_k}x{tuning.num_stages}"
        try:
          impl, ms, o = run_ours(inputs, N, args.impl, budget_s=args.budget_s, reps=args.reps, tuning=tuning)
          emit(f"ours ({impl}{label})", "packed varlen", DV, ms)
          ours_o = o if ours_o is None else ours_o
        except NotImplementedError as e:  # e.g. --impl pallas with inputs the kernel does not take
          emit(f"ours ({args.impl}{label})", "packed varlen", status=f"unsupported: {str(e).splitlines()[0][:200]}")
      for name in args.peers:
        layout = "batch N,L,H,D" if name.startswith("jax") else "batch N,H,L,D"
        if skip[name]:
          emit(name, layout, status=skip[name])
          continue
        try:
          run = run_jax if name.startswith("jax") else run_torch
          v_dim, ms, o = run(inputs, N, name, budget_s=args.budget_s, reps=args.reps)
        except (NotImplementedError, ValueError, TypeError) as e:  # the shape or dtype is refused up front
          emit(name, layout, status=f"unsupported: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
          continue
        except Exception as e:  # keep the other numbers when a peer fails at run time (e.g. out of memory)
          emit(name, layout, status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
          continue
        finally:
          if name.startswith("torch") and not skip[name]:
            import torch
            torch.cuda.empty_cache()  # the next shape's JAX arrays need the memory torch's allocator keeps
        emit(name, layout, v_dim, ms, o, ours_o)
      del inputs
  finally:
    if out:
      out.close()
    faulthandler.cancel_dump_traceback_later()
  return 0


if __name__ == "__main__":
  sys.exit(main())
