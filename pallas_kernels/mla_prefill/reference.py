"""Dense pure-JAX reference of causal varlen MLA prefill attention, and the input checks of the op.

Layout: ``T`` packed tokens of ``N`` sequences, sequence ``n`` holding tokens ``[cu_seqlens[n],
cu_seqlens[n + 1])``. Head ``h`` of token ``i`` attends to the tokens ``j <= i`` of its own sequence with
logits ``scale * (q[i, h, :Dn] . k_nope[j, h] + q[i, h, Dn:] . k_rope[j])`` in f32: the rope key is one row
per token shared by all heads (MLA's ``k_pe``). Every token sees itself, so no row is empty.

With ``cu_seqlens_k`` the keys are their own packed rows (``Tk`` of them): sequence ``n`` has ``Lk_n >= L_n``
keys ``[cu_seqlens_k[n], cu_seqlens_k[n + 1])`` and its ``L_n`` queries are its last ``L_n`` tokens (a chunk
after ``Lk_n - L_n`` cached tokens): query ``t`` of the sequence sees its keys ``0 .. Lk_n - L_n + t``. Key rows
past ``cu_seqlens_k[N]`` belong to no sequence. Both forms are row bounds: query row ``i`` sees the key rows
``row_lo[i] <= j < row_hi[i]`` (``row_bounds``), non-decreasing in ``i``.

Non-finite inputs: a NaN or inf in ``q`` or in a visible key (``k_nope`` or ``k_rope``) makes the heads it
reaches NaN in ``o`` and ``lse``; a NaN or inf in a visible ``v`` row makes that head's ``o`` NaN. A token
never sees later tokens or other sequences, so their values, finite or not, never reach it: masked logits are
replaced (``where``) and non-finite V rows are zeroed and counted apart, since ``0 * NaN`` would leak.

This dense form builds ``[H, T, T]`` f32 scores: it is the test reference for small ``T`` only.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import util
from pallas_kernels.kda import checks

_HIGHEST = jax.lax.Precision.HIGHEST


def validate_prefill_inputs(q: jax.Array, k_nope: jax.Array, k_rope: jax.Array, v: jax.Array,
                            cu_seqlens: jax.Array, cu_seqlens_k: jax.Array | None = None) -> None:
  """Raises ``ValueError`` naming the argument for any malformed prefill input.

  Shapes and dtypes are always checked; the values of ``cu_seqlens`` (non-decreasing from 0 to T) and of
  ``cu_seqlens_k`` (non-decreasing from 0 to at most Tk, each sequence at least as long as its queries) only
  when they are concrete (not traced).
  """
  util.check_dtype("q", q, util.FLOAT_DTYPES)
  util.check_shape("q", q, (None, None, None))
  t, h, dq = q.shape
  tk = t if cu_seqlens_k is None else k_nope.shape[0]
  util.check_shape("k_nope", k_nope, (tk, h, None))
  dn = k_nope.shape[-1]
  if dn < 1 or dn > dq:
    raise ValueError(f"k_nope last dim Dn must lie in [1, {dq}] (q's last dim Dn + Dr = {dq}), got {dn}")
  util.check_shape("k_rope", k_rope, (tk, dq - dn))
  util.check_shape("v", v, (tk, h, None))
  for name, x in (("k_nope", k_nope), ("k_rope", k_rope), ("v", v)):
    util.check_dtype(name, x, (q.dtype,))
  if h < 1 or v.shape[-1] < 1:
    raise ValueError(f"H and Dv must be >= 1, got H = {h} and v shape {tuple(v.shape)}")
  checks.check_index("cu_seqlens", cu_seqlens, (None,), (jnp.int32,))
  if cu_seqlens.shape[0] < 1:
    raise ValueError(f"cu_seqlens must have shape (N + 1,) with N >= 0, got {tuple(cu_seqlens.shape)}")
  cu = util.concrete(cu_seqlens)
  checks.check_pointer("cu_seqlens", cu, t, f"T = {t}")
  if cu_seqlens_k is None:
    return
  checks.check_index("cu_seqlens_k", cu_seqlens_k, cu_seqlens.shape, (jnp.int32,))
  cuk = util.concrete(cu_seqlens_k)
  if cuk is not None and (cuk[0] != 0 or (np.diff(cuk) < 0).any() or cuk[-1] > tk):
    raise ValueError(f"cu_seqlens_k must be non-decreasing from 0 to at most Tk = {tk}, got {cuk.tolist()}")
  if cu is not None and cuk is not None and (np.diff(cuk) < np.diff(cu)).any():
    raise ValueError(f"cu_seqlens_k must give each sequence at least as many keys as queries (cu_seqlens "
                     f"{cu.tolist()}), got {cuk.tolist()}")


def default_scale(q: jax.Array) -> float:
  """``(Dn + Dr) ** -0.5``."""
  return float(q.shape[-1]) ** -0.5


def row_bounds(cu_seqlens: jax.Array, cu_seqlens_k: jax.Array | None, t: int) -> tuple[jax.Array, jax.Array]:
  """``row_lo, row_hi [T]`` int32: query row ``i`` sees the key rows ``row_lo[i] <= j < row_hi[i]`` (module
  docstring); both non-decreasing in ``i``. Empty sequences share a boundary: ``side="right"`` picks the
  non-empty one that holds the row."""
  rows = jnp.arange(t, dtype=jnp.int32)
  seq = jnp.searchsorted(cu_seqlens, rows, side="right") - 1
  if cu_seqlens_k is None:
    return cu_seqlens[seq].astype(jnp.int32), rows + 1
  lo = cu_seqlens_k[seq]
  # The queries are the sequence's last tokens: query t of sequence n is key Lk_n - L_n + t.
  return lo.astype(jnp.int32), (cu_seqlens_k[seq + 1] - cu_seqlens[seq + 1] + rows + 1).astype(jnp.int32)


def logits(q: jax.Array, k_nope: jax.Array, k_rope: jax.Array, scale: float) -> jax.Array:
  """``[H, Tq, Tk]`` f32 ``scale * (q_nope . k_nope + q_rope . k_rope)``; the rope key is never broadcast."""
  dn = k_nope.shape[-1]
  # f32 operands, not only an f32 result: XLA on a GPU lowers small dots (the blockwise path's tiles) as a
  # multiply in the operands' dtype then an f32 sum, which rounds every bf16 product to bf16.
  q, k_nope, k_rope = (x.astype(jnp.float32) for x in (q, k_nope, k_rope))
  s = jnp.einsum("qhd,khd->hqk", q[..., :dn], k_nope, precision=_HIGHEST)
  if k_rope.shape[-1]:
    s = s + jnp.einsum("qhr,kr->hqk", q[..., dn:], k_rope, precision=_HIGHEST)
  return s * scale


def split_v(v: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``v`` with non-finite entries zeroed (f32) and ``[T, H]`` f32 ones where a row held one."""
  finite = jnp.isfinite(v)
  return jnp.where(finite, v, 0).astype(jnp.float32), (~finite.all(axis=-1)).astype(jnp.float32)


def mla_prefill_reference(q: jax.Array, k_nope: jax.Array, k_rope: jax.Array, v: jax.Array, *,
                          cu_seqlens: jax.Array, cu_seqlens_k: jax.Array | None = None,
                          scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  """Dense causal varlen attention (``[H, T, Tk]`` f32 scores; small T only).

  Args:
    q: ``[T, H, Dn + Dr]`` f32/bf16/f16. k_nope: ``[Tk, H, Dn]``. k_rope: ``[Tk, Dr]`` shared by all heads.
    v: ``[Tk, H, Dv]`` (any Dv). All four share q's dtype. ``Tk = T`` without ``cu_seqlens_k``.
    cu_seqlens: ``[N + 1]`` int32, non-decreasing from 0 to T.
    cu_seqlens_k: ``[N + 1]`` int32 or None (the keys are the queries' own tokens): see the module docstring.
    scale: softmax scale; None means ``(Dn + Dr) ** -0.5``.

  Returns:
    ``o [T, H, Dv]`` in q's dtype (rounded once from f32) and ``lse [T, H]`` f32 natural log.
  """
  validate_prefill_inputs(q, k_nope, k_rope, v, cu_seqlens, cu_seqlens_k)
  scale = default_scale(q) if scale is None else float(scale)
  if q.shape[0] == 0:
    return jnp.zeros((0, q.shape[1], v.shape[-1]), q.dtype), jnp.zeros((0, q.shape[1]), jnp.float32)
  return _dense(q, k_nope, k_rope, v, cu_seqlens, cu_seqlens_k, scale=scale)


@functools.partial(jax.jit, static_argnames=("scale",))
def _dense(q, k_nope, k_rope, v, cu_seqlens, cu_seqlens_k, *, scale):
  idx = jnp.arange(k_nope.shape[0], dtype=jnp.int32)
  lo, hi = row_bounds(cu_seqlens, cu_seqlens_k, q.shape[0])
  mask = (idx[None, :] >= lo[:, None]) & (idx[None, :] < hi[:, None])
  s = jnp.where(mask[None], logits(q, k_nope, k_rope, scale), -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  # A NaN or +inf max must give NaN (exp(inf - inf)); only an all -inf row (infinite inputs) needs a shift.
  m = jnp.where(m == -jnp.inf, 0.0, m)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1)
  # l == 0 only when every visible logit is -inf, which only infinite inputs give: NaN, never an empty row.
  l = jnp.where(l == 0, jnp.nan, l)
  v_clean, v_bad = split_v(v)
  o = jnp.einsum("hqk,khv->qhv", p, v_clean, precision=_HIGHEST) / l.T[:, :, None]
  hit = jnp.einsum("qk,kh->qh", mask.astype(jnp.float32), v_bad, precision=_HIGHEST)
  o = jnp.where(hit[:, :, None] > 0, jnp.nan, o)
  return o.astype(q.dtype), (m[:, :, 0] + jnp.log(l)).T
