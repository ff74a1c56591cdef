"""Test support shared by the tests, benchmarks and notebooks: float64 oracles, realistic inputs, metrics.

Nothing here runs on a device or depends on a test framework: the oracles are plain float64 NumPy, so they
are the independent truth the pure-JAX references and the kernels are checked against.
"""

from __future__ import annotations

import numpy as np

from pallas_kernels.kda.reference import L2NORM_EPS, SOFTPLUS_THRESHOLD


def kda_gate_params(rng: np.random.Generator, H: int, K: int, *,
                    A_log: float | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Kimi-Linear's gate parameters as the model initialises them: ``A_log [H]`` and ``dt_bias [H, K]`` f32.

  ``A_log = log U(1, 16)`` (decay rates 1-16) unless a value for every head is given; ``dt_bias`` is the
  inverse softplus of ``dt ~ exp U(log 1e-3, log 1e-1)``.
  """
  a_log = np.log(rng.uniform(1, 16, H)) if A_log is None else np.full(H, A_log)
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


def kda_recurrence_oracle(q, k, v, g, beta, scale: float, h0=None, l2norm: bool = True):
  """The delta-rule recurrence token by token in float64, with a K-first state ``S [B, H, K, V]``.

  Per token: ``S = exp(g) S; S += k (beta (v - S^T k))^T; o = scale S^T q`` (q and k L2-normalised first
  when ``l2norm``).

  Args:
    q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]``. g: ``[B, T, H, K]`` log decay. beta: ``[B, T, H]``.
    h0: ``[B, H, V, K]`` initial state (V-first, the pools' layout) or None for zeros.

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
    o[:, t] = scale * np.einsum("bhkv,bhk->bhv", S, q[:, t])
    states.append(np.swapaxes(S, -1, -2))
  return o, np.stack(states)


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
