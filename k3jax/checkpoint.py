"""Hugging Face checkpoints (Kimi-Linear and Kimi-K3 formats) to ``KimiK3Model`` parameters, and back for tests.

``load_hf`` reads ``config.json``, ``model.safetensors.index.json`` and the shards (memory-mapped), maps every
HF tensor to its parameter and places each parameter directly with its sharding (and the ``PaddingPlan`` of
``k3jax.sharding``): a device receives only its block, and a host holds at most one converted tensor (one
device's experts for a stacked expert tensor). ``k3jax.testing.write_tiny_hf`` writes random checkpoints with
the real names and layouts.

Formats (``model_type`` in ``config.json``):

* ``kimi_linear``: flat config, names ``model.*`` / ``lm_head.weight``, ``A_log [1, 1, H, 1]``.
* ``kimi_k3``: config under ``text_config``, names prefixed ``language_model.``, ``A_log [K]`` (the H values
  zero-padded to the head dim; the tail must be zero), vision tensors (``vision_tower.*``, ``mm_projector.*``,
  ``multi_modal_projector.*``) skipped by an explicit rule.

Naming: a ``kimi_linear`` checkpoint saved by ``transformers`` (5.x, its native ``KimiLinear`` classes) names
the dense MLP of the first ``first_k_dense_replace`` layers ``model.layers.{i}.block_sparse_moe.{gate,up,down}_proj``
instead of ``model.layers.{i}.mlp.*`` (it renames ``block_sparse_moe`` to ``mlp`` on load and back on save, for
every layer; the MoE layers' names come back unchanged). ``load_hf`` reads either naming (``NAMINGS``), one per
checkpoint.

Conversion: Linear ``[out, in]`` becomes ``[in, out]`` reshaped to the module's head-split kernel;
``kv_b_proj [H*(dn+dv), R]`` becomes ``W_UK [R, H, dn]`` and ``W_UV [R, H, dv]``; ``experts.{e}.w1/w3/w2``
are stacked to ``[E, De, I]`` / ``[E, I, De]``; convs ``[P, 1, W]`` become ``[H, K, W]``; ``dt_bias [P]``
becomes ``[H, K]``. Router, ``A_log`` and ``dt_bias`` are kept in f32 (the module's dtypes).

MXFP4 routed experts (compressed-tensors ``mxfp4-pack-quantized``, group 32): ``weight_packed [out, in/2]``
uint8 holds two e2m1 codes per byte (element ``2j`` in the low nibble, ``2j+1`` in the high nibble; code bit 3
is the sign, bits 0-2 index ``0, .5, 1, 1.5, 2, 3, 4, 6``) and ``weight_scale [out, in/32]`` uint8 holds E8M0
exponents (``2 ** (s - 127)``; 255 is NaN and rejected). Dequantization is exact in f32.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from k3jax import padding, progress as progress_lib
from k3jax import sharding as sharding_lib
from k3jax.config import KDA, K3Config, read_json
from k3jax.model import KimiK3Model

FORMATS = ("kimi_linear", "kimi_k3")
NAMINGS = ("original", "transformers")  # the published names; the names transformers saves (kimi_linear only)
K3_PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MXFP4_GROUP = 32
MXFP4_FORMAT = "mxfp4-pack-quantized"
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
_E8M0_NAN = 255
_FLOAT_DTYPES = ("BF16", "F16", "F32")
_NP_DTYPE = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "U8": np.uint8}


# ------------------------------------------------------------------------------------------------ MXFP4
def mxfp4_dequantize(packed: np.ndarray, scale: np.ndarray, name: str = "weight") -> np.ndarray:
  """Exact dequantization of one MXFP4 matrix.

  Args:
    packed: ``[out, in / 2]`` uint8, two e2m1 codes per byte (low nibble first).
    scale: ``[out, in / 32]`` uint8 E8M0 exponents.
    name: the tensor's name, for errors.

  Returns:
    ``[out, in]`` float32.

  Raises:
    ValueError: wrong dtypes or shapes, a NaN scale (255), or a value beyond the float32 range.
  """
  if packed.dtype != np.uint8 or scale.dtype != np.uint8:
    raise ValueError(f"{name}: weight_packed and weight_scale must be uint8, got {packed.dtype} and {scale.dtype}")
  out, half = packed.shape
  if scale.shape != (out, 2 * half // MXFP4_GROUP) or (2 * half) % MXFP4_GROUP:
    raise ValueError(f"{name}: weight_scale must be [{out}, {2 * half} / {MXFP4_GROUP}] for weight_packed "
                     f"{tuple(packed.shape)}, got {tuple(scale.shape)}")
  if (scale == _E8M0_NAN).any():
    where = np.argwhere(scale == _E8M0_NAN)[:4].tolist()
    raise ValueError(f"{name}: weight_scale holds the E8M0 NaN code 255 at {where}")
  codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(out, 2 * half)
  mag = E2M1[codes & 7]
  vals = np.where(codes & 8, -mag, mag).reshape(out, -1, MXFP4_GROUP)
  with np.errstate(over="ignore"):
    w = np.ldexp(vals, scale.astype(np.int32)[..., None] - 127).reshape(out, 2 * half)
  if not np.isfinite(w).all():
    raise ValueError(f"{name}: dequantized values overflow float32 at {np.argwhere(~np.isfinite(w))[:4].tolist()} "
                     f"(e2m1 code times 2 ** (scale - 127) exceeds 3.4e38)")
  return w


# ------------------------------------------------------------------------------------------------ name table
@dataclasses.dataclass(frozen=True)
class HfRule:
  """How one model parameter comes from the checkpoint.

  Attributes:
    path: the parameter's path in ``nnx.state(model)``.
    hf: HF name without the format prefix; for stacked experts a template with ``{e}`` and no suffix.
    hf_shape: the HF tensor's shape (per expert for stacked experts).
    kind: what the tensor is ("linear", "norm", "embed", "conv", "a_log", "a_log_padded", "dt_bias", "bias",
      "expert"); decides the random draw of ``k3jax.testing.write_tiny_hf`` and the special checks.
    view: shape after the optional transpose (a reshape).
    transpose: the HF tensor is a ``[out, in]`` Linear weight.
    part: slice of the last axis of ``view`` kept (``kv_b_proj`` halves, the padded K3 ``A_log``).
    num_experts: > 0 for a stack of per-expert tensors along a new leading axis.
  """

  path: tuple
  hf: str
  hf_shape: tuple[int, ...]
  kind: str
  view: tuple[int, ...]
  transpose: bool = False
  part: slice | None = None
  num_experts: int = 0

  @property
  def shape(self) -> tuple[int, ...]:
    """The parameter's (unpadded) shape."""
    view = self.view if self.part is None else self.view[:-1] + (len(range(*self.part.indices(self.view[-1]))),)
    return ((self.num_experts,) if self.num_experts else ()) + view

  def convert(self, a: np.ndarray, name: str) -> np.ndarray:
    """HF-layout ``a`` (one expert for a stack) -> the parameter layout, in ``a``'s dtype (cast once, later)."""
    a = (a.T if self.transpose else a).reshape(self.view)
    if self.part is None:
      return a
    if self.kind == "a_log_padded":
      tail = a[self.part.stop:]
      if tail.any():
        raise ValueError(f"{name}: the kimi_k3 A_log holds {self.part.stop} head values zero-padded to "
                         f"{a.shape[0]}, but its tail [{self.part.stop}:] is not zero: {tail.tolist()}")
    return a[..., self.part]


def hf_rules(cfg: K3Config, fmt: str, naming: str = "original") -> list[HfRule]:
  """Every parameter of ``KimiK3Model(cfg)`` with its HF source in format ``fmt`` and naming ``naming``.

  Raises:
    ValueError: a ``naming`` not in ``NAMINGS``, or "transformers" with a format other than kimi_linear
      (transformers has no Kimi-K3 class).
  """
  if naming not in NAMINGS:
    raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
  if naming == "transformers" and fmt != "kimi_linear":
    raise ValueError(f"naming 'transformers' needs fmt 'kimi_linear' (transformers has no Kimi-K3 class), "
                     f"got fmt {fmt!r}")
  rules: list[HfRule] = []
  dense_mlp = "block_sparse_moe." if naming == "transformers" else "mlp."
  d, v = cfg.hidden_size, cfg.vocab_size

  def lin(path, hf, out, inp, view):
    rules.append(HfRule(path + ("kernel",), hf + ".weight", (out, inp), "linear", view, transpose=True))

  def norm(path, hf, n):
    rules.append(HfRule(path + ("weight",), hf + ".weight", (n,), "norm", (n,)))

  def attn_res(path, hf):
    rules.append(HfRule(path + ("norm",), hf + "_res_norm.weight", (d,), "norm", (d,)))
    rules.append(HfRule(path + ("proj",), hf + "_res_proj.weight", (1, d), "linear", (d, 1), transpose=True))

  def mlp(path, hf, width):
    lin(path + ("gate_proj",), hf + "gate_proj", width, d, (d, width))
    lin(path + ("up_proj",), hf + "up_proj", width, d, (d, width))
    lin(path + ("down_proj",), hf + "down_proj", d, width, (width, d))

  rules.append(HfRule(("embed_tokens",), "model.embed_tokens.weight", (v, d), "embed", (v, d)))
  for i, kind in enumerate(cfg.layer_types):
    lp, hp = ("layers", i), f"model.layers.{i}."
    norm(lp + ("input_layernorm",), hp + "input_layernorm", d)
    norm(lp + ("post_attention_layernorm",), hp + "post_attention_layernorm", d)
    if cfg.attn_res_block_size is not None:
      attn_res(lp + ("self_attention_res",), hp + "self_attention")
      attn_res(lp + ("mlp_res",), hp + "mlp")
    ap, ha = lp + ("self_attn",), hp + "self_attn."
    if kind == KDA:
      h, k, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
      p = h * k
      for n in ("q", "k", "v"):
        lin(ap + (f"{n}_proj",), ha + f"{n}_proj", p, d, (d, h, k))
        rules.append(HfRule(ap + (f"{n}_conv1d", "weight"), ha + f"{n}_conv1d.weight", (p, 1, w), "conv", (h, k, w)))
      if fmt == "kimi_k3":
        rules.append(HfRule(ap + ("A_log",), ha + "A_log", (k,), "a_log_padded", (k,), part=slice(0, h)))
      else:
        rules.append(HfRule(ap + ("A_log",), ha + "A_log", (1, 1, h, 1), "a_log", (h,)))
      rules.append(HfRule(ap + ("dt_bias",), ha + "dt_bias", (p,), "dt_bias", (h, k)))
      lin(ap + ("f_a_proj",), ha + "f_a_proj", k, d, (d, k))
      lin(ap + ("f_b_proj",), ha + "f_b_proj", p, k, (k, h, k))
      lin(ap + ("b_proj",), ha + "b_proj", h, d, (d, h))
      if cfg.use_full_rank_gate:
        lin(ap + ("g_proj",), ha + "g_proj", p, d, (d, h, k))
      else:
        lin(ap + ("g_a_proj",), ha + "g_a_proj", k, d, (d, k))
        lin(ap + ("g_b_proj",), ha + "g_b_proj", p, k, (k, h, k))
      norm(ap + ("o_norm",), ha + "o_norm", k)
      lin(ap + ("o_proj",), ha + "o_proj", d, p, (h, k, d))
    else:
      h, r, dn, dv = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
      dqk = dn + cfg.qk_rope_head_dim
      if cfg.q_lora_rank is None:
        lin(ap + ("q_proj",), ha + "q_proj", h * dqk, d, (d, h, dqk))
      else:
        rq = cfg.q_lora_rank
        lin(ap + ("q_a_proj",), ha + "q_a_proj", rq, d, (d, rq))
        norm(ap + ("q_a_layernorm",), ha + "q_a_layernorm", rq)
        lin(ap + ("q_b_proj",), ha + "q_b_proj", h * dqk, rq, (rq, h, dqk))
      lin(ap + ("kv_a_proj_with_mqa",), ha + "kv_a_proj_with_mqa", r + cfg.qk_rope_head_dim, d,
          (d, r + cfg.qk_rope_head_dim))
      norm(ap + ("kv_a_layernorm",), ha + "kv_a_layernorm", r)
      for name, part in (("w_uk", slice(0, dn)), ("w_uv", slice(dn, dn + dv))):
        rules.append(HfRule(ap + ("kv_b_proj", name), ha + "kv_b_proj.weight", (h * (dn + dv), r), "linear",
                           (r, h, dn + dv), transpose=True, part=part))
      if cfg.mla_use_output_gate:
        lin(ap + ("g_proj",), ha + "g_proj", h * dv, d, (d, h, dv))
      lin(ap + ("o_proj",), ha + "o_proj", d, h * dv, (h, dv, d))
    if not cfg.is_moe(i):
      mlp(lp + ("mlp",), hp + dense_mlp, cfg.intermediate_size)
      continue
    mp, hm = lp + ("block_sparse_moe",), hp + "block_sparse_moe."
    e, de, inter = cfg.num_experts, cfg.moe_hidden_size, cfg.moe_intermediate_size
    lin(mp + ("gate",), hm + "gate", e, d, (d, e))
    rules.append(HfRule(mp + ("gate", "e_score_correction_bias"), hm + "gate.e_score_correction_bias", (e,),
                       "bias", (e,)))
    for name, out, inp in (("w1", inter, de), ("w3", inter, de), ("w2", de, inter)):
      rules.append(HfRule(mp + ("experts", name), hm + "experts.{e}." + name, (out, inp), "expert", (inp, out),
                         transpose=True, num_experts=e))
    if cfg.num_shared_experts:
      mlp(mp + ("shared_experts",), hm + "shared_experts.", inter * cfg.num_shared_experts)
    if cfg.routed_expert_hidden_size is not None:
      lin(mp + ("routed_expert_down_proj",), hm + "routed_expert_down_proj", de, d, (d, de))
      lin(mp + ("routed_expert_up_proj",), hm + "routed_expert_up_proj", d, de, (de, d))
      if cfg.latent_moe_use_norm:
        norm(mp + ("routed_expert_norm",), hm + "routed_expert_norm", de)
  if cfg.attn_res_block_size is not None:
    attn_res(("output_attn_res",), "model.output_attn")
  norm(("norm",), "model.norm", d)
  if not cfg.tie_word_embeddings:
    lin(("lm_head",), "lm_head", v, d, (d, v))
  return rules


def _naming_of(cfg: K3Config, fmt: str, present: set[str]) -> str:
  """The naming of a checkpoint holding the tensors ``present``: "transformers" where it holds its names.

  Raises:
    ValueError: one parameter under both names, or some parameters under each naming (each names an example).
  """
  if fmt != "kimi_linear":
    return "original"
  pairs = [(a.hf, b.hf) for a, b in zip(hf_rules(cfg, fmt, "original"), hf_rules(cfg, fmt, "transformers"))
           if a.hf != b.hf]
  for ours, theirs in pairs:
    if ours in present and theirs in present:
      raise ValueError(f"checkpoint holds one parameter twice: as {ours!r} (original naming) and as {theirs!r} "
                       f"(transformers naming)")
  ours = [a for a, _ in pairs if a in present]
  theirs = [b for _, b in pairs if b in present]
  if ours and theirs:
    raise ValueError(f"checkpoint mixes the original naming ({len(ours)} tensors, e.g. {ours[0]!r}) with the "
                     f"transformers naming ({len(theirs)} tensors, e.g. {theirs[0]!r}); it must use one")
  return "transformers" if theirs else "original"


def expert_names(rule: HfRule, e: int, mxfp4: bool) -> list[str]:
  """The HF names of expert ``e`` of an expert rule: ``weight``, or ``weight_packed`` + ``weight_scale`` (MXFP4)."""
  base = rule.hf.format(e=e)
  return [base + ".weight_packed", base + ".weight_scale"] if mxfp4 else [base + ".weight"]


@dataclasses.dataclass(frozen=True)
class _Expected:
  shape: tuple[int, ...]
  dtypes: tuple[str, ...]


def _expected_tensors(rules: list[HfRule], prefix: str, mxfp4: bool) -> dict[str, _Expected]:
  """HF name (with prefix) -> expected shape and allowed dtypes, for every tensor the rules read."""
  out = {}
  for rule in rules:
    if not rule.num_experts:
      out[prefix + rule.hf] = _Expected(rule.hf_shape, _FLOAT_DTYPES)
      continue
    rows, cols = rule.hf_shape
    for e in range(rule.num_experts):
      names = expert_names(rule, e, mxfp4)
      if mxfp4:
        out[prefix + names[0]] = _Expected((rows, cols // 2), ("U8",))
        out[prefix + names[1]] = _Expected((rows, cols // MXFP4_GROUP), ("U8",))
      else:
        out[prefix + names[0]] = _Expected(rule.hf_shape, _FLOAT_DTYPES)
  return out


# ------------------------------------------------------------------------------------------------ config
def _read_json(path: str, what: str) -> dict:
  if not os.path.isfile(path):
    raise ValueError(f"{what} not found: {path}")
  return read_json(path)


def _mxfp4_from_config(raw: dict) -> bool:
  """Whether the routed experts are MXFP4 (``quantization_config`` at the top level or in ``text_config``).

  Raises:
    NotImplementedError: a quantization other than compressed-tensors ``mxfp4-pack-quantized`` with 4-bit
      float weights in groups of 32.
  """
  q = raw.get("quantization_config", raw.get("text_config", {}).get("quantization_config"))
  if q is None:
    return False
  if q.get("quant_method") != "compressed-tensors" or q.get("format") != MXFP4_FORMAT:
    raise NotImplementedError(f"quantization_config must be compressed-tensors {MXFP4_FORMAT!r} (MXFP4 routed "
                              f"experts), got quant_method={q.get('quant_method')!r} format={q.get('format')!r}")
  for name, group in q.get("config_groups", {}).items():
    w = group.get("weights", {})
    got = (w.get("num_bits"), w.get("type"), w.get("group_size"))
    if got != (4, "float", MXFP4_GROUP):
      raise NotImplementedError(f"quantization_config.config_groups.{name}.weights must be 4-bit float in groups "
                                f"of {MXFP4_GROUP} (num_bits, type, group_size), got {got}")
  return True


def _architecture_diff(a: K3Config, b: K3Config) -> dict:
  ha, hb = a.to_hf("kimi_linear"), b.to_hf("kimi_linear")
  return {k: (ha.get(k), hb.get(k)) for k in sorted(set(ha) | set(hb)) if ha.get(k) != hb.get(k)}


# ------------------------------------------------------------------------------------------------ reading
class _Checkpoint:
  """The tensors of a checkpoint directory: ``name -> (file, shape, dtype)`` from the shard headers.

  ``read`` checks that float tensors hold only finite values when ``check_finite``: a NaN weight would otherwise
  turn every logit it reaches into NaN without an error.
  """

  def __init__(self, path: str, check_finite: bool):
    self.path, self.check_finite = path, check_finite
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
      weight_map = _read_json(index_path, INDEX_FILE).get("weight_map")
      if not isinstance(weight_map, dict):
        raise ValueError(f"{index_path}: must hold a 'weight_map' object of tensor name -> shard file")
    elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
      weight_map = None
    else:
      raise ValueError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
    files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
    self.info: dict[str, tuple[str, tuple[int, ...], str]] = {}
    self._files = {}
    for fname in files:
      fpath = os.path.join(path, fname)
      if not os.path.isfile(fpath):
        names = sorted(n for n, f in weight_map.items() if f == fname)
        raise ValueError(f"shard {fname} named by {INDEX_FILE} (for {len(names)} tensors, e.g. {names[0]!r}) "
                         f"does not exist in {path}")
      try:
        handle = safe_open(fpath, framework="numpy")
      except SafetensorError as e:
        raise ValueError(f"{fpath}: not a readable safetensors file (truncated or corrupt?): {e}") from e
      self._files[fname] = handle
      for name in handle.keys():
        if weight_map is not None and weight_map.get(name) != fname:
          raise ValueError(f"tensor {name!r} is in shard {fname} but {INDEX_FILE} maps it to "
                           f"{weight_map.get(name)!r}")
        sl = handle.get_slice(name)
        self.info[name] = (fname, tuple(sl.get_shape()), sl.get_dtype())
    if weight_map is not None:
      lost = sorted(set(weight_map) - set(self.info))
      if lost:
        raise ValueError(f"tensors {lost[:5]} are in {INDEX_FILE} but not in the shard it names "
                         f"({weight_map[lost[0]]} for {lost[0]!r})")

  def read(self, name: str) -> np.ndarray:
    fname, _, dtype = self.info[name]
    a = self._files[fname].get_tensor(name)
    if self.check_finite and dtype in _FLOAT_DTYPES:
      bad = ~np.isfinite(a)
      if bad.any():
        raise ValueError(f"tensor {name} ({fname}) holds {int(bad.sum())} non-finite values (NaN or Inf), the "
                         f"first at {np.argwhere(bad)[0].tolist()} (load_hf(..., check_finite=False) skips this "
                         f"check)")
    return a

  def nbytes(self, name: str) -> int:
    _, shape, dtype = self.info[name]
    return math.prod(shape) * np.dtype(_NP_DTYPE.get(dtype, np.uint8)).itemsize


def _check_tensors(ckpt: _Checkpoint, expected: dict[str, _Expected], fmt: str) -> None:
  """Strict name, shape and dtype check of the whole checkpoint, before anything is read."""
  present = set(ckpt.info)
  skipped = {n for n in present if fmt == "kimi_k3" and n.startswith(VISION_PREFIXES)}
  missing = sorted(set(expected) - present)
  if missing:
    details = ", ".join(f"{n} {list(expected[n].shape)}" for n in missing[:8])
    raise ValueError(f"checkpoint {ckpt.path} is missing {len(missing)} tensors the {fmt} config needs: {details}"
                     + (" ..." if len(missing) > 8 else ""))
  unexpected = sorted(present - set(expected) - skipped)
  if unexpected:
    raise ValueError(f"checkpoint {ckpt.path} has {len(unexpected)} tensors the {fmt} config does not use: "
                     f"{unexpected[:8]}" + (" ..." if len(unexpected) > 8 else "")
                     + (" (vision tensors are only skipped in the kimi_k3 format)"
                        if any(n.startswith(VISION_PREFIXES) for n in unexpected) else ""))
  for name, exp in expected.items():
    fname, shape, dtype = ckpt.info[name]
    if shape != exp.shape or dtype not in exp.dtypes:
      raise ValueError(f"tensor {name} ({fname}): expected shape {list(exp.shape)} with dtype in "
                       f"{list(exp.dtypes)}, got shape {list(shape)} dtype {dtype}")


class _Progress:
  """A ``k3jax.progress`` bar of checkpoint bytes read, noting parameters placed and tensors read (a ``with``)."""

  def __init__(self, ckpt: _Checkpoint, total_params: int, names: Iterable[str], enabled: bool):
    self.ckpt, self.total_params = ckpt, total_params
    names = list(names)
    self.total_tensors = len(names)
    self.params = 0
    self._seen: set[str] = set()
    self.bar = progress_lib.bar("load_hf", sum(ckpt.nbytes(n) for n in names), enabled=enabled, unit="B",
                                unit_scale=True, unit_divisor=1024, postfix=self._counts())

  def __enter__(self) -> _Progress:
    return self

  def __exit__(self, *exc) -> None:
    self.bar.close()

  def _counts(self) -> str:
    return f"{self.params}/{self.total_params} parameters, {len(self._seen)}/{self.total_tensors} tensors"

  def _note(self) -> None:
    self.bar.set_postfix_str(self._counts(), refresh=False)

  def read(self, name: str) -> np.ndarray:
    """``ckpt.read(name)``, counting its bytes once however often it is read."""
    if name not in self._seen:
      self._seen.add(name)
      self._note()
      self.bar.update(self.ckpt.nbytes(name))
    return self.ckpt.read(name)

  def placed(self) -> None:
    """Counts one more parameter placed."""
    self.params += 1
    self._note()


class _Source:
  """Blocks of one parameter (unpadded, checkpoint dtype), read only as far as a block needs."""

  def __init__(self, rule: HfRule, prefix: str, mxfp4: bool, progress: _Progress):
    self.rule, self.prefix, self.mxfp4, self.progress = rule, prefix, mxfp4, progress
    self._whole: np.ndarray | None = None

  def _expert(self, e: int) -> np.ndarray:
    names = [self.prefix + n for n in expert_names(self.rule, e, self.mxfp4)]
    if self.mxfp4:
      a = mxfp4_dequantize(self.progress.read(names[0]), self.progress.read(names[1]), names[0])
    else:
      a = self.progress.read(names[0])
    return self.rule.convert(a, names[0])

  def block(self, bounds: list[tuple[int, int]]) -> np.ndarray:
    """The parameter's ``[start, stop)`` block per dim (bounds within the unpadded shape)."""
    if self.rule.num_experts:
      (e0, e1), rest = bounds[0], bounds[1:]
      experts = [self._expert(e) for e in range(e0, e1)]
      stack = np.stack(experts) if experts else np.zeros((0,) + self.rule.shape[1:], np.float32)  # padding only
      return stack[(slice(None),) + tuple(slice(a, b) for a, b in rest)]
    if self._whole is None:
      name = self.prefix + self.rule.hf
      self._whole = self.rule.convert(self.progress.read(name), name)
    return self._whole[tuple(slice(a, b) for a, b in bounds)]


def _padded_block(source: _Source, index: tuple, padded: tuple[int, ...], name: str, dtype) -> np.ndarray:
  """Block ``index`` of padded parameter ``name``: real values in front, ``padding.pad_param``'s fill after."""
  real = source.rule.shape
  want = [idx.indices(p)[:2] for idx, p in zip(index, padded)]
  bounds = [(min(a, r), min(b, r)) for (a, b), r in zip(want, real)]
  blk = padding.pad_param(name, source.block(bounds), [b - a for a, b in want])
  return np.ascontiguousarray(blk.astype(dtype))


def _abstract_params(cfg: K3Config) -> tuple[nnx.GraphDef, nnx.State, list]:
  graphdef, state = nnx.split(nnx.eval_shape(lambda: KimiK3Model(cfg, rngs=nnx.Rngs(0))))
  return graphdef, state, list(nnx.to_flat_state(state))


def _check_rules_cover(rules: list[HfRule], flat: Iterable) -> None:
  """The name table and the model agree on every parameter and its shape (guards against model changes)."""
  by_path = {r.path: r for r in rules}
  params = {path: var.shape for path, var in flat}
  unmapped = sorted(set(params) - set(by_path), key=str)
  extra = sorted(set(by_path) - set(params), key=str)
  if unmapped or extra:
    raise ValueError(f"checkpoint name table and KimiK3Model disagree: parameters without a checkpoint tensor "
                     f"{['.'.join(map(str, p)) for p in unmapped[:5]]}, table entries without a parameter "
                     f"{['.'.join(map(str, p)) for p in extra[:5]]}")
  for path, shape in params.items():
    if tuple(shape) != by_path[path].shape:
      raise ValueError(f"parameter {'.'.join(map(str, path))} has shape {tuple(shape)} but its checkpoint tensor "
                       f"{by_path[path].hf} converts to {by_path[path].shape}")


def load_hf(path: str | os.PathLike, mesh: jax.sharding.Mesh | None = None, config: K3Config | None = None, *,
            progress: bool = True, check_finite: bool = True) -> tuple[K3Config, KimiK3Model]:
  """Loads a Kimi-Linear or Kimi-K3 HF checkpoint into a ``KimiK3Model``.

  Args:
    path: directory with ``config.json`` and ``model.safetensors.index.json`` plus shards (or one
      ``model.safetensors``); tensor names in either of ``NAMINGS`` (the published or the transformers-saved).
    mesh: None places every parameter whole on this process's first device. A mesh with the ``"model"`` axis pads
      the model with ``PaddingPlan.for_config(cfg, mesh size)`` and places each parameter directly with the
      sharding of its logical axes (as ``k3jax.sharding.shard_model`` would).
    config: None builds the config from ``config.json``. A ``K3Config`` sets what ``config.json`` does not
      hold (dtypes, ``impl``, ``latent_norm_eps``); every architecture field it shares with ``config.json``
      must agree.
    progress: show a ``k3jax.progress`` bar on stderr (checkpoint bytes read, parameters placed, tensors
      read); False shows nothing.
    check_finite: reject a float tensor holding NaN or Inf (one extra pass over each tensor as it is read).

  Returns:
    ``(cfg, model)``: the unpadded config and the model (``model.cfg`` is the padded config with a mesh; run
    it with ``k3jax.steps.jit_model_step(model, mesh, vocab_size=cfg.vocab_size)``).

  Raises:
    ValueError: a missing, unexpected, wrongly shaped or typed tensor (named, with what was expected), a
      non-finite float tensor (with ``check_finite``), a non-zero tail of a K3 ``A_log``, an MXFP4 NaN scale,
      inconsistent index/shards, a corrupt or truncated shard or a ``config.json`` / index that is not a JSON
      object (each naming the file, the library's error chained), a ``config`` that contradicts
      ``config.json``, a mesh without the ``"model"`` axis, or a tensor held under both ``NAMINGS`` or a mix
      of the two (naming the tensors).
    NotImplementedError: a quantization other than MXFP4 routed experts.
  """
  path = os.fspath(path)
  raw = _read_json(os.path.join(path, "config.json"), "config.json")
  fmt = raw.get("model_type")
  cfg = K3Config.from_hf(raw)
  if config is not None:
    if not isinstance(config, K3Config):
      raise ValueError(f"config must be a K3Config or None, got {type(config).__name__}")
    diff = _architecture_diff(config, cfg)
    if diff:
      raise ValueError(f"config contradicts {os.path.join(path, 'config.json')} on {{key: (config, config.json)}} "
                       f"{diff}")
    cfg = config
  sharding_lib.check_load_mesh(mesh)
  mxfp4 = _mxfp4_from_config(raw)
  prefix = K3_PREFIX if fmt == "kimi_k3" else ""
  ckpt = _Checkpoint(path, check_finite)
  rules = hf_rules(cfg, fmt, _naming_of(cfg, fmt, set(ckpt.info)))
  _check_rules_cover(rules, _abstract_params(cfg)[2])
  expected = _expected_tensors(rules, prefix, mxfp4)
  _check_tensors(ckpt, expected, fmt)
  plan = padding.PaddingPlan.for_config(cfg, 1 if mesh is None else sharding_lib.mesh_size(mesh))
  graphdef, state, flat = _abstract_params(plan.config(cfg))
  by_path = {r.path: r for r in rules}
  with _Progress(ckpt, len(flat), expected, progress) as bar:
    for path, var in flat:
      target = sharding_lib.param_target(".".join(map(str, path)), var.shape,
                                         var.get_metadata()["logical_axes"], mesh)
      source = _Source(by_path[path], prefix, mxfp4, bar)
      dtype = np.dtype(var.dtype)
      var.set_value(jax.make_array_from_callback(
          tuple(var.shape), target,
          lambda index, source=source, shape=tuple(var.shape), name=str(path[-1]), dtype=dtype:
          _padded_block(source, index, shape, name, dtype)))
      bar.placed()
  return cfg, nnx.merge(graphdef, state)


def hf_tensor_names(config: K3Config, fmt: str, mxfp4: bool = False,
                    naming: str = "original") -> dict[str, tuple[int, ...]]:
  """HF name -> shape of every text tensor a checkpoint of ``config`` in ``fmt`` and ``naming`` holds."""
  if fmt not in FORMATS:
    raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
  prefix = K3_PREFIX if fmt == "kimi_k3" else ""
  return {n: e.shape for n, e in _expected_tensors(hf_rules(config, fmt, naming), prefix, mxfp4).items()}


__all__ = ["FORMATS", "NAMINGS", "hf_tensor_names", "load_hf", "mxfp4_dequantize"]
