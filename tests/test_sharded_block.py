"""benchmarks/sharded_block.py in --tiny mode: 1 device saves the reference, the 9 CPU devices compare with it."""

import dataclasses
import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

from support import device_mesh, needs_devices

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "sharded_block.py"
_spec = importlib.util.spec_from_file_location("sharded_block", _PATH)
sharded_block = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sharded_block  # dataclasses look their module up while the file executes
_spec.loader.exec_module(sharded_block)

ROW_FIELDS = ("devices", "mesh", "padding", "prefill_ms", "prefill_tok_s", "decode_ms", "decode_tok_s", "peak_gib",
              "params_cache_gib", "num_experts")
TABLE_COLUMNS = ("devices", "mesh", "padding", "prefill ms", "prefill tok/s", "decode ms/step", "decode tok/s",
                 "peak GiB/dev", "params+cache GiB/dev", "max rel diff vs ref")
QUICK = ["--reps", "1", "--watchdog", "0"]
STATS = ("token_rel_median", "token_rel_p99", "token_rel_max", "tokens_above_tol", "tokens_compared")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_sharded_logits_match_one_device(tmp_path, capsys, dtype):
  needs_devices(9)
  ref, log = tmp_path / "ref.npz", tmp_path / "sb.jsonl"
  status = [sharded_block.main(["--tiny", "--dtype", dtype, "--devices", "1", "--save", str(ref), "--json", str(log),
                                *QUICK]),
            sharded_block.main(["--compare", str(ref), "--json", str(log), *QUICK])]  # the dtype comes from ref
  out = capsys.readouterr().out
  assert status == [0, 0]
  single, sharded = [json.loads(line) for line in log.read_text().splitlines()]
  assert (single["devices"], sharded["devices"]) == (1, 9)
  assert single["dtype"] == sharded["dtype"] == dtype
  if dtype == "float32":
    assert sharded["impl"] == "xla" and sharded["tolerance"] == 1e-3
  for row in (single, sharded):
    assert set(ROW_FIELDS) <= set(row)
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0 and row["params_cache_gib"] > 0
  # The tiny model's dims do not divide by 9: the sharded run is padded, and still matches.
  assert single["padding"] == "none" and "num_experts 8->9" in sharded["padding"]
  assert sharded["ok"] and 0 <= sharded["max_rel_diff"] <= sharded_block.TOLERANCES[dtype]
  for phase, tokens in (("prefill", 3 * sharded_block.PREFILL_ROWS), ("decode", (1 + 3) * 3)):
    stats = {k: sharded[f"{phase}_{k}"] for k in STATS}
    assert all(np.isfinite(v) for v in stats.values()), stats
    assert 0 <= stats["token_rel_median"] <= stats["token_rel_p99"] <= stats["token_rel_max"], stats
    assert stats["token_rel_max"] >= sharded[f"{phase}_rel_diff"], stats  # a row's scale <= the global one
    assert (stats["tokens_above_tol"], stats["tokens_compared"]) == (0, tokens)
  assert sharded["reference_devices"] == 1 and sharded["prefill_scaling_efficiency"] > 0
  assert {f: sharded[f] for f in sharded_block.RUN_FIELDS} == {f: single[f] for f in sharded_block.RUN_FIELDS}
  for column in TABLE_COLUMNS:
    assert column in out
  assert "scaling efficiency" in out and "OK, tol" in out and "0 of 12 above tol" in out


def _fake_reference(path: pathlib.Path) -> sharded_block.Output:
  """A reference .npz of random logits with the tiny sizes (no model run), and its Output."""
  rng = np.random.default_rng(0)
  row = dict(devices=1, prefill_ms=10.0, decode_ms=1.0, tiny=True, dtype="bfloat16", experts=8, seqs=3,
             prompt_len=16, prefill_batch=3, context=64, decode_steps=3, warmup=1, seed=0, prefill_tokens=48)
  out = sharded_block.Output(row=row, prefill_logits=rng.standard_normal((3, 4, 256), np.float32),
                             decode_logits=rng.standard_normal((4, 3, 256), np.float32))
  np.savez(path, prefill_logits=out.prefill_logits, decode_logits=out.decode_logits, run=json.dumps(row))
  return out


def test_compare_flags_wrong_logits(tmp_path):
  ref = tmp_path / "ref.npz"
  out = _fake_reference(ref)
  tol = sharded_block.TOLERANCES["bfloat16"]
  scale = max(np.abs(out.prefill_logits).max(), np.abs(out.decode_logits).max())
  out.decode_logits[-1, 0, 0] += 2 * tol * scale  # one logit of the last step
  sharded_block.compare(out, str(ref))
  assert not out.row["ok"] and out.row["max_rel_diff"] == pytest.approx(2 * tol, rel=1e-3)
  assert out.row["prefill_rel_diff"] == 0.0
  # The per-token numbers tell one bad token from a bad run.
  assert (out.row["prefill_tokens_above_tol"], out.row["prefill_token_rel_max"]) == (0, 0.0)
  decode = (out.row["decode_tokens_above_tol"], out.row["decode_tokens_compared"], out.row["decode_token_rel_median"])
  assert decode == (1, 12, 0.0)
  assert out.row["prefill_tokens"] == 48  # the run's own numbers survive the comparison's
  cut = dataclasses.replace(out, row=dict(out.row), decode_logits=out.decode_logits[:, :, :-1])
  with pytest.raises(ValueError, match="decode logits of shape"):
    sharded_block.compare(cut, str(ref))


def test_token_stats_match_a_float64_oracle():
  """Rows with known rel = |diff| / row scale (float64): the statistics are NumPy's of those values."""
  rng = np.random.default_rng(1)
  rel = np.concatenate([rng.uniform(0, 2e-3, 198), [0.0, 0.5]])  # 200 tokens: p99 is the second largest
  scale = rng.uniform(1, 30, rel.size)
  ref = rng.uniform(-1, 1, (rel.size, 50)) * scale[:, None]  # |entries| < scale ...
  ref[:, 7] = -scale  # ... and the row's largest |logit|, negative
  logits = ref.copy()
  logits[np.arange(rel.size), rng.integers(0, 50, rel.size)] += rel * scale * rng.choice([-1, 1], rel.size)
  as_tokens = lambda x: x.astype(np.float32).reshape(4, 50, 50)
  stats = sharded_block.token_stats(as_tokens(logits), as_tokens(ref), tol=1e-3)
  assert stats["token_rel_median"] == pytest.approx(np.median(rel), rel=1e-4)
  assert stats["token_rel_p99"] == pytest.approx(np.percentile(rel, 99, method="higher"), rel=1e-4)
  assert stats["token_rel_max"] == pytest.approx(0.5, rel=1e-5)
  assert (stats["tokens_above_tol"], stats["tokens_compared"]) == (int(np.sum(rel > 1e-3)), 200)
  # An all-zero reference row: equal -> 0, different -> inf; a NaN row counts as above the tolerance.
  zero = np.zeros((3, 4), np.float32)
  bad = zero.copy()
  bad[1, 0] = 1.0
  stats = sharded_block.token_stats(bad, zero, tol=1e-3)
  assert (stats["tokens_above_tol"], stats["token_rel_median"], stats["token_rel_max"]) == (1, 0.0, np.inf)
  bad[2, 3] = np.nan
  stats = sharded_block.token_stats(bad, zero, tol=1e-3)
  assert stats["tokens_above_tol"] == 2 and np.isnan(stats["token_rel_max"])


def test_compare_takes_the_reference_sizes(tmp_path):
  ref = tmp_path / "ref.npz"
  _fake_reference(ref)
  args = sharded_block._resolve(sharded_block._parser().parse_args(["--compare", str(ref)]))
  assert (args.tiny, args.dtype, args.seqs, args.prompt_len, args.context, args.experts) == (
      True, "bfloat16", 3, 16, 64, 8)
  with pytest.raises(ValueError, match="--context=128 contradicts the reference"):
    sharded_block._resolve(sharded_block._parser().parse_args(["--compare", str(ref), "--context", "128"]))


def test_compare_rejects_another_dtype(tmp_path):
  ref = tmp_path / "ref.npz"
  out = _fake_reference(ref)
  with pytest.raises(ValueError, match="--dtype='float32' contradicts the reference .* ran dtype='bfloat16'"):
    sharded_block._resolve(sharded_block._parser().parse_args(["--compare", str(ref), "--dtype", "float32"]))
  out.row["dtype"] = "float32"
  with pytest.raises(ValueError, match="this run's dtype is 'float32', the reference .* ran 'bfloat16'"):
    sharded_block.compare(out, str(ref))


def test_float32_mode_sets_every_dtype():
  parse = lambda *argv: sharded_block._resolve(sharded_block._parser().parse_args(["--tiny", *argv]))
  f32, bf16 = (sharded_block.block_config(parse("--dtype", d, "--impl", "xla")) for d in ("float32", "bfloat16"))
  assert len(sharded_block.F32_FIELDS) == 6
  assert {getattr(f32, f).name for f in sharded_block.F32_FIELDS} == {"float32"}
  assert (bf16.dtype.name, bf16.cache_dtype.name, bf16.state_dtype.name) == ("bfloat16", "bfloat16", "float32")
  with pytest.raises(NotImplementedError, match="--dtype float32 runs --impl xla only"):
    parse("--dtype", "float32", "--impl", "pallas")


def test_device_init_does_not_depend_on_the_mesh(monkeypatch):
  """The jitted initialisation (the path of K3 sizes) gives the same real parameters on 1 and 9 devices, zero-padded."""
  import jax
  from flax import nnx

  monkeypatch.setattr(sharded_block, "HOST_INIT_BYTES", 0)
  args = sharded_block._resolve(sharded_block._parser().parse_args(["--tiny"]))
  args.impl = "xla"
  cfg = sharded_block.block_config(args)
  params = {}
  for n in (1, 9):
    model, plan = sharded_block.init_model(cfg, device_mesh(n), seed=0,
                                           compiler_options={"xla_backend_optimization_level": 0})
    params[n] = {path: np.asarray(jax.device_get(var.get_value()))
                 for path, var in nnx.to_flat_state(nnx.state(model))}
  assert plan.applied  # the 9-device model is padded
  for path, one in params[1].items():
    nine = params[9][path]
    real = nine[tuple(slice(0, s) for s in one.shape)]
    np.testing.assert_array_equal(real, one, err_msg=str(path))
    fill = -np.inf if path[-1] == "e_score_correction_bias" else 0
    assert (nine.size == one.size) or np.all(np.delete(nine.ravel(), np.ravel_multi_index(
        np.indices(one.shape).reshape(one.ndim, -1), nine.shape)) == fill), path
