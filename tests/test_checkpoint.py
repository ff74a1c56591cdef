"""HF checkpoint import: round trips of both formats, MXFP4 == bf16 bit for bit, logits of a loaded model
against a float64 NumPy forward of the HF math written here (straight from the safetensors names), sharded
load == unsharded load padded by ``shard_model``, and every error of the loader and the writer.
"""

import io
import json
import os
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from support import device_mesh, fast_jit

import k3jax
from k3jax import checkpoint as ck
from k3jax import config as cfg_lib
from k3jax import progress, sharding, testing

F32 = dict(dtype=jnp.float32, param_dtype=jnp.float32, cache_dtype=jnp.float32, conv_dtype=jnp.float32,
           state_dtype=jnp.float32, partial_dtype=jnp.float32, impl="xla")
# K3 format: every K3 switch on; the latent expert width 64 is a multiple of the MXFP4 group (32).
K3 = cfg_lib.preset("tiny", routed_expert_hidden_size=64)
LINEAR = cfg_lib.preset("tiny_linear")
CONFIGS = {"kimi_k3": K3, "kimi_linear": LINEAR}


def _flat(model) -> dict:
  return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


def _read_all(path) -> dict[str, np.ndarray]:
  """Every tensor of a checkpoint directory, by HF name."""
  with open(os.path.join(path, ck.INDEX_FILE)) as f:
    files = sorted(set(json.load(f)["weight_map"].values()))
  out = {}
  for fname in files:
    with safe_open(os.path.join(path, fname), framework="numpy") as h:
      out.update({n: h.get_tensor(n) for n in h.keys()})
  return out


def _rewrite(path, edit) -> None:
  """Applies ``edit(tensors)`` (in place on the name -> array dict) and rewrites shards and index.

  Tensors keep their shard; new ones go to the first shard.
  """
  with open(os.path.join(path, ck.INDEX_FILE)) as f:
    index = json.load(f)
  weight_map = index["weight_map"]
  tensors = _read_all(path)
  edit(tensors)
  files = sorted(set(weight_map.values()))
  new_map = {n: weight_map.get(n, files[0]) for n in tensors}
  for fname in files:
    save_file({n: np.ascontiguousarray(a) for n, a in tensors.items() if new_map[n] == fname},
              os.path.join(path, fname))
  index["weight_map"] = new_map
  with open(os.path.join(path, ck.INDEX_FILE), "w") as f:
    json.dump(index, f)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """One checkpoint per (format, mxfp4), written once; tests copy before editing."""
  root = tmp_path_factory.mktemp("hf")
  out = {}
  for fmt, mxfp4 in (("kimi_linear", False), ("kimi_k3", False), ("kimi_k3", True)):
    out[fmt, mxfp4] = testing.write_tiny_hf(root / f"{fmt}_{mxfp4}", CONFIGS[fmt], seed=3, fmt=fmt, mxfp4=mxfp4)
  return out


def _copy(written, key, tmp_path) -> str:
  dst = tmp_path / "ckpt"
  shutil.copytree(written[key], dst)
  return str(dst)


# ---------------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("fmt", ["kimi_linear", "kimi_k3"])
def test_round_trip(written, fmt):
  path = written[fmt, False]
  cfg = CONFIGS[fmt]
  names = sorted(os.listdir(path))
  shards = [n for n in names if n.endswith(".safetensors")]
  assert len(shards) >= 2 and "config.json" in names and ck.INDEX_FILE in names
  with open(os.path.join(path, "config.json")) as f:
    raw = json.load(f)
  if fmt == "kimi_k3":
    assert raw["model_type"] == "kimi_k3" and raw["text_config"]["model_type"] == "kimi_linear"
    lac = raw["text_config"]["linear_attn_config"]
  else:
    assert raw["model_type"] == "kimi_linear" and "text_config" not in raw
    lac = raw["linear_attn_config"]
  assert lac["full_attn_layers"] == [i + 1 for i, t in enumerate(cfg.layer_types) if t == "mla"]  # 1-indexed

  w = _read_all(path)
  pre = "language_model." if fmt == "kimi_k3" else ""
  text = {n[len(pre):]: a for n, a in w.items() if n.startswith(pre)}
  vision = sorted(n for n in w if not n.startswith(pre))
  assert bool(vision) == (fmt == "kimi_k3")
  assert set(text) == set(ck.hf_tensor_names(cfg, "kimi_linear"))  # same text names, prefix aside

  loaded_cfg, model = ck.load_hf(path, progress=False)
  assert loaded_cfg == cfg
  p = _flat(model)
  h, k, d = cfg.kda_num_heads, cfg.kda_head_dim, cfg.hidden_size
  hq, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
  f64 = lambda a: np.asarray(a, np.float64)
  # Model dtypes: router, A_log, dt_bias, convs and o_norm f32; the rest param_dtype (bf16).
  for name, a in p.items():
    f32 = name.endswith(("A_log", "dt_bias", "gate.kernel", "e_score_correction_bias", "conv1d.weight",
                         "o_norm.weight"))
    assert a.dtype == (jnp.float32 if f32 else jnp.bfloat16), name
    assert np.isfinite(f64(a)).all(), name
  kda, mla, moe = "layers.0.self_attn.", "layers.2.self_attn.", "layers.1.block_sparse_moe."
  t = lambda n: f64(text["model." + n])
  # Each layout written out by index: Linear [out, in] -> [in, out] and the head split.
  np.testing.assert_array_equal(f64(p[kda + "q_proj.kernel"]), t("layers.0.self_attn.q_proj.weight").T.reshape(d, h, k))
  np.testing.assert_array_equal(f64(p[kda + "o_proj.kernel"]),
                                t("layers.0.self_attn.o_proj.weight").reshape(d, h, k).transpose(1, 2, 0))
  np.testing.assert_array_equal(f64(p[kda + "f_b_proj.kernel"])[3, 2, 5],
                                t("layers.0.self_attn.f_b_proj.weight")[2 * k + 5, 3])
  np.testing.assert_array_equal(f64(p[kda + "k_conv1d.weight"])[1, 7, :],
                                t("layers.0.self_attn.k_conv1d.weight")[k + 7, 0, :])
  np.testing.assert_array_equal(f64(p[kda + "dt_bias"])[2, 3], t("layers.0.self_attn.dt_bias")[2 * k + 3])
  a_log = t("layers.0.self_attn.A_log")
  assert a_log.shape == ((k,) if fmt == "kimi_k3" else (1, 1, h, 1))
  np.testing.assert_array_equal(f64(p[kda + "A_log"]), a_log.reshape(-1)[:h])
  if fmt == "kimi_k3":
    assert (a_log[h:] == 0).all()
  kv_b = t("layers.2.self_attn.kv_b_proj.weight")  # [H*(dn+dv), R]
  assert kv_b.shape == (hq * (dn + dv), r)
  np.testing.assert_array_equal(f64(p[mla + "kv_b_proj.w_uk"])[11, 2, 3], kv_b[2 * (dn + dv) + 3, 11])
  np.testing.assert_array_equal(f64(p[mla + "kv_b_proj.w_uv"])[11, 2, 3], kv_b[2 * (dn + dv) + dn + 3, 11])
  np.testing.assert_array_equal(f64(p[mla + "o_proj.kernel"])[1, 4, 9],
                                t("layers.2.self_attn.o_proj.weight")[9, dv + 4])
  for e in (0, cfg.num_experts - 1):
    for wn in ("w1", "w2", "w3"):
      np.testing.assert_array_equal(f64(p[moe + f"experts.{wn}"])[e],
                                    t(f"layers.1.block_sparse_moe.experts.{e}.{wn}.weight").T)
  np.testing.assert_array_equal(f64(p[moe + "gate.kernel"]), t("layers.1.block_sparse_moe.gate.weight").T)
  np.testing.assert_array_equal(f64(p["embed_tokens"]), t("embed_tokens.weight"))
  np.testing.assert_array_equal(f64(p["lm_head.kernel"]), f64(text["lm_head.weight"]).T)
  # Norm weights are 1 + N(0, 0.05): never all ones.
  norm = t("layers.0.input_layernorm.weight")
  assert 0.005 < norm.std() < 0.1 and abs(norm.mean() - 1) < 0.05


@pytest.fixture(scope="module")
def transformers_written(tmp_path_factory):
  """The kimi_linear checkpoint of ``written`` (seed 3) as transformers saves it; tests copy before editing."""
  return testing.write_tiny_hf(tmp_path_factory.mktemp("hf_tf"), LINEAR, seed=3, naming="transformers")


DENSE_TF = "model.layers.0.block_sparse_moe."  # transformers' name of layer 0's dense MLP (``model.layers.0.mlp.``)


def test_transformers_naming_loads_bitwise_equal(written, transformers_written):
  """A checkpoint saved by transformers (renamed dense MLP, derived config keys) loads to the same parameters."""
  path = transformers_written
  names = set(_read_all(path))
  assert names == set(ck.hf_tensor_names(LINEAR, "kimi_linear", naming="transformers"))
  assert {DENSE_TF + f"{n}_proj.weight" for n in ("gate", "up", "down")} <= names
  assert not any(".mlp." in n for n in names)
  assert names - set(ck.hf_tensor_names(LINEAR, "kimi_linear")) == {
      DENSE_TF + f"{n}_proj.weight" for n in ("gate", "up", "down")}
  with open(os.path.join(path, "config.json")) as f:
    raw = json.load(f)
  assert {k: raw[k] for k in cfg_lib.TRANSFORMERS_KEYS} == LINEAR.transformers_keys()
  assert raw["layer_types"][2] == "full_attention" and raw["mlp_layer_types"][:2] == ["dense", "sparse"]
  cfg, model = ck.load_hf(path, progress=False)
  assert cfg == LINEAR
  a, b = _flat(model), _flat(ck.load_hf(written["kimi_linear", False], progress=False)[1])
  assert set(a) == set(b)
  for name in b:
    x, y = np.asarray(a[name]), np.asarray(b[name])
    assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name


def test_error_one_tensor_under_both_namings(transformers_written, tmp_path):
  path = str(tmp_path / "ckpt")
  shutil.copytree(transformers_written, path)
  _rewrite(path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": t[DENSE_TF + "up_proj.weight"]}))
  _load_error(path, re.escape(f"holds one parameter twice: as 'model.layers.0.mlp.up_proj.weight' (original "
                              f"naming) and as '{DENSE_TF}up_proj.weight' (transformers naming)"))


def test_error_mixed_namings(transformers_written, tmp_path):
  path = str(tmp_path / "ckpt")
  shutil.copytree(transformers_written, path)
  _rewrite(path, lambda t: t.update({"model.layers.0.mlp.down_proj.weight": t.pop(DENSE_TF + "down_proj.weight")}))
  _load_error(path, re.escape("mixes the original naming (1 tensors, e.g. 'model.layers.0.mlp.down_proj.weight') "
                              f"with the transformers naming (2 tensors, e.g. '{DENSE_TF}gate_proj.weight')"))


def test_error_missing_tensor_in_transformers_naming(transformers_written, tmp_path):
  """A missing tensor is named as the checkpoint's own naming spells it."""
  path = str(tmp_path / "ckpt")
  shutil.copytree(transformers_written, path)
  _rewrite(path, lambda t: t.pop(DENSE_TF + "gate_proj.weight"))
  _load_error(path, re.escape(f"missing 1 tensors the kimi_linear config needs: {DENSE_TF}gate_proj.weight [96, 64]"))


def test_error_transformers_config_contradicts_primary_keys(transformers_written, tmp_path):
  path = str(tmp_path / "ckpt")
  shutil.copytree(transformers_written, path)
  with open(os.path.join(path, "config.json")) as f:
    raw = json.load(f)
  raw["linear_num_heads"] = 8
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(raw, f)
  _load_error(path, re.escape("linear_num_heads=8 contradicts linear_attn_config.num_heads=4"))


def test_single_file_checkpoint(written, tmp_path):
  path = _copy(written, ("kimi_linear", False), tmp_path)
  tensors = _read_all(path)
  for f in os.listdir(path):
    if f.endswith(".safetensors") or f == ck.INDEX_FILE:
      os.remove(os.path.join(path, f))
  save_file(tensors, os.path.join(path, ck.SINGLE_FILE))
  a = _flat(ck.load_hf(path, progress=False)[1])
  b = _flat(ck.load_hf(written["kimi_linear", False], progress=False)[1])
  for name in b:
    np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


def test_tied_embeddings(tmp_path):
  cfg = LINEAR.replace(tie_word_embeddings=True)
  path = testing.write_tiny_hf(tmp_path, cfg, seed=1, num_shards=2)
  assert "lm_head.weight" not in _read_all(path)
  loaded, model = ck.load_hf(path, progress=False)
  assert loaded == cfg and not hasattr(model, "lm_head") and "lm_head.kernel" not in _flat(model)


def test_progress_lines_in_a_log(written, capsys, monkeypatch):
  """Captured stderr is not a terminal: every update of the bar is a line of its own, never ``\\r``-joined."""
  path = written["kimi_linear", False]
  n = len(_flat(nnx.eval_shape(lambda: k3jax.KimiK3Model(LINEAR, rngs=nnx.Rngs(0)))))
  t = len(ck.hf_tensor_names(LINEAR, "kimi_linear"))
  total = tqdm.format_sizeof(sum(a.nbytes for a in _read_all(path).values()), divisor=1024)
  ck.load_hf(path, progress=False)
  assert capsys.readouterr().err == ""
  monkeypatch.setattr(progress, "LOG_INTERVAL", 3600.0)
  ck.load_hf(path)  # a load shorter than the log interval shows its first and its last state
  first, last = capsys.readouterr().err.split("\n")[:-1]
  assert first.startswith("load_hf:   0%") and first.endswith(f"0/{n} parameters, 0/{t} tensors]")
  assert last.startswith("load_hf: 100%") and f"| {total}/{total} [" in last
  assert last.endswith(f"{n}/{n} parameters, {t}/{t} tensors]")
  monkeypatch.setattr(progress, "LOG_INTERVAL", 0.0)
  ck.load_hf(path)
  err = capsys.readouterr().err
  lines = err.splitlines()
  assert "\r" not in err and err.endswith("\n") and len(lines) > 3
  assert all(line.startswith("load_hf: ") and line.endswith(" tensors]") for line in lines), lines
  assert lines[-1].startswith("load_hf: 100%") and lines[-1].endswith(f"{n}/{n} parameters, {t}/{t} tensors]")


def test_progress_redraws_in_place_on_a_terminal(written, monkeypatch):
  """On a terminal the bar is tqdm's own: redrawn in place (``\\r``), one newline at the end."""

  class Terminal(io.StringIO):
    def isatty(self):
      return True
  monkeypatch.setattr(sys, "stderr", Terminal())
  ck.load_hf(written["kimi_linear", False])
  err = sys.stderr.getvalue()
  assert err.startswith("\rload_hf:") and err.count("\n") == 1 and err.endswith("\n")


# ---------------------------------------------------------------------------------------------- MXFP4
def test_mxfp4_dequantize_known_bytes():
  # Low nibble is element 2j, high nibble 2j+1; bit 3 is the sign; magnitudes 0 .5 1 1.5 2 3 4 6.
  codes = np.array([0x21, 0xF7, 0x8A, 0x53] * 8, np.uint8)[None, :]  # one row of 64 values, 2 groups
  scale = np.array([[127, 130]], np.uint8)  # 2^0 and 2^3
  got = ck.mxfp4_dequantize(codes, scale)
  assert got.dtype == np.float32 and got.shape == (1, 64)
  first = np.array([0.5, 1.0, 6.0, -6.0, -1.0, -0.0, 1.5, 3.0])
  np.testing.assert_array_equal(got[0, :32], np.tile(first, 4))
  np.testing.assert_array_equal(got[0, 32:], np.tile(first, 4) * 8.0)
  # Extreme exponents are exact (2^-127 is an f32 subnormal, 2^127 * 6 is finite).
  tiny_huge = ck.mxfp4_dequantize(np.full((1, 16), 0x71, np.uint8), np.array([[0]], np.uint8))
  np.testing.assert_array_equal(tiny_huge[0, :2], [np.ldexp(0.5, -127), np.ldexp(6.0, -127)])
  big = ck.mxfp4_dequantize(np.full((1, 16), 0x55, np.uint8), np.array([[253]], np.uint8))  # 3 * 2^126
  np.testing.assert_array_equal(big, np.full((1, 32), np.ldexp(3.0, 126), np.float32))


def test_mxfp4_equals_bf16_bit_for_bit(written):
  packed = _read_all(written["kimi_k3", True])
  plain = _read_all(written["kimi_k3", False])
  name = "language_model.model.layers.1.block_sparse_moe.experts.5.w2"
  assert packed[name + ".weight_packed"].dtype == np.uint8 and packed[name + ".weight_scale"].dtype == np.uint8
  de, inter = K3.moe_hidden_size, K3.moe_intermediate_size
  assert packed[name + ".weight_packed"].shape == (de, inter // 2)
  assert packed[name + ".weight_scale"].shape == (de, inter // 32)
  assert name + ".weight" not in packed and plain[name + ".weight"].dtype == ml_dtypes.bfloat16
  # The written weights span many scales (not all one exponent) and use negative codes.
  assert len(np.unique(packed[name + ".weight_scale"])) > 1 and (packed[name + ".weight_packed"] & 0x88).any()
  with open(os.path.join(written["kimi_k3", True], "config.json")) as f:
    q = json.load(f)["quantization_config"]
  assert q["format"] == "mxfp4-pack-quantized" and q["config_groups"]["group_0"]["weights"]["group_size"] == 32

  _, a = ck.load_hf(written["kimi_k3", True], progress=False)
  _, b = ck.load_hf(written["kimi_k3", False], progress=False)
  fa, fb = _flat(a), _flat(b)
  assert fa.keys() == fb.keys()
  for n in fa:
    x, y = np.asarray(fa[n]), np.asarray(fb[n])
    assert x.dtype == y.dtype and x.shape == y.shape, n
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=n)


# ---------------------------------------------------------------------------------------------- HF math oracle
def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _silu(x):
  return x * _sigmoid(x)


def _act(cfg, gate, up):
  if cfg.hidden_act == "silu":
    return _silu(gate) * up
  b, bl = cfg.situ_beta, cfg.situ_linear_beta
  return b * np.tanh(gate / b) * _sigmoid(gate) * bl * np.tanh(up / bl)


def _kda(cfg, w, p, x, fmt):
  """``KimiDeltaAttention`` of one fresh sequence ``x [T, D]`` (token-by-token recurrence)."""
  t_len = x.shape[0]
  h, k = cfg.kda_num_heads, cfg.kda_head_dim

  def conv(name, y):  # depthwise causal conv [P, 1, W] then SiLU
    taps = w[p + name + ".weight"][:, 0, :]
    width = taps.shape[1]
    ypad = np.concatenate([np.zeros((width - 1, y.shape[1])), y])
    return _silu(sum(taps[:, i] * ypad[i:i + t_len] for i in range(width)))

  q, kk, v = (conv(f"{n}_conv1d", x @ w[p + f"{n}_proj.weight"].T).reshape(t_len, h, k) for n in "qkv")
  q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
  kk = kk / np.sqrt((kk * kk).sum(-1, keepdims=True) + 1e-6)
  a = np.exp(w[p + "A_log"].reshape(-1)[:h])[None, :, None]
  f = ((x @ w[p + "f_a_proj.weight"].T) @ w[p + "f_b_proj.weight"].T + w[p + "dt_bias"]).reshape(t_len, h, k)
  if cfg.gate_lower_bound is None:
    g = -a * np.where(f > 20, f, np.log1p(np.exp(np.minimum(f, 20))))
  else:
    g = cfg.gate_lower_bound * _sigmoid(a * f)
  beta = _sigmoid(x @ w[p + "b_proj.weight"].T)
  state = np.zeros((h, k, k))
  o = np.zeros((t_len, h, k))
  for t in range(t_len):
    state = state * np.exp(g[t])[:, :, None]
    err = v[t] - np.einsum("hk,hkv->hv", kk[t], state)
    state = state + beta[t][:, None, None] * kk[t][:, :, None] * err[:, None, :]
    o[t] = np.einsum("hk,hkv->hv", q[t] * k**-0.5, state)
  if cfg.use_full_rank_gate:
    z = x @ w[p + "g_proj.weight"].T
  else:
    z = (x @ w[p + "g_a_proj.weight"].T) @ w[p + "g_b_proj.weight"].T
  y = _rms(o, w[p + "o_norm.weight"], cfg.rms_norm_eps) * _sigmoid(z.reshape(t_len, h, k))
  return y.reshape(t_len, h * k) @ w[p + "o_proj.weight"].T


def _mla(cfg, w, p, x):
  """``KimiMLAAttention`` (NoPE) of one sequence, causal, with K3's q-LoRA and output gate when present."""
  t_len = x.shape[0]
  h, r, dn, dv = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
  if cfg.q_lora_rank is None:
    q = x @ w[p + "q_proj.weight"].T
  else:
    q = _rms(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], 1e-6) @ w[p + "q_b_proj.weight"].T
  q = q.reshape(t_len, h, -1)
  a = x @ w[p + "kv_a_proj_with_mqa.weight"].T
  c = _rms(a[:, :r], w[p + "kv_a_layernorm.weight"], 1e-6)
  kv = (c @ w[p + "kv_b_proj.weight"].T).reshape(t_len, h, dn + dv)
  key = np.concatenate([kv[..., :dn], np.broadcast_to(a[:, None, r:], (t_len, h, a.shape[1] - r))], -1)
  s = np.einsum("thd,shd->hts", q, key) * q.shape[-1] ** -0.5
  s = np.where(np.tril(np.ones((t_len, t_len), bool)), s, -np.inf)
  prob = np.exp(s - s.max(-1, keepdims=True))
  prob /= prob.sum(-1, keepdims=True)
  o = np.einsum("hts,shd->thd", prob, kv[..., dn:])
  if cfg.mla_use_output_gate:
    o = o * _sigmoid(x @ w[p + "g_proj.weight"].T).reshape(t_len, h, dv)
  return o.reshape(t_len, h * dv) @ w[p + "o_proj.weight"].T


def _mlp(cfg, w, p, x):
  return _act(cfg, x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T) @ w[p + "down_proj.weight"].T


def _moe(cfg, w, p, x):
  scores = _sigmoid(x @ w[p + "gate.weight"].T)
  top = np.argsort(-(scores + w[p + "gate.e_score_correction_bias"]), axis=-1)[:, :cfg.num_experts_per_token]
  weights = np.take_along_axis(scores, top, -1)
  if cfg.moe_renormalize and cfg.num_experts_per_token > 1:
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
  weights = weights * cfg.routed_scaling_factor
  latent = cfg.routed_expert_hidden_size is not None
  xin = x @ w[p + "routed_expert_down_proj.weight"].T if latent else x
  y = np.zeros_like(xin)
  for t in range(x.shape[0]):
    for e, we in zip(top[t], weights[t]):
      pe = p + f"experts.{e}."
      y[t] += we * (_act(cfg, xin[t] @ w[pe + "w1.weight"].T, xin[t] @ w[pe + "w3.weight"].T) @ w[pe + "w2.weight"].T)
  if latent:
    if cfg.latent_moe_use_norm:
      y = _rms(y, w[p + "routed_expert_norm.weight"], cfg.rms_norm_eps)
    y = y @ w[p + "routed_expert_up_proj.weight"].T
  if cfg.num_shared_experts:
    y = y + _mlp(cfg, w, p + "shared_experts.", x)
  return y


def _attn_res_mix(w, p, prefix, blocks, eps):
  """Softmax over ``{blocks..., prefix}`` scored on their RMS-normalised values by ``norm * proj``."""
  if not blocks:
    return prefix
  cand = np.stack(blocks + [prefix])  # [B + 1, T, D]
  query = w[p + "_res_norm.weight"] * w[p + "_res_proj.weight"][0]
  s = _rms(cand, 1.0, eps) @ query  # [B + 1, T]
  prob = np.exp(s - s.max(0))
  prob /= prob.sum(0)
  return (prob[..., None] * cand).sum(0)


def _hf_forward(cfg, w, tokens, fmt):
  """Float64 HF forward of one fresh sequence from the checkpoint tensors ``w`` (prefix stripped)."""
  eps = cfg.rms_norm_eps
  x = w["model.embed_tokens.weight"][tokens]
  blocks = []
  for i, kind in enumerate(cfg.layer_types):
    p = f"model.layers.{i}."
    attn = (lambda h, p=p: _kda(cfg, w, p + "self_attn.", h, fmt)) if kind == "kda" else (
        lambda h, p=p: _mla(cfg, w, p + "self_attn.", h))
    ffn = (lambda h, p=p: _moe(cfg, w, p + "block_sparse_moe.", h)) if cfg.is_moe(i) else (
        lambda h, p=p: _mlp(cfg, w, p + "mlp.", h))
    ln1, ln2 = w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"]
    if cfg.attn_res_block_size is None:
      x = x + attn(_rms(x, ln1, eps))
      x = x + ffn(_rms(x, ln2, eps))
      continue
    h = _attn_res_mix(w, p + "self_attention", x, blocks, eps)
    prefix = x
    if i % cfg.attn_res_block_size == 0:
      blocks, prefix = blocks + [x], None
    a = attn(_rms(h, ln1, eps))
    prefix = a if prefix is None else prefix + a
    h = _attn_res_mix(w, p + "mlp", prefix, blocks, eps)
    x = prefix + ffn(_rms(h, ln2, eps))
  if cfg.attn_res_block_size is not None:
    x = _attn_res_mix(w, "model.output_attn", x, blocks, eps)
  x = _rms(x, w["model.norm.weight"], eps)
  return x @ w["lm_head.weight"].T


# Three layers, both kinds: KDA (dense FFN), MLA (MoE), KDA (MoE); attention-residual blocks at layers 0, 2.
SMALL = {"kimi_k3": K3.replace(num_hidden_layers=3, layer_types=("kda", "mla", "kda")),
         "kimi_linear": LINEAR.replace(num_hidden_layers=3, layer_types=("kda", "mla", "kda"))}


@pytest.mark.parametrize("fmt", ["kimi_linear", "kimi_k3"])
def test_logits_match_numpy_hf_forward(fmt, tmp_path):
  cfg = SMALL[fmt]
  path = testing.write_tiny_hf(tmp_path, cfg, seed=11, fmt=fmt, mxfp4=fmt == "kimi_k3")
  run_cfg = cfg.replace(**F32)
  loaded_cfg, model = ck.load_hf(path, config=run_cfg, progress=False)
  assert loaded_cfg == run_cfg
  graph, state = nnx.split(model)
  lens = [7, 5]
  tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, sum(lens)).astype(np.int32)
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  cache = k3jax.init_cache(run_cfg, len(lens), 64, fill=np.nan)
  step = fast_jit(lambda st, tok, c, ca: nnx.merge(graph, st).prefill(tok, c, ca))
  logits, _ = step(state, jnp.asarray(tokens), jnp.asarray(cu), cache)
  assert logits.shape == (sum(lens), cfg.vocab_size) and logits.dtype == jnp.float32

  pre = "language_model." if fmt == "kimi_k3" else ""
  w = {}
  tensors = _read_all(path)
  for name, a in tensors.items():
    if not name.startswith(pre) or name.endswith(".weight_scale"):
      continue  # vision tensors; scales are read with their packed weights
    if name.endswith(".weight_packed"):
      a = ck.mxfp4_dequantize(a, tensors[name.replace("_packed", "_scale")])
      name = name.replace("_packed", "")
    w[name[len(pre):]] = np.asarray(a, np.float64)
  ref = np.concatenate([_hf_forward(cfg, w, tokens[cu[n]:cu[n + 1]], fmt) for n in range(len(lens))])
  got = np.asarray(logits, np.float64)
  assert np.isfinite(got).all()
  # f32 model (params exact copies of the bf16/MXFP4 values) vs float64 through 3 layers of O(1) logits with
  # reductions of length <= 512: the observed error is ~5e-6 (f32 rounding); 5e-5 leaves a 10x margin while a
  # layout error (any swapped or transposed tensor) moves logits by O(0.1).
  np.testing.assert_allclose(got, ref, atol=5e-5, rtol=5e-5)


# ---------------------------------------------------------------------------------------------- sharded
def test_sharded_load_equals_unsharded_padded(written):
  path = written["kimi_k3", True]
  mesh = device_mesh(9)
  cfg, sharded = ck.load_hf(path, mesh=mesh, progress=False)
  assert cfg == K3
  _, whole = ck.load_hf(path, progress=False)
  ref, plan = sharding.shard_model(whole, mesh)
  # tiny: heads 4, experts 8, vocab 256, FFN 96/32 are all padded for 9 devices.
  assert set(plan.applied) == {"num_attention_heads", "kda_num_heads", "num_experts", "vocab_size",
                               "intermediate_size", "moe_intermediate_size"}
  assert sharded.cfg == ref.cfg == plan.config(K3)
  fa, fb = _flat(sharded), _flat(ref)
  assert fa.keys() == fb.keys()
  for n in fa:
    a, b = fa[n], fb[n]
    assert a.shape == b.shape and a.dtype == b.dtype, n
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), n
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=n)
  # Experts are split: each device holds one of the 9 (padded) experts.
  w1 = fa["layers.1.block_sparse_moe.experts.w1"]
  assert {s.data.shape[0] for s in w1.addressable_shards} == {1} and len(w1.addressable_shards) == 9


def test_sharded_load_reads_only_each_devices_experts(written, monkeypatch):
  reads = []
  original = ck._Checkpoint.read

  def spy(self, name):
    reads.append(name)
    return original(self, name)

  monkeypatch.setattr(ck._Checkpoint, "read", spy)
  ck.load_hf(written["kimi_k3", True], mesh=device_mesh(9), progress=False)
  expert = [n for n in reads if ".experts." in n]
  # Every expert tensor is read exactly once although 9 devices each receive their own block.
  assert len(expert) == len(set(expert)) == 2 * 3 * K3.num_experts * sum(map(K3.is_moe, range(6)))


# ---------------------------------------------------------------------------------------------- errors
def _load_error(path, match, exc=ValueError, **kw):
  with pytest.raises(exc, match=match):
    ck.load_hf(path, progress=False, **kw)


def test_error_missing_tensor(written, tmp_path):
  path = _copy(written, ("kimi_k3", False), tmp_path)
  name = "language_model.model.layers.2.self_attn.kv_b_proj.weight"
  _rewrite(path, lambda t: t.pop(name))
  _load_error(path, rf"missing 1 tensors .*{name} \[{4 * 32}, 512\]")


def test_error_missing_expert(written, tmp_path):
  path = _copy(written, ("kimi_k3", True), tmp_path)
  name = "language_model.model.layers.4.block_sparse_moe.experts.7.w3.weight_scale"
  _rewrite(path, lambda t: t.pop(name))
  _load_error(path, f"missing 1 tensors .*{name}")


def test_error_unexpected_tensor(written, tmp_path):
  path = _copy(written, ("kimi_linear", False), tmp_path)
  _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)}))
  _load_error(path, r"1 tensors the kimi_linear config does not use: \['model.layers.0.self_attn.q_norm.weight'\]")


def test_error_vision_tensor_outside_k3(written, tmp_path):
  path = _copy(written, ("kimi_linear", False), tmp_path)
  _rewrite(path, lambda t: t.update({"vision_tower.patch_embed.proj.weight": np.ones((4, 3), np.float32)}))
  _load_error(path, "vision tensors are only skipped in the kimi_k3 format")


def test_error_bf16_expert_in_mxfp4_checkpoint(written, tmp_path):
  path = _copy(written, ("kimi_k3", True), tmp_path)
  name = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"
  _rewrite(path, lambda t: t.update({name + ".weight": np.ones((32, 64), ml_dtypes.bfloat16)}))
  _load_error(path, f"does not use: \\['{name}.weight'\\]")


def test_error_wrong_shape(written, tmp_path):
  path = _copy(written, ("kimi_linear", False), tmp_path)
  name = "model.layers.0.self_attn.A_log"
  _rewrite(path, lambda t: t.update({name: np.zeros((4,), np.float32)}))  # the K3 form in a Kimi-Linear file
  _load_error(path, rf"tensor {name} \(model-0000\d-of-00003.safetensors\): expected shape \[1, 1, 4, 1\]")


@pytest.mark.parametrize("name,dtype", [("language_model.model.layers.0.self_attn.q_proj.weight", np.int32),
                                        ("language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed",
                                         ml_dtypes.bfloat16)])
def test_error_wrong_dtype(written, tmp_path, name, dtype):
  path = _copy(written, ("kimi_k3", True), tmp_path)
  _rewrite(path, lambda t: t.update({name: t[name].astype(dtype)}))
  _load_error(path, rf"tensor {name} .*with dtype in \[.*\], got shape \[.*\] dtype (I32|BF16)")


def test_error_a_log_tail_not_zero(written, tmp_path):
  path = _copy(written, ("kimi_k3", False), tmp_path)
  name = "language_model.model.layers.3.self_attn.A_log"

  def edit(t):
    t[name] = t[name].copy()
    t[name][10] = 0.5

  _rewrite(path, edit)
  _load_error(path, rf"{name}: the kimi_k3 A_log holds 4 head values zero-padded to 16, but its tail \[4:\] is "
                    r"not zero")


def test_error_mxfp4_nan_scale(written, tmp_path):
  path = _copy(written, ("kimi_k3", True), tmp_path)
  name = "language_model.model.layers.2.block_sparse_moe.experts.1.w1.weight_scale"

  def edit(t):
    t[name] = t[name].copy()
    t[name][3, 1] = 255

  _rewrite(path, edit)
  _load_error(path, r"experts.1.w1.weight_packed: weight_scale holds the E8M0 NaN code 255 at \[\[3, 1\]\]")


def test_error_index_and_shards_disagree(written, tmp_path):
  path = _copy(written, ("kimi_linear", False), tmp_path)
  index_path = os.path.join(path, ck.INDEX_FILE)
  with open(index_path) as f:
    index = json.load(f)
  good = json.dumps(index)
  name = "model.layers.0.input_layernorm.weight"  # in a shard with other tensors, so the shard is still read
  index["weight_map"].pop(name)
  with open(index_path, "w") as f:
    json.dump(index, f)
  _load_error(path, f"tensor '{name}' is in shard model-0000.-of-00003.safetensors but {ck.INDEX_FILE} maps it to None")

  index = json.loads(good)
  index["weight_map"]["model.extra.weight"] = "model-00001-of-00003.safetensors"
  with open(index_path, "w") as f:
    json.dump(index, f)
  _load_error(path, r"tensors \['model.extra.weight'\] are in model.safetensors.index.json but not in the shard")

  index = json.loads(good)
  index["weight_map"]["model.extra.weight"] = "model-00009-of-00009.safetensors"
  with open(index_path, "w") as f:
    json.dump(index, f)
  _load_error(path, "shard model-00009-of-00009.safetensors named by .* does not exist")

  with open(index_path, "w") as f:
    json.dump({"metadata": {}}, f)
  _load_error(path, "must hold a 'weight_map' object")

  os.remove(index_path)
  _load_error(path, f"neither {ck.INDEX_FILE} nor {ck.SINGLE_FILE} found")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_error_non_finite_weight(written, tmp_path, bad):
  path = _copy(written, ("kimi_linear", False), tmp_path)
  name = "model.layers.2.self_attn.kv_b_proj.weight"

  def edit(t):
    t[name] = t[name].copy()
    t[name][5, 7] = bad

  _rewrite(path, edit)
  _load_error(path, rf"tensor {name} \(model-0000\d-of-00003.safetensors\) holds 1 non-finite values \(NaN or "
                    r"Inf\), the first at \[5, 7\]")
  model = ck.load_hf(path, progress=False, check_finite=False)[1]
  assert np.isnan(np.asarray(model.layers[2].self_attn.kv_b_proj.w_uk[...])).any() == np.isnan(bad)


def test_error_truncated_shard(written, tmp_path):
  path = _copy(written, ("kimi_linear", False), tmp_path)
  shard = os.path.join(path, "model-00002-of-00003.safetensors")
  with open(shard, "rb") as f:
    data = f.read()
  with open(shard, "wb") as f:
    f.write(data[:len(data) // 2])
  with pytest.raises(ValueError, match=re.escape(f"{shard}: not a readable safetensors file")) as info:
    ck.load_hf(path, progress=False)
  assert info.value.__cause__ is not None  # the library's own error, chained


@pytest.mark.parametrize("fname", ["config.json", ck.INDEX_FILE])
def test_error_json_file_not_json(written, tmp_path, fname):
  path = _copy(written, ("kimi_k3", False), tmp_path)
  target = os.path.join(path, fname)
  with open(target, "w") as f:
    f.write('{"model_type": "kimi_k3", ')
  with pytest.raises(ValueError, match=re.escape(f"{target}: not valid JSON")) as info:
    ck.load_hf(path, progress=False)
  assert isinstance(info.value.__cause__, json.JSONDecodeError)
  with open(target, "w") as f:
    json.dump([1, 2], f)
  _load_error(path, re.escape(f"{target}: must hold a JSON object, got list"))


def test_error_no_config(tmp_path):
  _load_error(tmp_path, "config.json not found")


def test_error_config_argument(written):
  path = written["kimi_linear", False]
  _load_error(path, r"config contradicts .* \{'hidden_size': \(128, 64\)\}", config=LINEAR.replace(hidden_size=128))
  _load_error(path, "config must be a K3Config or None, got dict", config={"hidden_size": 64})
  mesh = jax.make_mesh((1,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
  _load_error(path, r"mesh must have the 'model' axis .*got axes \('tp',\)", mesh=mesh)


@pytest.mark.parametrize("change,match", [
    ({"quant_method": "fp8"}, "quantization_config must be compressed-tensors 'mxfp4-pack-quantized'"),
    ({"config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}},
     r"config_groups.group_0.weights must be 4-bit float in groups of 32 .* got \(4, 'float', 16\)"),
])
def test_error_unsupported_quantization(written, tmp_path, change, match):
  path = _copy(written, ("kimi_k3", True), tmp_path)
  cfg_path = os.path.join(path, "config.json")
  with open(cfg_path) as f:
    raw = json.load(f)
  raw["quantization_config"].update(change)
  with open(cfg_path, "w") as f:
    json.dump(raw, f)
  _load_error(path, match, exc=NotImplementedError)


def test_error_name_table_out_of_sync_with_model(written, monkeypatch):
  rules = ck.hf_rules
  monkeypatch.setattr(ck, "hf_rules", lambda cfg, fmt, naming="original": [
      r for r in rules(cfg, fmt, naming) if r.path != ("norm", "weight")])
  _load_error(written["kimi_linear", False], r"parameters without a checkpoint tensor \['norm.weight'\]")


def test_writer_errors(tmp_path):
  with pytest.raises(ValueError, match="fmt must be one of"):
    testing.write_tiny_hf(tmp_path, LINEAR, 0, fmt="kimi_k2")
  with pytest.raises(ValueError, match="num_shards must be an int >= 1, got 0"):
    testing.write_tiny_hf(tmp_path, LINEAR, 0, num_shards=0)
  with pytest.raises(ValueError, match="naming must be one of"):
    testing.write_tiny_hf(tmp_path, LINEAR, 0, naming="hub")
  with pytest.raises(ValueError, match="naming 'transformers' needs fmt 'kimi_linear'"):
    testing.write_tiny_hf(tmp_path, K3, 0, fmt="kimi_k3", naming="transformers")
  with pytest.raises(ValueError, match=r"multiples of 32, got \{'moe hidden size \(w1/w3 input\)': 48\}"):
    testing.write_tiny_hf(tmp_path, cfg_lib.preset("tiny"), 0, fmt="kimi_k3", mxfp4=True)
  with pytest.raises(ValueError, match="needs kda_num_heads <= kda_head_dim"):
    testing.write_tiny_hf(tmp_path, K3.replace(kda_num_heads=32), 0, fmt="kimi_k3")
  with pytest.raises(ValueError, match="fmt must be one of"):
    ck.hf_tensor_names(K3, "kimi")


def test_mxfp4_dequantize_errors():
  with pytest.raises(ValueError, match="w: weight_packed and weight_scale must be uint8, got int8 and uint8"):
    ck.mxfp4_dequantize(np.zeros((2, 16), np.int8), np.zeros((2, 1), np.uint8), "w")
  with pytest.raises(ValueError, match=r"weight_scale must be \[2, 32 / 32\] for weight_packed \(2, 16\), got \(2, 2"):
    ck.mxfp4_dequantize(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8))
  with pytest.raises(ValueError, match=r"w: dequantized values overflow float32 at \[\[0, 1\], \[0, 3\]"):
    ck.mxfp4_dequantize(np.full((1, 16), 0x70, np.uint8), np.array([[254]], np.uint8), "w")  # 6 * 2^127
