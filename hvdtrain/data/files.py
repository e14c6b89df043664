"""Data in files, read as streams of records: TFRecord, text lines, one sample per file, or a
reader of your own; all files shared by the ranks, or each host with files of its own.

    def parse(record):                         # one record -> (x, y)
        f = tf.io.parse_single_example(record, {"x": tf.io.FixedLenFeature([784], tf.float32),
                                                "y": tf.io.FixedLenFeature([], tf.int64)})
        return tf.reshape(f["x"], (28, 28, 1)), f["y"]

    data = hvdtrain.FileData("data/train-*.tfrecord", parse, test="data/test-*.tfrecord")
    data = hvdtrain.FileData(paths, decode_image, reader="file")    # one sample per file
    data = hvdtrain.FileData("/local/part-*.tfrecord", parse, per_host=True)

How an epoch is read. The files' record counts are known (given as `counts`, or counted
once at the start, the ranks splitting the work, and agreed by all). Each epoch the file
order is a permutation drawn from (seed, epoch); the records, in that order, are cut into
one contiguous range per rank, of equal size (to one record): so a rank reads whole files,
at most one partly at each end of its range, and it shards by record when there are fewer
files than ranks. Each rank shuffles its range (a buffer seeded by seed, epoch and rank),
then parses, batches and takes `steps_per_epoch` batches, the same number on every rank.
With `per_host=True` each host lists its own files and its ranges are cut among its local
ranks; the steps are the fewest any rank of any host can fill. A record is read at most once
per epoch; the (ranks x batch) remainder of an epoch is left out, a different part each
epoch.

Resume. The pipeline of each epoch depends only on (seed, epoch, rank and the counts), so a
resume at step s of an epoch rebuilds that epoch and skips its first s x batch records
(read again, not parsed): resuming mid-epoch costs one re-read of that much of the rank's
range. With `--deterministic` a killed and resumed run ends bitwise like an uninterrupted
one (tests/test_recipe.py); random augmentation inside `parse` is not replayed exactly.
"""

import glob
import hashlib
import json

import numpy as np
import tensorflow as tf

from hvdtrain.data import Data, chain
from hvdtrain.errors import HvdtrainError, invalid_value, one_line

__all__ = ["FileData", "READERS", "count_records", "epoch_ranges", "epoch_range"]

_BUFFER = 256 * 1024  # TensorFlow's default read buffer, given: unsaid, each rank logs a line


def _tfrecords(path, compression_type=None):
    return tf.data.TFRecordDataset(path, compression_type, buffer_size=_BUFFER)


READERS = {
    "tfrecord": _tfrecords,
    "lines": tf.data.TextLineDataset,
    "file": lambda path: tf.data.Dataset.from_tensors(tf.io.read_file(path)),
}


def _reader(reader, compression=None):
    if callable(reader):
        return reader
    if reader not in READERS:
        raise invalid_value("reader", reader, f"one of {', '.join(READERS)}, or a function")
    if compression and reader in ("tfrecord", "lines"):
        return lambda path: READERS[reader](path, compression_type=compression)
    return READERS[reader]


def _unreadable(path, error, compression):
    """Why TensorFlow could not read `path`, in a line: its op error without the function
    and op names around it; a GZIP file read as plain says how to read it."""
    reason = one_line(error, most=200)
    try:
        with open(path, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"  # gzip's magic number
    except OSError:
        gzipped = False
    if gzipped and not compression:
        reason += '; it is GZIP-compressed: pass compression="GZIP" (hvdtrain.FileData)'
    return reason


def count_records(files, reader="tfrecord", compression=None):
    """The number of records in each file (read once, in TensorFlow)."""
    read = _reader(reader, compression)
    counts = []
    for path in files:
        try:
            counts.append(int(read(path).reduce(np.int64(0), lambda n, _: n + 1).numpy()))
        except tf.errors.OpError as e:
            raise HvdtrainError(
                f"Invalid data file {path}: cannot read it ({_unreadable(path, e, compression)})."
            ) from None
    return counts


def epoch_ranges(counts, seed, epoch, parts):
    """Each part's [(file index, skip, take)] of one epoch (pure).

    The files in an order drawn from (seed, epoch), their records cut into `parts`
    contiguous ranges of equal size (to one record).
    """
    total = sum(counts)
    return [
        epoch_range(counts, seed, epoch, p * total // parts, (p + 1) * total // parts)
        for p in range(parts)
    ]


def epoch_range(counts, seed, epoch, lo, hi):
    """[(file index, skip, take)] of the records `lo` to `hi` of one epoch (pure): the files
    in an order drawn from (seed, epoch), their records one after the other."""
    order = np.random.default_rng([seed, epoch, 0x5EED]).permutation(len(counts))
    starts = np.concatenate([[0], np.cumsum([counts[i] for i in order])])
    pieces = []
    for j, i in enumerate(order):
        a, b = max(lo, starts[j]), min(hi, starts[j + 1])
        if a < b:
            pieces.append((int(i), int(a - starts[j]), int(b - a)))
    return pieces


class FileData(Data):
    """Training (and test) samples in files; see the module doc for how they are read.

    Args:
        files: the training files: a list of paths, a glob pattern, or a function
            `(placement) -> paths` (with `per_host`, what this host holds).
        parse: `record -> (x, y)` (or `(x, y, sample_weight)`), applied after shuffling; a
            string tensor: a TFRecord's serialized example, a line of text, or with
            `reader="file"` the file's whole contents (its bytes, not its path).
        test: the test files, in the same forms, or None.
        reader: "tfrecord", "lines" (text lines), "file" (each file one record: its bytes),
            or `path -> tf.data.Dataset` of records.
        compression: "GZIP" or "ZLIB" for compressed TFRecord or text files.
        counts: records per training file, in the order of the sorted file list (skips
            the counting pass).
        test_counts: the same for the test files.
        per_host: each host holds files of its own (the pattern lists different files on
            each host); they are split among the host's local ranks.
        shuffle_buffer: records in each rank's shuffle buffer.
        source: a short name for the metrics JSON.
    """

    def __init__(
        self,
        files,
        parse,
        test=None,
        *,
        reader="tfrecord",
        compression=None,
        counts=None,
        test_counts=None,
        per_host=False,
        shuffle_buffer=10_000,
        source="files",
    ):
        if not callable(parse):
            raise invalid_value("parse", parse, "a function record -> (x, y)")
        if (
            isinstance(shuffle_buffer, bool)
            or not isinstance(shuffle_buffer, int)
            or (shuffle_buffer < 1)
        ):
            raise invalid_value("shuffle_buffer", shuffle_buffer, "a positive number of records")
        self.files, self.test, self.parse = files, test, parse
        self.read = _reader(reader, compression)
        self.reader, self.compression = reader, compression
        if per_host and (counts is not None or test_counts is not None):
            raise invalid_value(
                "counts", counts, "None with per_host=True (each host counts its own)"
            )
        self.given = {"train": counts, "test": test_counts}
        self.per_host, self.shuffle_buffer, self.source = per_host, shuffle_buffer, source
        self.parts = {}  # split -> (paths, counts) of this rank's group
        self.group = None  # (index in the group, group size)

    # -- agreeing on the files and their counts ---------------------------------------
    def prepare(self, placement, seed=0):
        """Lists the files on every rank, checks that the ranks that share them list the
        same, and counts their records (each rank a share). A mistake on any rank is the
        same error on every rank (`hvdtrain.agree`), never a rank left waiting."""
        from hvdtrain.runtime.process import agree

        p = placement
        specs = {k: v for k, v in (("train", self.files), ("test", self.test)) if v is not None}
        listed = agree(lambda: {split: _list(spec, p, split) for split, spec in specs.items()})
        me = {"host": p.host, "local_rank": p.local_rank, "local_size": p.local_size}
        me["lists"] = {k: _digest(v) for k, v in listed.items()}
        everyone = _gather(p, me, "hvdtrain.recipe.outputs")
        agree(lambda: _check_lists(everyone, self.per_host))
        groups = _groups(everyone, self.per_host)
        index, size = groups[p.rank]
        group = [r for r, e in enumerate(everyone) if not self.per_host or e["host"] == p.host]
        self.group = (index, size)
        for split, paths in listed.items():
            self.parts[split] = (paths, self._counts(p, split, paths, index, size, group))
        # Equal steps: every rank's records per epoch are known once the totals are shared.
        totals = _gather(p, sum(self.parts["train"][1]), "hvdtrain.data.files")
        self._per_rank = min(
            t * (i + 1) // s - t * i // s for t, (i, s) in zip(totals, groups, strict=True)
        )
        self._total = sum(totals[r] for r in _leaders(everyone, self.per_host))

    def _counts(self, p, split, paths, index, size, group):
        from hvdtrain.runtime.process import agree

        given = self.given[split]
        if given is not None:
            if len(given) != len(paths) or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in given
            ):
                raise invalid_value(
                    f"{split}_counts", given, f"{len(paths)} record counts, one per file"
                )
            return list(given)
        # The ranks of the group count a share each; everyone gets every count.
        mine = range(index, len(paths), size)

        def count():
            found = count_records([paths[i] for i in mine], self.reader, self.compression)
            return dict(zip(mine, found, strict=True))

        share = agree(count)
        gathered = _gather(p, share, f"hvdtrain.counts.{split}")
        counts = {}
        for r in group:
            counts.update(gathered[r])
        return [counts[i] for i in range(len(paths))]

    def describe(self):
        paths, counts = self.parts["train"]
        where = "this host's " if self.per_host else ""
        text = f"{len(paths)} {where}file(s), {sum(counts)} records"
        if "test" in self.parts:
            text += f"; test: {len(self.parts['test'][0])} file(s), {sum(self.parts['test'][1])}"
        return text

    @property
    def num_samples(self):
        return self._total

    def steps_per_epoch(self, batch_size, placement):
        steps = self._per_rank // batch_size
        if steps < 1:
            raise invalid_value(
                "batch_size",
                batch_size,
                f"at most {self._per_rank} (the fewest records a rank gets per epoch)",
            )
        return steps

    # -- pipelines --------------------------------------------------------------------
    def _records(self, split, seed, epoch, shuffle_seed=None):
        paths, counts = self.parts[split]
        index, size = self.group
        pieces = epoch_ranges(counts, seed, epoch, size)[index]
        return self._read(paths, pieces, shuffle_seed) if pieces else None

    def _read(self, paths, pieces, shuffle_seed=None):
        """The records of `pieces` ([(file index, skip, take)] of `paths`), in a dataset of
        their number, shuffled with `shuffle_seed` unless it is None."""
        files = tf.constant([paths[i] for i, _, _ in pieces], tf.string)
        skips = tf.constant([s for _, s, _ in pieces], tf.int64)
        takes = tf.constant([t for _, _, t in pieces], tf.int64)
        ds = tf.data.Dataset.from_tensor_slices((files, skips, takes)).interleave(
            lambda f, s, t: self.read(f).skip(s).take(t),
            cycle_length=max(1, min(4, len(pieces))),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )
        # Its length, known from the counts (Keras evaluates several steps per call only over
        # a dataset of known length); a file shorter than counted stops the job with an error.
        ds = ds.apply(tf.data.experimental.assert_cardinality(sum(t for _, _, t in pieces)))
        if shuffle_seed is not None:
            ds = ds.shuffle(self.shuffle_buffer, seed=shuffle_seed, reshuffle_each_iteration=False)
        return ds

    def train_dataset(self, batch_size, placement, *, seed, start_step, steps, epochs):
        first, skip = divmod(start_step, steps)
        index = self.group[0]

        def one(epoch):
            ds = self._records("train", seed, epoch, _seed(seed, epoch, placement.rank, index))
            ds = ds.take(steps * batch_size)
            return ds.skip(skip * batch_size) if epoch == first else ds

        ds = chain(one(e) for e in range(first, max(epochs, first + 1)))
        return self._batches(ds, batch_size)

    @property
    def shares(self):
        """Files every rank lists can be shared out unequally; a host's own (`per_host`)
        cannot leave it."""
        return not self.per_host

    def train_share(self, batch_size, *, seed, epoch, first, steps):
        """The records of batches `first` to `first + steps` of epoch `epoch`'s order over all
        ranks (`epoch_range`), shuffled among themselves."""
        paths, counts = self.parts["train"]
        lo = first * batch_size
        pieces = epoch_range(counts, seed, epoch, lo, lo + steps * batch_size)
        return self._batches(self._read(paths, pieces, _seed(seed, epoch, "share", first)),
                             batch_size)  # fmt: skip

    def _batches(self, records, batch_size):
        ds = records.map(self.parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    @property
    def has_test(self):
        return self.test is not None

    def eval_dataset(self, batch_size, placement):
        if "test" not in self.parts:
            return None
        ds = self._records("test", 0, 0)
        if ds is None:  # fewer test records than ranks: this one has none
            return None
        ds = ds.map(self.parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def _list(spec, placement, split):
    if callable(spec):
        paths = spec(placement)
    elif isinstance(spec, str):
        paths = glob.glob(spec)
        if not paths:
            raise invalid_value(f"{split} files", spec, "a pattern that matches files")
    else:
        paths = spec
    paths = sorted(str(p) for p in paths)
    if not paths:
        raise invalid_value(f"{split} files", spec, "at least one file")
    return paths


def _digest(paths):
    return hashlib.sha256(json.dumps(paths).encode()).hexdigest()


def _gather(placement, obj, name):
    if placement.size == 1:
        return [obj]
    import horovod.tensorflow as hvd

    return hvd.allgather_object(obj, name=name)


def _check_lists(everyone, per_host):
    """The ranks that share files (all, or a host's) list the same ones (the same verdict on
    every rank: it reads only what every rank gathered)."""
    hosts = {}
    for r, e in enumerate(everyone):
        hosts.setdefault(e["host"] if per_host else "", []).append(r)
    for host, ranks in hosts.items():
        if per_host and sorted(everyone[r]["local_rank"] for r in ranks) != list(
            range(everyone[ranks[0]]["local_size"])
        ):
            raise HvdtrainError(
                f"per-host data: the ranks of host {host} are not its local ranks 0 to "
                f"{everyone[ranks[0]]['local_size'] - 1}; launch with one host name per machine"
            )
        for split in everyone[ranks[0]]["lists"]:
            if len({everyone[r]["lists"].get(split) for r in ranks}) != 1:
                where = f"of host {host}" if per_host else "of the job"
                raise HvdtrainError(
                    f"Invalid value for `{split} files`: the ranks {where} list different files; "
                    "put the same files on every "
                    + ("rank of a host" if per_host else "host, or use per_host=True")
                )


def _groups(everyone, per_host):
    """(index in its group, group size) of every rank."""
    if not per_host:
        return [(r, len(everyone)) for r in range(len(everyone))]
    return [(e["local_rank"], e["local_size"]) for e in everyone]


def _leaders(everyone, per_host):
    """One rank per group (its total counts once)."""
    if not per_host:
        return [0]
    return [r for r, e in enumerate(everyone) if e["local_rank"] == 0]


def _seed(seed, epoch, rank, index):
    h = hashlib.sha256(f"{seed}/{epoch}/{rank}/{index}".encode()).digest()
    return int.from_bytes(h[:7], "big")
