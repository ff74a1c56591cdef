"""CPU smoke runs of benchmarks/mla_prefill.py, benchmarks/mla_decode.py, benchmarks/long_prompt.py and
benchmarks/prefix_cache.py at tiny sizes (impl xla), kernel_profile.py's trace summary on a made-up trace,
kda_prefill.py's paired overheads and kernel overheads on scripted times and its SMEM padding in interpret mode,
the harness's GPU timeline on made-up profiles and its clock sampler on a stand-in nvidia-smi, wgmma_rates.py's
cases lowered for sm_90a with their NumPy check values, and tma_rates.py's page formats lowered for sm_90a."""

import argparse
import contextlib
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The scripts import ``benchmarks.*`` from the repository root: ``python -m pytest`` has it on the path, the
# bare ``pytest`` entry point does not.
_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from benchmarks import (_harness, kda_prefill, kernel_profile, long_prompt, mla_decode, mla_prefill,  # noqa: E402
                        prefix_cache, tma_rates, wgmma_rates)
from pallas_kernels import util  # noqa: E402


def test_mla_prefill_smoke(tmp_path, capsys):
  log = tmp_path / "mla_prefill.jsonl"
  assert mla_prefill.main(["--smoke", "--json", str(log), "--watchdog", "0"]) == 0
  out = capsys.readouterr().out
  rows = [json.loads(line) for line in log.read_text().splitlines()]
  shapes = {(r["T"], r["N"], r["H"]) for r in rows}
  assert shapes == {(256, 1, 2), (256, 2, 2)}
  assert len(rows) == len(shapes) * (1 + len(mla_prefill.PEERS + mla_prefill.EXTRA_PEERS))
  for row in rows:
    assert set(row) == set(mla_prefill.ROW_KEYS), row
    if row["status"] != "ok":
      # cuDNN and torch need a GPU (skipped without one) and fp16/bf16/fp8 inputs (the f32 smoke is unsupported
      # on a GPU): reported with the reason, not run.
      why = ("skipped: ", "unsupported: ") if util.is_hopper_gpu() else ("skipped: ",)
      assert row["impl"] in mla_prefill.PEERS and row["status"].startswith(why), row
      assert row["ms"] is None and row["tflops"] is None
      continue
    assert np.isfinite(row["ms"]) and row["ms"] > 0 and row["tflops"] > 0 and 0 < row["peak_frac"] < 1, row
    assert row["seq_len"] * row["N"] == row["T"]
  ours = [r for r in rows if r["impl"].startswith("ours")]
  assert [r["impl"] for r in ours] == ["ours (xla)"] * 2 and all(r["status"] == "ok" for r in ours)
  # XLA's dense attention through the peers' batch layout, v padded to 192: the same numbers as ours (f32).
  dense = [r for r in rows if r["impl"] == "jax-xla"]
  assert len(dense) == 2 and all(r["status"] == "ok" and r["v_dim"] == 192 and r["rel_rmse"] < 1e-5
                                 for r in dense), dense
  # Without a GPU the peers are skipped; on one, the f32 smoke's inputs are unsupported by every GPU-only peer.
  assert "ours (xla)" in out and "TFLOP/s" in out
  assert ("unsupported: " if util.is_hopper_gpu() else "skipped: cpu backend") in out


def test_mla_decode_ragged_smoke(tmp_path, monkeypatch, capfd):
  """``--ragged``: lengths from one fixed draw in [1, context]; bytes and FLOPs count the tokens actually cached;
  ``--splits`` and ``--layouts`` time each split count and layout given, ``--fp8-paths`` each fp8 path after the
  bf16 cache's row."""
  lens = mla_decode.ragged_lengths(8, 256)
  assert lens.dtype == np.int32 and lens.min() >= 1 and lens.max() <= 256 and len(set(lens.tolist())) > 1
  np.testing.assert_array_equal(lens, mla_decode.ragged_lengths(8, 256))
  out = tmp_path / "rows.json"
  monkeypatch.setattr(sys, "argv", ["mla_decode.py", "--impl", "xla", "--batch", "8", "--context", "256", "--heads",
                                    "16", "--no-flashmla", "--copy-gib", "0.001", "--ragged", "--splits", "4",
                                    "--layouts", "balanced", "--cache-dtypes", "bfloat16", "float8_e4m3fn",
                                    "--fp8-paths", "ring", "registers", "--json", str(out)])
  mla_decode.main()
  assert f"ragged lengths, {lens.sum()} tokens" in capfd.readouterr().out  # fd capture: faulthandler needs one
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r["partial"], r["splits"], r["layout"], r["cache"], r["fp8_path"]) for r in rows] == [
      (partial, 4, "balanced", cache, path) for partial in ("bfloat16", "float32")
      for cache, path in (("bfloat16", None), ("float8_e4m3fn", "ring"), ("float8_e4m3fn", "registers"))]
  for r in rows:
    assert r["ragged"] and r["tokens"] == lens.sum()
    assert r["tflops"] * 1e12 * r["time_us"] * 1e-6 == pytest.approx(mla_decode.decode_flops(16, int(lens.sum())))
    row_bytes = 576 * 2 if r["cache"] == "bfloat16" else 640
    assert r["tbs"] * 1e12 * r["time_us"] * 1e-6 == pytest.approx(lens.sum() * row_bytes)
    assert (r["vs_bf16"] is None) == (r["cache"] == "bfloat16")


def test_mla_decode_resident_pages_smoke(tmp_path, monkeypatch, capfd):
  """``--resident-pages``: every page id from the first N pages (each of them taken), without it a permutation of
  all pages; the rows say so; N < 1 is refused."""
  key = jax.random.key(0)
  np.testing.assert_array_equal(np.sort(np.asarray(mla_decode.page_order(key, 64))), np.arange(64))
  resident = np.asarray(mla_decode.page_order(key, 64, 3))
  assert resident.dtype == np.int32 and resident.shape == (64,) and set(resident.tolist()) == {0, 1, 2}
  out = tmp_path / "rows.json"
  argv = ["mla_decode.py", "--impl", "xla", "--batch", "2", "--context", "256", "--heads", "16", "--no-flashmla",
          "--copy-gib", "0.001", "--json", str(out)]
  monkeypatch.setattr(sys, "argv", argv + ["--resident-pages", "3"])
  mla_decode.main()
  assert "page ids from the first 3 pages only" in capfd.readouterr().out
  assert [json.loads(line)["resident_pages"] for line in out.read_text().splitlines()] == [3, 3]
  monkeypatch.setattr(sys, "argv", argv + ["--resident-pages", "0"])
  with pytest.raises(SystemExit):
    mla_decode.main()
  assert "argument --resident-pages: must be >= 1, got 0" in capfd.readouterr().err


def test_mla_decode_models_how_a_batch_spreads_over_the_sms():
  """Page-times of the grid's programs list-scheduled on 132 SMs: a full batch at S = 2 is one wave of 256-page
  programs (4 SMs idle); a ragged batch at S = 2 is set by its longest sequence, at S = 8 spread wider."""
  full, ragged = np.full(32, 32768), mla_decode.ragged_lengths(32, 32768)
  assert [mla_decode.modelled_page_times(full, 512, s, 2) for s in (2, 8)] == [258.0, 264.0]
  assert [round(mla_decode.modelled_page_times(ragged, 512, s, 2)) for s in (2, 4, 8)] == [258, 191, 162]
  assert mla_decode.modelled_page_times(np.zeros(4), 512, 2, 1) == pytest.approx(0.2)
  # Balanced splits: the equal splits on full sequences (two empty programs more a sequence); one 32K sequence
  # among 2K ones takes four 128-page programs instead of two of 256.
  one_long = np.array([32768] + [2048] * 31)
  assert mla_decode.modelled_page_times(full, 512, 2, 2, balanced=True) == 258.0
  assert [round(mla_decode.modelled_page_times(one_long, 512, 2, 2, balanced=b)) for b in (False, True)] == [258, 136]


def test_tunings_argument():
  assert mla_prefill.tuning_arg("64x4") == mla_prefill.MlaPrefillTuning(kernel_block_k=64, num_stages=4)
  with pytest.raises(argparse.ArgumentTypeError, match="BLOCK_KxSTAGES"):
    mla_prefill.tuning_arg("64")


def test_causal_flops_counts_the_visible_pairs():
  # One sequence of 3 tokens: 1 + 2 + 3 = 6 visible pairs, 2 (Dqk + Dv) FLOPs per pair and head.
  assert mla_prefill.causal_flops([3], H=2, dqk=192, dv=128) == 6 * 2 * 2 * 320
  assert mla_prefill.causal_flops([3, 3], H=1) == 2 * mla_prefill.causal_flops([3], H=1)


def test_long_prompt_chunked_equals_one_shot(tmp_path, capsys):
  log = tmp_path / "long_prompt.jsonl"
  assert long_prompt.main(["--tiny", "--dtype", "float32", "--json", str(log), "--watchdog", "0"]) == 0
  out = capsys.readouterr().out
  (row,) = [json.loads(line) for line in log.read_text().splitlines()]
  assert set(row) == set(long_prompt.ROW_KEYS), row
  assert (row["prompt_len"], row["chunk"], row["devices"], row["impl"]) == (64, 16, 1, "xla")
  assert row["chunked_status"] == row["oneshot_status"] == "ok"
  for key in ("chunked_ms", "chunked_tok_s", "oneshot_ms", "oneshot_tok_s", "decode_ms", "decode_tok_s"):
    assert np.isfinite(row[key]) and row[key] > 0, key
  assert len(row["chunk_ms"]) == 64 // 16 and all(np.isfinite(row["chunk_ms"]))
  assert row["decode_context"] == 64
  # f32 everywhere, full-precision matmuls: the chunked path (cached prefix in absorbed form, merged by lse)
  # and the one-shot path differ only in summation order.
  assert row["logits_max_rel_diff"] < 1e-4, row
  assert "one-shot vs chunked" in out and "decode" in out


def test_prefix_cache_hit_matches_the_uncached_prefill(tmp_path, capsys):
  log = tmp_path / "prefix_cache.jsonl"
  assert prefix_cache.main(["--tiny", "--dtype", "float32", "--reps", "1", "--json", str(log),
                            "--watchdog", "0"]) == 0
  out = capsys.readouterr().out
  (row,) = [json.loads(line) for line in log.read_text().splitlines()]
  assert set(row) == set(prefix_cache.ROW_KEYS), row
  assert (row["prefix_len"], row["new_len"], row["interval"], row["impl"]) == (256, 64, 64, "xla")
  # 320 tokens at a 64-token interval: the uncached admit saves 5 checkpoints, the repeat hits at 256 (the
  # longest boundary below 320) and prefills 64; the checkpoint prefill of the 256-token prefix saves 4.
  assert (row["checkpoints_saved"], row["cached_tokens"], row["cached_prefill_tokens"], row["ckpt_count"]) == (
      5, 256, 64, 4)
  for key in ("uncached_ms", "cached_ms", "speedup", "prefill_ms", "prefill_ckpt_ms"):
    assert np.isfinite(row[key]) and row[key] > 0, key
  assert np.isfinite(row["ckpt_overhead_pct"])
  assert len(row["uncached_ms_reps"]) == len(row["prefill_ckpt_ms_reps"]) == 1
  # f32 everywhere, full-precision matmuls: the hit (a copied checkpoint, the prefix's latent rows read from the
  # shared pages) and the whole-prompt prefill differ only in summation order.
  assert row["logits_max_rel_diff"] < 1e-4, row
  k3 = row["memory_kimi_k3"]
  assert set(k3) == set(prefix_cache.MEMORY_KEYS) and k3["interval"] == 64
  assert k3["checkpoint_bytes"] == k3["recurrent_bytes"] + k3["conv_bytes"]
  assert k3["bytes_per_cached_token"] == k3["checkpoint_bytes"] / 64 + k3["page_bytes_per_token"]
  assert row["memory_kimi_k3_bf16_state"]["recurrent_bytes"] * 2 == k3["recurrent_bytes"]
  assert "command: python3 benchmarks/prefix_cache.py --tiny" in out and "device: " in out
  assert "tokens skipped" in out and "overhead" in out


def test_long_prompt_profile_sorts_kernels_into_families(monkeypatch):
  fake = [("mla_prefill_mosaic_gpu_kernel", 5.0), ("nvjet_hsh_128x256_64x4", 3.0), ("loop_add_fusion", 1.0),
          ("input_transpose_fusion", 0.25), ("loop_add_fusion", 0.5), ("cutlass_80_tensorop_gemm", 2.0)]

  @contextlib.contextmanager
  def cupti():
    records = []
    yield records
    records.extend(fake)

  monkeypatch.setattr(_harness, "cupti_kernels", cupti)
  prof, out = long_prompt.profile(lambda: jnp.ones(3))
  assert (np.asarray(out) == 1).all()
  assert prof["family_ms"] == {"pallas": 5.0, "matmul": 5.0, "other": 1.75} and prof["kernel_ms"] == 11.75
  assert prof["top_other"] == [("loop_add_fusion", 1.5), ("input_transpose_fusion", 0.25)]
  assert prof["wall_over_ops"] == prof["wall_ms"] / 10.0


def test_long_prompt_profile_needs_a_gpu():
  if util.is_hopper_gpu():
    pytest.skip("the error of a machine without a Hopper GPU")
  with pytest.raises(NotImplementedError, match="--profile"):
    long_prompt.main(["--tiny", "--dtype", "float32", "--profile", "--watchdog", "0"])


def test_kernel_profile_summarises_phases_per_program(tmp_path):
  # Two programs (tids) of the profiler's Chrome trace format: a phase "a" once and a phase "b" twice per
  # program (the second time nested in "c"), times in thousands of cycles, events not in time order within a file.
  def trace(tid, t0, b_times):
    events = [dict(name="a", ph="B", ts=t0, tid=tid), dict(name="a", ph="E", ts=t0 + 1.0, tid=tid),
              dict(name="b", ph="B", ts=t0 + 1.0, tid=tid), dict(name="b", ph="E", ts=t0 + 1.0 + b_times[0], tid=tid),
              dict(name="c", ph="B", ts=t0 + 5.0, tid=tid), dict(name="b", ph="B", ts=t0 + 5.0, tid=tid),
              dict(name="b", ph="E", ts=t0 + 5.0 + b_times[1], tid=tid), dict(name="c", ph="E", ts=t0 + 8.0, tid=tid)]
    return events[::-1]

  path = tmp_path / "1-trace.json"
  path.write_text(json.dumps(dict(traceEvents=trace(1, 0.0, (2.0, 3.0)) + trace(2, 100.0, (2.0, 1.0)))))
  (summary,) = kernel_profile.summarise(str(tmp_path))
  assert summary["programs"] == 2 and summary["span_kcycles"] == pytest.approx(8.0)
  a, b, c = (summary["phases"][n] for n in "abc")
  assert a["per_program"] == 1 and a["median_kcycles"] == pytest.approx(1.0) and a["share"] == pytest.approx(1 / 8)
  assert b["per_program"] == 2 and b["median_kcycles"] == pytest.approx(2.0)
  assert b["total_kcycles"] == pytest.approx(4.0)  # the median of 5 and 3
  assert c["total_kcycles"] == pytest.approx(3.0)


@pytest.mark.parametrize("resident", [None, 3])
def test_kernel_profile_mla_inputs_take_resident_pages(resident):
  """The profiled MLA decode call's page ids: every page of the cache once, or with ``--resident-pages 3`` only the
  first three (the L2-resident working set of ``benchmarks/mla_decode.py``)."""
  args = argparse.Namespace(batch=2, context=4 * 64, heads=16, cache_dtype="float8_e4m3fn", resident_pages=resident)
  q, cache, table, lens = kernel_profile.mla_decode_inputs(args)
  assert q.shape == (2, 16, 576) and q.dtype == jnp.bfloat16 and lens.tolist() == [256, 256]
  assert cache.shape == (8, 64, 640) and cache.dtype == jnp.float8_e4m3fn
  assert table.shape == (2, 4) and table.dtype == jnp.int32
  ids = np.asarray(table).ravel()
  if resident is None:
    assert sorted(ids.tolist()) == list(range(8))
  else:
    assert set(ids.tolist()) == {0, 1, 2}


def test_kernel_profile_refuses_no_resident_pages(capsys):
  with pytest.raises(SystemExit):
    kernel_profile.main(["mla-decode", "--resident-pages", "0"])
  assert "argument --resident-pages: must be >= 1, got 0" in capsys.readouterr().err


def test_kda_prefill_paired_overheads_cancel_drift(monkeypatch):
  """The GPU slows by 40% over the rounds; a variant 3% slower than the base in every round measures +3%, and one
  round where a variant ran 2% slow moves its median by nothing and shows in its ratio range."""
  calls = []

  def fake_bench(run, iters, reps=5):
    assert (iters, reps) == (20, 1)
    calls.append(run)
    base = 1.0 + 0.1 * ((len(calls) - 1) // 3)  # drift: each round is slower than the one before
    return base * {"base": 1.0, "v": 1.03, "w": 1.0}[run] * (1.02 if len(calls) == 7 else 1.0)

  monkeypatch.setattr(kda_prefill, "bench", fake_bench)
  out = kda_prefill.paired_overheads({"base": "base", "v": "v", "w": "w"}, rounds=5)
  assert len(calls) == 15 and calls[:3] == ["base", "v", "w"] and calls[3:6] == ["v", "w", "base"]
  assert set(out) == {"base", "v", "w"} and set(out["base"]) == {"ms"}
  np.testing.assert_allclose(out["v"]["overhead"], 0.03, rtol=1e-9)
  np.testing.assert_allclose(out["w"]["overhead"], 0.0, atol=1e-12)
  np.testing.assert_allclose([out["w"]["ratio_lo"], out["w"]["ratio_hi"]], [1.0, 1.02], rtol=1e-9)
  np.testing.assert_allclose(out["base"]["ms"], 1.2, rtol=1e-9)


def test_kda_prefill_bench_fit_separates_a_streams_fixed_cost(monkeypatch):
  """Streams of n calls that cost 0.5 ms once and 1.2 ms per call, one stream of each length 10% slow: the fit
  gives the slope and the intercept (medians), while ``bench`` over 20 calls spreads the fixed cost on them."""
  clock, seen = [0.0], []

  def run(n):
    seen.append(n)
    clock[0] += (0.5 + 1.2 * n) * 1e-3 * (1.1 if seen.count(n) == 2 else 1.0)

  monkeypatch.setattr(kda_prefill.time, "perf_counter", lambda: clock[0])
  fit = kda_prefill.bench_fit(run)
  assert seen[0] == 1 and sorted(set(seen[1:])) == list(kda_prefill.FIT_COUNTS)
  assert fit["per_call_ms"] == pytest.approx(1.2) and fit["fixed_ms"] == pytest.approx(0.5)
  assert kda_prefill.bench(run, 20) == pytest.approx(1.2 + 0.5 / 20)


def test_kda_prefill_kernel_overheads_leave_out_the_prep_mode():
  """A variant's kernel overhead counts its non-prep kernels only, over the base's rest plus the fastest prep: a
  slow prep (the executable's mode) adds nothing, an extra stage-2 cost does."""
  prep, state = "kda_prefill_prep_mosaic_gpu_kernel", "kda_prefill_state_mosaic_gpu_kernel"
  tables = {"base": [("convert", 0.01), (prep, 1.40), (state, 0.35)],
            "slow_prep": [("convert", 0.01), (prep, 1.90), (state, 0.35)],
            "ckpt": [("convert", 0.01), (prep, 1.45), (state, 0.35), ("copy", 0.036)]}
  out = kda_prefill.kernel_overheads(tables)
  assert out["base_prep_ms"] == 1.40 and out["slow_prep_prep_ms"] == 1.90
  assert out["base_rest_ms"] == pytest.approx(0.36)
  assert out["slow_prep_kernel_overhead"] == pytest.approx(0.0)
  assert out["ckpt_kernel_overhead"] == pytest.approx(0.036 / 1.76)
  assert "base_kernel_overhead" not in out


def test_kda_prefill_padded_smem_keeps_results():
  """``padded_smem`` (the prep's one-program-per-SM timing) adds SMEM the kernel never touches: the prep's
  outputs are bitwise those without it (interpret mode, one chunk of one head), and plgpu.kernel is restored."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  from pallas_kernels.kda import prefill_prep
  from pallas_kernels.mosaic_interpret import interpret_mode

  rng = np.random.default_rng(0)
  T, H, K = 64, 1, 64
  raw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  args = (raw(T, H, K), raw(T, H, K), raw(T, H, K), raw(T, H, K),
          jnp.asarray(rng.standard_normal((T + 64, H)), jnp.float32), jnp.zeros((H,), jnp.float32),
          jnp.asarray(rng.standard_normal((H, K)), jnp.float32), jnp.asarray([[0], [50]], jnp.int32))
  prep = lambda: prefill_prep.prep(*args, scale=K ** -0.5, lower_bound=-5.0, smem_operands=True)
  real = plgpu.kernel
  with interpret_mode():
    want = prep()
    with kda_prefill.padded_smem(4096):
      assert plgpu.kernel is not real
      got = prep()
  assert plgpu.kernel is real
  for a, b in zip(want, got, strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _xspace(planes: str):
  from jax.profiler import ProfileData
  return ProfileData.from_text_proto(planes)


def test_gpu_events_keep_the_stream_lines_of_the_gpu_plane():
  profile = _xspace('''
    planes { id: 1 name: "/host:CPU" lines { id: 1 name: "python" timestamp_ns: 0
      events { metadata_id: 1 offset_ps: 0 duration_ps: 9000000 } }
      event_metadata { key: 1 value { id: 1 name: "host_work" } } }
    planes { id: 2 name: "/device:GPU:0"
      lines { id: 1 name: "Stream #13(Compute)" timestamp_ns: 1000
        events { metadata_id: 2 offset_ps: 5000000 duration_ps: 1000000 }
        events { metadata_id: 1 offset_ps: 2000000 duration_ps: 2500000 } }
      lines { id: 2 name: "XLA Ops" timestamp_ns: 1000
        events { metadata_id: 1 offset_ps: 2000000 duration_ps: 2500000 } }
      event_metadata { key: 1 value { id: 1 name: "prep" } }
      event_metadata { key: 2 value { id: 2 name: "state" } } }''')
  assert _harness.gpu_events(profile) == [("prep", 3.0, 5.5), ("state", 6.0, 7.0)]
  with pytest.raises(ValueError, match="no GPU plane"):
    _harness.gpu_events(_xspace('planes { id: 1 name: "/host:CPU" }'))
  with pytest.raises(ValueError, match="no stream events, lines: .'XLA Ops'"):
    _harness.gpu_events(_xspace('planes { id: 1 name: "/device:GPU:0" lines { id: 1 name: "XLA Ops" } }'))


def test_gpu_timeline_reads_the_profile_of_the_calls():
  """The trace of real jitted calls is written and read back: on the CPU it has no GPU plane to report; on a GPU
  its events are the calls' kernels, in order and with positive durations, the same kernels in every call."""
  import jax

  f = jax.jit(lambda x: jnp.sin(x) @ x)
  x = jnp.ones((32, 32))
  calls = []

  def run(n):
    calls.append(n)
    jax.block_until_ready([f(x) for _ in range(n)])

  if not util.is_hopper_gpu():
    with pytest.raises(ValueError, match="no GPU plane"):
      _harness.gpu_timeline(run, calls=3)
  else:
    events = _harness.gpu_timeline(run, calls=3)
    assert events and all(end > start for _, start, end in events), events
    assert [start for _, start, _ in events] == sorted(start for _, start, _ in events)
    assert _harness.timeline_summary(events, calls=3)["busy_us"] > 0
  assert calls == [2, 3]


def test_gpu_clocks_reads_nvidia_smi_while_the_block_runs(tmp_path, monkeypatch):
  """A stand-in nvidia-smi prints three readings and a cut one, then runs until the sampler stops it."""
  args = tmp_path / "args"
  fake = tmp_path / "nvidia-smi"
  fake.write_text(f'''#!/bin/sh
case "$*" in *-lms*) ;; *) echo "1980, 80.0, 0x1"; exit 0;; esac
echo "$@" > {args}
echo "1980, 650.5, 0x0000000000000004"
echo "1755, 699.9, 0x0000000000000004"
echo "1830, 690.0, 0x0000000000000000"
echo "18"
exec sleep 60
''')
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
  with _harness.gpu_clocks(interval_ms=5) as clocks:
    assert clocks.samples == 0
    for _ in range(200):  # until the stand-in has written its readings (it stays alive, as nvidia-smi -lms does)
      if args.exists():
        break
      time.sleep(0.05)
    time.sleep(0.2)
  assert (clocks.samples, clocks.sm_mhz, clocks.power_w) == (3, 1830.0, 690.0)
  assert clocks.reasons == ("0x0000000000000000", "0x0000000000000004")
  assert args.read_text().split() == ["-i", "3", f"--query-gpu={_harness.CLOCK_FIELDS}",
                                      "--format=csv,noheader,nounits", "-lms", "5"]


def test_gpu_clocks_leave_out_a_field_the_driver_rejects(tmp_path):
  fake = tmp_path / "nvidia-smi"
  fake.write_text('''#!/bin/sh
case "$*" in *clocks_event_reasons*) echo "Field is not a valid field to query."; exit 2;; esac
''')
  fake.chmod(0o755)
  assert _harness._clock_fields(str(fake), "0") == "clocks.sm,power.draw"


def test_gpu_clocks_without_nvidia_smi_reads_nothing(tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))
  with _harness.gpu_clocks() as clocks:
    pass
  assert clocks.samples == 0 and np.isnan(clocks.sm_mhz) and clocks.reasons == ()
  assert _harness.parse_clocks("[N/A], 650\n") == _harness.Clocks()


def test_timeline_summary_splits_calls_into_kernels_and_idle_time():
  # Three calls of three kernels (us): A 10 long, idle 2, B 5 long overlapping C (B 22-27, C 25-30); calls start
  # every 40 us, so 10 us idle between calls; the second call's B starts 1 us later (idle 3 before it).
  events = []
  for c in range(3):
    t = 40.0 * c
    late = 1.0 if c == 1 else 0.0
    events += [("A", t, t + 10), ("B", t + 12 + late, t + 17 + late), ("C", t + 15 + late, t + 30)]
  got = _harness.timeline_summary(events, calls=3)
  assert got["period_us"] == 40.0 and got["idle_between_calls_us"] == 10.0
  assert got["idle_in_call_us"] == 2.0 and got["busy_us"] == 28.0
  assert [s["name"] for s in got["steps"]] == ["A", "B", "C"]
  assert [s["idle_before_us"] for s in got["steps"]] == [10.0, 2.0, 0.0]
  assert [s["us"] for s in got["steps"]] == [10.0, 5.0, 15.0]
  with pytest.raises(ValueError, match="multiple of calls=2"):
    _harness.timeline_summary(events, calls=2)
  with pytest.raises(ValueError, match="same kernels"):
    _harness.timeline_summary(events[:3] + [("X", 40.0, 50.0)] + events[4:6], calls=2)


def test_kda_prefill_timeline_prints_a_summary_per_shape(monkeypatch, capsys):
  calls = 6
  events = [e for c in range(calls) for e in (("prep", 40.0 * c, 40.0 * c + 25), ("state", 40.0 * c + 27,
                                                                                    40.0 * c + 35))]
  monkeypatch.setattr(kda_prefill, "make_inputs", lambda lens, H: None)
  monkeypatch.setattr(kda_prefill, "ours_runner", lambda x, lens, H, **kw: (lambda n: None, None))
  monkeypatch.setattr(kda_prefill, "gpu_timeline", lambda run, n: events[:2 * n])
  monkeypatch.setattr(kda_prefill, "bench", lambda run, iters: 0.04)
  monkeypatch.setattr(kda_prefill.faulthandler, "dump_traceback_later", lambda *a, **kw: None)  # no watchdog
  monkeypatch.setattr(sys, "argv", ["kda_prefill.py", "--timeline"])
  assert kda_prefill.main() == 0
  rows = [line.split(" {", 1) for line in capsys.readouterr().out.splitlines() if " {" in line]
  assert [name for name, _ in rows] == [kda_prefill.SHAPES[2][0], kda_prefill.SHAPES[0][0]]
  for _, row in rows:
    got = json.loads("{" + row)
    assert got["wall_ms"] == 0.04 and got["period_us"] == 40.0 and got["idle_in_call_us"] == 2.0
    assert [s["name"] for s in got["steps"]] == ["prep", "state"]


def test_kda_prefill_rows_quote_each_peers_ratio_per_stream_and_per_call(monkeypatch, tmp_path):
  """A peer whose graph replay is its faster form: the 20-call ratio takes its ``bench`` time, the per-call ratio
  its fitted slope, each against ours measured the same way; a peer that fails leaves the row without it."""
  ours = np.ones((8, 1, 128), np.float32)
  monkeypatch.setattr(kda_prefill, "make_inputs", lambda lens, H: None)
  monkeypatch.setattr(kda_prefill, "ours_runner", lambda x, lens, H, **kw: ("ours", ours))
  monkeypatch.setattr(kda_prefill, "bench", lambda run, iters: {"ours": 1.20}[run])
  monkeypatch.setattr(kda_prefill, "bench_fit", lambda run: {"ours": dict(per_call_ms=1.16, fixed_ms=0.8)}[run])
  fit = lambda per_call: dict(per_call_ms=per_call, fixed_ms=0.05)
  peer = lambda x, bound: (dict(called_ms=1.30, graph_ms=1.19, called_fit=fit(1.25), graph_fit=fit(1.1832)), ours)

  def broken(x, bound):
    raise ImportError("not built")

  monkeypatch.setattr(kda_prefill, "PEERS", (("flashkda", peer), ("fla", broken)))
  monkeypatch.setattr(kda_prefill.faulthandler, "dump_traceback_later", lambda *a, **kw: None)  # no watchdog
  out = tmp_path / "rows.json"
  monkeypatch.setattr(sys, "argv", ["kda_prefill.py", "--quick", "--shapes", "2", "--json", str(out)])
  assert kda_prefill.main() == 0
  row, = json.loads(out.read_text())["results"]
  assert row["ours_ms"] == 1.20 and row["ours_per_call_ms"] == 1.16 and row["ours_fixed_ms"] == 0.8
  assert row["flashkda_graph_ms"] == 1.19 and row["flashkda_per_call_ms"] == 1.1832
  assert row["ratio_flashkda"] == pytest.approx(1.19 / 1.20)
  assert row["ratio_flashkda_per_call"] == pytest.approx(1.1832 / 1.16)
  assert row["rel_rmse_vs_flashkda"] == 0.0 and not any(k.startswith(("fla_", "ratio_fla_")) for k in row)


def test_kda_prefill_segments_rows(monkeypatch, tmp_path):
  """``--segments``: each G times ours again with ``prefill_segments=G`` (20 calls and per call) and compares its
  ``o`` with the default's."""
  runs = {None: ("ours", np.ones((8, 1, 128), np.float32)), 6: ("seg6", np.full((8, 1, 128), 1.01, np.float32))}
  monkeypatch.setattr(kda_prefill, "make_inputs", lambda lens, H: None)
  monkeypatch.setattr(kda_prefill, "ours_runner", lambda x, lens, H, segments=None, **kw: runs[segments])
  monkeypatch.setattr(kda_prefill, "bench", lambda run, iters: {"ours": 0.40, "seg6": 0.33}[run])
  monkeypatch.setattr(kda_prefill, "bench_fit",
                      lambda run: {"ours": dict(per_call_ms=0.37, fixed_ms=0.5), "seg6": dict(per_call_ms=0.31,
                                                                                               fixed_ms=0.4)}[run])
  monkeypatch.setattr(kda_prefill, "PEERS", ())
  monkeypatch.setattr(kda_prefill.faulthandler, "dump_traceback_later", lambda *a, **kw: None)  # no watchdog
  out = tmp_path / "rows.json"
  monkeypatch.setattr(sys, "argv", ["kda_prefill.py", "--quick", "--shapes", "3", "--segments", "6", "--json",
                                    str(out)])
  assert kda_prefill.main() == 0
  row, = json.loads(out.read_text())["results"]
  assert row["ours_ms"] == 0.40 and row["ours_seg6_ms"] == 0.33 and row["ours_seg6_per_call_ms"] == 0.31
  assert row["rel_rmse_seg6_vs_ours"] == pytest.approx(0.01, rel=1e-4)


@pytest.mark.parametrize("case", wgmma_rates.CASES, ids=lambda c: c.name)
def test_wgmma_rates_cases_lower_for_sm90a(case):
  """Every timed product lowers for the GPU (interpret mode cannot take q from registers), and its NumPy check
  has a row per warpgroup."""
  a, b = wgmma_rates.inputs(case)
  wgmma_rates.make(case, iters=2, ctas=2).trace(a, b).lower(lowering_platforms=("cuda",))
  want = wgmma_rates.expected(case, a, b, iters=2)
  assert want.shape == (case.warpgroups, wgmma_rates.ROWS) and np.all(np.isfinite(want))


def test_wgmma_rates_combined_cases_count_each_product():
  """The cases of several products are checked and counted as the sum of their single-product cases: ``qk+pv`` per
  warpgroup, ``qk,pv`` within one, and ``pv4`` (four N = 64 column blocks) as ``pv`` at N = 256."""
  case = lambda kind, n, w=1: wgmma_rates.Case(kind, n, w)
  qk, pv = case("qk", 64), case("pv", 256)
  a, b = wgmma_rates.inputs(case("qk+pv", 256, 2))  # a page tile: QK at N = 64, V its first 256 columns
  want = {c.name: wgmma_rates.expected(c, a, b, iters=3) for c in (case("qk+pv", 256, 2), case("qk,pv", 256), qk,
                                                                   pv, case("pv4", 256))}
  np.testing.assert_allclose(want["qk+pv N=256 W=2"], np.concatenate([want[qk.name], want[pv.name]]))
  np.testing.assert_allclose(want["qk,pv N=256 W=1"], want[qk.name] + want[pv.name])
  np.testing.assert_allclose(want["pv4 N=256 W=1"], want[pv.name])
  assert case("qk+pv", 256, 2).flops() == case("qk,pv", 256).flops() == qk.flops() + pv.flops()
  assert case("pv4", 256).flops() == pv.flops() == 2 * 64 * 256 * 64


def test_wgmma_rates_refuses_no_iterations(capsys):
  with pytest.raises(SystemExit):
    wgmma_rates.main(["--iters", "0"])
  assert "argument --iters: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("case", tma_rates.CASES, ids=lambda c: c.name)
def test_tma_rates_cases_lower_for_sm90a(case):
  """Every page format's loads lower for the GPU (the probe has no compute to check: it times the loads), over a
  cache of the format's shape whose every page the table names once, with the most slots ``Case.fits`` admits
  (up to 5); one slot more is refused by Mosaic GPU's SMEM check, which is why ``main`` skips it."""
  args = tma_rates.inputs(case, batch=2, splits=2, pages=3)
  cache, table = args[:2]
  assert cache.shape == case.cache_shape(12) and sorted(np.asarray(table).ravel()) == list(range(12))
  assert len(args) == 2 + case.scales_apart
  lower = lambda slots: tma_rates.make(case, slots, batch=2, splits=2, pages=3).trace(*args).lower(
      lowering_platforms=("cuda",))
  most = max(s for s in range(1, 6) if case.fits(s))
  lower(most)
  if most < 5:
    with pytest.raises(ValueError, match="exceeds available shared memory"):
      lower(most + 1)


def test_tma_rates_page_bytes():
  """The bytes a page's boxes name: the values, plus 64 rows of 8 scale words, or the page's 512 bytes of scales."""
  by_name = {c.name: c for c in tma_rates.CASES}
  assert by_name["f8_row_values"].page_bytes() == 64 * 576
  assert by_name["f8_row_values_words"].page_bytes() == 64 * 576 + 64 * 32
  assert by_name["f8_row_whole"].page_bytes() == 64 * 640
  assert by_name["f8_scales_apart"].page_bytes() == 64 * 576 + 512
  assert by_name["f8_scales_apart"].cache_shape(5) == (5, 64, 576)
  assert by_name["bf16_row"].page_bytes() == 64 * 576 * 2
  assert by_name["bf16_row"].fits(3) and not by_name["bf16_row"].fits(4)
  assert by_name["f8_row_values_words"].fits(5)


def test_tma_rates_refuses_no_slots(capsys):
  with pytest.raises(SystemExit):
    tma_rates.main(["--slots", "0"])
  assert "--slots, --batch, --splits and --pages must be >= 1" in capsys.readouterr().err
