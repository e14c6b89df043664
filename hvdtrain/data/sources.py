"""Where a dataset comes from, agreed by every rank: a folder given, Keras' cache, a download
by one rank per host, or a fallback (embedded or synthetic data). Used by the entry points
(`hvdtrain.mnist`, `hvdtrain.cifar10`); any dataset that Keras downloads fits.
"""

import os
import socket

from hvdtrain.errors import one_line, write_line

__all__ = ["keras_datasets_dir", "choose_source"]


def keras_datasets_dir():
    """Where `tf.keras.datasets.*.load_data()` keep their downloads (~/.keras/datasets)."""
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(home, "datasets")


def choose_source(data_dir, cache_path, download, fallback, prog):
    """Which data every rank uses: "data-dir", "keras-cache" or `fallback`.

    Call it on every rank after `hvd.init()`: the ranks agree through collectives, so
    none trains on other data than the others. In order: `data_dir` if given; Keras'
    cache (`cache_path`) if every rank sees it; `download()` run by local rank 0 of each
    host while the other ranks wait (10 s socket timeout; skipped when HVDTRAIN_OFFLINE=1);
    else `fallback`.
    """
    import horovod.tensorflow as hvd
    import tensorflow as tf

    def everywhere(flag):  # True only if `flag` holds on every rank (also a barrier)
        total = hvd.allreduce(tf.constant(int(flag)), op=hvd.Min, name="hvdtrain.source")
        return bool(total.numpy())

    if data_dir:
        return "data-dir"
    has_cache = os.path.exists(cache_path)
    if everywhere(has_cache):
        return "keras-cache"
    if os.environ.get("HVDTRAIN_OFFLINE") == "1":
        return fallback
    ok = True
    if hvd.local_rank() == 0 and not has_cache:  # one download per host; the others wait
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(10)
        try:
            download()
        except Exception as e:  # offline, refused, damaged: fall back below
            # The whole reason, on one line (Keras wraps the URL error in a long message).
            reason = one_line(e, whole=True)
            write_line(f"{prog}: download failed ({reason}); using {fallback}")
            ok = False
        finally:
            socket.setdefaulttimeout(previous)
    return "keras-cache" if everywhere(ok) else fallback
