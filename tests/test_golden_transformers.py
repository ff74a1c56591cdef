"""Golden test against transformers itself: ``load_hf`` + ``k3jax.prefill`` reproduce the logits of
transformers' own ``KimiLinearForCausalLM`` on a checkpoint transformers saved.

The fixture ``tests/data/kimi_linear_tiny`` (made once by its ``make_fixture.py``, whose docstring and
``provenance.json`` say how: torch + transformers on CPU, float32, the torch reference KDA) holds a tiny random
model (KDA / MLA / KDA / MLA, dense layer 0, MoE layers 1-3) in the transformers naming, and ``expected.npz``
with the prompt tokens and transformers' float32 logits. The fixture is committed together with this test, so a
missing fixture fails (it is never skipped).

Metric: per prompt, ``max |k3jax - transformers| / max |transformers|`` (the largest logit error relative to the
largest logit) must be <= 1e-4. Both sides are float32 with different op orders (chunked vs packed KDA, eager vs
absorbed MLA, dense vs grouped experts); their rounding differences are ~1e-6 of the logit scale, while a wrong
layout, eps, scale, gate or routing moves logits by O(1e-2) or more.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

import k3jax
from k3jax import checkpoint as ck
from k3jax.config import K3Config

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "kimi_linear_tiny")
F32 = dict(dtype=jnp.float32, param_dtype=jnp.float32, cache_dtype=jnp.float32, conv_dtype=jnp.float32,
           state_dtype=jnp.float32, partial_dtype=jnp.float32, impl="xla")
MAX_REL_ERR = 1e-4


def _require_fixture() -> None:
  for name in ("config.json", "expected.npz"):
    assert os.path.isfile(os.path.join(FIXTURE, name)), (
        f"missing golden fixture file {os.path.join(FIXTURE, name)}: run "
        f"'CUDA_VISIBLE_DEVICES=\"\" python tests/data/kimi_linear_tiny/make_fixture.py tests/data/kimi_linear_tiny' "
        f"on a machine with torch and transformers, and commit its outputs")


def _tensor_shapes() -> dict[str, tuple[int, ...]]:
  """Every tensor of the fixture checkpoint (one ``model.safetensors`` or an index plus shards), by name."""
  index = os.path.join(FIXTURE, ck.INDEX_FILE)
  if os.path.isfile(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = [ck.SINGLE_FILE]
  out = {}
  for fname in files:
    with safe_open(os.path.join(FIXTURE, fname), framework="numpy") as h:
      out.update({n: tuple(h.get_slice(n).get_shape()) for n in h.keys()})
  return out


def test_fixture_is_transformers_saved():
  _require_fixture()
  with open(os.path.join(FIXTURE, "config.json")) as f:
    raw = json.load(f)
  assert raw["model_type"] == "kimi_linear"
  assert "transformers_version" in raw, "config.json was not written by transformers"
  cfg = K3Config.from_hf(raw)
  assert cfg.layer_types == ("kda", "mla", "kda", "mla") and cfg.first_k_dense_replace == 1
  shapes = _tensor_shapes()
  # transformers saves the dense MLP of layer 0 under block_sparse_moe (it renames every .mlp.).
  assert "model.layers.0.block_sparse_moe.gate_proj.weight" in shapes
  assert not any(".mlp." in n for n in shapes)
  # Exactly the tensors (names and shapes) of the transformers naming: nothing missing, nothing extra.
  assert shapes == ck.hf_tensor_names(cfg, "kimi_linear", naming="transformers")


def test_logits_match_transformers():
  _require_fixture()
  expected = np.load(os.path.join(FIXTURE, "expected.npz"))
  n_seq = int(expected["num_sequences"])
  tokens = [expected[f"tokens_{n}"].astype(np.int32) for n in range(n_seq)]
  want = [expected[f"logits_{n}"] for n in range(n_seq)]
  run_cfg = K3Config.from_hf(FIXTURE, **F32)
  cfg, model = ck.load_hf(FIXTURE, config=run_cfg, progress=False)
  assert cfg == run_cfg
  lens = [len(t) for t in tokens]
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  cache = k3jax.init_cache(run_cfg, n_seq, max(lens), fill=np.nan)
  logits, _ = k3jax.prefill(model, jnp.asarray(np.concatenate(tokens)), jnp.asarray(cu), cache)
  got = np.asarray(logits)
  assert got.shape == (sum(lens), cfg.vocab_size) and got.dtype == np.float32
  errors = []
  for n in range(n_seq):
    ref = want[n].astype(np.float64)
    assert ref.shape == (lens[n], cfg.vocab_size) and np.abs(ref).max() > 1.0  # non-degenerate logits
    out = got[cu[n]:cu[n + 1]].astype(np.float64)
    assert np.isfinite(out).all(), f"prompt {n}: non-finite logits"
    errors.append(float(np.abs(out - ref).max() / np.abs(ref).max()))
  assert max(errors) <= MAX_REL_ERR, f"relative logit errors per prompt {errors} exceed {MAX_REL_ERR}"
