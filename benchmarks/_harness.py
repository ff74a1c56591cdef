"""What every benchmark shares: the H200's measured ceilings, CUPTI kernel timings, a GPU timeline of back-to-back
calls, the SM clock and power while a measurement runs, L2-busting rotations.

The ceilings are those measured on the H200 (benchmarks/RESULTS.md): a roofline fraction is a time against
``max(FLOPs / PEAK_BF16_FLOPS, bytes / COPY_BYTES_PER_S)``.
"""

import argparse
import contextlib
import dataclasses
import functools
import os
import pathlib
import shutil
import subprocess
import tempfile

import numpy as np

# bf16 tensor-core rate and device-to-device copy bandwidth (read + write) measured on the H200.
PEAK_BF16_FLOPS = 790e12
COPY_BYTES_PER_S = 4.27e12
# Larger than the H200's L2 (50 MB): a working set of three times this is never L2 resident.
L2_BYTES = 60e6


def positive_int(text: str) -> int:
  """An argparse ``type``: an int >= 1 (argparse names the option in its error)."""
  n = int(text)
  if n < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
  return n


@contextlib.contextmanager
def cupti_kernels():
  """Collects ``(kernel name, ms)`` of every kernel that runs inside (JAX's CUPTI hook, also sees torch)."""
  from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
  ext = mosaic_gpu_lib._mosaic_gpu_ext
  records: list[tuple[str, float]] = []
  ext._cupti_init()
  try:
    yield records
  finally:
    records.extend(ext._cupti_get_timings(True))


@dataclasses.dataclass
class Clocks:
  """What ``gpu_clocks`` sampled: medians of the SM clock (MHz) and the board power (W) over ``samples`` readings,
  and the clock-event reasons seen (nvidia-smi's bit masks, e.g. ``0x4`` software power cap, ``0x1`` idle).
  ``samples == 0``: nothing was read (no nvidia-smi, or the block ended before its first reading)."""

  samples: int = 0
  sm_mhz: float = float("nan")
  power_w: float = float("nan")
  reasons: tuple[str, ...] = ()


CLOCK_FIELDS = "clocks.sm,power.draw,clocks_event_reasons.active"


@functools.cache
def _clock_fields(exe: str, gpu: str) -> str:
  """``CLOCK_FIELDS``, or without the reasons where this driver's nvidia-smi does not know that field (it then
  rejects the whole query)."""
  probe = subprocess.run([exe, "-i", gpu, f"--query-gpu={CLOCK_FIELDS}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False)
  return CLOCK_FIELDS if probe.returncode == 0 else CLOCK_FIELDS.rsplit(",", 1)[0]


def parse_clocks(text: str) -> Clocks:
  """``Clocks`` from nvidia-smi's ``--format=csv,noheader,nounits`` lines of ``CLOCK_FIELDS`` (lines that do not
  parse, such as a reading cut by the sampler's end, are skipped)."""
  mhz, watts, reasons = [], [], set()
  for line in text.splitlines():
    parts = [p.strip() for p in line.split(",")]
    try:
      clock, power = float(parts[0]), float(parts[1])
    except (IndexError, ValueError):
      continue
    mhz.append(clock)
    watts.append(power)
    reasons.update(parts[2:3])
  if not mhz:
    return Clocks()
  return Clocks(samples=len(mhz), sm_mhz=float(np.median(mhz)), power_w=float(np.median(watts)),
                reasons=tuple(sorted(reasons)))


@contextlib.contextmanager
def gpu_clocks(interval_ms: int = 20):
  """Samples the first visible GPU's SM clock, power and clock-event reasons every ``interval_ms`` with nvidia-smi
  while the block runs; yields a ``Clocks`` filled in when the block ends (left empty without nvidia-smi).

  Why: a kernel that keeps the tensor cores busy can reach the board's power cap over a stream of calls and run
  below the 1.98 GHz boost clock, so two kernels timed over the same number of calls may not see the same clock;
  the reading says which clock a time was measured at.
  """
  clocks = Clocks()
  exe = shutil.which("nvidia-smi")
  if exe is None:
    yield clocks
    return
  gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
  query = [exe, "-i", gpu, f"--query-gpu={_clock_fields(exe, gpu)}", "--format=csv,noheader,nounits"]
  proc = subprocess.Popen(query + ["-lms", str(interval_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True)
  try:
    yield clocks
  finally:
    proc.terminate()
    read = parse_clocks(proc.communicate()[0])
    for field in dataclasses.fields(Clocks):
      setattr(clocks, field.name, getattr(read, field.name))


def gpu_events(profile) -> list[tuple[str, float, float]]:
  """``(name, start_us, end_us)`` of the work on the first GPU's streams (kernels and copies) in a
  ``jax.profiler.ProfileData``, by start time; the derived lines of that plane (XLA modules, ops) are left out."""
  plane = next((p for p in profile.planes if p.name.startswith("/device:GPU:")), None)
  if plane is None:
    raise ValueError(f"profile has no GPU plane, planes: {[p.name for p in profile.planes]}")
  events = [(e.name, e.start_ns / 1e3, (e.start_ns + e.duration_ns) / 1e3)
            for line in plane.lines if line.name.startswith("Stream") for e in line.events]
  if not events:
    raise ValueError(f"profile's GPU plane has no stream events, lines: {[line.name for line in plane.lines]}")
  return sorted(events, key=lambda e: e[1])


def gpu_timeline(run, calls: int = 6) -> list[tuple[str, float, float]]:
  """``gpu_events`` of ``run(calls)`` (back-to-back calls that block at the end) under ``jax.profiler``, after
  two warm-up calls. The profiler's activity tracing may lengthen the gaps a little."""
  import jax
  from jax.profiler import ProfileData

  run(2)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      run(calls)
    path, = pathlib.Path(d).rglob("*.xplane.pb")
    return gpu_events(ProfileData.from_file(str(path)))


def timeline_summary(events: list[tuple[str, float, float]], calls: int) -> dict:
  """Where the wall time of ``calls`` back-to-back calls goes on the GPU (``events`` from ``gpu_events``, the same
  kernels in every call). Per call, medians in us: ``period_us`` (start to start of consecutive calls),
  ``busy_us`` (time some kernel runs), ``idle_in_call_us`` (between its first start and last end with nothing
  running) and ``idle_between_calls_us``; ``steps``: per kernel position its name, median duration and the
  median idle time before it (within the call; for the first kernel, since the previous call)."""
  per_call, rest = divmod(len(events), calls)
  if rest or not per_call:
    raise ValueError(f"events: expected a multiple of calls={calls}, got {len(events)}: {[e[0] for e in events]}")
  groups = [events[i * per_call:(i + 1) * per_call] for i in range(calls)]
  if any([e[0] for e in g] != [e[0] for e in groups[0]] for g in groups):
    raise ValueError(f"events: the calls do not run the same kernels in the same order: {[e[0] for e in events]}")

  busy, idle_in, idle_between, before = [], [], [], [[] for _ in range(per_call)]
  for c, g in enumerate(groups):
    # Idle before kernel i: from the last end among the kernels before it (they may overlap) to its start.
    gaps = [max(0.0, g[i][1] - max(e[2] for e in g[:i])) for i in range(1, per_call)]
    idle_in.append(sum(gaps))
    busy.append(max(e[2] for e in g) - g[0][1] - sum(gaps))
    for i, gap in enumerate(gaps, 1):
      before[i].append(gap)
    if c:
      idle_between.append(max(0.0, g[0][1] - max(e[2] for e in groups[c - 1])))
      before[0].append(idle_between[-1])
  med = lambda xs: float(np.median(xs)) if xs else float("nan")
  return dict(
      period_us=med(list(np.diff([g[0][1] for g in groups]))), busy_us=med(busy), idle_in_call_us=med(idle_in),
      idle_between_calls_us=med(idle_between),
      steps=[dict(name=groups[0][i][0][:80], us=med([g[i][2] - g[i][1] for g in groups]),
                  idle_before_us=med(before[i])) for i in range(per_call)])


def rotation_plan(state_bytes: int) -> tuple[int, int]:
  """``(rotations, iters)`` for a working set of ``state_bytes``: enough rotating copies that three times the
  L2 never holds the next step's states, and about 2 GB of state traffic timed (a multiple of the rotations)."""
  rot = int(min(64, max(1, np.ceil(3 * L2_BYTES / state_bytes))))
  return rot, int(min(400, max(20, 2e9 / (2 * state_bytes)))) // rot * rot or rot
