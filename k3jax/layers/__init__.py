"""NNX modules of one Kimi-K3 decoder layer: norms, KDA, MLA, dense MLP / latent MoE, attention residuals."""
