"""The tags launchers put before each rank's output, and a rank's line put back together.

horovodrun (Gloo) and `mpirun --tag-output` (horovodrun --mpi, `hvdtrain-run --backend
mpirun`) put a tag before what each rank writes: `[1]<stdout>:` and `[1,1]<stdout>:` (job,
rank). horovodrun tags whole lines. Open MPI tags every piece it reads from a rank: a line
that a rank wrote in two writes, or that mpirun read in two reads, comes out as::

    [1,0]<stdout>:Total params: 7,8[1,0]<stdout>:50 (30.66 KB)

and a character of several bytes (model.summary's `━`) may be cut between the pieces, which
then read as two replacement characters. `Rejoin` puts each rank's pieces back into its
lines, byte for byte; the ranks themselves write whole lines (`hvdtrain.runtime.streams`),
so that pieces are rare to begin with. Pure: tested without launchers.

    rejoin = Rejoin()
    rejoin.feed("[1,0]<stdout>:ab[1,1]<stdout>:xy\\n")   # ['[1,1]<stdout>:xy\\n']
    rejoin.feed("[1,0]<stdout>:cd\\n")                   # ['[1,0]<stdout>:abcd\\n']
"""

import re

__all__ = ["Rejoin", "split_tag", "TAG"]

# [rank] (horovodrun) or [job,rank] (mpirun --tag-output), then the stream.
TAG = re.compile(r"\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:")


def split_tag(line):
    """(rank, stream, the line without its tag) of a tagged `line`, else (None, None, line)."""
    m = TAG.match(line)
    if not m:
        return None, None, line
    return int(m.group(1)), m.group(2), line[m.end() :]


def _readable(text):
    """`text` read from a launcher with errors="surrogateescape", as text: its bytes decoded
    again, whole now, a byte that is no character replaced."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


class Rejoin:
    """Each rank's pieces of a line put back together (see the module's docstring).

    `feed(line)` takes a line as read from a launcher (decoded with
    errors="surrogateescape", so that a cut character's bytes survive) and returns the
    lines it completes: a piece without its line end is held, by its tag, until the piece
    that ends it comes, and an untagged line passes as it is."""

    def __init__(self):
        self.open = {}  # tag: what came of its line so far

    def feed(self, line):
        starts = [m.start() for m in TAG.finditer(line)]
        if not starts:
            return [_readable(line)]
        out = []
        if starts[0] > 0:  # untagged text before the first tag (the launcher's own)
            out.append(_readable(line[: starts[0]] + "\n"))
        bounds = starts[1:] + [len(line)]
        for start, end in zip(starts, bounds, strict=True):
            piece = line[start:end]
            tag = TAG.match(piece).group(0)
            text = self.open.pop(tag, "") + piece[len(tag) :]
            if text.endswith("\n"):
                out.append(_readable(tag + text))
            else:
                self.open[tag] = text
        return out

    def flush(self):
        """What is held when the output ends, each piece as a line."""
        held, self.open = self.open, {}
        return [_readable(tag + text + "\n") for tag, text in held.items()]
