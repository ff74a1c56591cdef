"""k3jax: a Kimi-K3 style hybrid (KDA + MLA + latent MoE) transformer in Flax NNX."""
