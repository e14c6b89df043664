"""Batches made in Python, as Keras's `fit` takes them: a `keras.utils.PyDataset` (Keras 3),
a `tf.keras.utils.Sequence` (Keras 2, ImageDataGenerator's `flow`, `flow_from_directory` and
`flow_from_dataframe` included), or a generator. The object goes to `hvdtrain.fit` unchanged:

    train = ImageDataGenerator(rescale=1 / 255, rotation_range=10).flow_from_directory(
        "data/train", target_size=(64, 64), batch_size=32)              # a Sequence
    hvdtrain.fit(build_model, train, args)                             # as model.fit(train)
    hvdtrain.fit(build_model, (train, test), args)                     # validation_data=test
    hvdtrain.fit(build_model, hvdtrain.BatchData(train, test=test, workers=4), args)
    hvdtrain.fit(build_model, hvdtrain.BatchData(make_batches, steps_per_epoch=500), args)

What a rank sees. The batch size is the data's (`--batch-size` is not used for training).
An indexed dataset (`PyDataset`, `Sequence`) is sharded by batch index before anything is
loaded: each epoch the full batches are put in an order drawn from (seed, epoch), the same
on every rank (Keras's `shuffle`; `shuffle=False` keeps 0, 1, 2, ...), and rank r loads the
r-th, (r + ranks)-th, ... of them, `len // ranks` batches: every rank takes the same number of
steps and a batch is loaded by one rank only. Left out of an epoch: a short last batch, and
the (len % ranks) batches at the end of the epoch's order (other ones each epoch when
shuffled); the metrics JSON's `samples_per_epoch` counts what was trained. A generator is
read in order; a generator function is called anew each epoch, and when it takes
`(rank, size)` (or `(rank, size, seed, epoch)`) it shards itself and the rank takes all it
yields, else every rank runs it and takes every ranks-th batch. Its length, when not given as
`steps_per_epoch`, is counted once (one pass over epoch 0, each rank its share) and agreed:
the fewest batches any rank gets.

Keras's hooks and randomness. `on_epoch_begin` and `on_epoch_end` are called as Keras calls
them, by the loader at each epoch's start and end. Every call hvdtrain makes into the object
(`__getitem__`, the hooks) runs with numpy's and Python's global random generators seeded
from (seed, epoch, index) and restored after: a `Sequence` that reshuffles its samples in
`on_epoch_end` (ImageDataGenerator's iterators) holds the same order on every rank, so the
ranks' batches are disjoint, and augmentation drawn from `np.random` is the same again on a
resume (not with thread workers, which share the generators). A resumed run calls
`on_epoch_end` of the epoch before the one it resumes in, once.

Loading. A `PyDataset`'s `workers`, `use_multiprocessing` and `max_queue_size` are honoured on
each rank as Keras honours them (threads, or processes forked per epoch, loading up to
`max_queue_size` batches ahead, in order); for a Keras 2 `Sequence` they are arguments here.
One line warns when the ranks of a host run more loader workers than it has cores.

Test sets (`test=`, or the second of a pair): rank r evaluates batches r, r + ranks, ... of an
indexed test set, all of them (a short last batch included), every sample exactly once; a
test generator the same way (or all of it when it shards itself).
"""

import inspect
import itertools
import os

import numpy as np
import tensorflow as tf

from hvdtrain.data import loaders
from hvdtrain.data.base import Data
from hvdtrain.errors import HvdtrainError, invalid_value, one_line
from hvdtrain.runtime import watchdog

__all__ = ["BatchData", "is_batches"]


def is_batches(obj):
    """Whether `obj` is batches made in Python: an indexed dataset (a `PyDataset`, a
    `Sequence`), a generator, or a generator function. No TensorFlow or Keras needed."""
    return loaders.is_indexed(obj) or inspect.isgenerator(obj) or inspect.isgeneratorfunction(obj)


class BatchData(Data):
    """Batches made in Python: a `PyDataset`, a `Sequence` or a generator (see the module
    doc for which batches a rank sees).

    Args:
        train: a `keras.utils.PyDataset` or `tf.keras.utils.Sequence` (ImageDataGenerator's
            iterators included), a generator function (of `()`, `(rank, size)` or
            `(rank, size, seed, epoch)`; called each epoch), or a generator object (read
            once, across the epochs: give `steps_per_epoch`).
        test: the test set, in the same forms (a generator function of `()` or
            `(rank, size)`), or None.
        steps_per_epoch: batches per epoch per rank; None counts a generator function's
            batches (one pass) and takes `len // ranks` of an indexed dataset.
        shuffle: the batch order of an indexed dataset drawn anew each epoch (as Keras's
            `fit(shuffle=True)`), the same on every rank.
        workers: threads or processes loading an indexed dataset's batches on each rank, as
            Keras's; None takes the `PyDataset`'s own (1 for a `Sequence`).
        use_multiprocessing: processes (forked each epoch) rather than threads; None takes
            the `PyDataset`'s own (False for a `Sequence`).
        max_queue_size: batches loaded ahead; None takes the `PyDataset`'s own (10).
        source: a short name for the metrics JSON.
    """

    source = "python"

    def __init__(
        self,
        train,
        test=None,
        *,
        steps_per_epoch=None,
        shuffle=True,
        workers=None,
        use_multiprocessing=None,
        max_queue_size=None,
        source=None,
    ):
        if not is_batches(train) and not callable(train):
            raise invalid_value(
                "train",
                type(train).__name__,
                "a keras.utils.PyDataset, a tf.keras.utils.Sequence, a generator or a "
                "function that makes one",
            )
        if test is not None and not is_batches(test) and not callable(test):
            raise invalid_value("test", type(test).__name__, "batches in the forms of `train`")
        if steps_per_epoch is not None and (
            isinstance(steps_per_epoch, bool)
            or not isinstance(steps_per_epoch, int)
            or steps_per_epoch < 1
        ):
            raise invalid_value("steps_per_epoch", steps_per_epoch, "a positive number or None")
        loading = (workers, use_multiprocessing, max_queue_size)
        self.train = self._source(train, type(train).__name__, loading)
        self.test = None if test is None else self._source(test, "the test set", loading)
        if (
            isinstance(self.train, loaders.Stream)
            and not self.train.function
            and not steps_per_epoch
        ):
            raise HvdtrainError(
                "Invalid value for `data`: received a generator object, which can be read "
                "once and whose length is unknown; expected "
                "hvdtrain.BatchData(generator, steps_per_epoch=N), or the function that makes "
                "the generator (called anew each epoch)"
            )
        if isinstance(self.test, loaders.Stream) and not self.test.function:
            raise invalid_value(
                "test", "a generator object", "a function that makes the test generator"
            )
        self.given_steps, self.shuffle = steps_per_epoch, bool(shuffle)
        self.source = source or (
            "generator" if isinstance(self.train, loaders.Stream) else "python"
        )
        self.batch_size = None  # the data's own: `prepare` reads it
        # Batches per rank and epoch; full batches; all batches; samples in all:
        self._steps = self._full = self._batches = self._samples = None
        self.signature = self.test_signature = None
        self.loader_workers = 0
        self.failure = None  # the error a loader met, for `explain`

    @staticmethod
    def _source(obj, name, loading):
        if loaders.is_indexed(obj):
            return loaders.Indexed(obj, name, *loading)
        return loaders.Stream(obj, getattr(obj, "__name__", name))

    # -- agreeing on the batches ----------------------------------------------------------
    def prepare(self, placement, seed=0):
        """Reads the first batches (and counts a generator's), checks them, and agrees with
        the other ranks on the length and the steps; an error on any rank is one line on
        every rank."""
        from hvdtrain.runtime.process import agree

        p = placement
        mine = agree(lambda: self._look(self.train, p, seed, count=not self.given_steps))
        everyone = _gather(p, mine, "hvdtrain.data.batches")
        agree(lambda: _check_ranks(everyone, self.train))
        self.batch_size, self.signature = mine["batch_size"], mine["signature"]
        if isinstance(self.train, loaders.Indexed):
            self._batches, self._full = mine["length"], mine["full"]
            self._samples = mine["samples"]
            self._steps = self.given_steps or self._full // p.size
            if self._steps < 1 or self._steps * p.size > self._full:
                raise HvdtrainError(
                    f"{self.train.name} has {self._full} full batch(es) for {p.size} ranks: "
                    "every rank needs at least one per step; give it more batches (a smaller "
                    "batch size) or run fewer ranks"
                    + (f" (steps_per_epoch={self.given_steps})" if self.given_steps else "")
                )
            self.loader_workers = self.train.workers if self.train.parallel() else 0
        else:
            counts = [e["count"] for e in everyone]
            self._steps = self.given_steps or min(counts)
            self._full = self._steps * p.size
            self._samples = self._full * self.batch_size
            if self._steps < 1:
                raise HvdtrainError(
                    f"{self.train.name} gave rank {counts.index(min(counts))} no batch in "
                    "epoch 0: every rank needs at least one; make it yield batches for every "
                    "rank"
                )
        if self.test is not None:
            look = agree(lambda: self._look(self.test, p, seed, count=False))
            self.test_signature = look["signature"]

    def _look(self, source, p, seed, count):
        """This rank's view of a source: its length and full batches (indexed), or the
        batches it yields in epoch 0 (`count`); the first batches' signature and size."""
        if isinstance(source, loaders.Indexed):
            n = len(source)
            if n == 0:
                raise HvdtrainError(f"{source.name} is empty (its length is 0)")
            first = source.get(0, seed, 0)
            last = source.get(n - 1, seed, 0) if n > 1 else first
            size = loaders.size_of(first)
            if isinstance(tf.nest.flatten(first)[0], np.ndarray) and size == 0:
                raise HvdtrainError(f"{source.name}[0] is an empty batch")
            full = n if loaders.size_of(last) == size else n - 1
            batches = [first, last] if n > 1 and full == n else [first]
            return {
                "length": n,
                "full": full,
                "samples": full * size + (loaders.size_of(last) if full < n else 0),
                "batch_size": size,
                "signature": _signature_of(batches, source.name),
            }
        if not source.function:  # read once: its first batch is kept for the first step
            first = source.first if source.items is not None else source.peek()
            return {"count": None, "batch_size": loaders.size_of(first),
                    "signature": _signature_of([first], source.name)}  # fmt: skip
        it = source.open(p.rank, p.size, seed, 0)
        first = source.next(it, source.own(0, p.rank, p.size))
        if first is None:
            raise HvdtrainError(f"{source.name} yielded no batch for rank {p.rank} in epoch 0")
        signature = _signature_of([first], source.name)
        n = 1
        if count:
            for n in itertools.count(1):
                own = source.own(n, p.rank, p.size)
                batch = source.next(it, own)
                if batch is None:
                    break
                loaders.check_batch(batch, signature, f"{source.name}'s batch {own}")
        return {"count": n, "batch_size": loaders.size_of(first), "signature": signature}

    def describe(self):
        name, size = self.train.name, self._full // self._steps
        if isinstance(self.train, loaders.Indexed):
            left = self._batches - self._steps * size
            return (
                f"{name}: {self._batches} batches of {self.batch_size} (the data's batch size), "
                f"{self._steps} per rank and epoch, {left} left out each epoch"
            )
        counted = "" if self.given_steps else ", counted"
        return (
            f"{name}: {self._steps} batches of {self.batch_size} (the data's batch size) per "
            f"rank and epoch{counted}"
        )

    @property
    def num_samples(self):
        """The samples of all batches (those left out of every epoch included)."""
        return self._samples

    def steps_per_epoch(self, batch_size, placement):
        # `batch_size` is the data's x the accumulation: whole accumulation cycles.
        cycle = max(1, batch_size // self.batch_size)
        if self._steps < cycle:
            raise invalid_value(
                "--accumulate", cycle, f"at most {self._steps} (the batches a rank takes per epoch)"
            )
        return self._steps // cycle

    def loader_warning(self, placement):
        """One line when this host's ranks together run more loader workers than it has
        cores; or None."""
        cores, ranks = os.cpu_count() or 1, placement.local_size
        total = self.loader_workers * ranks
        if total <= cores:
            return None
        kind = "processes" if self.train.processes else "threads"
        return (
            f"the {ranks} rank(s) of this host run {total} loader {kind} in all (workers="
            f"{self.loader_workers} each) on {cores} core(s): loading competes with training; "
            f"give each rank workers={max(1, cores // ranks)} or fewer"
        )

    # -- pipelines --------------------------------------------------------------------
    def order(self, epoch, seed, placement):
        """The batch indices `placement`'s rank loads in `epoch` (pure: every rank draws the
        same order, then takes every ranks-th batch of it from its rank on)."""
        indices = self._epoch_order(epoch, seed)
        return [int(i) for i in indices[placement.rank :: placement.size][: self._steps]]

    def _epoch_order(self, epoch, seed):
        """The full batches' indices in epoch `epoch`'s order, the same on every rank."""
        if not self.shuffle:
            return np.arange(self._full)
        return np.random.default_rng([seed, epoch, 0xBA7C]).permutation(self._full)

    @property
    def shares(self):
        """Batches by index (a `Sequence`, a `PyDataset`) can be shared out unequally; a
        generator's are its own."""
        return isinstance(self.train, loaders.Indexed)

    def train_share(self, batch_size, *, seed, epoch, first, steps):
        """The batches `first` to `first + steps` of epoch `epoch`'s order over all ranks (an
        indexed dataset's: `shares`), its epoch hooks run around them as Keras runs them."""
        src = self.train
        todo = [int(i) for i in self._epoch_order(epoch, seed)[first : first + steps]]
        share = lambda: self._epoch_of(todo, seed, epoch)  # noqa: E731
        ds = tf.data.Dataset.from_generator(self._kept(share, src), output_signature=self.signature)
        return ds.prefetch(1 if src.parallel() else tf.data.AUTOTUNE)

    def _epoch_of(self, todo, seed, epoch):
        """An indexed dataset's batches `todo` of epoch `epoch`, checked, between its epoch
        hooks as Keras runs them (the end once all are loaded)."""
        src = self.train
        src.hook("on_epoch_begin", seed, epoch)
        if not todo:
            src.hook("on_epoch_end", seed, epoch)
        for k, (i, batch) in enumerate(src.load(todo, seed, epoch)):
            loaders.check_batch(batch, self.signature, f"{src.name}[{i}]")
            if k == len(todo) - 1:  # all loaded: the hook runs as Keras runs it
                src.hook("on_epoch_end", seed, epoch)
            yield batch

    def train_dataset(self, batch_size, placement, *, seed, start_step, steps, epochs):
        # A batch per (micro-)step: `steps` may be fewer than the batches a rank has (whole
        # accumulation cycles), the rest left out too.
        first, skip = divmod(start_step, steps)
        last, src, p = max(epochs, first + 1), self.train, placement

        def indexed():
            if first > 0 and src.ended != first - 1:  # as after the epoch before
                src.hook("on_epoch_end", seed, first - 1)
            for epoch in range(first, last):
                todo = self.order(epoch, seed, p)[skip if epoch == first else 0 : steps]
                yield from self._epoch_of(todo, seed, epoch)

        def function():
            for epoch in range(first, last):
                it = src.open(p.rank, p.size, seed, epoch)
                for k in range(steps):
                    batch = src.next(it, src.own(k, p.rank, p.size))
                    if batch is None:
                        raise self._ran_out(p, epoch, k, steps)
                    if k >= (skip if epoch == first else 0):
                        where = f"{src.name}'s batch {src.own(k, p.rank, p.size)}"
                        loaders.check_batch(batch, self.signature, where)
                        yield batch

        def stream():  # one generator object: rank r's k-th batch is its (k x ranks + r)-th
            for epoch in range(first, last):
                for k in range(skip if epoch == first else 0, steps):
                    n = (epoch * steps + k) * p.size + p.rank
                    batch = src.at(n)
                    if batch is None:
                        raise self._ran_out(p, epoch, k, steps)
                    loaders.check_batch(batch, self.signature, f"{src.name}'s batch {n}")
                    yield batch

        if isinstance(src, loaders.Indexed):
            gen = indexed
        else:
            gen = function if src.function else stream
        ds = tf.data.Dataset.from_generator(self._kept(gen, src), output_signature=self.signature)
        # Loader workers load ahead themselves (`max_queue_size`), as under Keras.
        parallel = isinstance(src, loaders.Indexed) and src.parallel()
        return ds.prefetch(1 if parallel else tf.data.AUTOTUNE)

    def _ran_out(self, p, epoch, k, steps):
        return HvdtrainError(
            f"rank {p.rank}'s data ran out: {self.train.name} gave {k} batch(es) in epoch "
            f"{epoch + 1} where the epoch needs {steps}; make it yield at least {steps} "
            "batches for every rank each epoch, or give a smaller steps_per_epoch",
            every_rank=False,
        )

    def _kept(self, gen, src):
        """`gen` with the error it meets kept for `explain` (tf.data hides its type), and
        each batch's wait told to the watchdog: this thread runs `src`'s code (or waits for
        its loaders) on its own, so a rank stuck there is named for it
        (`watchdog.doing_in_thread`)."""
        doing = f"loading a batch of your data ({src.name}, your code)"

        def run():
            try:
                batches, end = gen(), object()
                while True:
                    with watchdog.doing_in_thread(doing):
                        batch = next(batches, end)
                    if batch is end:
                        return
                    yield batch
            except HvdtrainError as e:
                self.failure = HvdtrainError(str(e), every_rank=False)
                raise
            except Exception as e:  # a bug in the user's code (`loaders.raised`): itself
                self.failure = e
                raise

        return run

    def explain(self, error):
        return self.failure

    @property
    def has_test(self):
        return self.test is not None

    def eval_dataset(self, batch_size, placement):
        if self.test is None:
            return None
        src, p, signature = self.test, placement, self.test_signature

        def indexed():
            for i, batch in src.load(range(p.rank, len(src), p.size), 0, 0):
                loaders.check_batch(batch, signature, f"the test set's batch {i}")
                yield batch

        def function():
            it = src.open(p.rank, p.size, 0, 0)
            for n in itertools.count():
                batch = src.next(it, src.own(n, p.rank, p.size))
                if batch is None:
                    return
                loaders.check_batch(
                    batch, signature, f"the test set's batch {src.own(n, p.rank, p.size)}"
                )
                yield batch

        gen = indexed if isinstance(src, loaders.Indexed) else function
        ds = tf.data.Dataset.from_generator(self._kept(gen, src), output_signature=signature)
        if isinstance(src, loaders.Indexed):  # of known length: Keras need not count it
            ds = ds.apply(
                tf.data.experimental.assert_cardinality(len(range(p.rank, len(src), p.size)))
            )
        return ds.prefetch(tf.data.AUTOTUNE)


def _signature_of(batches, name):
    try:
        return loaders.batch_signature(batches)
    except (ValueError, TypeError) as e:
        raise HvdtrainError(
            f"{name}'s batches are not alike: {one_line(e, named=True, whole=True, most=300)}; "
            "make every batch the same structure"
        ) from None


def _gather(placement, obj, name):
    if placement.size == 1:
        return [obj]
    import horovod.tensorflow as hvd

    return hvd.allgather_object(obj, name=name)


def _by_rank(values):
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def _check_ranks(everyone, source):
    """Every rank built the same data: the same length (indexed), batch size and structure."""
    if isinstance(source, loaders.Indexed):
        lengths = [e["length"] for e in everyone]
        if len(set(lengths)) > 1:
            raise HvdtrainError(
                f"the ranks' {source.name} have different lengths ({_by_rank(lengths)} "
                "batches); build the same dataset on every rank: hvdtrain shards it by "
                "batch index"
            )
    sizes = [e["batch_size"] for e in everyone]
    if len(set(sizes)) > 1:
        raise HvdtrainError(
            f"the ranks' {source.name} have different batch sizes ({_by_rank(sizes)}); give "
            "every rank the same batch size"
        )
    specs = {loaders.spec_text(e["signature"]) for e in everyone if e["signature"] is not None}
    if len(specs) > 1:
        raise HvdtrainError(
            f"the ranks' {source.name} give batches of different structures or dtypes "
            f"({' / '.join(sorted(specs))}); build the same dataset on every rank"
        )
