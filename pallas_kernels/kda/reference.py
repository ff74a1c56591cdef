"""Pure-JAX KDA references: gate, token recurrence, chunked WY prefill (varlen, pool, checkpoints), decode.

Short and unoptimised on purpose: plain ``jnp`` in f32 with ``Precision.HIGHEST`` dots. Every state here, in
arguments, results and pools, uses the V-first layout ``[..., H, V, K]`` (the transpose of FLA's default
K-first ``[..., H, K, V]``): ``S[v, k]``.

Recurrence per head, with ``S`` V-first, ``alpha = exp(g)`` decaying the K axis::

  S <- S * exp(g_t)[None, :];  u = beta_t (v_t - S k_t);  S <- S + u k_t^T;  o_t = scale * S q_t
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kda.config import CHUNK_SIZE
from pallas_kernels.util import LOG2E

L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0
SUB_BLOCK = 16
# Floor of the per-token gate in log2 units inside the chunked form (see ``_chunk_prep``).
GATE_FLOOR = -256.0
_HI = lax.Precision.HIGHEST
_f32 = jnp.float32
# (chunk, head) pairs whose chunk-parallel stage runs at once. Each holds C x C x K-sized f32 temporaries (the
# per-pair gate exponents of its 16 x 16 blocks), so vectorising over every chunk of a long prompt at once would
# hold T / C * H of them, growing with the prompt (benchmarks/RESULTS.md, session 41). Batches of chunks bound that.
PREP_CHUNK_HEADS = 256


def _einsum(spec: str, *xs: jax.Array) -> jax.Array:
  return jnp.einsum(spec, *xs, precision=_HI, preferred_element_type=_f32)


def l2norm(x: jax.Array) -> jax.Array:
  """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis, in f32 (eps added to the sum, as FLA/FlashKDA)."""
  x = x.astype(_f32)
  return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def kda_gate(g_raw: jax.Array, A_log: jax.Array, dt_bias: jax.Array, *,
             lower_bound: float | None = None) -> jax.Array:
  """The KDA forget-gate activation: natural-log per-channel decay ``g <= 0``.

  * ``lower_bound=None`` (Kimi-Linear): ``g = -exp(A_log) * softplus(g_raw + dt_bias)``, softplus with
    threshold 20 (``x`` itself above 20). Unbounded below.
  * ``lower_bound=lb`` (Kimi-K3 "safe gate"): ``g = lb * sigmoid(exp(A_log) * (g_raw + dt_bias))``,
    so ``g`` lies in ``(lb, 0)``.

  Args:
    g_raw: ``[..., H, K]`` raw gate input, any float dtype.
    A_log: ``[H]`` f32, per-head log decay rate.
    dt_bias: ``[H, K]`` f32.
    lower_bound: None or the lower bound (a float in [-5, 0)).

  Returns:
    ``g`` ``[..., H, K]`` f32.
  """
  x = g_raw.astype(_f32) + dt_bias.astype(_f32)
  rate = jnp.exp(A_log.astype(_f32))[:, None]
  if lower_bound is None:
    # Clamp before exp so the untaken branch of the where cannot overflow.
    softplus = jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))
    return -rate * softplus
  return lower_bound * jax.nn.sigmoid(rate * x)


def _recurrent_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                    beta: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
  """One token of the delta rule on a V-first f32 state ``[..., V, K]``; q, k, g ``[..., K]``, v ``[..., V]``,
  beta ``[...]``. Returns (o ``[..., V]``, new state). The output reads the state after the write."""
  state = state * jnp.exp(g)[..., None, :]
  u = beta[..., None] * (v - _einsum("...vk,...k->...v", state, k))
  state = state + u[..., :, None] * k[..., None, :]
  return scale * _einsum("...vk,...k->...v", state, q), state


def _default_scale(scale: float | None, head_dim: int) -> float:
  return head_dim ** -0.5 if scale is None else scale


def kda_recurrent_reference(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                            scale: float | None = None, initial_state: jax.Array | None = None,
                            l2norm_qk: bool = True) -> tuple[jax.Array, jax.Array]:
  """Token-by-token KDA (a ``lax.scan`` over T in f32): the ground truth for the chunked algorithm.

  Args:
    q, k: ``[B, T, H, K]`` (L2-normalised here when ``l2norm_qk``).
    v: ``[B, T, H, V]``.
    g: ``[B, T, H, K]`` already activated natural-log decay (``kda_gate``), ``g <= 0``.
    beta: ``[B, T, H]`` already in (0, 1) (after the sigmoid).
    scale: query scale, default ``K ** -0.5``.
    initial_state: ``[B, H, V, K]`` (V-first) or None (zeros).
    l2norm_qk: L2-normalise q and k over K first.

  Returns:
    ``o [B, T, H, V]`` f32 and the final state ``[B, H, V, K]`` f32 (V-first).
  """
  B, _, H, K = q.shape
  V = v.shape[-1]
  scale = _default_scale(scale, K)
  if l2norm_qk:
    q, k = l2norm(q), l2norm(k)
  state = (jnp.zeros((B, H, V, K), _f32) if initial_state is None else initial_state.astype(_f32))
  xs = tuple(jnp.moveaxis(x.astype(_f32), 1, 0) for x in (q, k, v, g, beta))

  def step(s, x):
    o, s = _recurrent_step(s, *x, scale)
    return s, o

  state, o = lax.scan(step, state, xs)
  return jnp.moveaxis(o, 0, 1), state


# ------------------------------------------------------------------------------------------------------
# Chunked WY algorithm: chunk-parallel intra-chunk matrices, then a sequential pass of chunk states.


def _span_sums(g: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
  """``sum_s g[s]`` over the rows ``lo < s <= hi`` of ``g [n, K]`` (``lo``, ``hi`` int arrays of one shape
  ``[...]``; an empty span sums to 0) -> ``[..., K]``.

  Every gate exponent of the chunked form is such a span, summed directly rather than taken as a difference
  of two cumulative sums: the terms all have one sign, so the sum is accurate to a few ulps of itself, while
  a difference of cumulative sums loses a short span's decay next to a large one (after a spiky token, or
  at extreme ``A_log``), and its rounding can make an exponent that must be <= 0 positive, which overflows.
  """
  s = jnp.arange(g.shape[0])
  mask = (lo[..., None] < s) & (s <= hi[..., None])
  return _einsum("...s,sd->...d", mask.astype(_f32), g)


def _diag_block(a: jax.Array, b: jax.Array, g: jax.Array, bounded: bool) -> jax.Array:
  """``M[p, i, j] = sum_d a[p, i, d] b[j, d] 2^(G[i, d] - G[j, d])`` for ``j <= i`` in one 16x16 diagonal
  block, ``G`` the cumulative log2 gate ``g``; ``a [P, n, K]`` stacks several left operands, ``b, g [n, K]``.

  Bounded gate (per-token ``g >= -5 log2(e)``): one anchor at the block midpoint (row 8), so each factor spans
  at most 8 tokens (``|exponent| <= 8 * 5 * log2e ~ 58``) and the block is a plain matmul. The anti-causal
  products can reach ``2^116`` (finite in f32) and are removed with a select, never a multiply.
  Unbounded gate: no shared anchor is safe, so every pair gets its own ``exp2`` of a non-positive exponent;
  the anti-causal exponents are masked to -inf *before* ``exp2``.
  Rows past a sequence end carry g = 0 (the anchor stays exact).
  """
  n = b.shape[0]
  r = jnp.arange(n)
  causal = r[:, None] >= r[None, :]
  if bounded:
    mid = jnp.full((n,), min(n // 2, n - 1))
    e = jnp.where((r >= mid)[:, None], _span_sums(g, mid, r), -_span_sums(g, r, mid))  # G[r] - G[mid]
    m = _einsum("pid,jd->pij", a * jnp.exp2(e), b * jnp.exp2(-e))
    return jnp.where(causal, m, 0.0)
  expo = jnp.where(causal[:, :, None], _span_sums(g, r[None, :], r[:, None]), -jnp.inf)
  return _einsum("pid,jd,ijd->pij", a, b, jnp.exp2(expo))


def _intra_chunk(a: jax.Array, b: jax.Array, g: jax.Array, bounded: bool) -> jax.Array:
  """Lower-triangular (diagonal included) ``[P, C, C]`` matrices of ``sum_d a_p,i b_j 2^(G_i - G_j)``
  (``a [P, C, K]``, ``b, g [C, K]``, ``G`` the cumulative log2 gate ``g``), built from 16x16 sub-blocks:
  diagonal blocks by ``_diag_block``; an off-diagonal block (i > j) anchored just before the first row of
  query sub-block i, so both factors are <= 1."""
  P, C, K = a.shape
  nb = C // SUB_BLOCK
  r = jnp.arange(C)
  anchor = (r // SUB_BLOCK) * SUB_BLOCK - 1  # the row before each row's sub-block
  row_expo = _span_sums(g, anchor, r)  # G_r - G_anchor <= 0
  # [i, j, s, K]: the key factor of block j under the anchor of query block i, -inf where j >= i (there the
  # span is empty and the key is not below the anchor).
  block_anchor = jnp.arange(nb) * SUB_BLOCK - 1
  key_span = _span_sums(g, jnp.broadcast_to(r, (nb, C)), jnp.broadcast_to(block_anchor[:, None], (nb, C)))
  below = (r[None, :] // SUB_BLOCK) < jnp.arange(nb)[:, None]
  key_expo = jnp.where(below[:, :, None], key_span, -jnp.inf).reshape(nb, nb, SUB_BLOCK, K)
  a = a.reshape(P, nb, SUB_BLOCK, K)
  b, g, row_expo = (x.reshape(nb, SUB_BLOCK, K) for x in (b, g, row_expo))
  off = _einsum("pird,ijsd->pirjs", a * jnp.exp2(row_expo), b[None] * jnp.exp2(key_expo))
  diag = jax.vmap(functools.partial(_diag_block, bounded=bounded), in_axes=(1, 0, 0), out_axes=1)(a, b, g)
  on_diag = jnp.eye(nb, dtype=bool)[:, None, :, None]
  return (off + jnp.where(on_diag, diag[:, :, :, None, :], 0.0)).reshape(P, C, C)


def _chunk_prep(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *, scale: float,
                bounded: bool) -> tuple[jax.Array, ...]:
  """The chunk-parallel part of one (chunk, head): the intra-chunk matrices and the WY factors.

  Args: q, k ``[C, K]`` L2-normalised, v ``[C, V]``, g ``[C, K]`` activated, beta ``[C]``; rows past the
  sequence end must hold k = 0, g = 0, beta = 0 (then they neither decay nor write the state).

  Returns: ``qg = scale * q * 2^G [C, K]``, ``aqk [C, C]`` (lower, diagonal included, scaled),
  ``w [C, K]``, ``u [C, V]``, ``kg = k * 2^(G_last - G) [C, K]``, ``gamma = 2^G_last [K]``; all f32, with
  ``G`` the cumulative gate in log2 units.
  """
  C, K = q.shape
  # A token at the floor zeroes every factor spanning it, as its true gate does (2^-150 is already 0 in
  # f32); the floor keeps the span sums finite (g = -inf once exp(A_log) overflows).
  g = jnp.maximum(g * LOG2E, GATE_FLOOR)
  r = jnp.arange(C)
  G = _span_sums(g, jnp.full((C,), -1), r)
  G_to_last = _span_sums(g, r, jnp.full((C,), C - 1))  # G_last - G
  qk, kk = _intra_chunk(jnp.stack([q, k]), k, g, bounded)
  lmat = jnp.where(r[:, None] > r[None, :], beta[:, None] * kk, 0.0)
  decay = jnp.exp2(G)
  # (I + L) is unit lower triangular; solve it against both right-hand sides instead of forming its inverse.
  rhs = beta[:, None] * jnp.concatenate([k * decay, v], axis=1)
  wu = jax.scipy.linalg.solve_triangular(jnp.eye(C, dtype=_f32) + lmat, rhs, lower=True, unit_diagonal=True)
  return (scale * q * decay, scale * qk, wu[:, :K], wu[:, K:], k * jnp.exp2(G_to_last), decay[-1])


def _chunk_state_step(state: jax.Array, prep: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
  """One chunk of the sequential stage for all heads (output, then state update): state ``[H, V, K]`` f32 at the
  chunk start -> (o ``[C, H, V]``, state at the chunk end)."""
  qg, aqk, w, u, kg, gamma = prep
  e = u - _einsum("hck,hvk->hcv", w, state)
  o = _einsum("hck,hvk->chv", qg, state) + _einsum("hij,hjv->ihv", aqk, e)
  return o, state * gamma[:, None, :] + _einsum("hcv,hck->hvk", e, kg)


def _chunk_layout(cu_seqlens: jax.Array, T: int, C: int) -> tuple[jax.Array, ...]:
  """A static chunk layout of a packed varlen batch.

  Sequence n owns ``ceil(L_n / C)`` consecutive chunks starting at ``chunk_offsets[n]``; chunks never cross
  sequences. The total is at most ``T // C + N`` (each sequence adds at most one partial chunk), which is the
  static chunk count ``NC``; chunks past ``chunk_offsets[N]`` are padding (every row masked).

  Returns: ``chunk_offsets [N+1]``, per chunk ``seq [NC]``, ``first`` (first chunk of its sequence)
  ``[NC]`` bool, the token index of each row ``[NC, C]`` (clipped into range) and the row-valid mask
  ``[NC, C]``.
  """
  N = cu_seqlens.shape[0] - 1
  NC = T // C + N if T else 0
  lens = cu_seqlens[1:] - cu_seqlens[:-1]
  chunk_offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum((lens + C - 1) // C)]).astype(jnp.int32)
  c = jnp.arange(NC, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(chunk_offsets, c, side="right") - 1, 0, N - 1)
  j = c - chunk_offsets[seq]
  row = j[:, None] * C + jnp.arange(C, dtype=jnp.int32)[None, :]
  valid = (row < lens[seq][:, None]) & (c < chunk_offsets[N])[:, None]
  tok = jnp.clip(cu_seqlens[seq][:, None] + row, 0, max(T - 1, 0))
  return chunk_offsets, seq, j == 0, tok, valid


def _chunked_varlen(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                    cu_seqlens: jax.Array, initial_states: jax.Array, *, scale: float, chunk_size: int,
                    bounded: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Chunked KDA over packed sequences, f32 throughout.

  The chunks of the static layout of ``_chunk_layout`` go in batches of ``PREP_CHUNK_HEADS // H`` (at least one,
  at most all): a batch's token rows are gathered, its chunk-parallel stage is vmapped over (chunk, head), and a
  ``lax.scan`` walks its chunks in order, carrying the state into the next batch; a sequence's first chunk
  restarts from its initial state. Memory is ``O((T / C + N) * H * V * K)`` for the per-chunk end states, with
  one batch's temporaries at a time.

  Args: q, k ``[T, H, K]`` L2-normalised; v ``[T, H, V]``; g ``[T, H, K]`` activated; beta ``[T, H]``;
  cu_seqlens ``[N+1]`` int32; initial_states ``[N, H, V, K]`` f32.

  Returns: ``o [T, H, V]`` f32, the state after every chunk ``[NC, H, V, K]`` f32, ``chunk_offsets [N+1]``.
  """
  T, H = q.shape[:2]
  C = chunk_size
  chunk_offsets, *layout = _chunk_layout(cu_seqlens, T, C)
  NC = layout[0].shape[0]
  per_batch = max(1, PREP_CHUNK_HEADS // H)
  heads = jax.vmap(functools.partial(_chunk_prep, scale=scale, bounded=bounded))

  def step(state, x):
    chunk_prep, is_first, n = x
    state = jnp.where(is_first, initial_states[n], state)
    o, state = _chunk_state_step(state, chunk_prep)
    return state, (o, state)

  def batch(state, x):
    seq, first, tok, valid = x

    def rows(a):  # [T, H, ...] -> [chunks, H, C, ...], rows past a sequence end zeroed
      a = jnp.where(valid.reshape(valid.shape + (1,) * (a.ndim - 1)), a[tok], 0.0)
      return jnp.moveaxis(a, 1, 2)

    prep = jax.vmap(heads)(*(rows(a) for a in (q, k, v, g, beta)))
    return lax.scan(step, state, (prep, first, seq))

  state0 = jnp.zeros_like(initial_states[0])
  if NC <= per_batch:  # one batch (also no chunks at all)
    _, (o_chunks, states) = batch(state0, layout)
  else:
    # Padding chunks (to whole batches) mask every row: k, g and beta are 0 there, so they neither decay nor
    # write the state, and their end states come after every real chunk's.
    batches = -(-NC // per_batch)
    layout = [jnp.pad(a, [(0, batches * per_batch - NC)] + [(0, 0)] * (a.ndim - 1)) for a in layout]
    layout = [a.reshape((batches, per_batch) + a.shape[1:]) for a in layout]
    _, (o_chunks, states) = lax.scan(batch, state0, layout)
    o_chunks, states = (a.reshape((-1,) + a.shape[2:])[:NC] for a in (o_chunks, states))
  # Every token sits in exactly one valid chunk row: gather it back.
  t = jnp.arange(T, dtype=jnp.int32)
  n_of_t = jnp.searchsorted(cu_seqlens, t, side="right") - 1
  pos = t - cu_seqlens[n_of_t]
  return o_chunks[chunk_offsets[n_of_t] + pos // C, pos % C], states, chunk_offsets


def _final_states(states: jax.Array, chunk_offsets: jax.Array, init: jax.Array) -> jax.Array:
  """The state after each sequence's last chunk ``[N, H, V, K]``; a sequence without chunks keeps ``init``."""
  if not states.shape[0]:
    return init
  has_chunks = (chunk_offsets[1:] > chunk_offsets[:-1])[:, None, None, None]
  return jnp.where(has_chunks, states[jnp.maximum(chunk_offsets[1:] - 1, 0)], init)


def kda_chunk_reference(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                        scale: float | None = None, initial_state: jax.Array | None = None,
                        l2norm_qk: bool = True, lower_bound: float | None = None,
                        chunk_size: int = CHUNK_SIZE) -> tuple[jax.Array, jax.Array]:
  """The chunked WY algorithm (chunk 64, 16-token sub-blocks) on a dense batch; same contract as
  ``kda_recurrent_reference``.

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` activated; beta: ``[B, T, H]`` in (0, 1).
    scale: default ``K ** -0.5``. initial_state: ``[B, H, V, K]`` (V-first) or None. l2norm_qk: as above.
    lower_bound: the gate's per-token lower bound if it is the bounded gate (midpoint-anchored diagonal
      blocks, needs ``lower_bound >= -5``); None: pairwise diagonal blocks, safe for any gate.
    chunk_size: a multiple of 16.

  Returns:
    ``o [B, T, H, V]`` f32 and the final state ``[B, H, V, K]`` f32.
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  if l2norm_qk:
    q, k = l2norm(q), l2norm(k)
  init = jnp.zeros((B, H, V, K), _f32) if initial_state is None else initial_state.astype(_f32)
  packed = [x.astype(_f32).reshape((B * T,) + x.shape[2:]) for x in (q, k, v, g, beta)]
  cu = jnp.arange(B + 1, dtype=jnp.int32) * T
  o, states, chunk_offsets = _chunked_varlen(*packed, cu, init, scale=_default_scale(scale, K),
                                             chunk_size=chunk_size, bounded=lower_bound is not None)
  return o.reshape(B, T, H, V), _final_states(states, chunk_offsets, init)


def _activate(q: jax.Array, k: jax.Array, g_raw: jax.Array, beta_raw: jax.Array, A_log: jax.Array,
              dt_bias: jax.Array, lower_bound: float | None) -> tuple[jax.Array, ...]:
  """L2 norm of q, k, the gate and beta's sigmoid: the raw -> kernel-input step shared by prefill/decode."""
  return (l2norm(q), l2norm(k), kda_gate(g_raw, A_log, dt_bias, lower_bound=lower_bound),
          jax.nn.sigmoid(beta_raw.astype(_f32)))


def _scatter_states(pool: jax.Array, slots: jax.Array, states: jax.Array) -> jax.Array:
  """``pool[slots] = states`` rounded once to the pool dtype; slot -1 rows are dropped (nothing written)."""
  P = pool.shape[0]
  slots = jnp.where(slots < 0, P, slots)
  return pool.at[slots].set(states.astype(pool.dtype), mode="drop")


def _gather_states(pool: jax.Array, slots: jax.Array, use: jax.Array) -> jax.Array:
  """f32 ``pool[slots]`` where ``use`` (and slot >= 0), zeros elsewhere; a select, so poison is never read."""
  use = use & (slots >= 0)
  states = pool[jnp.clip(slots, 0, pool.shape[0] - 1)].astype(_f32)
  return jnp.where(use[:, None, None, None], states, 0.0)


def kda_prefill_reference(q: jax.Array, k: jax.Array, v: jax.Array, g_raw: jax.Array, beta_raw: jax.Array, *,
                          A_log: jax.Array, dt_bias: jax.Array, cu_seqlens: jax.Array, state_pool: jax.Array,
                          state_indices: jax.Array, has_initial_state: jax.Array,
                          checkpoint_indptr: jax.Array, checkpoint_offsets: jax.Array,
                          checkpoint_slots: jax.Array, lower_bound: float | None = None,
                          scale: float | None = None, chunk_size: int = CHUNK_SIZE) -> tuple[jax.Array, jax.Array]:
  """``kda_prefill(impl="xla")``: chunked KDA over packed sequences with pool slots and checkpoints.

  Jit-able with traced index arrays (all shapes static, see ``_chunk_layout``). Inputs are assumed valid
  (``api.kda_prefill`` checks them); invalid indices under tracing give unspecified results.

  Args:
    q, k: ``[T, H, K]`` raw; v: ``[T, H, V]``; g_raw: ``[T, H, K]``; beta_raw: ``[T, H]``.
    A_log: ``[H]`` f32; dt_bias: ``[H, K]`` f32; cu_seqlens: ``[N+1]`` int32.
    state_pool: ``[P, H, V, K]`` (V-first) f32 or bf16.
    state_indices: ``[N]`` int32; initial state read from this slot when ``has_initial_state`` (else zero),
      final state written to it; -1: zero initial state, nothing written. A length-0 sequence with an
      initial state leaves its slot bitwise unchanged.
    has_initial_state: ``[N]`` bool.
    checkpoint_indptr: ``[N+1]`` int32 CSR rows; checkpoint_offsets ``[M]`` int32 (multiples of chunk_size
      in ``(0, L_n]``); checkpoint_slots ``[M]`` int32: the state after ``offset`` tokens of the sequence is
      written there (-1: skipped).
    lower_bound, scale, chunk_size: as ``KdaConfig``.

  Returns:
    ``o [T, H, V]`` in q's dtype and the new pool (same shape and dtype; the state is kept in f32 across
    chunks and rounded once per write).
  """
  N = cu_seqlens.shape[0] - 1
  C = chunk_size
  qn, kn, g, beta = _activate(q, k, g_raw, beta_raw, A_log, dt_bias, lower_bound)
  init = _gather_states(state_pool, state_indices, has_initial_state)
  o, states, chunk_offsets = _chunked_varlen(qn, kn, v.astype(_f32), g, beta, cu_seqlens, init,
                                             scale=_default_scale(scale, q.shape[-1]), chunk_size=C,
                                             bounded=lower_bound is not None)
  lens = cu_seqlens[1:] - cu_seqlens[:-1]
  final = _final_states(states, chunk_offsets, init)
  final_slots = jnp.where((lens == 0) & has_initial_state, -1, state_indices)
  M = checkpoint_offsets.shape[0]
  ck_seq = jnp.clip(jnp.searchsorted(checkpoint_indptr, jnp.arange(M, dtype=jnp.int32), side="right") - 1,
                    0, N - 1)
  ck_chunk = jnp.clip(chunk_offsets[ck_seq] + checkpoint_offsets // C - 1, 0, max(states.shape[0] - 1, 0))
  pool = _scatter_states(state_pool, final_slots, final)
  if M and states.shape[0]:
    pool = _scatter_states(pool, checkpoint_slots, states[ck_chunk])
  return o.astype(q.dtype), pool


def kda_decode_reference(q: jax.Array, k: jax.Array, v: jax.Array, g_raw: jax.Array, beta_raw: jax.Array, *,
                         A_log: jax.Array, dt_bias: jax.Array, state_pool: jax.Array, state_indices: jax.Array,
                         num_accepted: jax.Array | None = None, lower_bound: float | None = None,
                         scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  """``kda_decode(impl="xla")``: the token recurrence on pool slots, one or ``1 + S`` tokens per sequence.

  One-token form: q ``[N, H, K]``, state_indices ``[N]``: the slot is read and written in place.
  Speculative form: q ``[N, 1 + S, H, K]``, state_indices ``[N, 1 + S]``, num_accepted ``[N]``: the state is
  read from column ``num_accepted[n] - 1`` and the state after token t written to column t (-1 columns are
  not written), so a verifier can roll back. A row whose read slot is -1 is padding: output 0,
  nothing read or written. Each token's state is rounded to the pool dtype before the next token uses it,
  so the speculative form equals ``1 + S`` successive one-token calls also for a bf16 pool.

  Args:
    q, k: ``[N, H, K]`` / ``[N, 1 + S, H, K]`` raw; v: ``[..., H, V]``; g_raw: like q; beta_raw: ``[..., H]``.
    A_log: ``[H]`` f32; dt_bias: ``[H, K]`` f32.
    state_pool: ``[P, H, V, K]`` (V-first) f32 or bf16.
    state_indices: ``[N]`` or ``[N, 1 + S]`` int32. num_accepted: ``[N]`` int32 in ``[1, 1 + S]`` (spec form).
    lower_bound, scale: as ``KdaConfig``.

  Returns:
    ``o`` (``[N, H, V]`` / ``[N, 1 + S, H, V]``) in q's dtype and the new pool.
  """
  single = q.ndim == 3
  if single:
    q, k, v, g_raw, beta_raw = (x[:, None] for x in (q, k, v, g_raw, beta_raw))
    state_indices = state_indices[:, None]
    num_accepted = jnp.ones(q.shape[:1], jnp.int32)
  N, S1 = q.shape[:2]
  qn, kn, g, beta = _activate(q, k, g_raw, beta_raw, A_log, dt_bias, lower_bound)
  read_slot = jnp.take_along_axis(state_indices, (num_accepted - 1)[:, None], axis=1)[:, 0]
  active = read_slot >= 0
  state = _gather_states(state_pool, read_slot, active)
  scale = _default_scale(scale, q.shape[-1])

  def step(s, x):
    o, s = _recurrent_step(s, *x, scale)
    s = s.astype(state_pool.dtype).astype(_f32)
    return s, (o, s)

  xs = tuple(jnp.moveaxis(x.astype(_f32), 1, 0) for x in (qn, kn, v, g, beta))
  _, (o, states) = lax.scan(step, state, xs)
  o = jnp.where(active[:, None, None, None], jnp.moveaxis(o, 0, 1), 0.0)
  slots = jnp.where(active[:, None], state_indices, -1).reshape(-1)
  pool = _scatter_states(state_pool, slots, jnp.moveaxis(states, 0, 1).reshape((N * S1,) + states.shape[2:]))
  o = o.astype(q.dtype)
  return (o[:, 0] if single else o), pool
