"""A logger that speaks on rank 0 only: the other ranks stay silent unless they fail; and
Keras's own lines of set-up on rank 0 only."""

import logging
import re
import sys
import threading

__all__ = ["get_logger", "keras_set_up_on_rank0"]


def get_logger(rank=None):
    """The `hvdtrain` logger: INFO on rank 0, ERROR only on the other ranks.

    `rank` defaults to Horovod's rank (call after `hvdtrain.init()`).
    """
    if rank is None:
        import horovod.tensorflow as hvd

        rank = hvd.rank()
    log = logging.getLogger("hvdtrain")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("hvdtrain: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    if rank != 0:  # TensorFlow's own Python warnings too
        logging.getLogger("tensorflow").setLevel(logging.ERROR)
    return log


# What Keras prints while it looks at a user's data, once per call, the same on every rank:
# `flow_from_directory` (Keras 2), `flow_from_dataframe`, `image_dataset_from_directory` and
# `text_dataset_from_directory` (both Kerases).
_KERAS_SET_UP = re.compile(
    r"Found \d+ (?:images|files|validated image filenames)(?: belonging to \d+ classes)?\."
    r"|Using \d+ files for (?:training|validation)\."
)
_STARTS = ("Found ", "Using ")


class _WithoutKerasSetUp:
    """A text stream that passes everything to `stream` but Keras's own lines of set-up
    (`_KERAS_SET_UP`, whole lines): a line that may be one is held until its end."""

    def __init__(self, stream):
        self.stream, self._held, self._lock = stream, "", threading.Lock()

    def write(self, text):
        with self._lock:
            *lines, rest = (self._held + text).split("\n")
            out = "".join(f"{line}\n" for line in lines if not _KERAS_SET_UP.fullmatch(line))
            self._held = rest if rest.startswith(_STARTS) else ""
            out += "" if self._held else rest
            if out:
                self.stream.write(out)
        return len(text)

    def flush(self):
        with self._lock:
            if self._held:
                self.stream.write(self._held)
                self._held = ""
        self.stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, buffer: the stream's
        return getattr(self.stream, name)


def keras_set_up_on_rank0(rank):
    """On a rank other than 0, from now on: Keras's own lines of set-up (`Found 490 images
    belonging to 3 classes.`) are left out of stdout, where every rank printed its own
    (`hvdtrain.init` calls it: for a data function or a dataset hvdtrain calls). Lines a
    script printed before are out already (docs/your-model.md)."""
    if rank != 0 and not isinstance(sys.stdout, _WithoutKerasSetUp):
        sys.stdout = _WithoutKerasSetUp(sys.stdout)
