"""Helpers shared by every op and by ``k3jax``: backend choice, dtype canonicalisation, input checks,
hardware constants.

Every check raises ``ValueError`` (bad input) naming the argument, what was expected and what was given.
"""

import contextlib
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

IMPLS: tuple[str, ...] = ("xla", "pallas", "interpret")
# Streaming multiprocessors of an H100/H200 SXM: grid heuristics size for this machine, so CPU and GPU pick the
# same grids (and the CPU tests draw the GPU's choices).
NUM_SMS = 132
LOG2E = math.log2(math.e)
# Mosaic GPU's on-device profiler, for every kernel traced while PROFILE_DIR_ENV names a directory: each
# warpgroup records the entry and exit times of the kernel's named regions (``jax.named_scope``) into SMEM, and
# each kernel call writes a Chrome trace (``*-trace.json``) there; benchmarks/kernel_profile.py summarises them.
PROFILE_DIR_ENV = "K3JAX_PROFILE_DIR"
PROFILE_SPACE_ENV = "K3JAX_PROFILE_SPACE"  # regions recorded per warpgroup (default 512; later ones are dropped)


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def pad_rows(x: jax.Array, rows: int) -> jax.Array:
  """``x`` with zero rows appended along axis 0 up to ``rows`` (``x`` itself when it has them already)."""
  if x.shape[0] == rows:
    return x
  return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


@functools.cache
def is_hopper_gpu() -> bool:
  """True when the default JAX backend is a CUDA GPU of compute capability 9.x (sm_90a)."""
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  if dev.platform != "gpu":
    return False
  return str(getattr(dev, "compute_capability", "")).startswith("9")


def default_impl() -> str:
  """The one place that decides the default backend: ``"pallas"`` on Hopper, ``"xla"`` elsewhere."""
  return "pallas" if is_hopper_gpu() else "xla"


def canonical_impl(impl: str | None) -> str:
  if impl is None:
    return default_impl()
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  return impl


def canonical_dtype(name: str, dtype, allowed: tuple) -> jnp.dtype:
  """``jnp.dtype(dtype)``, checked against ``allowed`` (so jnp.float32 and "float32" hash alike)."""
  try:
    dt = jnp.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"{name} must be a dtype, got {dtype!r}") from e
  allowed = tuple(jnp.dtype(a) for a in allowed)
  if dt not in allowed:
    raise ValueError(f"{name} must be one of {[a.name for a in allowed]}, got {dt.name}")
  return dt


def check_shape(name: str, x, expected: tuple) -> None:
  """``expected`` entries are ints or None (any size)."""
  shape = tuple(x.shape)
  if len(shape) != len(expected) or any(e is not None and e != s for e, s in zip(expected, shape)):
    want = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ("," if len(expected) == 1 else "") + ")"
    raise ValueError(f"{name} must have shape {want}, got {shape}")


def check_dtype(name: str, x, allowed: tuple) -> None:
  allowed = tuple(jnp.dtype(a) for a in allowed)
  if jnp.dtype(x.dtype) not in allowed:
    raise ValueError(f"{name} must have dtype in {[a.name for a in allowed]}, got {jnp.dtype(x.dtype).name}")


FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
INT_DTYPES = (jnp.int32, jnp.int64)


def concrete(x) -> np.ndarray | None:
  """The host value of ``x`` when it is concrete (not traced), else None: value checks run only then.

  A replicated ``jax.Array`` is read through one of its shards: reading the array itself caches its host
  value on it, and a multi-device array holding that cache is no longer donated to a jitted step (XLA
  copies it instead), so a host check of a cache's ``seq_lens`` would turn an in-place update into a copy.
  """
  if isinstance(x, jax.core.Tracer):
    return None
  if isinstance(x, jax.Array) and x.is_fully_replicated:
    return np.asarray(x.addressable_shards[0].data)
  return np.asarray(x)


def compiler_params(**kwargs) -> plgpu.CompilerParams:
  """``plgpu.CompilerParams(**kwargs)`` of a kernel, with the on-device profiler switched on where the
  environment asks for it (``PROFILE_DIR_ENV``, read when the kernel is traced).

  The profile buffer takes ``4 * 4 * space`` bytes of SMEM per warpgroup, so a kernel at the SMEM limit (the
  MLA decode with 64-row head tiles) fails to compile with it; and the timer reads add a few cycles per region.
  """
  profile_dir = os.environ.get(PROFILE_DIR_ENV)
  if profile_dir:
    space = int(os.environ.get(PROFILE_SPACE_ENV, "512"))
    if space < 1:
      raise ValueError(f"{PROFILE_SPACE_ENV} must be an int >= 1, got {space}")
    kwargs.update(profile_space=space, profile_dir=profile_dir, profile_bounds_check=True)
  return plgpu.CompilerParams(**kwargs)


class Phases:
  """Consecutive named regions of a kernel body, for the profiler of ``compiler_params`` (free otherwise).

  ``phases.start(name)`` closes the open region and opens ``name``; ``phases.end()`` closes it. A kernel marks
  its phases with one line each instead of nesting its body in ``with jax.named_scope(...)`` blocks.
  """

  def __init__(self):
    self._open = contextlib.ExitStack()

  def start(self, name: str) -> None:
    self._open.close()
    self._open.enter_context(jax.named_scope(name))

  def end(self) -> None:
    self._open.close()


def accumulate(products, *inits: jax.Array, from_inits: bool) -> tuple[jax.Array, ...]:
  """``inits`` (f32 arrays in the WGMMA layout) plus what ``products(*acc_refs)`` issues into one accumulator
  each (wgmma), as values.

  ``from_inits``: the accumulators start at ``inits`` (``plgpu.ACC.init``), so the products need no second set
  of registers and no adds after them. Interpret mode cannot start an accumulator from registers: with False
  they start at zero and ``inits`` are added afterwards (the same sums, rounded in another order).
  """
  if from_inits:
    return tuple(pl.run_state(lambda refs: products(*refs))(tuple(plgpu.ACC.init(x) for x in inits)))

  def body(*refs):
    products(*refs)
    return tuple(r[...] for r in refs)

  outs = pl.run_scoped(body, *(plgpu.ACC(x.shape, jnp.float32) for x in inits))
  return tuple(x + y for x, y in zip(inits, outs))


def finish_stores() -> None:
  """The calling thread's last wait on its SMEM -> GMEM copies, at the end of a program: only the reads of SMEM
  must finish before the program exits and its SMEM goes to the next program (as CUTLASS epilogues wait); the
  GMEM writes complete on their own before the kernel does, and waiting for them would hold the program's SM
  slot for a DRAM write latency."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def smem_transforms(dtype, cols: int) -> tuple:
  """SMEM tiling ``(8, swizzle / itemsize)`` + the widest swizzle dividing a row of ``cols`` elements.

  That is a valid wgmma / TMA layout and keeps register loads free of bank conflicts; ``()`` when no swizzle
  (128, 64 or 32 bytes) divides the row.
  """
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = next((s for s in (128, 64, 32) if (cols * itemsize) % s == 0), None)
  if swizzle is None:
    return ()
  return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)
