"""A rank's stdout and stderr write whole lines: `whole_lines()` (`hvdtrain.init` and
`hvdtrain.launch`'s ranks call it).

A launcher that tags each rank's output (`mpirun --tag-output`: `[1,0]<stdout>:`) tags every
piece it reads, so a line that reaches it in pieces is cut, between ranks' lines too, and a
character of several bytes (model.summary's `━`) may be cut in two (`hvdtrain.launcher.tags`
puts such pieces back together for `hvdtrain-run`). Two ways a rank wrote pieces:

- block buffering, Python's default when stdout is a pipe: 8 KB at a time, wherever the
  buffer ends, mid-line and mid-character (a model's summary fills it);
- PYTHONUNBUFFERED=1 (common in Docker images): every `write` at once, so `print("a", 1)`
  writes "a", " ", "1" and the line end one by one.

Line buffering writes each line whole, in one write, when it ends: output as prompt as
unbuffered, in whole lines. Standard library only; a terminal's streams are left as they are.
"""

import sys

__all__ = ["whole_lines"]


def whole_lines(streams=None):
    """Makes `streams` (default: the process's own stdout and stderr, not a capture's)
    line-buffered where they write to a pipe or a file unbuffered or block-buffered."""
    for stream in streams or (sys.__stdout__, sys.__stderr__):
        if stream is None or not hasattr(stream, "reconfigure"):
            continue
        try:
            if stream.isatty() or stream.line_buffering and not stream.write_through:
                continue
            stream.reconfigure(write_through=False, line_buffering=True)
        except (ValueError, OSError):  # closed, or used in a way that forbids it
            pass
