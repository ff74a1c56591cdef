"""Public KDA entry points: ``kda_prefill`` (chunked, varlen, pool slots, checkpoints) and ``kda_decode``.

State pool layout everywhere: ``[P, H, V, K]`` (V-first, as vLLM's Kimi-K3 pool).
"""

import jax

from pallas_kernels.kda.config import KdaConfig


def kda_prefill(q: jax.Array, k: jax.Array, v: jax.Array, g_raw: jax.Array, beta_raw: jax.Array, *,
                A_log: jax.Array, dt_bias: jax.Array, cu_seqlens: jax.Array, state_pool: jax.Array,
                state_indices: jax.Array, has_initial_state: jax.Array,
                checkpoint_indptr: jax.Array | None = None, checkpoint_offsets: jax.Array | None = None,
                checkpoint_slots: jax.Array | None = None,
                config: KdaConfig | None = None) -> tuple[jax.Array, jax.Array]:
  """KDA chunked prefill over packed variable-length sequences.

  Args:
    q, k: ``[T, H, K]`` raw (L2 normalisation happens inside), f32/bf16/f16.
    v: ``[T, H, V]``, same dtype as q.
    g_raw: ``[T, H, K]`` raw gate input (before ``dt_bias`` and the activation).
    beta_raw: ``[T, H]`` raw β (sigmoid inside).
    A_log: ``[H]`` f32. dt_bias: ``[H, K]`` f32.
    cu_seqlens: ``[N+1]`` int32, non-decreasing, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``.
    state_pool: ``[P, H, V, K]`` in ``config.state_dtype`` (V-first layout).
    state_indices: ``[N]`` int32 pool slot of each sequence; its initial state is read (zero when
      ``has_initial_state[n]`` is false) and its final state written. -1: start from zero, write nothing.
    has_initial_state: ``[N]`` bool.
    checkpoint_indptr: ``[N+1]`` int32 CSR row pointer into the checkpoint arrays (or None: no checkpoints).
    checkpoint_offsets: ``[M]`` int32, tokens from the sequence start, multiples of ``chunk_size``,
      in ``(0, L_n]``; the state after that many tokens is written to ``checkpoint_slots``.
    checkpoint_slots: ``[M]`` int32 destination pool slots (-1: skip).
    config: ``KdaConfig``.

  Returns:
    ``o [T, H, V]`` in q's dtype, and the new ``state_pool`` (same shape/dtype; only the slots named by
    ``state_indices`` / ``checkpoint_slots`` change).
  """
  raise NotImplementedError("kda_prefill: filled in by [1/9]")


def kda_decode(q: jax.Array, k: jax.Array, v: jax.Array, g_raw: jax.Array, beta_raw: jax.Array, *,
               A_log: jax.Array, dt_bias: jax.Array, state_pool: jax.Array, state_indices: jax.Array,
               num_accepted: jax.Array | None = None,
               config: KdaConfig | None = None) -> tuple[jax.Array, jax.Array]:
  """KDA recurrent decode on pool slots, one token per sequence (or 1 + S speculative tokens).

  Args:
    q, k: ``[N, H, K]`` (one token) or ``[N, 1 + S, H, K]`` (speculative verify), raw.
    v: ``[N, H, V]`` / ``[N, 1 + S, H, V]``. g_raw: like q. beta_raw: ``[N, H]`` / ``[N, 1 + S, H]``.
    A_log: ``[H]`` f32. dt_bias: ``[H, K]`` f32.
    state_pool: ``[P, H, V, K]`` in ``config.state_dtype``.
    state_indices: ``[N]`` int32 (read and written in place), or ``[N, 1 + S]`` for the speculative form:
      the initial state is read from column ``num_accepted[n] - 1`` and the state after token t is
      written to column t. -1: output 0, read and write nothing.
    num_accepted: ``[N]`` int32 in ``[1, 1 + S]``, required with the speculative form only.
    config: ``KdaConfig``.

  Returns:
    ``o`` (``[N, H, V]`` or ``[N, 1 + S, H, V]``) in q's dtype and the new ``state_pool``.
  """
  raise NotImplementedError("kda_decode: filled in by [1/9]")
