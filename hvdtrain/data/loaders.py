"""Batches made in Python, read: each batch checked and made standard, and the two kinds of
source `hvdtrain.BatchData` reads (`Indexed`: a `PyDataset` or `Sequence` by index, loaded
in this process, in threads or in forked processes; `Stream`: a generator), with Keras's
hooks and numpy's and Python's random generators seeded per batch (`seeded_random`)."""

import concurrent.futures
import contextlib
import hashlib
import inspect
import itertools
import multiprocessing
import os
import random
import traceback
import warnings

import numpy as np
import tensorflow as tf

from hvdtrain import errors
from hvdtrain.errors import HvdtrainError, invalid_value, kind_of, one_line
from hvdtrain.runtime import tracebacks

__all__ = [
    "is_indexed",
    "seed_of",
    "seeded_random",
    "standard_batch",
    "as_tuples",
    "describe_batch",
    "batch_signature",
    "check_batch",
    "spec_text",
    "size_of",
    "arity",
    "Indexed",
    "SHARED",
    "get_shared",
    "Stream",
    "raised",
]


def is_indexed(obj):
    """A Keras `Sequence` or `PyDataset` (or one written alike): batches by index, with
    Keras's epoch hooks. Arrays have `__getitem__` and `__len__` too, but no hooks."""
    return (
        hasattr(obj, "__getitem__") and hasattr(obj, "on_epoch_end") and not isinstance(obj, type)
    )


def seed_of(*parts):
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "big")


@contextlib.contextmanager
def seeded_random(*parts):
    """numpy's and Python's global random generators seeded from `parts` (the same on every
    rank), restored after."""
    np_state, py_state = np.random.get_state(), random.getstate()
    np.random.seed(seed_of(*parts))
    random.seed(seed_of(*parts))
    try:
        yield
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


def standard_batch(batch, where):
    """A batch as Keras takes it: a tuple `(x,)`, `(x, y)` or `(x, y, sample_weight)`, or a
    dict; its lists as tuples, its leaves numpy arrays (None for a missing part). Else the
    error, saying `where` the batch came from."""
    if isinstance(batch, np.ndarray):
        batch = (batch,)
    if isinstance(batch, list):
        batch = tuple(batch)
    if isinstance(batch, dict) or (isinstance(batch, tuple) and 1 <= len(batch) <= 3):
        return tf.nest.map_structure(lambda a: a if a is None else np.asarray(a), as_tuples(batch))
    got = f"a tuple of {len(batch)}" if isinstance(batch, tuple) else kind_of(batch)
    raise HvdtrainError(
        f"{where}: expected a tuple (x,), (x, y) or (x, y, sample_weight), or a dict; "
        f"received {got}"
    )


def as_tuples(data):
    if isinstance(data, dict):
        return {k: as_tuples(v) for k, v in data.items()}
    if isinstance(data, list | tuple) and not hasattr(data, "_fields"):
        if data and all(isinstance(v, np.ndarray | dict | list | tuple) for v in data):
            return tuple(as_tuples(v) for v in data)
    return data


def describe_batch(batch):
    return str(tf.nest.map_structure(lambda a: f"{a.dtype}{list(a.shape)}", batch))


def batch_signature(batches):
    """The `tf.TensorSpec`s of batches of one structure: the batch dimension unknown, any
    other dimension unknown where the batches differ in it."""
    first = batches[0]

    def spec(*leaves):
        shapes = [a.shape for a in leaves]
        dims = [None] + [
            d if all(len(s) == len(shapes[0]) and s[i] == d for s in shapes) else None
            for i, d in enumerate(shapes[0][1:], start=1)
        ]
        return tf.TensorSpec(dims if leaves[0].ndim else [], tf.as_dtype(leaves[0].dtype))

    return tf.nest.map_structure(spec, first, *batches[1:])


def check_batch(batch, signature, what):
    """`batch` (standardized) fits `signature`, or an error saying how it differs."""
    try:
        tf.nest.assert_same_structure(batch, signature)
    except (ValueError, TypeError):
        raise HvdtrainError(
            f"{what} has another structure than the first batch: {describe_batch(batch)}, where "
            f"the first was {spec_text(signature)}; make every batch alike"
        ) from None
    for a, s in zip(tf.nest.flatten(batch), tf.nest.flatten(signature), strict=True):
        if tf.as_dtype(a.dtype) != s.dtype or not s.shape.is_compatible_with(a.shape):
            raise HvdtrainError(
                f"{what} is {describe_batch(batch)} where the first batches were "
                f"{spec_text(signature)}; give every batch the same dtypes and shapes "
                "(the batch dimension may differ)"
            )


def spec_text(signature):
    return str(tf.nest.map_structure(lambda s: f"{s.dtype.name}{s.shape.as_list()}", signature))


def size_of(batch):
    return len(tf.nest.flatten(batch)[0]) if tf.nest.flatten(batch)[0].ndim else 1


def arity(fn):
    """How many positional arguments a generator function takes: 0, 2 or 4."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 0
    required = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if len(required) not in (0, 2, 4):
        raise invalid_value(
            "generator function",
            f"{getattr(fn, '__name__', fn)}{inspect.signature(fn)}",
            "a function of (), (rank, size) or (rank, size, seed, epoch) that yields batches",
        )
    return len(required)


# -- the sources: batches by index, or a stream ------------------------------------------
class Indexed:
    """A `PyDataset` or `Sequence`."""

    def __init__(self, seq, name, workers, processes, queue):
        self.seq, self.name = seq, name
        self.workers = workers if workers is not None else getattr(seq, "workers", 1)
        self.processes = bool(
            processes if processes is not None else getattr(seq, "use_multiprocessing", False)
        )
        self.queue = queue if queue is not None else getattr(seq, "max_queue_size", 10)
        for what, value in (("workers", self.workers), ("max_queue_size", self.queue)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise invalid_value(what, value, "an integer >= 0")
        self.ended = None  # the last epoch whose on_epoch_end ran in this process

    def __len__(self):
        try:  # Keras 3's PyDataset may give `num_batches` alone (None: endless)
            n = len(self.seq) if hasattr(type(self.seq), "__len__") else self.seq.num_batches
        except Exception as e:
            raise raised(e, f"len({self.name})") from None
        if n is None:
            raise HvdtrainError(
                f"{self.name} has no length (num_batches is None): an endless PyDataset; give "
                "its batches per epoch as hvdtrain.BatchData(data, steps_per_epoch=N)"
            )
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
            raise invalid_value(f"len({self.name})", n, "a number of batches")
        return int(n)

    def get(self, index, seed, epoch, seeded=True):
        with seeded_random(seed, epoch, index) if seeded else contextlib.nullcontext():
            try:
                batch = self.seq[index]
            except HvdtrainError:
                raise
            except Exception as e:
                raise raised(e, f"{self.name}[{index}]") from None
        return standard_batch(batch, f"{self.name}[{index}]")

    def hook(self, name, seed, epoch):
        fn = getattr(self.seq, name, None)
        if fn is None:
            return
        with seeded_random(seed, epoch, name):
            try:
                fn()
            except Exception as e:
                raise raised(e, f"{self.name}.{name}()") from None
        if name == "on_epoch_end":
            self.ended = epoch

    def parallel(self):
        """Whether loading runs beside the training thread (Keras's own rule)."""
        return self.workers > 1 or (self.workers > 0 and self.processes)

    def load(self, indices, seed, epoch):
        """Yields `(index, batch)` for `indices` of one epoch, in order: in this thread, or
        by `workers` threads or processes up to `max_queue_size` ahead."""
        if not self.parallel():
            for i in indices:
                yield i, self.get(i, seed, epoch)
            return
        if self.processes:  # forked per epoch: the workers see what on_epoch_end changed
            global SHARED
            SHARED = self
            with warnings.catch_warnings():  # Keras forks alike ("multi-threaded" warning)
                warnings.simplefilter("ignore", DeprecationWarning)
                pool = multiprocessing.get_context("fork").Pool(self.workers)
            submit = lambda i: pool.apply_async(get_shared, (i, seed, epoch))  # noqa: E731
            result = lambda f: f.get()  # noqa: E731
        else:  # threads share numpy's generator: no seeding there
            pool = concurrent.futures.ThreadPoolExecutor(self.workers)
            submit = lambda i: pool.submit(self.get, i, seed, epoch, False)  # noqa: E731
            result = lambda f: f.result()  # noqa: E731
        closed = []

        def close():
            if not closed:
                closed.append(True)
                if self.processes:
                    pool.terminate()
                else:
                    pool.shutdown(wait=True, cancel_futures=True)

        try:
            pending, todo = [], iter(indices)
            for i in itertools.islice(todo, max(self.queue, 1)):
                pending.append((i, submit(i)))
            while pending:
                i, future = pending.pop(0)
                batch = result(future)
                for j in itertools.islice(todo, 1):
                    pending.append((j, submit(j)))
                if not pending:  # the epoch's last: the workers are done before its hooks
                    close()
                yield i, batch
        finally:
            close()


SHARED = None  # the `Indexed` that forked loader processes read (set before the fork)


def get_shared(index, seed, epoch):
    return SHARED.get(index, seed, epoch)


class Stream:
    """A generator function (called anew each epoch), or a generator object (one stream
    across the epochs, read in this process from its start)."""

    def __init__(self, gen, name):
        self.name, self.gen = name, gen
        self.function = callable(gen) and not inspect.isgenerator(gen)
        self.arity = arity(gen) if self.function else 0
        self.items = None  # a generator object's batches, from `position` on
        self.position = 0
        self.first = None  # its first batch (`peek`)

    @property
    def self_sharded(self):
        return self.arity >= 2

    def open(self, rank, size, seed, epoch):
        """This epoch's batches for `rank`, from a generator function."""
        args = (rank, size, seed, epoch)[: self.arity]
        try:
            it = iter(self.gen(*args))
        except Exception as e:
            raise raised(e, f"{self.name}{args}") from None
        return it if self.self_sharded else itertools.islice(it, rank, None, size)

    def own(self, k, rank, size):
        """The position in the generator's own count of rank `rank`'s `k`-th batch of an
        epoch (`open`): what an error names, as the user counts the generator's batches."""
        return k if self.self_sharded else k * size + rank

    def next(self, it, position):
        """The next batch of `it` (standardized), or None at its end; `position`: its place
        in the generator's own count (`own`)."""
        try:
            batch = next(it)
        except StopIteration:
            return None
        except Exception as e:
            raise raised(e, f"{self.name}'s batch {position}") from None
        return standard_batch(batch, f"{self.name}'s batch {position}")

    def at(self, position):
        """Batch `position` of a generator object (those before it read and dropped), or
        None where it ended."""
        if self.items is None:
            self.items = iter(self.gen)
        if position < self.position:
            raise HvdtrainError(
                f"{self.name} is a generator object, read once: it cannot go back to batch "
                f"{position}; pass the function that makes it"
            )
        while self.position < position:
            self.position += 1
            if self.next(self.items, self.position - 1) is None:
                return None
        self.position += 1
        return self.next(self.items, position)

    def peek(self):
        """A generator object's first batch, kept for the first step."""
        self.first = self.at(0)
        if self.first is None:
            raise HvdtrainError(f"{self.name} yielded no batch")
        self.items, self.position = itertools.chain([self.first], self.items), 0
        return self.first


def raised(error, what):
    """What to raise for `error`, raised by the data's code while hvdtrain ran it for
    `what` (in the data's own terms: `Images[9]`, `Images.on_epoch_end()`, `batches's batch
    20`, counted as the generator counts them).

    A ValueError or KeyError with a message that a `raise` in the user's own code threw is
    deliberate: one line naming `what`, and that function with its file and line (an
    `HvdtrainError`, exit 2). Another error that came through the user's code (a typo's
    NameError, a library's error on what the code gave it) is a bug, treated as one in a
    callback is: itself, marked with `what` and the place (`errors.in_your_code`), so that
    its traceback is printed once per host and its rank's line names both (exit 1). An
    error from no code of the user's (a library's own loader) stays one line."""
    frame = tracebacks.your_frame(error.__traceback__)
    if frame is None:
        return HvdtrainError(f"{what} raised {one_line(error, named=True, whole=True, most=300)}")
    raiser = traceback.extract_tb(error.__traceback__)[-1]
    where = f"{frame.name} ({os.path.basename(frame.filename)}:{frame.lineno})"
    deliberate = (
        isinstance(error, ValueError | KeyError)
        and str(error).strip()
        and (raiser.filename, raiser.lineno) == (frame.filename, frame.lineno)
        and (raiser.line or "").startswith("raise")
    )
    if deliberate:
        text = one_line(error, named=True, whole=True, most=300)
        return HvdtrainError(f"{what} raised {text} in {where}")
    return errors.in_your_code(error, what, where)
