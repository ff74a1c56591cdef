"""The jitted model step, on one device or a mesh: ``jit_model_step``, ``prefill``/``decode``, the sharded cache.

One jitted prefill and one jitted decode serve both cases: ``jit_model_step(model)`` (no mesh) is the
one-device step that ``k3jax.prefill``/``decode`` call, and ``jit_model_step(model, mesh)`` the same step with
every parameter and cache sharded. Use on a mesh (``k3jax.checkpoint.load_hf(path, mesh=mesh)`` does the first
step while loading)::

  mesh = sharding.make_mesh(9)
  model, plan = sharding.shard_model(model, mesh)   # pad for 9 devices, place every parameter
  cache = init_mesh_cache(model.cfg, num_seqs, max_seq_len, mesh)
  step = jit_model_step(model, mesh, vocab_size=plan.real("vocab_size"))
  logits, cache = step.prefill(tokens, cu_seqlens, cache)
  logits, cache = step.decode(next_tokens, cache)
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import cache as cache_lib, model as model_lib, sharding
from k3jax.cache import Checkpoints, ModelCache
from pallas_kernels import util


def init_mesh_cache(cfg, num_seqs: int, max_seq_len: int, mesh: jax.sharding.Mesh, *, fill: float = 0.0,
                    num_slots: int | None = None, num_pages: int | None = None, idle: bool = False) -> ModelCache:
  """An empty sharded cache (born sharded) for ``cfg`` (already padded) on ``mesh``.

  KDA pools and conv pools are split by heads. Each MLA cache is a DCP cache (``k3jax.dcp``): every device
  has a local pool of ``num_seqs * pages_per_device(max_seq_len)`` pages, and the block table holds local
  page ids shared by all devices. ``state_indices``, ``block_table`` and ``seq_lens`` are replicated.

  Args:
    cfg: model config (``K3Config``; dims and cache dtypes). num_seqs: N.
    max_seq_len: tokens per sequence. mesh: the mesh. fill: initial value of every pool element.
    num_slots: KDA pool slots (default N). num_pages: local MLA pages per device (default N times the pages
      a sequence needs per device). idle: rows start idle, nothing allocated (``init_cache``'s ``idle``).
  """
  n = sharding.mesh_size(mesh)

  def build():
    local = cache_lib.init_cache(cfg, num_seqs, util.cdiv(max_seq_len, n), fill=fill, num_slots=num_slots,
                                 num_pages=num_pages, idle=idle)
    mla = tuple(jnp.full((n * x.shape[0],) + x.shape[1:], fill, x.dtype) for x in local.mla)
    return local.replace(mla=mla)

  with jax.set_mesh(mesh):
    return jax.jit(build, out_shardings=sharding.tree_shardings(mesh, sharding.cache_specs(cfg)))()


@dataclasses.dataclass(frozen=True)
class ModelStep:
  """Jitted ``prefill`` / ``decode`` of a model, on one device (``mesh`` None) or placed on a mesh.

  Both take and return a cache (from ``k3jax.init_cache`` on one device, ``init_mesh_cache`` on a mesh;
  donated: pass the returned one on) and return f32 logits over the real vocabulary (replicated on a mesh).
  They check the index values of their concrete arguments on the host
  (``k3jax.model.check_prefill_inputs``/``check_decode_inputs``, the capacity counted on this mesh) before the
  jitted step: a rejected call raises ``ValueError`` and donates nothing. A caller who runs
  ``KimiK3Model.prefill`` under a jit of their own gets shape and dtype checks only, since traced values cannot
  be read: an id outside ``[0, vocab)`` then embeds as another token (negative ids wrap, large ones clamp), a
  malformed ``cu_seqlens`` mixes or drops tokens, and tokens past the capacity overwrite other latent rows of
  the cache. Such a caller runs the two checks on the host first.
  """

  mesh: jax.sharding.Mesh | None
  state: nnx.State
  prefill_jit: Callable
  decode_jit: Callable
  verify_jit: Callable
  copy_jit: Callable
  vocab_size: int

  def _context(self):
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def prefill(self, tokens: jax.Array, cu_seqlens: jax.Array, cache: ModelCache, *, last_only: bool = False,
              checkpoints: Checkpoints | None = None) -> tuple[jax.Array, ModelCache]:
    """``KimiK3Model.prefill`` (``tokens [T]`` int32, ``cu_seqlens [N + 1]`` int32, optional ``Checkpoints``)
    -> ``(logits [T, vocab]`` f32, or ``[N, vocab]`` with ``last_only``, ``cache)``."""
    with self._context():
      self.check_prefill(tokens, cu_seqlens, cache, checkpoints=checkpoints)
      if tokens.shape[0] == 0:  # every L_n is 0: nothing changes (as KimiK3Model.prefill)
        return model_lib.empty_prefill_logits(cu_seqlens.shape[0] - 1, self.vocab_size, last_only), cache
      # The MLA layers' bound on cached rows to read back, from the host's values (static: one compile each).
      rows = model_lib.needed_prefix_rows(cu_seqlens, cache.seq_lens)
      return self.prefill_jit(self.state, tokens, cu_seqlens, cache, last_only, checkpoints, rows)

  def check_prefill(self, tokens: jax.Array, cu_seqlens: jax.Array, cache: ModelCache, *,
                    checkpoints: Checkpoints | None = None) -> None:
    """The host checks ``prefill`` runs first (``check_prefill_inputs``, the capacity counted on this mesh)."""
    with self._context():
      model_lib.check_prefill_inputs(tokens, cu_seqlens, cache, vocab_size=self.vocab_size,
                                     checkpoints=checkpoints)

  @property
  def num_devices(self) -> int:
    """Devices of the mesh (1 without one): the DCP split of the MLA cache."""
    return 1 if self.mesh is None else sharding.mesh_size(self.mesh)

  def copy_slots(self, cache: ModelCache, src: jax.Array, dst: jax.Array) -> ModelCache:
    """``k3jax.cache.copy_slots`` (every KDA layer's states of slots ``src`` into ``dst``), jitted with the
    cache donated, after ``check_copy_slots`` on the host."""
    with self._context():
      cache_lib.check_copy_slots(cache, src, dst)
      return self.copy_jit(cache, src, dst)

  def decode(self, tokens: jax.Array, cache: ModelCache) -> tuple[jax.Array, ModelCache]:
    """``KimiK3Model.decode`` (``tokens [N]`` int32) -> ``(logits [N, vocab]`` f32, ``cache)``."""
    with self._context():
      model_lib.check_decode_inputs(tokens, cache, vocab_size=self.vocab_size)
      return self.decode_jit(self.state, tokens, cache)

  def verify(self, tokens: jax.Array, cache: ModelCache, draft_slots: jax.Array) -> tuple[jax.Array, ModelCache]:
    """``KimiK3Model.verify`` (``tokens [N, 1 + S]`` int32, ``draft_slots [N, S]`` int32) -> ``(logits [N, 1 + S,
    vocab]`` f32, ``cache)``; follow it with ``k3jax.cache.accept``."""
    with self._context():
      model_lib.check_decode_inputs(tokens, cache, vocab_size=self.vocab_size, draft_slots=draft_slots)
      return self.verify_jit(self.state, tokens, cache, draft_slots)

  def lowered(self, kind: str, *args) -> jax.stages.Lowered:
    """``prefill`` (args ``tokens, cu_seqlens, cache[, last_only[, checkpoints[, prefix_rows]]]``), ``decode``
    (args ``tokens, cache``) or ``verify`` (args ``tokens, cache, draft_slots``) lowered for these arguments, no
    host checks (for compiled HLO and memory analyses). ``prefix_rows`` defaults to 0: a fresh prefill."""
    if kind == "prefill":  # the jit's shardings name every argument: the defaults are passed explicitly
      args = args + (False, None, 0)[len(args) - 3:]
    fn = {"prefill": self.prefill_jit, "decode": self.decode_jit, "verify": self.verify_jit}[kind]
    with self._context():
      return fn.lower(self.state, *args)

  def compiled_text(self, kind: str, *args) -> str:
    """Compiled HLO of ``lowered(kind, *args)`` (for inspecting collectives)."""
    with self._context():
      return self.lowered(kind, *args).compile().as_text()


def _jit_steps(graphdef: nnx.GraphDef, vocab: int, shardings: tuple | None,
               compiler_options: tuple[tuple[str, str | bool | int | float], ...] | None
               ) -> tuple[Callable, Callable, Callable, Callable]:
  """The jitted ``(prefill, decode, verify, copy_slots)`` of a model's graph: ``shardings`` is ``(params, caches,
  whole)`` on a mesh and None on one device (the arguments' own placement)."""

  def prefill(state, tokens, cu_seqlens, cache, last_only=False, checkpoints=None, prefix_rows=None):
    logits, cache = nnx.merge(graphdef, state).prefill(tokens, cu_seqlens, cache, last_only=last_only,
                                                       checkpoints=checkpoints, prefix_rows=prefix_rows)
    return logits[:, :vocab], cache

  def decode(state, tokens, cache):
    logits, cache = nnx.merge(graphdef, state).decode(tokens, cache)
    return logits[:, :vocab], cache

  def verify(state, tokens, cache, draft_slots):
    logits, cache = nnx.merge(graphdef, state).verify(tokens, cache, draft_slots)
    return logits[..., :vocab], cache

  options = None if compiler_options is None else dict(compiler_options)
  if shardings is None:
    return (jax.jit(prefill, donate_argnums=3, static_argnums=(4, 6), compiler_options=options),
            jax.jit(decode, donate_argnums=2, compiler_options=options),
            jax.jit(verify, donate_argnums=2, compiler_options=options),
            jax.jit(cache_lib.copy_slots, donate_argnums=0))
  params, caches, whole = shardings
  return (jax.jit(prefill, in_shardings=(params, whole, whole, caches, whole), out_shardings=(whole, caches),
                  donate_argnums=3, static_argnums=(4, 6), compiler_options=options),
          jax.jit(decode, in_shardings=(params, whole, caches), out_shardings=(whole, caches), donate_argnums=2,
                  compiler_options=options),
          jax.jit(verify, in_shardings=(params, whole, caches, whole), out_shardings=(whole, caches),
                  donate_argnums=2, compiler_options=options),
          jax.jit(cache_lib.copy_slots, in_shardings=(caches, whole, whole), out_shardings=caches,
                  donate_argnums=0))


@functools.lru_cache(maxsize=16)
def _one_device_steps(graphdef: nnx.GraphDef, vocab: int) -> tuple[Callable, Callable, Callable, Callable]:
  """``_jit_steps`` on one device, built once per model graph: ``k3jax.prefill(model, ...)`` called again with
  the same model (or one of the same structure) reuses its jitted functions and their compilations."""
  return _jit_steps(graphdef, vocab, None, None)


def jit_model_step(model: nnx.Module, mesh: jax.sharding.Mesh | None = None, *, vocab_size: int | None = None,
                   compiler_options: dict[str, str | bool | int | float] | None = None) -> ModelStep:
  """The jitted step of a model, on one device (``mesh`` None) or on the mesh ``shard_model`` placed it on.

  On a mesh, parameters keep their ``param_specs`` shardings, caches their ``cache_specs`` shardings
  (donated), and every op runs on the ambient mesh: KDA ops per head group, MLA decode with DCP.

  Args:
    model: a ``KimiK3Model`` (from ``shard_model``, padded for the mesh, when ``mesh`` is given).
    mesh: the mesh it was placed on, or None for one device.
    vocab_size: the real vocabulary (logits past it, from padded rows, are dropped); default the model's.
    compiler_options: XLA options for both compiles (``jax.jit``'s), e.g.
      ``{"xla_backend_optimization_level": 0}``: CPU compiles several times faster, the same ops.
  """
  vocab = model.cfg.vocab_size if vocab_size is None else vocab_size
  graphdef, state = nnx.split(model)
  if mesh is None and compiler_options is None:
    steps = _one_device_steps(graphdef, vocab)
  else:
    shardings = None if mesh is None else (sharding.tree_shardings(mesh, sharding.param_specs(model)),
                                           sharding.tree_shardings(mesh, sharding.cache_specs(model.cfg)),
                                           NamedSharding(mesh, P()))
    options = None if compiler_options is None else tuple(sorted(compiler_options.items()))
    steps = _jit_steps(graphdef, vocab, shardings, options)
  return ModelStep(mesh=mesh, state=state, prefill_jit=steps[0], decode_jit=steps[1], verify_jit=steps[2],
                   copy_jit=steps[3], vocab_size=vocab)


def prefill(model: nnx.Module, tokens: jax.Array, cu_seqlens: jax.Array, cache: ModelCache, *,
            last_only: bool = False, checkpoints: Checkpoints | None = None) -> tuple[jax.Array, ModelCache]:
  """``model.prefill`` on one device, jitted with the cache donated, after a host check of the values.

  ``jit_model_step(model).prefill(...)``: see ``ModelStep`` for the checks.

  Args:
    model: a ``KimiK3Model``. tokens: ``[T]`` int32. cu_seqlens: ``[N + 1]`` int32. cache: ``ModelCache`` from
      ``k3jax.init_cache`` (donated). last_only: only each sequence's last new token's logits.
    checkpoints: ``Checkpoints`` (KDA states saved at given offsets into given slots) or None.

  Returns:
    ``logits [T, vocab]`` (``[N, vocab]`` with ``last_only``) f32 and the updated cache, as
    ``KimiK3Model.prefill``.
  """
  return jit_model_step(model).prefill(tokens, cu_seqlens, cache, last_only=last_only, checkpoints=checkpoints)


def decode(model: nnx.Module, tokens: jax.Array, cache: ModelCache) -> tuple[jax.Array, ModelCache]:
  """``model.decode`` on one device, jitted with the cache donated, after a host check of the values.

  ``jit_model_step(model).decode(...)``: see ``ModelStep`` for the checks.

  Args:
    model: a ``KimiK3Model``. tokens: ``[N]`` int32. cache: ``ModelCache`` (donated).

  Returns:
    ``logits [N, vocab]`` f32 and the updated cache, as ``KimiK3Model.decode``.
  """
  return jit_model_step(model).decode(tokens, cache)


def verify(model: nnx.Module, tokens: jax.Array, cache: ModelCache,
           draft_slots: jax.Array) -> tuple[jax.Array, ModelCache]:
  """``model.verify`` on one device, jitted with the cache donated, after a host check of the values.

  Args:
    model: a ``KimiK3Model``. tokens: ``[N, 1 + S]`` int32 (the last sampled token, then S drafts).
    cache: ``ModelCache`` (donated). draft_slots: ``[N, S]`` int32 pool slots for the drafts' states.

  Returns:
    ``logits [N, 1 + S, vocab]`` f32 and the updated cache, as ``KimiK3Model.verify``; ``k3jax.accept`` then
    keeps the accepted tokens.
  """
  return jit_model_step(model).verify(tokens, cache, draft_slots)


_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = \(?([a-z0-9]+)\[([0-9,]*)\][^\n]*? "
                         r"(all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute)(?:-start)?\(",
                         re.MULTILINE)


def collectives(hlo_text: str) -> list[tuple[str, str, tuple[int, ...]]]:
  """``(op, dtype, per-device result shape)`` of every collective in compiled HLO text (first tuple element).

  For inspecting what a sharded step communicates (tests and the demo), e.g.
  ``collectives(jax.jit(f).lower(*args).compile().as_text())``.
  """
  return [(op, dtype, tuple(int(d) for d in dims.split(",") if d))
          for dtype, dims, op in _COLLECTIVE.findall(hlo_text)]
