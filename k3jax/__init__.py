"""k3jax: a Kimi-K3 style hybrid (KDA + MLA + latent MoE) transformer in Flax NNX.

``K3Config`` (``from_hf``, ``preset``) describes the model, ``KimiK3Model`` holds the parameters,
``init_cache`` builds the KDA state pool and the paged MLA latent cache, and the jitted ``prefill`` /
``decode`` run a packed varlen prefill and one decode step with the cache donated (``jit_model_step`` gives
the same step as an object, on one device or on a mesh); ``verify`` scores 1 + S speculative tokens per sequence
and ``accept`` keeps the accepted ones.
"""

from k3jax.cache import KdaState, ModelCache, SlotAllocator, accept, init_cache
from k3jax.config import K3Config, preset
from k3jax.model import DecoderLayer, KimiK3Model
from k3jax.steps import ModelStep, decode, jit_model_step, prefill, verify

__all__ = ["DecoderLayer", "K3Config", "KdaState", "KimiK3Model", "ModelCache", "ModelStep", "SlotAllocator",
           "accept", "decode", "init_cache", "jit_model_step", "prefill", "preset", "verify"]
