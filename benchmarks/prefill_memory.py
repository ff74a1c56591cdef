"""Working memory of a long MLA prefill, from XLA's buffer assignment (compiled, not run; any backend).

Prints the temporary bytes (``compile().memory_analysis().temp_size_in_bytes``) of
  * ``op``: ``pallas_kernels.mla_prefill_attention`` (bf16, ``impl="xla"``) at T tokens and H heads, and
  * ``layer``: one Kimi-K3 ``MlaLayer.prefill`` (96 heads, one device, bf16, impl xla) of T tokens into a cache
    of T tokens: the prefill attention, the cached-prefix part and the merge.
A dense ``[H, T, T]`` f32 score array would be ``4 H T^2`` bytes; this shows what replaced it.

Usage: ``PYTHONPATH=. python3 benchmarks/prefill_memory.py --what op layer --tokens 16384 32768 [--heads 11]``
"""

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import config as cfg_lib
from k3jax.layers.mla import MlaLayer


def op_temp_bytes(t: int, h: int) -> int:
  """Temporary bytes of the MLA prefill op at ``T = t``, ``H = h`` (q/k 192 = 128 + 64, v 128)."""
  from pallas_kernels import MlaPrefillConfig, mla_prefill_attention

  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  args = (spec(t, h, 192), spec(t, h, 128), spec(t, 64), spec(t, h, 128), jax.ShapeDtypeStruct((2,), jnp.int32))
  fn = lambda q, k_nope, k_rope, v, cu: mla_prefill_attention(q, k_nope, k_rope, v, cu_seqlens=cu,
                                                                config=MlaPrefillConfig(impl="xla"))
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def layer_temp_bytes(t: int) -> int:
  """Temporary bytes of one K3 ``MlaLayer.prefill`` of ``t`` tokens into a cache of ``t`` tokens."""
  cfg = cfg_lib.preset("kimi_k3", impl="xla", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                       cache_dtype=jnp.bfloat16)
  graph, state = nnx.split(nnx.eval_shape(lambda: MlaLayer(cfg, rngs=nnx.Rngs(0))))
  spec = jax.ShapeDtypeStruct
  pages = t // 64
  args = (state, spec((t, cfg.hidden_size), jnp.bfloat16),
          spec((pages, 64, cfg.kv_lora_rank + cfg.qk_rope_head_dim), jnp.bfloat16), spec((t,), jnp.int32),
          spec((t,), jnp.int32), spec((1, pages), jnp.int32), spec((1,), jnp.int32))

  def prefill(state, x, kv, seq, pos, table, prefix):
    # A fresh prefill: no cached prefix to read back.
    return nnx.merge(graph, state).prefill(x, kv, seq=seq, pos=pos, block_table=table, prefix_lens=prefix,
                                           prefix_rows=0)

  return jax.jit(prefill).lower(*args).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--what", nargs="+", choices=("op", "layer"), default=["op", "layer"])
  parser.add_argument("--tokens", type=int, nargs="+", default=[32768])
  parser.add_argument("--heads", type=int, default=11, help="heads of the op (11: K3 on 9 devices)")
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
  for t in args.tokens:
    if "op" in args.what:
      print(f"op    T={t:6d} H={args.heads:3d}: temp {op_temp_bytes(t, args.heads) / 2**30:9.3f} GiB "
            f"(dense [H, T, T] f32 scores: {4 * args.heads * t * t / 2**30:.1f} GiB)", flush=True)
    if "layer" in args.what:
      print(f"layer T={t:6d} H= 96: temp {layer_temp_bytes(t) / 2**30:9.3f} GiB "
            f"(dense [H, T, T] f32 scores: {4 * 96 * t * t / 2**30:.1f} GiB)", flush=True)


if __name__ == "__main__":
  main()
