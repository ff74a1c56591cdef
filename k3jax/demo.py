"""`make demo`: the tiny Kimi-K3 model: a packed prefill of a few prompts, 16 greedy decode steps, tokens/s,
and a consistency check (the decode logits against a prefill of the same tokens)."""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import k3jax

PROMPT_LENS = (5, 9, 3)
DECODE_STEPS = 16
# Relative to the largest logit. bf16 activations: prefill (chunked KDA, non-absorbed MLA) and decode
# (recurrent KDA, absorbed MLA) round differently (~1e-2 relative here); a wrong cache, mask or position
# gives errors of the order of the logits themselves.
TOLERANCE = 0.05


def _timed(fn, *args):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t0


def _cu(lens) -> jax.Array:
  return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


def main() -> int:
  # K = 64: the Mosaic GPU KDA kernels take K in {64, 128}, so the same demo runs them on a Hopper GPU.
  cfg = k3jax.preset("tiny", kda_head_dim=64)
  model = k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(0))
  n = len(PROMPT_LENS)
  max_len = max(PROMPT_LENS) + DECODE_STEPS
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, length).astype(np.int32) for length in PROMPT_LENS]
  tokens, cu = jnp.asarray(np.concatenate(prompts)), _cu(PROMPT_LENS)
  print(f"k3jax demo: tiny Kimi-K3, {cfg.num_hidden_layers} layers ({' '.join(cfg.layer_types)}), "
        f"impl={cfg.impl}, dtype={cfg.dtype.name}, state {cfg.state_dtype.name}, "
        f"partials {cfg.partial_dtype.name}, device {jax.devices()[0].platform}")

  # The first call of each step compiles; the second, on a fresh cache, is timed.
  _, t_compile = _timed(k3jax.prefill, model, tokens, cu, k3jax.init_cache(cfg, n, max_len))
  (logits, cache), t_prefill = _timed(k3jax.prefill, model, tokens, cu, k3jax.init_cache(cfg, n, max_len))
  print(f"prefill: {n} prompts, {tokens.shape[0]} packed tokens: compile+run {t_compile:.1f} s, "
        f"run {t_prefill * 1e3:.1f} ms ({tokens.shape[0] / t_prefill:,.0f} tokens/s)")

  last = np.asarray(cu[1:]) - 1
  next_tok = jnp.argmax(logits[last], axis=-1).astype(jnp.int32)
  generated, step_logits, step_times = [], [], []
  for _ in range(DECODE_STEPS):
    generated.append(np.asarray(next_tok))
    (logits_t, cache), dt = _timed(k3jax.decode, model, next_tok, cache)
    step_logits.append(np.asarray(logits_t, np.float32))
    step_times.append(dt)
    next_tok = jnp.argmax(logits_t, axis=-1).astype(jnp.int32)
  steady = float(np.median(step_times[1:]))
  print(f"decode: {DECODE_STEPS} steps x {n} sequences: first step (compile) {step_times[0]:.1f} s, "
        f"then {steady * 1e3:.2f} ms/step ({n / steady:,.0f} tokens/s)")
  gen = np.stack(generated, axis=1)
  for i in range(n):
    print(f"  sequence {i}: prompt {prompts[i].tolist()} -> {gen[i].tolist()}")

  # Consistency: prefill each prompt + its generated tokens; row p of that prefill must equal the decode
  # logits of the step that consumed token p.
  full = [np.concatenate([prompts[i], gen[i]]) for i in range(n)]
  lens = [len(f) for f in full]
  check_logits, _ = k3jax.prefill(model, jnp.asarray(np.concatenate(full)), _cu(lens),
                                  k3jax.init_cache(cfg, n, max_len))
  check_logits = np.asarray(check_logits, np.float32)
  starts = np.concatenate([[0], np.cumsum(lens)])
  diff = max(np.abs(check_logits[starts[i] + PROMPT_LENS[i] + s] - step_logits[s][i]).max()
             for i in range(n) for s in range(DECODE_STEPS))
  scale = float(np.abs(check_logits).max())
  ok = bool(np.isfinite(diff) and diff <= TOLERANCE * scale)
  print(f"consistency: max |decode - prefill| logit = {diff:.4f} over {n * DECODE_STEPS} tokens, "
        f"{diff / scale:.2%} of max |logit| {scale:.2f} (tolerance {TOLERANCE:.0%}): {'OK' if ok else 'FAILED'}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
