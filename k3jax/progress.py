"""Progress bars on stderr (``tqdm``): redrawn in place on a terminal, one line per update in a log.

tqdm starts every redraw with ``\\r``, so a log of its output holds one long line of run-together states.
Where stderr is not a terminal, ``bar`` therefore writes through ``LineStream`` (one line per redraw) and
redraws at most every ``LOG_INTERVAL`` seconds, in ASCII.
"""

import sys

from tqdm import tqdm

# Seconds between two lines of a bar where stderr is not a terminal (the first and last state always show).
LOG_INTERVAL = 30.0


class LineStream:
  """A text stream for tqdm that turns each ``\\r``-started redraw into a line of its own."""

  def __init__(self, stream):
    self.stream = stream

  def write(self, text: str) -> None:
    """Writes each non-blank ``\\r``-separated part of ``text`` as a line, trailing blanks removed."""
    lines = [part.rstrip() for part in text.split("\r")]
    lines = [line for line in lines if line]
    if lines:
      sys.stdout.flush()  # keep the order of stdout lines around the bar (tqdm does this for sys.stderr itself)
      self.stream.write("".join(line + "\n" for line in lines))

  def flush(self) -> None:
    """Flushes the wrapped stream."""
    self.stream.flush()


def bar(desc: str, total: int, *, enabled: bool = True, **kwargs) -> tqdm:
  """A tqdm bar on the current ``sys.stderr``; ``enabled=False`` shows nothing.

  Args:
    desc: the label in front of the bar.
    total: the count at 100%.
    enabled: False disables the bar (``tqdm(disable=True)``): its methods still work and print nothing.
    **kwargs: further ``tqdm`` arguments (``unit``, ``unit_scale``, ...); they override the log settings.
  """
  err = sys.stderr
  if getattr(err, "isatty", lambda: False)():
    return tqdm(total=total, desc=desc, file=err, disable=not enabled, **kwargs)
  log = {"mininterval": LOG_INTERVAL, "maxinterval": LOG_INTERVAL, "ascii": True}
  return tqdm(total=total, desc=desc, file=LineStream(err), disable=not enabled, **{**log, **kwargs})
