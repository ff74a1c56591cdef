"""Test support shared by the tests, benchmarks and notebooks: float64 oracles, realistic inputs, metrics.

Nothing here runs on a device or depends on a test framework: the oracles are plain float64 NumPy, so they
are the independent truth the pure-JAX references and the kernels are checked against.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda.reference import L2NORM_EPS, SOFTPLUS_THRESHOLD
from pallas_kernels.mla.config import LATENT_DIM, PAGE_SIZE, ROPE_DIM


def kda_gate_params(rng: np.random.Generator, H: int, K: int, *, A_log: float | None = None,
                    dt_bias_std: float | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Kimi-Linear's gate parameters as the model initialises them: ``A_log [H]`` and ``dt_bias [H, K]`` f32.

  ``A_log = log U(1, 16)`` (decay rates 1-16) unless a value for every head is given; ``dt_bias`` is the
  inverse softplus of ``dt ~ exp U(log 1e-3, log 1e-1)``, or with ``dt_bias_std`` ``N(0, dt_bias_std^2)``:
  centred on 0, so ``g_raw + dt_bias`` reaches the strong decays (and the lower-bound gate's middle) that the
  init's negative bias makes rare.
  """
  a_log = np.log(rng.uniform(1, 16, H)) if A_log is None else np.full(H, A_log)
  if dt_bias_std is not None:
    return a_log.astype(np.float32), np.float32(dt_bias_std) * rng.standard_normal((H, K)).astype(np.float32)
  dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), size=(H, K)))
  return a_log.astype(np.float32), np.log(np.expm1(dt)).astype(np.float32)


def kda_gate_oracle(g_raw, A_log, dt_bias, lower_bound: float | None) -> np.ndarray:
  """The per-channel log decay ``g`` in float64 (natural log), shape of ``g_raw [..., H, K]``.

  Kimi-Linear (``lower_bound`` None): ``g = -exp(A_log) softplus(g_raw + dt_bias)``. Kimi-K3:
  ``g = lower_bound * sigmoid(exp(A_log) (g_raw + dt_bias))``, bounded in ``(lower_bound, 0)``.
  """
  x = np.asarray(g_raw, np.float64) + np.asarray(dt_bias, np.float64)
  rate = np.exp(np.asarray(A_log, np.float64))[:, None]
  if lower_bound is None:
    t = SOFTPLUS_THRESHOLD
    return -rate * np.where(x > t, x, np.log1p(np.exp(np.minimum(x, t))))
  return lower_bound * np.exp(-np.logaddexp(0.0, -rate * x))


def kda_inputs(rng: np.random.Generator, lead: tuple[int, ...], H: int, K: int, V: int, *,
               g_scale: float = 1.0, g_shift: float = 0.0) -> dict[str, np.ndarray]:
  """Raw token inputs of the KDA ops as f32 NumPy arrays, keyed by the ops' argument names.

  ``q``, ``k`` ``[*lead, H, K]``, ``v`` ``[*lead, H, V]``, ``g_raw`` ``[*lead, H, K]`` and ``beta_raw``
  ``[*lead, H]`` are unit normal, drawn in that order (the ops L2-normalise q and k and apply the gate and
  β's sigmoid inside); ``g_raw`` is then ``g_scale * N(0, 1) + g_shift`` (a large shift saturates the gate).
  """
  f = lambda *s: rng.standard_normal(tuple(lead) + s).astype(np.float32)
  x = dict(q=f(H, K), k=f(H, K), v=f(H, V), g_raw=f(H, K), beta_raw=f(H))
  x["g_raw"] = (x["g_raw"] * np.float32(g_scale) + np.float32(g_shift)).astype(np.float32)
  return x


def kda_recurrence_oracle(q, k, v, g, beta, scale: float, h0=None, l2norm: bool = True, state_dtype=None):
  """The delta-rule recurrence token by token in float64, with a K-first state ``S [B, H, K, V]``.

  Per token: ``S = exp(g) S; S += k (beta (v - S^T k))^T; o = scale S^T q`` (q and k L2-normalised first
  when ``l2norm``).

  Args:
    q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]``. g: ``[B, T, H, K]`` log decay. beta: ``[B, T, H]``.
    h0: ``[B, H, V, K]`` initial state (V-first, the pools' layout) or None for zeros.
    state_dtype: None, or a NumPy dtype (f32, ``ml_dtypes.bfloat16``) each token's state is rounded to
      before ``o`` reads it and the next token starts from it: a decode kernel storing every token's state.

  Returns:
    ``o [B, T, H, V]`` and the states after every token ``[T + 1, B, H, V, K]`` (V-first; entry 0 is the
    initial state), so tests can read any prefix state.
  """
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  if l2norm:
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + L2NORM_EPS)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + L2NORM_EPS)
  B, T, H, K = q.shape
  V = v.shape[-1]
  S = np.zeros((B, H, K, V)) if h0 is None else np.swapaxes(np.asarray(h0, np.float64), -1, -2).copy()
  o = np.zeros((B, T, H, V))
  states = [np.swapaxes(S, -1, -2)]
  for t in range(T):
    S = np.exp(g[:, t])[..., None] * S
    err = v[:, t] - np.einsum("bhkv,bhk->bhv", S, k[:, t])
    S = S + k[:, t, :, :, None] * (beta[:, t, :, None] * err)[:, :, None, :]
    if state_dtype is not None:
      S = S.astype(state_dtype).astype(np.float64)
    o[:, t] = scale * np.einsum("bhkv,bhk->bhv", S, q[:, t])
    states.append(np.swapaxes(S, -1, -2))
  return o, np.stack(states)


def kda_prefill_oracle(q, k, v, g_raw, beta_raw, *, A_log, dt_bias, cu_seqlens, state_pool, state_indices,
                       has_initial_state, checkpoint_indptr=None, checkpoint_offsets=None, checkpoint_slots=None,
                       lower_bound: float | None, scale: float | None = None) -> tuple[np.ndarray, np.ndarray, set]:
  """``kda_prefill`` in float64, sequence by sequence with ``kda_recurrence_oracle``, pool semantics included.

  Args:
    q, k, v, g_raw, beta_raw, A_log, dt_bias, cu_seqlens, state_pool, state_indices, has_initial_state and the
      checkpoint arrays: as ``kda_prefill`` takes them (any float / int arrays, bf16 included); checkpoints
      None: none. lower_bound, scale: as ``KdaConfig``.

  Returns:
    ``o [T, H, V]``, the new pool ``[P, H, V, K]`` (both float64; unwritten slots are the old values) and the
    set of written slots (final states and checkpoints).
  """
  q, k, v, pool = (np.asarray(a, np.float64) for a in (q, k, v, state_pool))
  g = kda_gate_oracle(g_raw, A_log, dt_bias, lower_bound)
  beta = 1.0 / (1.0 + np.exp(-np.asarray(beta_raw, np.float64)))
  cu, slots, has = (np.asarray(a) for a in (cu_seqlens, state_indices, has_initial_state))
  ck_ptr = np.zeros(len(cu), np.int64) if checkpoint_indptr is None else np.asarray(checkpoint_indptr)
  ck_off = np.zeros(0, np.int64) if checkpoint_offsets is None else np.asarray(checkpoint_offsets)
  ck_slot = np.zeros(0, np.int64) if checkpoint_slots is None else np.asarray(checkpoint_slots)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  o, new, written = np.zeros(v.shape), pool.copy(), set()
  for n in range(len(cu) - 1):
    rows, s = slice(cu[n], cu[n + 1]), int(slots[n])
    h0 = pool[s][None] if has[n] and s >= 0 else None
    o_n, states = kda_recurrence_oracle(q[None, rows], k[None, rows], v[None, rows], g[None, rows],
                                        beta[None, rows], scale, h0)
    o[rows] = o_n[0]
    if s >= 0 and not (has[n] and cu[n + 1] == cu[n]):  # a length-0 sequence with a state keeps its slot
      new[s] = states[-1, 0]
      written.add(s)
    for m in range(ck_ptr[n], ck_ptr[n + 1]):
      if ck_slot[m] >= 0:
        new[ck_slot[m]] = states[ck_off[m], 0]
        written.add(int(ck_slot[m]))
  return o, new, written


def kda_decode_oracle(q, k, v, g_raw, beta_raw, *, A_log, dt_bias, state_pool, state_indices, num_accepted=None,
                      lower_bound: float | None, scale: float | None = None) -> tuple[np.ndarray, np.ndarray, set]:
  """``kda_decode`` in float64 on pool slots, one token (``q [N, H, K]``, ``state_indices [N]``) or ``1 + S``
  (``q [N, 1 + S, H, K]``, ``state_indices [N, 1 + S]``, ``num_accepted [N]``) per sequence; arguments as
  ``kda_decode`` takes them (any float / int arrays), lower_bound and scale as ``KdaConfig``.

  Each token's state is rounded to the pool's dtype before ``o`` reads it and the next token starts from it,
  as the decode kernel stores it (``kda_decode_reference`` reads ``o`` before that rounding). A row whose read
  slot is -1 outputs 0 and writes nothing.

  Returns:
    ``o`` (``[N, H, V]`` / ``[N, 1 + S, H, V]``), the new pool (both float64; unwritten slots are the old
    values) and the set of written slots.
  """
  single = np.ndim(state_indices) == 1
  q, k, v, g_raw, beta_raw = (np.asarray(a, np.float64)[:, None] if single else np.asarray(a, np.float64)
                              for a in (q, k, v, g_raw, beta_raw))
  slots = np.asarray(state_indices).reshape(len(q), -1)
  accepted = np.ones(len(slots), np.int64) if num_accepted is None else np.asarray(num_accepted)
  g = kda_gate_oracle(g_raw, A_log, dt_bias, lower_bound)
  beta = 1.0 / (1.0 + np.exp(-beta_raw))
  stored = np.asarray(state_pool).dtype
  pool = np.asarray(state_pool, np.float64)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  o, new, written = np.zeros(v.shape), pool.copy(), set()
  for n in range(len(slots)):
    read = slots[n, accepted[n] - 1]
    if read < 0:
      continue
    rows = slice(n, n + 1)
    o_n, states = kda_recurrence_oracle(q[rows], k[rows], v[rows], g[rows], beta[rows], scale, pool[read][None],
                                        state_dtype=stored)
    o[n] = o_n[0]
    for t, dst in enumerate(slots[n]):
      if dst >= 0:
        new[dst] = states[t + 1, 0]
        written.add(int(dst))
  return (o[:, 0] if single else o), new, written


def rel_rmse(x, ref) -> float:
  """RMSE of ``x - ref`` over the RMS of ``ref``, in float64.

  The plain RMSE for an all-zero ``ref`` and 0 for empty arrays; NaN or inf anywhere gives NaN or inf,
  which fails every ``<`` bound.
  """
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  if not ref.size:
    return 0.0
  err, rms = np.sqrt(np.mean((x - ref) ** 2)), np.sqrt(np.mean(ref ** 2))
  return float(err / rms if rms else err)


def bits(x) -> np.ndarray:
  """The raw bits of a 2- or 4-byte float array (for bitwise comparisons: NaN payloads and -0.0 count)."""
  x = np.asarray(x)
  return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


# ------------------------------------------------------------------------------------------------------- MLA
K3_MLA_SCALE = 192 ** -0.5  # Kimi-K3's softmax scale (qk_nope + qk_rope) ** -0.5, also of its absorbed decode
MLA_PAD_IDS = (2147480000, -1)  # FlashMLA's huge padding id, and -1: never read past a sequence's end


def _f64(x) -> np.ndarray:
  """Any float array (bf16 included) as float64; bf16 and f32 values are exact in float64."""
  return np.asarray(x).astype(np.float64)


def mla_paged_inputs(seed: int, lens, *, num_heads: int, max_pages: int, num_pages: int | None = None,
                     q_std: float = 1.0, q_dtype=np.float32, latent: int = LATENT_DIM, rope: int = ROPE_DIM,
                     page: int = PAGE_SIZE, first_page: int = 0):
  """Random MLA decode inputs with NaN in every cache row that is not a token, and scattered page ids.

  The latent rows are N(0, 1) (c_kv is RMS-normalised, k_pe of unit scale); q_abs is N(0, q_std), so at K3's
  scale the logits have std ``K3_MLA_SCALE * sqrt(576) * q_std`` (moderately peaky at q_std = 1). Used pages
  get distinct ids drawn from ``[first_page, num_pages)`` in random order; unused table slots hold
  ``MLA_PAD_IDS``. The cache is built with ``jnp`` on the default device (only the used pages go through the
  host): it may be gigabytes, with page ids above 65535.

  Returns:
    ``q [B, Hq, D]`` (q_dtype), ``cache [num_pages, page, D]`` bf16, ``table [B, max_pages]`` int32,
    ``lens [B]`` int32, all jnp arrays.
  """
  rng = np.random.default_rng(seed)
  lens = np.asarray(lens, np.int32)
  dim = latent + rope
  need = -(-lens // page)
  num_pages = num_pages or max(int(need.sum()), 1) + 3
  ids = first_page + rng.permutation(num_pages - first_page)[: int(need.sum())]
  table = np.array(MLA_PAD_IDS, np.int32)[rng.integers(0, 2, (len(lens), max_pages))]
  used = np.full((int(need.sum()), page, dim), np.nan, np.float32)
  start = 0
  for b, length in enumerate(lens):
    table[b, :need[b]] = ids[start:start + need[b]]
    rows = used[start:start + need[b]].reshape(-1, dim)
    rows[:length] = rng.standard_normal((length, dim))
    start += need[b]
  q = rng.standard_normal((len(lens), num_heads, dim)) * q_std
  cache = jnp.full((num_pages, page, dim), jnp.nan, jnp.bfloat16).at[ids].set(jnp.asarray(used, jnp.bfloat16))
  return jnp.asarray(q, q_dtype), cache, jnp.asarray(table), jnp.asarray(lens)


def mla_paged_cache(tokens, lens, table, pages: int, *, devices: int = 1, page_size: int = PAGE_SIZE) -> np.ndarray:
  """Host copy of the paged latent cache holding ``tokens [B, L, D]``; every other row is NaN.

  Token ``t`` of sequence ``b`` goes to device ``t % devices`` (the decode-context-parallel interleave of
  ``k3jax.dcp``; one device is the plain paged layout), local position ``c = t // devices``: row
  ``c % page_size`` of page ``(t % devices) * pages + table[b, c // page_size]``.

  Returns:
    ``[devices * pages, page_size, D]`` in the dtype of ``tokens``.
  """
  cache = np.full((devices * pages, page_size, tokens.shape[-1]), np.nan, tokens.dtype)
  for b, length in enumerate(lens):
    for t in range(length):
      c = t // devices
      cache[(t % devices) * pages + table[b, c // page_size], c % page_size] = tokens[b, t]
  return cache


def _mla_oracle(q, lens, rows_of, scale: float, latent: int):
  """float64 attention of each ``q[b] [Hq, D]`` over ``rows_of(b, lens[b]) [lens[b], D]`` (V: the first
  ``latent`` columns); ``(0, -inf)`` for an empty sequence."""
  o = np.zeros(q.shape[:2] + (latent,))
  lse = np.full(q.shape[:2], -np.inf)
  for b, length in enumerate(lens):
    if length == 0:
      continue
    rows = rows_of(b, length)
    s = scale * q[b] @ rows.T
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    o[b] = p @ rows[:, :latent] / p.sum(axis=1, keepdims=True)
    lse[b] = m[:, 0] + np.log(p.sum(axis=1))
  return o, lse


def mla_attention_oracle(q, tokens, lens, *, scale: float, latent: int = LATENT_DIM):
  """float64 absorbed MLA decode of ``q [B, Hq, D]`` over the first ``lens[b]`` rows of ``tokens [B, L, D]``.

  Returns:
    ``o [B, Hq, latent]`` f64 and ``lse [B, Hq]`` f64 natural log; an empty sequence gives ``(0, -inf)``.
  """
  tokens = _f64(tokens)
  return _mla_oracle(_f64(q), np.asarray(lens), lambda b, n: tokens[b, :n], scale, latent)


def mla_decode_oracle(q, cache, table, lens, *, scale: float, latent: int = LATENT_DIM):
  """float64 absorbed MLA decode over a paged cache, gathered page by page in NumPy.

  Args:
    q: ``[B, Hq, D]``. cache: ``[pages, page_size, D]``. table: ``[B, max_pages]`` page ids.
    lens: ``[B]`` tokens per sequence. scale: softmax scale. latent: ``Dc``, the leading columns forming V.

  Returns:
    ``o [B, Hq, latent]`` f64 and ``lse [B, Hq]`` f64 natural log; an empty sequence gives ``(0, -inf)``.
  """
  cache, table = _f64(cache), np.asarray(table)
  page = cache.shape[1]
  rows_of = lambda b, n: np.concatenate([cache[p] for p in table[b, : -(-n // page)]])[:n]
  return _mla_oracle(_f64(q), np.asarray(lens), rows_of, scale, latent)


def mla_merge_oracle(o_parts, lse_parts):
  """float64 log-sum-exp merge: an empty part (LSE -inf) adds nothing whatever its o, a NaN LSE gives NaN.

  Returns:
    ``o [..., Dc]`` f64 and ``lse [...]`` f64 of the ``[S, ..., Dc]`` parts and their ``[S, ...]`` LSE.
  """
  o_parts, lse_parts = _f64(o_parts), _f64(lse_parts)
  with np.errstate(invalid="ignore"):
    lse = np.logaddexp.reduce(lse_parts, axis=0)
    w = np.where(np.isneginf(lse_parts), 0.0, np.exp(lse_parts - lse))
    return np.sum(np.where(w[..., None] == 0, 0.0, w[..., None] * o_parts), axis=0), lse


def mla_hand_case():
  """Two tokens, Dc = Dr = 1, page size 2, two heads; the expected values are worked out by hand.

  Sequence 0 (page 2): tokens ``[v, k_pe] = [2, 0]`` and ``[4, ln 3]``. Head 0 has ``q = [0, 1]``: logits
  ``0, ln 3``, weights 1/4 and 3/4, so ``o = 2/4 + 12/4 = 3.5`` and ``lse = ln(1 + 3) = ln 4``. Head 1 has
  ``q = [1, 0]``: logits 2 and 4, so ``o = (2 e^2 + 4 e^4) / (e^2 + e^4)`` and ``lse = 4 + ln(1 + e^-2)``.
  Sequence 1 (page 0, one token ``[2, 0]``; its second row is NaN): one weight of 1, so ``o = 2`` and
  ``lse`` is the logit, 0 for head 0 and 2 for head 1. Sequence 2 is empty: ``(0, -inf)``. Page 1 is unused
  (NaN), and the padding ids of the table must never be read.

  Returns:
    ``(q, cache, table, lens)`` as jnp f32/int32 arrays, and ``(o [3, 2, 1], lse [3, 2])`` expected in f64.
  """
  nan = np.nan
  cache = np.array([[[2, 0], [nan, nan]], [[nan, nan], [nan, nan]], [[2, 0], [4, np.log(3)]]], np.float32)
  q = np.array([[[0, 1], [1, 0]]] * 3, np.float32)
  table = np.array([[2, MLA_PAD_IDS[0]], [0, MLA_PAD_IDS[1]], [MLA_PAD_IDS[0], MLA_PAD_IDS[1]]], np.int32)
  lens = np.array([2, 1, 0], np.int32)
  e2, e4 = np.exp(2.0), np.exp(4.0)
  o = np.array([[[3.5], [(2 * e2 + 4 * e4) / (e2 + e4)]], [[2.0], [2.0]], [[0.0], [0.0]]])
  lse = np.array([[np.log(4.0), 4 + np.log1p(np.exp(-2.0))], [0.0, 2.0], [-np.inf, -np.inf]])
  return tuple(jnp.asarray(x) for x in (q, cache, table, lens)), (o, lse)


def mla_prefill_oracle(q, k_nope, k_rope, v, cu_seqlens, scale: float, cu_seqlens_k=None):
  """float64 causal attention within each packed sequence, the rope key ``k_rope [Tk, Dr]`` shared by all heads.

  Args:
    q: ``[T, H, Dn + Dr]``. k_nope: ``[Tk, H, Dn]``. v: ``[Tk, H, Dv]``. cu_seqlens: ``[N + 1]`` boundaries.
    cu_seqlens_k: ``[N + 1]`` key boundaries, or None (``Tk = T``, the keys are the queries' tokens): sequence
      n's queries are its last ``L_n`` of ``Lk_n`` tokens, query t seeing keys ``0 .. Lk_n - L_n + t``.

  Returns:
    ``o [T, H, Dv]`` f64 and ``lse [T, H]`` f64 natural log.
  """
  q, k_nope, k_rope, v = (_f64(x) for x in (q, k_nope, k_rope, v))
  cu = np.asarray(cu_seqlens)
  cuk = cu if cu_seqlens_k is None else np.asarray(cu_seqlens_k)
  t, h, _ = q.shape
  o, lse = np.zeros((t, h, v.shape[-1])), np.zeros((t, h))
  for a, b, ka, kb in zip(cu[:-1], cu[1:], cuk[:-1], cuk[1:]):
    if a == b:
      continue
    k = np.concatenate([k_nope[ka:kb], np.broadcast_to(k_rope[ka:kb, None], (kb - ka, h, k_rope.shape[-1]))],
                       axis=-1)
    s = np.einsum("qhd,khd->hqk", q[a:b], k) * scale
    s = np.where(np.tril(np.ones((b - a, kb - ka), bool), k=(kb - ka) - (b - a))[None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    o[a:b] = np.einsum("hqk,khv->qhv", p / p.sum(-1, keepdims=True), v[ka:kb])
    lse[a:b] = (m[..., 0] + np.log(p.sum(-1))).T
  return o, lse
