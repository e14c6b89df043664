"""A logger that speaks on rank 0 only: the other ranks stay silent unless they fail."""

import logging
import sys

__all__ = ["get_logger"]


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
