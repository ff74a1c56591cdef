"""`make gpu-check`: everything CI cannot see, on a Hopper GPU, summarised in one table.

Sections (each a subprocess with its own time limit and log):
  gpu-tests    ``pytest -m gpu``: the compiled kernels at real sizes
  randomized   ``pytest tests/test_randomized_*.py`` with the GPU example budget (compiled kernels)
  kernel-tests the rest of the kernel files' tests (``-m "not gpu" -k "not randomized"``), compiled
  model-tests  the rest of the suite: layers, model, caches, loaders, CLI and benchmark scripts on the GPU's XLA
               (tests of a mesh larger than the one GPU skip: CI runs them on 9 CPU devices)
  Each test section logs every failure's traceback as it happens to ``<out>/<name>.failures.txt``; gpu-tests
  and randomized run side by side, and so do kernel-tests and model-tests.
  demo         ``python -m k3jax.demo`` with the Pallas kernels
  kda-prefill, kda-decode, short-conv, mla-decode, mla-prefill, sharded-block, prefix-cache   each benchmark
               in its quick mode; the summary quotes the key numbers and the ratios to the peers (FLA,
               FlashKDA and FlashMLA where they are importable, cuDNN and torch SDPA for the prefill)

The table goes to stdout and to ``<out>/gpu-check.md`` (logs and benchmark JSON beside it); the last line is
the one-line summary. Exit status 1 when a section fails, 3 when ``--budget`` stopped the run between sections.
Run on the GPU machine with the image's python3: ``make gpu-check`` or ``PYTHONPATH=. python3 tools/gpu_check.py
[--sections NAME ...] [--out DIR] [--budget SECONDS --resume]``; with ``--resume`` one check runs over several
device calls (``run_check``).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Section:
  """One check: ``argv`` (``{json}`` is replaced by its JSON path), a time limit and a summariser.

  ``summary(log, json_path)`` returns the key numbers as text (raise to mark the section failed).
  ``expected_s`` (default: the time limit) is what ``--budget`` plans with: the limits leave room for a slow
  machine, so packing calls by them would leave most of each call unused. Adjacent sections of one ``group`` run
  side by side (their expected times are those of that run).
  """

  name: str
  argv: tuple[str, ...]
  timeout_s: int
  summary: Callable[[str, pathlib.Path], str]
  expected_s: int | None = None
  group: str | None = None

  @property
  def planned_s(self) -> int:
    return self.timeout_s if self.expected_s is None else self.expected_s


class BudgetSpent(Exception):
  """A section reached the end of the ``--budget`` before its own time limit: no verdict, it runs again."""


def _pytest_summary(log: str, _: pathlib.Path) -> str:
  """pytest's closing line (``41 passed, 2 skipped in 332.10s``); for a run cut short before it, the verdicts
  that ``-v`` logged so far, naming the failed tests."""
  lines = [ln.strip("= ") for ln in log.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
  if lines:
    return lines[-1]
  verdicts = [m.groups() for m in re.finditer(r"\b(PASSED|FAILED|ERROR) (\S+)", log)]
  failed = [test for verdict, test in verdicts if verdict != "PASSED"]
  return (f"no pytest summary line; {len(verdicts) - len(failed)} passed, {len(failed)} failed or errors so far"
          + "".join(f"\n  {test}" for test in failed))


def _demo_summary(log: str, _: pathlib.Path) -> str:
  """The demo's check lines, shortened to their verdicts."""
  checks = [ln for ln in log.splitlines() if ln.startswith(("consistency", "sharded =="))]
  return "; ".join(ln.split(":")[0] + ": " + ln.rsplit(": ", 1)[-1] for ln in checks)


def _rows(path: pathlib.Path) -> list[dict]:
  """Benchmark rows from a JSON file (a list, ``{"results": [...]}``, JSON lines, or one line: one row)."""
  text = path.read_text()
  try:
    data = json.loads(text)
  except json.JSONDecodeError:
    return [json.loads(ln) for ln in text.splitlines() if ln.strip()]
  if isinstance(data, dict):
    return data["results"] if "results" in data else [data]
  return data


def _ratio(row: dict, key: str, peer: str) -> str:
  return f", {row[key]:.2f}x {peer}" if row.get(key) is not None else ""


def _mhz(row: dict, key: str) -> str:
  """`` at N MHz`` where the row holds a finite SM clock under ``key`` (benchmarks/_harness.py ``gpu_clocks``)."""
  mhz = row.get(key)
  return f" at {mhz:.0f} MHz" if mhz is not None and math.isfinite(mhz) else ""


def _each(fmt: Callable[[dict], str]) -> Callable[[str, pathlib.Path], str]:
  """A benchmark summariser: ``fmt`` of every row of its JSON, joined."""
  return lambda _, path: "; ".join(fmt(r) for r in _rows(path))


def _per_call(row: dict, peer: str) -> str:
  """A peer's ratio per call in a stream (the line fit, which leaves out a stream's fixed cost), when measured."""
  key = f"ratio_{peer}_per_call"
  return f" ({row[key]:.2f}x per call)" if row.get(key) is not None else ""


def _gated(rows: Callable[[str, pathlib.Path], str], errors: Callable[[dict], dict[str, float]], limit: float,
           what: str) -> Callable[[str, pathlib.Path], str]:
  """The summariser ``rows``, failing the section (ValueError) where one of a row's ``errors`` (name: value) is
  above ``limit`` or NaN: the benchmarks run at XLA's default flags, as users do, where the tests do not (q's
  e4m3 split lost its low part there alone, benchmarks/RESULTS.md, session 42)."""
  def summary(log: str, path: pathlib.Path) -> str:
    bad = [f"{name} {err:.1e}" for r in _rows(path) for name, err in errors(r).items() if not err <= limit]
    if bad:
      raise ValueError(f"{what} above {limit}: {', '.join(bad)}")
    return rows(log, path)
  return summary


# Our output against each peer's that ran (``rel_rmse_vs_<peer>``, bf16 inputs): what bf16 rounding leaves between
# two correct kernels.
KDA_PREFILL_REL_RMSE_MAX = 2e-2
_kda_prefill = _gated(
    _each(lambda r: f"{r['shape']} {r['ours_ms']:.3f} ms, {r['roofline_frac']:.0%} of roofline"
                    f"{_ratio(r, 'ratio_fla', 'FLA')}{_per_call(r, 'fla')}"
                    f"{_ratio(r, 'ratio_flashkda', 'FlashKDA')}{_per_call(r, 'flashkda')}"),
    lambda r: {f"{r['shape']} {k.removeprefix('rel_rmse_vs_')}": v for k, v in r.items()
               if k.startswith("rel_rmse_vs_")},
    KDA_PREFILL_REL_RMSE_MAX, "output against a peer's")
_kda_decode = _each(lambda r: f"N={r['N']} H={r['H']} {r['state']} {r['ours_us']:.1f} us, "
                              f"{r['copy_frac']:.0%} of copy{_ratio(r, 'vs_fla', 'FLA')}")
_short_conv = _each(lambda r: f"{r['phase']} N={r['N']} H={r['H']} {r['conv_us']:.1f} us, "
                              f"{r['conv_xla_us'] / r['conv_us']:.2f}x XLA")
# An fp8 row's output against the bf16 cache's (``bf16_rel_err`` of mla_decode.py's N(0, 1) inputs): the e4m3
# rows' own rounding, the same for both fp8 paths; a path that adds an error of its own fails the section.
MLA_FP8_REL_ERR_MAX = 2.5e-2
_mla_decode = _gated(
    _each(lambda r: f"B={r['batch']} ctx={r['context']} Hq={r['heads']} "
                    f"{'narrow ' if r.get('narrow') else ''}"
                    f"{'' if r.get('cache', 'bfloat16') == 'bfloat16' else r['cache'] + ' cache '}"
                    f"{r['fp8_path'] + ' ' if r.get('fp8_path') else ''}"
                    f"{r['partial']} {r['time_us']:.1f} us{_mhz(r, 'sm_mhz')}, {r['frac_copy']:.0%} of copy"
                    f"{_ratio(r, 'ratio_flashmla', 'FlashMLA')}{_mhz(r, 'flashmla_sm_mhz')}"
                    f"{_ratio(r, 'vs_bf16', 'bf16 cache')}"),
    lambda r: ({} if r.get("bf16_rel_err") is None
               else {f"{r.get('fp8_path') or 'fp8'} {r['partial']}": r["bf16_rel_err"]}),
    MLA_FP8_REL_ERR_MAX, "fp8 output error against the bf16 cache")


def _mla_prefill(_: str, path: pathlib.Path) -> str:
  """Per shape: our time, TFLOP/s and fraction of the bf16 peak, and the ratio to the fastest peer that ran."""
  shapes: dict[str, list[dict]] = {}
  for r in _rows(path):
    shapes.setdefault(r["shape"], []).append(r)
  parts = []
  for shape, rows in shapes.items():
    ours = next(r for r in rows if r["impl"].startswith("ours"))
    if ours["ms"] is None:
      parts.append(f"{shape} {ours['impl']}: {ours['status']}")
      continue
    peers = [r for r in rows if r is not ours and r["ms"] is not None]
    best = min(peers, key=lambda r: r["ms"], default=None)
    vs = "" if best is None else f", {best['ms'] / ours['ms']:.2f}x {best['impl']}"
    parts.append(f"{shape} {ours['ms']:.3f} ms, {ours['tflops']:.0f} TFLOP/s ({ours['peak_frac']:.0%} of peak){vs}")
  return "; ".join(parts)


def _prefix_cache(_: str, path: pathlib.Path) -> str:
  r = _rows(path)[-1]
  return (f"{r['prefix_len']}+{r['new_len']} tokens: uncached {r['uncached_ms']:.1f} ms, cached {r['cached_ms']:.1f} "
          f"ms ({r['speedup']:.2f}x, logits rel diff {r['logits_max_rel_diff']:.1e}); checkpoints every "
          f"{r['interval']} cost {r['ckpt_overhead_pct']:+.1f}%")


def _sharded_block(_: str, path: pathlib.Path) -> str:
  r = _rows(path)[-1]
  return (f"prefill {r['prefill_ms']:.1f} ms ({r['prefill_tok_s']:,.0f} tok/s), decode {r['decode_ms']:.2f} ms/step, "
          f"peak {r['peak_gib']:.1f} GiB/device")


PY = sys.executable
# The test sections are bound by kernel compiles on the host's cores, and run two at a time side by side (a
# section's last minutes run a few long tests on a few workers; the other section's workers take the idle cores).
# pytest-xdist workers share the GPU (tests/conftest.py has each allocate on demand). The benchmarks run alone,
# one process at a time. Each test's verdict is logged as it ends (-v), so that a section cut short by its time
# limit still names its failures; -rf repeats them with their reasons.
PYTEST = (PY, "-m", "pytest", "-v", "-rf", "-p", "no:cacheprovider", "-n", "14")
# Each section's expected_s is its time on an H100 or H200 as measured (side by side for the test sections),
# rounded up: what --budget packs calls with; its limit is the verdict's, with room for a slower machine.
# The suite outside the gpu-marked and randomized tests is split into the kernel packages' test files and the
# rest.
KERNEL_TESTS = ("test_kda_", "test_mla_", "test_short_conv", "test_moe_", "test_mosaic_", "test_platform")


def suite_files(kernels: bool) -> tuple[str, ...]:
  """The test files of the kernel packages (``kernels``) or all the others, relative to the repository."""
  files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py"))
  return tuple(f for f in files if pathlib.Path(f).name.startswith(KERNEL_TESTS) == kernels)


UNMARKED = ("-m", "not gpu", "-k", "not randomized")
SECTIONS = (
    Section("gpu-tests", PYTEST + ("-m", "gpu"), 420, _pytest_summary, expected_s=300, group="marked"),
    Section("randomized", PYTEST + ("-k", "randomized", "tests"), 420, _pytest_summary, expected_s=300,
            group="marked"),
    Section("kernel-tests", PYTEST + UNMARKED + suite_files(True), 540, _pytest_summary, expected_s=240,
            group="unmarked"),
    Section("model-tests", PYTEST + UNMARKED + suite_files(False), 540, _pytest_summary,
            expected_s=360, group="unmarked"),
    Section("demo", (PY, "-m", "k3jax.demo"), 240, _demo_summary, expected_s=150),
    Section("kda-prefill", (PY, "benchmarks/kda_prefill.py", "--quick", "--shapes", "0", "3", "--json", "{json}"),
            300, _kda_prefill, expected_s=240),
    Section("kda-decode", (PY, "benchmarks/kda_decode.py", "--quick", "--json", "{json}"), 300, _kda_decode,
            expected_s=90),
    Section("short-conv", (PY, "benchmarks/short_conv.py", "--quick", "--json", "{json}"), 300, _short_conv,
            expected_s=100),
    Section("mla-decode", (PY, "benchmarks/mla_decode.py", "--batch", "32", "--context", "32768", "--heads", "16",
                           "128", "--cache-dtypes", "bfloat16", "float8_e4m3fn", "--fp8-paths", "ring", "registers",
                           "--json", "{json}"), 300, _mla_decode, expected_s=70),
    Section("mla-prefill", (PY, "benchmarks/mla_prefill.py", "--T", "32768", "--N", "1", "--H", "96", "11",
                            "--impl", "pallas", "--peers", "jax-cudnn-mla", "torch-cudnn", "--json", "{json}"),
            300, _mla_prefill, expected_s=60),
    Section("sharded-block", (PY, "benchmarks/sharded_block.py", "--devices", "1", "--experts", "16", "--seqs", "2",
                              "--prompt-len", "1024", "--context", "4096", "--decode-steps", "2", "--reps", "1",
                              "--json", "{json}"), 300, _sharded_block, expected_s=100),
    Section("prefix-cache", (PY, "benchmarks/prefix_cache.py", "--experts", "16", "--reps", "3", "--json", "{json}"),
            300, _prefix_cache, expected_s=180),
)


@dataclasses.dataclass
class Result:
  name: str
  ok: bool
  seconds: float
  summary: str
  finished: str = ""  # UTC, "YYYY-MM-DD HH:MM"


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")


def _kill_tree(pid: int) -> None:
  """Kills ``pid`` and its descendants: pytest-xdist's workers are a section's grandchildren, and would otherwise
  go on holding the GPU and the cores beside the next section. (Not a process group of the section's own: the
  device call's time limit ends the call's group, and the sections must stay in it.)"""
  children: dict[int, list[int]] = {}
  for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
    try:  # "pid (comm) state ppid ...", comm may hold spaces and parentheses
      ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
      continue
    children.setdefault(ppid, []).append(int(stat.parent.name))
  tree, stack = [], [pid]
  while stack:
    tree.append(stack.pop())
    stack += children.get(tree[-1], [])
  for p in tree:
    with contextlib.suppress(ProcessLookupError):
      os.kill(p, signal.SIGKILL)


def run_section(section: Section, out: pathlib.Path, timeout_s: float | None = None) -> Result:
  """Runs one section, writing ``<out>/<name>.log``; a non-zero exit, a time-out or a summariser error fails.

  ``timeout_s`` below the section's own limit is what is left of a budget: reaching it raises ``BudgetSpent``."""
  limit = section.timeout_s if timeout_s is None else min(section.timeout_s, timeout_s)
  json_path = out / f"{section.name}.json"
  json_path.unlink(missing_ok=True)
  failures = out / f"{section.name}.failures.txt"
  failures.unlink(missing_ok=True)
  argv = [a.replace("{json}", str(json_path)) for a in section.argv]
  # The repository first; a PYTHONPATH already set (carried wheels such as FLA) stays behind it.
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
  env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", K3JAX_FAILURE_LOG=str(failures))
  t0 = time.perf_counter()
  print(f"[gpu-check] {section.name}: {' '.join(argv)}", flush=True)
  log_path = out / f"{section.name}.log"
  # The log is written as the section runs, so a run cut short still leaves what it printed.
  with open(log_path, "w") as log_file:
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
      code = proc.wait(timeout=limit)
      ok, why = code == 0, f"exit {code}"
    except subprocess.TimeoutExpired:
      _kill_tree(proc.pid)
      proc.wait()
      if limit < section.timeout_s:
        print(f"[gpu-check] {section.name}: cut at the end of the budget ({limit:.0f} s); no verdict", flush=True)
        raise BudgetSpent(section.name) from None
      ok, why = False, f"timed out after {section.timeout_s} s"
  seconds = time.perf_counter() - t0
  log = log_path.read_text()
  try:
    summary = section.summary(log, json_path)
  except Exception as e:  # a summariser error is a failure of the section, never of the whole run
    ok, summary = False, f"no summary ({type(e).__name__}: {e})"
  if not ok:
    summary = f"FAILED ({why}): {summary}\n" + "\n".join(log.splitlines()[-25:])
  print(f"[gpu-check] {section.name}: {'ok' if ok else 'FAILED'} in {seconds:.0f} s", flush=True)
  return Result(section.name, ok, seconds, summary, _now())


STATE = "gpu-check.json"


def load_state(out: pathlib.Path, commit: str, where: str) -> dict[str, Result]:
  """The sections that an earlier run into ``out`` finished (``<out>/gpu-check.json``), by name; none if it has
  no state. A state of another commit or machine is refused (ValueError naming both): one check is one commit on
  one kind of GPU."""
  path = out / STATE
  if not path.exists():
    return {}
  state = json.loads(path.read_text())
  if (state["commit"], state["where"]) != (commit, where):
    raise ValueError(f"--resume: {path} holds a check at {state['commit']} on {state['where']}; this run is at "
                     f"{commit} on {where} (remove it to start afresh)")
  return {r["name"]: Result(**r) for r in state["results"]}


def save_state(out: pathlib.Path, commit: str, where: str, results: Sequence[Result]) -> None:
  (out / STATE).write_text(json.dumps(dict(commit=commit, where=where,
                                           results=[dataclasses.asdict(r) for r in results]), indent=1))


def run_check(planned: Sequence[Section], out: pathlib.Path, commit: str, where: str, *, left_out: Sequence[str] = (),
              resume: bool = False, budget: float | None = None) -> tuple[str, int]:
  """Runs the ``planned`` sections in order and returns the report's text and the exit status: 0 all passed, 1
  a section failed, 3 stopped before the end without a failure.

  ``budget`` (seconds): a section starts only while its expected time fits in what is left (a section that does
  not fit is passed over for the next ones), and runs at most until the budget ends; one cut there gets no verdict
  and runs again in the next call. So a run inside a device call's time limit ends before the call is cut, with
  every finished section saved. Adjacent sections of one ``group`` start together when the longest expected
  time among them fits. ``resume`` keeps the sections that an earlier run of the same commit on the same kind of
  GPU finished (passed or failed: a failure is not retried) and runs the rest. The state is saved after every
  section."""
  done = load_state(out, commit, where) if resume else {}
  results = [done[s.name] for s in planned if s.name in done]
  # Sections of the state that this run does not plan (``--sections``) stay in it for a later run of them all.
  others = [r for name, r in done.items() if name not in {s.name for s in planned}]
  t0 = time.perf_counter()
  text = report(results, len(planned), commit, where, out, left_out)
  order = [s.name for s in planned]
  for unit in _units([s for s in planned if s.name not in done]):
    left = None if budget is None else budget - (time.perf_counter() - t0)
    need = max(s.planned_s for s in unit)
    if left is not None and left < need:
      print(f"[gpu-check] {', '.join(s.name for s in unit)}: expected {need} s, which do not fit in the {left:.0f} "
            f"s left of the {budget:.0f} s budget; passed over (run again with --resume)", flush=True)
      continue
    cut = False
    with concurrent.futures.ThreadPoolExecutor(len(unit)) as pool:
      for future in concurrent.futures.as_completed([pool.submit(run_section, s, out, left) for s in unit]):
        try:
          results.append(future.result())
        except BudgetSpent:
          cut = True
          continue
        results.sort(key=lambda r: order.index(r.name))
        save_state(out, commit, where, results + others)
        text = report(results, len(planned), commit, where, out, left_out)
    if cut:
      break
  code = 1 if not all(r.ok for r in results) else 3 if len(results) < len(planned) else 0
  return text, code


def _units(sections: Sequence[Section]) -> list[list[Section]]:
  """The sections in order, adjacent ones of one ``group`` together (they run side by side)."""
  units: list[list[Section]] = []
  for s in sections:
    if units and s.group is not None and units[-1][-1].group == s.group:
      units[-1].append(s)
    else:
      units.append([s])
  return units


def default_device() -> tuple[str, str, str, str]:
  """JAX's default device as (platform, compute capability or "", device kind, jax version), read in a child
  process: a GPU client in this process would hold a CUDA context (and whatever JAX preallocates) for the whole
  run, beside the sections' own processes."""
  code = ("import jax; d = jax.devices()[0]; "
          "print(repr((d.platform, str(getattr(d, 'compute_capability', '')), d.device_kind, jax.__version__)))")
  out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True).stdout
  return ast.literal_eval(out.strip().splitlines()[-1])


def _commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return os.environ.get("K3JAX_COMMIT", "unknown")


def main(argv: list[str] | None = None) -> int:
  names = [s.name for s in SECTIONS]
  parser = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.splitlines()[0])
  parser.add_argument("--sections", nargs="+", choices=names, default=names, help="which sections, in order")
  parser.add_argument("--out", default=str(ROOT / "gpu-check-out"), help="folder for the table, logs and JSON")
  parser.add_argument("--commit", default=None, help="commit to name in the table (default: git's HEAD)")
  parser.add_argument("--budget", type=float, default=None,
                      help="seconds: start a section only while its expected time fits in what is left, and end "
                           "by then")
  parser.add_argument("--resume", action="store_true",
                      help="keep the sections that an earlier run into --out finished at this commit on this GPU")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  platform, capability, kind, version = default_device()
  if platform != "gpu" or not capability.startswith("9"):
    print(f"gpu-check needs a Hopper GPU (sm_90a); the default device is {kind}", file=sys.stderr)
    return 2
  commit = args.commit or _commit()
  planned = [s for s in SECTIONS if s.name in args.sections]
  left_out = [s.name for s in SECTIONS if s.name not in args.sections]
  try:
    text, code = run_check(planned, out, commit, f"{kind}, jax {version}", left_out=left_out, resume=args.resume,
                           budget=args.budget)
  except ValueError as e:
    print(e, file=sys.stderr)
    return 2
  print("\n" + text, flush=True)
  return code


def report(results: list[Result], planned: int, commit: str, where: str, out: pathlib.Path,
           left_out: Sequence[str] = ()) -> str:
  """Writes ``<out>/gpu-check.md`` (the table, failed sections' details, the summary line) and returns it.

  The summary line says PASS or FAIL only once all ``planned`` sections ran; before, INCOMPLETE. It names the
  sections ``left_out`` (not asked for), so that a line quoted from a partial check does not read as the whole,
  and the span of the sections' finishing times (a resumed check runs over several calls).
  """
  passed = sum(r.ok for r in results)
  times = sorted(r.finished for r in results if r.finished) or [_now()]
  first, last = times[0], times[-1]
  stamp = (f"{first} UTC" if first == last else f"{first}-{last[11:]} UTC" if first[:10] == last[:10]
           else f"{first} UTC to {last} UTC")
  verdict = ("INCOMPLETE" if len(results) < planned else "PASS" if passed == planned else "FAIL")
  parts = [", ".join(r.name + (" ok" if r.ok else " FAILED") for r in results)] if results else []
  if len(results) < planned:
    parts.append(f"{planned - len(results)} still to run")
  if left_out:
    parts.append(f"{len(left_out)} of {planned + len(left_out)} sections not asked for: {', '.join(left_out)}")
  line = f"gpu-check: {verdict} {passed}/{planned} sections ({'; '.join(parts)}) at {commit} on {where}, {stamp}"
  table = ["| section | result | time | key numbers |", "|---|---|---|---|"]
  table += [f"| {r.name} | {'pass' if r.ok else 'FAIL'} | {r.seconds:.0f} s | "
            f"{r.summary.splitlines()[0] if r.summary else ''} |" for r in results]
  details = [f"\n### {r.name}\n```\n{r.summary}\n```" for r in results if not r.ok]
  text = "\n".join(table + details + ["", line]) + "\n"
  (out / "gpu-check.md").write_text(text)
  return text


if __name__ == "__main__":
  sys.exit(main())
