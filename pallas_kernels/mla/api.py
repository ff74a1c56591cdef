"""Public MLA entry points: split-K absorbed decode over a paged latent cache, and the LSE merge."""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import util
from pallas_kernels.mla import cache_format, kernel, reference
from pallas_kernels.mla.config import HEAD_TILE, LATENT_DIM, PAGE_SIZE, ROPE_DIM, MlaDecodeConfig, MlaDecodeTuning


def choose_num_splits(batch: int, num_heads: int, max_pages: int) -> int:
  """Splits of the KV length that ``default_tuning`` picks, from static shapes only.

  The kernel runs one program per (64-head tile, split, sequence), about one per SM. With
  ``programs = batch * ceil(num_heads / 64)``: no split when the programs already fill 80% of the SMs;
  otherwise FlashAttention-2's wave-efficiency rule over ``s`` in ``[1, max_pages // 16]`` (a split covers
  at least 16 pages, so its partial writes stay small next to its KV reads): the smallest ``s`` whose
  efficiency ``waves / ceil(waves)`` (``waves = programs * s / 132``) is within 85% of the best.
  """
  programs = batch * util.cdiv(num_heads, HEAD_TILE)
  max_splits = max(1, max_pages // reference.MIN_PAGES_PER_SPLIT)
  if programs >= 0.8 * util.NUM_SMS or max_splits == 1:
    return 1

  def efficiency(s):
    waves = programs * s / util.NUM_SMS
    return waves / util.cdiv(programs * s, util.NUM_SMS)

  best = max(efficiency(s) for s in range(1, max_splits + 1))
  return next(s for s in range(1, max_splits + 1) if efficiency(s) >= 0.85 * best)


def default_tuning(batch: int, num_heads: int, max_pages: int, *,
                   cache_dtype: jax.typing.DTypeLike) -> MlaDecodeTuning:
  """The tuning ``mla_decode`` takes for ``config.tuning=None`` (and for each None field of a given tuning).

  Args:
    batch: B, sequences of the call. num_heads: Hq, query heads. max_pages: block-table columns.
    cache_dtype: the kv_cache's dtype (bf16 or fp8; ``kernel.narrow_applies`` says up to how many heads).

  Returns:
    ``MlaDecodeTuning`` with ``num_splits`` from ``choose_num_splits``, ``narrow`` True wherever the narrow
    kernel applies (``kernel.narrow_applies``): there it skips the padding rows of the 64-row head tile, so its
    page loads, not its matrix work, bound each page; and ``fp8_in_registers`` True wherever the narrow kernel
    takes an fp8 cache (no f16 copy of the pages: the faster path, ``benchmarks/RESULTS.md``).
  """
  narrow = kernel.narrow_applies(num_heads, cache_dtype)
  return MlaDecodeTuning(num_splits=choose_num_splits(batch, num_heads, max_pages), narrow=narrow,
                         fp8_in_registers=narrow and cache_format.is_fp8(cache_dtype))


def effective_num_splits(max_pages: int, num_splits: int) -> int:
  """The splits that hold at least one page slot: ``num_splits`` clamped so that no split is empty by shape."""
  return util.cdiv(max_pages, reference.pages_per_split(max_pages, num_splits))


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "partial_dtype", "narrow", "balanced",
                                             "fp8_in_registers", "impl", "out_dtype"))
def _mla_decode(q_abs, kv_cache, block_table, seq_lens, *, scale, num_splits, partial_dtype, narrow, balanced,
                fp8_in_registers, impl, out_dtype):
  seq_lens = seq_lens.astype(jnp.int32)
  if impl == "xla":
    o_parts, lse_parts = reference.mla_decode_partials_reference(
        q_abs, kv_cache, block_table, seq_lens, scale=scale, num_splits=num_splits,
        partial_dtype=partial_dtype, latent_dim=LATENT_DIM)
  else:
    budget = None
    if balanced:  # the budget of num_splits a sequence, spread by pages over up to twice as many splits
      num_splits, budget = effective_num_splits(block_table.shape[1], 2 * num_splits), num_splits
    o_parts, lse_parts = kernel.mla_decode_partials_mosaic(
        q_abs, kv_cache, block_table, seq_lens, scale=scale, num_splits=num_splits,
        partial_dtype=partial_dtype, narrow=narrow, interpret=impl == "interpret", budget=budget,
        registers=fp8_in_registers)
  return merge_partials(o_parts, lse_parts, out_dtype=out_dtype)


def mla_decode(q_abs: jax.Array, kv_cache: jax.Array, block_table: jax.Array, seq_lens: jax.Array, *,
               config: MlaDecodeConfig,
               out_dtype: jax.typing.DTypeLike | None = None) -> tuple[jax.Array, jax.Array]:
  """Absorbed MLA decode, split along the KV length.

  Each split attends on its own (f32 online softmax), stores its normalised partial in ``config.partial_dtype``
  with an f32 LSE, and ``merge_partials`` combines the splits: ``pages_per_split`` pages a split, or with
  ``MlaDecodeTuning.balanced`` (the kernels) spread over the sequences by the pages they hold.

  Args:
    q_abs: ``[B, Hq, Dc + Dr]`` (576 = 512 latent + 64 rope), absorbed queries, f32/bf16/f16
      (the kernels need bf16).
    kv_cache: ``[pages, 64, Dc + Dr]`` paged latent cache, bf16, or fp8 rows ``[pages, 64, Dc + Dr + 64]``
      ``float8_e4m3fn`` with per-token scales (``cache_format``); the xla path also takes f32/f16. V is its
      first ``Dc`` columns. Rows past a sequence's length and unused pages may hold anything (NaN too).
    block_table: ``[B, max_pages]`` int32 page ids of each sequence; ids of unused pages are ignored.
    seq_lens: ``[B]`` int32 tokens per sequence, in ``[0, max_pages * 64]`` (0 allowed).
    config: ``MlaDecodeConfig`` (scale, required: ``192 ** -0.5`` for K3, not ``576 ** -0.5``; partial dtype,
      impl, tuning).
    out_dtype: dtype of ``o`` (f32/bf16/f16); None means q's dtype. A partial that is merged again later
      (decode context parallelism) keeps ``config.partial_dtype`` here rather than rounding to q's dtype.

  Returns:
    ``o [B, Hq, Dc]`` in ``out_dtype`` and ``lse [B, Hq]`` f32 (natural log); an empty sequence gives
    ``o = 0``, ``lse = -inf``. A NaN or inf in ``q_abs`` or in a token's cache row makes the heads it
    reaches non-finite (NaN where it reaches the logits), whatever the tuning.

  Raises:
    ValueError: a ``config`` that is no ``MlaDecodeConfig``, malformed shapes, dtypes (``out_dtype`` too) or
      (when concrete) ``seq_lens`` / used page ids out of range.
    NotImplementedError: the kernels with a q dtype other than bf16, or a cache dtype other than bf16 / fp8.
  """
  if not isinstance(config, MlaDecodeConfig):
    raise ValueError(f"config must be an MlaDecodeConfig, got {config!r}")
  reference.validate_decode_inputs(q_abs, kv_cache, block_table, seq_lens, scale=config.scale,
                                   latent_dim=LATENT_DIM, page_size=PAGE_SIZE)
  util.check_shape("q_abs", q_abs, (None, None, LATENT_DIM + ROPE_DIM))
  out_dtype = util.canonical_dtype("out_dtype", q_abs.dtype if out_dtype is None else out_dtype,
                                    util.FLOAT_DTYPES)
  if config.impl != "xla" and (q_abs.dtype != jnp.bfloat16
                               or not (kv_cache.dtype == jnp.bfloat16 or cache_format.is_fp8(kv_cache.dtype))):
    raise NotImplementedError(f"mla_decode impl={config.impl!r} needs a bf16 q_abs and a bf16 or fp8 kv_cache, "
                              f"got {jnp.dtype(q_abs.dtype).name} and {jnp.dtype(kv_cache.dtype).name}")
  batch, num_heads, _ = q_abs.shape
  max_pages = block_table.shape[1]
  tuning = config.tuning or MlaDecodeTuning()
  defaults = default_tuning(batch, num_heads, max_pages, cache_dtype=kv_cache.dtype)
  num_splits = tuning.num_splits or defaults.num_splits
  # The XLA reference has one form (equal splits, 64-row tiles); the kernels take the narrow one where the tuning
  # (or its default) asks, and the balanced splits where the tuning asks for them.
  narrow = config.impl != "xla" and (defaults.narrow if tuning.narrow is None else tuning.narrow)
  balanced = config.impl != "xla" and tuning.balanced is True
  # fp8 pages stay in registers only where the narrow kernel (as asked, or by default) reads an fp8 cache; there
  # they do by default.
  registers_apply = narrow and cache_format.is_fp8(kv_cache.dtype)
  fp8_in_registers = config.impl != "xla" and (registers_apply if tuning.fp8_in_registers is None
                                               else tuning.fp8_in_registers)
  if narrow and not kernel.narrow_applies(num_heads, kv_cache.dtype):
    raise NotImplementedError(f"mla_decode tuning.narrow=True takes at most {kernel.NARROW_MAX_HEADS} query "
                              f"heads with a bf16 kv_cache and {kernel.FP8_NARROW_MAX_HEADS} with an fp8 one, got "
                              f"q_abs with {num_heads} and a {jnp.dtype(kv_cache.dtype).name} kv_cache")
  if fp8_in_registers and not registers_apply:
    raise NotImplementedError(f"mla_decode tuning.fp8_in_registers=True needs the narrow kernel over an fp8 "
                              f"kv_cache, got narrow={narrow} and a {jnp.dtype(kv_cache.dtype).name} kv_cache")
  return _mla_decode(q_abs, kv_cache, block_table, seq_lens, scale=config.scale,
                     num_splits=effective_num_splits(max_pages, num_splits), partial_dtype=config.partial_dtype,
                     narrow=narrow, balanced=balanced, fp8_in_registers=fp8_in_registers, impl=config.impl,
                     out_dtype=out_dtype)


def merge_partials(o_parts: jax.Array, lse_parts: jax.Array, *,
                   out_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """Log-sum-exp merge of ``S`` normalised partials.

  A part with LSE ``-inf`` is empty (no tokens) and contributes nothing, whatever its ``o`` holds. A NaN or
  ``+inf`` LSE comes from a non-finite input (a NaN or inf in q or in a token's cache row) and makes the
  merged row NaN: it is never mistaken for an empty part. All arithmetic is f32 and the output is rounded
  once, at the end.

  Args:
    o_parts: ``[S, ..., Dc]`` normalised partial outputs (f32/bf16/f16).
    lse_parts: ``[S, ...]`` f32 natural-log LSE; an empty part is ``(0, -inf)``.
    out_dtype: dtype of the merged output.

  Returns:
    ``o [..., Dc]`` in ``out_dtype`` and ``lse [...]`` f32; an all-empty row gives ``(0, -inf)``.
  """
  util.check_dtype("o_parts", o_parts, util.FLOAT_DTYPES)
  util.check_dtype("lse_parts", lse_parts, (jnp.float32,))
  out_dtype = util.canonical_dtype("out_dtype", out_dtype, util.FLOAT_DTYPES)
  if o_parts.ndim < 2:
    raise ValueError(f"o_parts must have shape (S, ..., Dc), got {tuple(o_parts.shape)}")
  util.check_shape("lse_parts", lse_parts, tuple(o_parts.shape[:-1]))
  if o_parts.shape[0] < 1:
    raise ValueError(f"o_parts must hold at least one part (S >= 1), got shape {tuple(o_parts.shape)}")
  # The parts are combined by elementwise ops over a static unroll of S, not by reductions over axis 0: XLA then
  # builds o in one loop fusion and the LSE in another, where the max, the sum and the weighted sum as
  # reductions were three kernels beside the decode kernel.
  parts = range(o_parts.shape[0])
  # maximum propagates NaN; a +inf part gives exp(inf - inf) = NaN below. Only the all-empty row needs a finite
  # shift, and it keeps total = 0, hence lse = log(0) = -inf.
  top = functools.reduce(jnp.maximum, [lse_parts[s] for s in parts])
  top = jnp.where(top == -jnp.inf, 0.0, top)
  e = [jnp.exp(lse_parts[s] - top) for s in parts]
  total = functools.reduce(jnp.add, e)
  denom = jnp.where(total == 0, 1.0, total)
  # A zero weight (an empty part, or one underflowed next to the others) must drop its o even if that is
  # NaN (the o of an empty part is not defined); a NaN weight must not, so no `weight > 0` here.
  weights = [(e[s] / denom)[..., None] for s in parts]
  o = functools.reduce(jnp.add, [jnp.where(w == 0, 0.0, w * o_parts[s].astype(jnp.float32))
                                 for s, w in zip(parts, weights)])
  return o.astype(out_dtype), top + jnp.log(total)
