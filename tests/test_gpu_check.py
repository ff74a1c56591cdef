"""`make gpu-check`'s runner and summarisers, on the CPU (the sections themselves need a Hopper GPU)."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from tools import gpu_check


def test_run_section_passes_and_fails_by_exit_status(tmp_path):
  ok = gpu_check.Section("ok", (sys.executable, "-c", "print('== 3 passed, 1 skipped in 2.0s ==')"), 60,
                         gpu_check._pytest_summary)
  res = gpu_check.run_section(ok, tmp_path)
  assert res.ok and res.summary == "3 passed, 1 skipped in 2.0s"
  assert (tmp_path / "ok.log").read_text().startswith("== 3 passed")
  bad = gpu_check.Section("bad", (sys.executable, "-c", "print('1 failed, 2 passed'); raise SystemExit(1)"), 60,
                          gpu_check._pytest_summary)
  res = gpu_check.run_section(bad, tmp_path)
  assert not res.ok and res.summary.startswith("FAILED (exit 1): 1 failed, 2 passed")


def test_sections_get_a_failure_log(tmp_path):
  write = "import os; open(os.environ['K3JAX_FAILURE_LOG'], 'w').write('=== t (call)')"
  res = gpu_check.run_section(gpu_check.Section("log", (sys.executable, "-c", write), 60, lambda *_: ""), tmp_path)
  assert res.ok and (tmp_path / "log.failures.txt").read_text() == "=== t (call)"


def test_conftest_logs_each_failure_as_it_happens(tmp_path):
  """tests/conftest.py appends a failed test's traceback to K3JAX_FAILURE_LOG (under xdist too); passes add
  nothing."""
  (tmp_path / "test_tmp.py").write_text("def test_ok():\n  pass\n\n\ndef test_bad():\n  assert 1 == 2, 'boom'\n")
  log = tmp_path / "failures.txt"
  tests = gpu_check.ROOT / "tests"
  env = dict(os.environ, K3JAX_FAILURE_LOG=str(log), PYTHONPATH=os.pathsep.join([str(tests), str(gpu_check.ROOT)]))
  argv = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "-c", os.devnull,
          "--rootdir", str(tmp_path), "-n", "2", str(tmp_path / "test_tmp.py")]
  done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 1, done.stdout + done.stderr
  text = log.read_text()
  assert text.count("=== ") == 1 and "test_tmp.py::test_bad (call)" in text and "AssertionError: boom" in text


def test_kernel_and_model_tests_split_the_suite():
  kernels, others = gpu_check.suite_files(True), gpu_check.suite_files(False)
  every = sorted(p.relative_to(gpu_check.ROOT).as_posix() for p in (gpu_check.ROOT / "tests").glob("test_*.py"))
  assert sorted(kernels + others) == every and not set(kernels) & set(others)
  assert "tests/test_mla_kernel.py" in kernels and "tests/test_model.py" in others
  sections = {s.name: s.argv for s in gpu_check.SECTIONS}
  assert set(kernels) <= set(sections["kernel-tests"]) and set(others) <= set(sections["model-tests"])


def test_a_time_out_ends_the_sections_child_processes_too(tmp_path):
  """pytest-xdist's workers are the section's grandchildren: a time-out (the section's or the budget's) ends
  them with it, so that none holds the GPU beside the next section."""
  pid_file = tmp_path / "grandchild.pid"
  code = (f"import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
          f"open({str(pid_file)!r}, 'w').write(str(g.pid)); time.sleep(60)")
  res = gpu_check.run_section(gpu_check.Section("spawns", (sys.executable, "-c", code), 2, gpu_check._pytest_summary),
                              tmp_path)
  assert not res.ok and "timed out after 2 s" in res.summary
  grandchild = int(pid_file.read_text())
  deadline = time.monotonic() + 10
  while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < deadline:  # reaped by init once killed
    time.sleep(0.1)
  assert not os.path.exists(f"/proc/{grandchild}") or "(Z)" in pathlib.Path(f"/proc/{grandchild}/stat").read_text()


def test_time_out_and_broken_summary_fail_the_section(tmp_path):
  slow = gpu_check.Section("slow", (sys.executable, "-c", "import time; time.sleep(30)"), 1,
                           gpu_check._pytest_summary)
  assert not gpu_check.run_section(slow, tmp_path).ok
  # Cut short before pytest's closing line: the verdicts that -v logged, the failed tests by name.
  log = "\n".join(["[gw0] [ 1%] PASSED tests/test_a.py::test_one ", "[gw1] [ 2%] FAILED tests/test_b.py::test_two[9] ",
                   "[gw0] [ 3%] ERROR tests/test_c.py::test_three "])
  assert gpu_check._pytest_summary(log, tmp_path) == ("no pytest summary line; 1 passed, 2 failed or errors so far"
                                                      "\n  tests/test_b.py::test_two[9]\n  tests/test_c.py::test_three")
  # A benchmark that exits 0 but writes no JSON has no numbers to quote: failed.
  empty = gpu_check.Section("empty", (sys.executable, "-c", "pass"), 60, gpu_check._kda_decode)
  res = gpu_check.run_section(empty, tmp_path)
  assert not res.ok and "no summary" in res.summary


def test_benchmark_summaries_quote_peer_ratios(tmp_path: pathlib.Path):
  path = tmp_path / "rows.json"
  path.write_text(json.dumps(dict(results=[dict(shape="N=1 T=8192 H=96", ours_ms=1.9, roofline_frac=0.5,
                                                ratio_fla=1.37, ratio_flashkda=0.74)])))
  assert gpu_check._kda_prefill("", path) == "N=1 T=8192 H=96 1.900 ms, 50% of roofline, 1.37x FLA, 0.74x FlashKDA"
  path.write_text(json.dumps(dict(results=[dict(shape="N=8x1024 H=96", ours_ms=1.2, roofline_frac=0.2,
                                                ratio_flashkda=0.99, ratio_flashkda_per_call=1.02)])))
  assert gpu_check._kda_prefill("", path) == "N=8x1024 H=96 1.200 ms, 20% of roofline, 0.99x FlashKDA (1.02x per call)"
  # Our output further from a peer's than two correct bf16 kernels are fails the section (NaN too).
  for err, ok in ((0.008, True), (0.05, False), (float("nan"), False)):
    path.write_text(json.dumps(dict(results=[dict(shape="N=8x1024 H=96", ours_ms=1.2, roofline_frac=0.2,
                                                  ratio_flashkda=0.99, rel_rmse_vs_flashkda=err)])))
    if ok:
      assert gpu_check._kda_prefill("", path).endswith("0.99x FlashKDA")
    else:
      with pytest.raises(ValueError, match="output against a peer's above 0.02: N=8x1024 H=96 flashkda"):
        gpu_check._kda_prefill("", path)
  path.write_text("\n".join(json.dumps(dict(batch=32, context=32768, heads=h, cache=c, partial="float32", time_us=t,
                                            frac_copy=f, ratio_flashmla=r, vs_bf16=v, narrow=n))
                            for h, c, t, f, r, v, n in ((16, "bfloat16", 292.0, 0.98, None, None, True),
                                                        (16, "float8_e4m3fn", 160.0, 0.93, None, 1.83, False),
                                                        (128, "bfloat16", 600.0, 0.47, 0.87, None, False))))
  summary = gpu_check._mla_decode("", path)
  assert "Hq=16 narrow float32 292.0 us, 98% of copy;" in summary
  assert "Hq=16 float8_e4m3fn cache float32 160.0 us, 93% of copy, 1.83x bf16 cache;" in summary
  assert summary.endswith("Hq=128 float32 600.0 us, 47% of copy, 0.87x FlashMLA")
  # The fp8 path, where the row names one (``--fp8-paths``).
  path.write_text(json.dumps(dict(batch=32, context=32768, heads=16, cache="float8_e4m3fn", fp8_path="registers",
                                  partial="float32", time_us=160.0, frac_copy=0.93, vs_bf16=1.83, narrow=True)))
  assert gpu_check._mla_decode("", path) == ("B=32 ctx=32768 Hq=16 narrow float8_e4m3fn cache registers float32 "
                                             "160.0 us, 93% of copy, 1.83x bf16 cache")
  # An fp8 path whose output strays from the bf16 cache's beyond the rows' own rounding fails the section; NaN too.
  for err, ok in ((0.017, True), (0.033, False), (float("nan"), False)):
    path.write_text(json.dumps(dict(batch=32, context=32768, heads=16, cache="float8_e4m3fn", fp8_path="registers",
                                    partial="bfloat16", time_us=160.0, frac_copy=0.93, vs_bf16=1.83,
                                    bf16_rel_err=err)))
    if ok:
      assert gpu_check._mla_decode("", path).endswith("1.83x bf16 cache")
    else:
      with pytest.raises(ValueError, match="fp8 output error against the bf16 cache above 0.025: registers bfloat16"):
        gpu_check._mla_decode("", path)
  # With the SM clocks that mla_decode.py reads (NaN where nvidia-smi gave none): each side's, where finite.
  path.write_text("\n".join(json.dumps(dict(batch=32, context=32768, heads=128, cache="bfloat16", partial="bfloat16",
                                            time_us=575.0, frac_copy=0.47, ratio_flashmla=0.9, sm_mhz=m,
                                            flashmla_sm_mhz=fm)) for m, fm in ((1755.0, 1830.0), (float("nan"), None))))
  assert gpu_check._mla_decode("", path) == ("B=32 ctx=32768 Hq=128 bfloat16 575.0 us at 1755 MHz, 47% of copy, "
                                             "0.90x FlashMLA at 1830 MHz; B=32 ctx=32768 Hq=128 bfloat16 575.0 us, "
                                             "47% of copy, 0.90x FlashMLA")


def test_a_single_json_line_is_one_row(tmp_path: pathlib.Path):
  # sharded_block.py appends one JSON line per run: a file holding one run parses as one dict.
  path = tmp_path / "sb.jsonl"
  path.write_text(json.dumps(dict(prefill_ms=34.8, prefill_tok_s=58909.0, decode_ms=5.11, peak_gib=11.85)) + "\n")
  assert gpu_check._sharded_block("", path) == ("prefill 34.8 ms (58,909 tok/s), decode 5.11 ms/step, "
                                                "peak 11.8 GiB/device")


def test_mla_prefill_and_prefix_cache_summaries(tmp_path: pathlib.Path):
  path = tmp_path / "mla.jsonl"
  rows = [dict(shape="T=32768 N=1x32768 H=96", impl="ours (pallas)", ms=50.0, tflops=660.0, peak_frac=0.835),
          dict(shape="T=32768 N=1x32768 H=96", impl="torch-cudnn", ms=55.0),
          dict(shape="T=32768 N=1x32768 H=96", impl="jax-cudnn-mla", ms=None),
          dict(shape="T=32768 N=1x32768 H=11", impl="ours (pallas)", ms=None, status="unsupported: f32")]
  path.write_text("\n".join(json.dumps(r) for r in rows))
  assert gpu_check._mla_prefill("", path) == ("T=32768 N=1x32768 H=96 50.000 ms, 660 TFLOP/s (84% of peak), "
                                              "1.10x torch-cudnn; T=32768 N=1x32768 H=11 ours (pallas): "
                                              "unsupported: f32")
  path = tmp_path / "pc.jsonl"
  path.write_text(json.dumps(dict(prefix_len=32768, new_len=1024, uncached_ms=900.0, cached_ms=60.0, speedup=15.0,
                                  logits_max_rel_diff=3e-3, interval=2048, ckpt_overhead_pct=1.25)))
  assert gpu_check._prefix_cache("", path) == ("32768+1024 tokens: uncached 900.0 ms, cached 60.0 ms (15.00x, "
                                               "logits rel diff 3.0e-03); checkpoints every 2048 cost +1.2%")


def test_report_is_incomplete_until_every_planned_section_ran(tmp_path: pathlib.Path):
  ok = gpu_check.Result("gpu-tests", True, 190.0, "48 passed, 1 skipped in 185.06s")
  bad = gpu_check.Result("demo", False, 100.0, "FAILED (exit 1): consistency: FAILED\nlast lines")
  text = gpu_check.report([ok], 2, "abc1234", "NVIDIA H200, jax 0.11.2", tmp_path)
  assert (tmp_path / "gpu-check.md").read_text() == text
  assert "| gpu-tests | pass | 190 s | 48 passed, 1 skipped in 185.06s |" in text
  assert text.splitlines()[-1].startswith("gpu-check: INCOMPLETE 1/2 sections (gpu-tests ok; 1 still to run) at "
                                          "abc1234 on NVIDIA H200")
  text = gpu_check.report([ok, bad], 2, "abc1234", "NVIDIA H200, jax 0.11.2", tmp_path)
  assert text.splitlines()[-1].startswith("gpu-check: FAIL 1/2 sections (gpu-tests ok, demo FAILED)")
  assert "### demo" in text and "last lines" in text
  assert gpu_check.report([ok], 1, "abc1234", "H200", tmp_path).splitlines()[-1].startswith("gpu-check: PASS 1/1")
  # A partial check names what it left out.
  line = gpu_check.report([ok], 1, "abc1234", "H200", tmp_path, ["randomized", "demo"]).splitlines()[-1]
  assert line.startswith("gpu-check: PASS 1/1 sections (gpu-tests ok; 2 of 3 sections not asked for: randomized, "
                         "demo) at abc1234 on H200")


def test_the_device_is_read_in_a_child_and_a_cpu_is_refused(tmp_path, capsys):
  """``default_device`` reports what JAX gives a fresh process (the CPU here), without a client in this one; a
  machine without a Hopper GPU runs no section (exit 2, the device named)."""
  import jax

  platform, capability, kind, version = gpu_check.default_device()
  assert (platform, version) == (jax.devices()[0].platform, jax.__version__) and kind
  if platform == "cpu":
    assert capability == ""
    assert gpu_check.main(["--out", str(tmp_path), "--sections", "demo"]) == 2
    assert f"the default device is {kind}" in capsys.readouterr().err
    assert not (tmp_path / "gpu-check.md").exists()


def _counting_section(name: str, log: pathlib.Path, *, limit: int = 60, fail: bool = False, sleep: float = 0,
                      expected: int | None = None) -> gpu_check.Section:
  """A section that appends its name to ``log`` each time it starts, sleeps, then passes or fails."""
  code = (f"import time; open({str(log)!r}, 'a').write({name!r} + '\\n'); time.sleep({sleep}); print('1 passed'); "
          f"raise SystemExit({int(fail)})")
  return gpu_check.Section(name, (sys.executable, "-c", code), limit, gpu_check._pytest_summary, expected_s=expected)


def test_a_budget_packs_sections_by_their_expected_times_and_resume_runs_only_the_rest(tmp_path: pathlib.Path):
  """A 10-minute device call runs what fits: a section starts only while its expected time (its limit where it
  has none) fits in what is left, one that does not is passed over for the later ones, and a later call of the
  same commit on the same GPU kind finishes the check; its one summary line covers all sections, in their order,
  and the span of their times. A failed section is kept, not retried; a run of some sections (``--sections``)
  keeps the others' results."""
  log = tmp_path / "ran.txt"
  sections = [_counting_section("a", log, limit=60), _counting_section("b", log, limit=500, expected=250),
              _counting_section("c", log, limit=500, fail=True), _counting_section("d", log, limit=500, expected=60)]
  where = "NVIDIA H200, jax 0.11.2"
  text, code = gpu_check.run_check(sections, tmp_path, "abc1234", where, budget=200)
  assert code == 3 and log.read_text().split() == ["a", "d"]  # b and c do not fit after a
  assert "gpu-check: INCOMPLETE 2/4 sections (a ok, d ok; 2 still to run) at abc1234 on NVIDIA H200" in text
  text, code = gpu_check.run_check(sections[:3], tmp_path, "abc1234", where, resume=True, budget=600)
  assert code == 1 and log.read_text().split() == ["a", "d", "b", "c"]
  assert "gpu-check: FAIL 2/3 sections (a ok, b ok, c FAILED) at abc1234" in text
  text, code = gpu_check.run_check(sections, tmp_path, "abc1234", where, resume=True)
  assert code == 1 and log.read_text().split() == ["a", "d", "b", "c"]  # c's failure stands
  assert "gpu-check: FAIL 3/4 sections (a ok, b ok, c FAILED, d ok) at abc1234 on NVIDIA H200, jax 0.11.2, 20" in text
  state = json.loads((tmp_path / gpu_check.STATE).read_text())
  assert [r["name"] for r in state["results"]] == ["a", "b", "c", "d"] and all(r["finished"] for r in state["results"])
  # Without --resume the check starts afresh; a state of another commit or GPU is refused, naming both.
  assert gpu_check.run_check(sections[:1], tmp_path, "abc1234", where)[1] == 0
  assert log.read_text().split()[-1] == "a"
  refused = "holds a check at abc1234 on NVIDIA H200.*this run is at def5678 on NVIDIA H200"
  with pytest.raises(ValueError, match=refused):
    gpu_check.run_check(sections, tmp_path, "def5678", where, resume=True)
  with pytest.raises(ValueError, match="this run is at abc1234 on NVIDIA H100"):
    gpu_check.run_check(sections, tmp_path, "abc1234", "NVIDIA H100 80GB HBM3, jax 0.11.2", resume=True)


def test_a_section_cut_by_the_budget_gets_no_verdict_and_runs_again(tmp_path: pathlib.Path):
  """A section slower than expected is stopped where the budget ends (before the device call's own limit cuts
  the whole run) and saved as nothing: the next call runs it again. Its own limit still fails it."""
  log = tmp_path / "ran.txt"
  slow = _counting_section("slow", log, limit=60, sleep=30, expected=1)
  where = "NVIDIA H200, jax 0.11.2"
  t0 = time.perf_counter()
  a = _counting_section("a", log, expected=1)
  text, code = gpu_check.run_check([a, slow], tmp_path, "abc1234", where, budget=3)
  assert time.perf_counter() - t0 < 20 and code == 3 and log.read_text().split() == ["a", "slow"]
  assert "gpu-check: INCOMPLETE 1/2 sections (a ok; 1 still to run)" in text
  assert [r["name"] for r in json.loads((tmp_path / gpu_check.STATE).read_text())["results"]] == ["a"]
  fast = _counting_section("slow", log, limit=60, expected=1)
  text, code = gpu_check.run_check([a, fast], tmp_path, "abc1234", where, resume=True, budget=30)
  assert code == 0 and log.read_text().split() == ["a", "slow", "slow"]
  assert "gpu-check: PASS 2/2 sections (a ok, slow ok)" in text
  res = gpu_check.run_section(_counting_section("own", log, limit=1, sleep=30), tmp_path, timeout_s=5)
  assert not res.ok and "timed out after 1 s" in res.summary


def test_the_summary_line_spans_the_sections_times(tmp_path: pathlib.Path):
  one = gpu_check.Result("a", True, 1.0, "ok", "2026-12-05 13:51")
  two = gpu_check.Result("b", True, 1.0, "ok", "2026-12-05 14:20")
  three = gpu_check.Result("c", True, 1.0, "ok", "2026-12-06 09:05")
  line = lambda rs: gpu_check.report(rs, len(rs), "abc1234", "H200", tmp_path).splitlines()[-1]
  assert line([one]).endswith("on H200, 2026-12-05 13:51 UTC")
  assert line([one, two]).endswith("on H200, 2026-12-05 13:51-14:20 UTC")
  assert line([one, two, three]).endswith("on H200, 2026-12-05 13:51 UTC to 2026-12-06 09:05 UTC")


def test_sections_of_one_group_run_side_by_side_and_keep_their_own_verdicts(tmp_path: pathlib.Path):
  """Two adjacent sections of one group start together (the pair takes about the longer one's time, not the sum)
  and are saved each with its own verdict; a group whose longest expected time does not fit is passed over whole;
  one cut by the budget gets no verdict while its partner that finished is saved."""
  log = tmp_path / "ran.txt"
  group = lambda name, sleep, fail=False, expected=5: dataclasses.replace(
      _counting_section(name, log, sleep=sleep, fail=fail, expected=expected), group="g")
  where = "NVIDIA H200, jax 0.11.2"
  t0 = time.perf_counter()
  text, code = gpu_check.run_check([group("a", 4), group("b", 4, fail=True), _counting_section("c", log)],
                                   tmp_path, "abc1234", where)
  assert time.perf_counter() - t0 < 7.5  # one after the other: over 8 s
  assert code == 1 and sorted(log.read_text().split()) == ["a", "b", "c"]
  assert "gpu-check: FAIL 2/3 sections (a ok, b FAILED, c ok)" in text
  assert [s.name for s in gpu_check._units([group("a", 0), group("b", 0), _counting_section("c", log),
                                            group("d", 0)])[0]] == ["a", "b"]
  log.unlink()
  (tmp_path / "1").mkdir()
  (tmp_path / "2").mkdir()
  text, code = gpu_check.run_check([group("a", 0, expected=1), group("b", 0, expected=50)], tmp_path / "1", "abc1234",
                                   where, budget=20)
  assert code == 3 and not log.exists() and "INCOMPLETE 0/2 sections" in text
  text, code = gpu_check.run_check([group("a", 0, expected=1), group("b", 30, expected=1)], tmp_path / "2", "abc1234",
                                   where, budget=3)
  assert code == 3 and "gpu-check: INCOMPLETE 1/2 sections (a ok; 1 still to run)" in text
  assert [r["name"] for r in json.loads((tmp_path / "2" / gpu_check.STATE).read_text())["results"]] == ["a"]
