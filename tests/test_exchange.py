"""Exchanging less (`hvdtrain.exchange`): `--sync local` and `--sync diloco`.

In this process: where exchanges fall, the steps per execution that fit, the gradients' gate,
the bad combinations as one line. On 2 ranks in the module's shared Gloo job
(tests/workers/exchange_checks.py, a model with BatchNorm): local SGD at H=1 with plain SGD is
the synchronous mode; DiLoCo with an outer SGD of rate 1 and no momentum is local SGD, on
each Keras; the ranks hold one checksum after every exchange and differ between them; the
metrics JSON counts the exchanges and their bytes. Kill-and-resume between two exchanges:
test_recipe.py; a GAN: test_customizing_fit.py; elastic: test_customizing_fit.py (slow).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, job_env, worker

import hvdtrain
from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import exchange_due, fitting_steps_per_execution
from hvdtrain.recipe.flags import make_config

CHECKS = worker("exchange_checks.py")
RECIPE = worker("recipe.py")


def test_exchanges_fall_every_h_steps_of_an_epoch_and_at_its_end():
    due = [s for s in range(1, 11) if exchange_due(s, 10, 4)]
    assert due == [4, 8, 10]
    assert [s for s in range(1, 5) if exchange_due(s, 4, 16)] == [4]  # H past the epoch


@pytest.mark.parametrize("default, every, spe", [(16, 64, 16), (16, 4, 4), (16, 24, 12),
                                                 (16, 17, 1), (1, 16, 1)])  # fmt: skip
def test_steps_per_execution_are_set_to_divide_h(default, every, spe):
    assert fitting_steps_per_execution(default, every) == spe


@pytest.mark.parametrize(
    "options, words",
    [
        ({"sync": "sometimes"}, "`--sync`: received 'sometimes'; expected step, local, diloco"),
        ({"sync_every": 4}, "`--sync-every`: received 4; expected no value without --sync "
         "local or --sync diloco"),
        ({"sync": "local", "outer_lr": 0.5}, "`--outer-lr`: received 0.5; expected no value "
         "without --sync diloco"),
        ({"sync": "local", "sync_every": 0}, "`--sync-every`: received 0; expected a positive"),
        ({"sync": "diloco", "outer_momentum": 1.0}, "expected a number from 0 to below 1"),
        ({"sync": "local", "accumulate": 2}, "`--accumulate`: received 2; expected 1 with "
         "--sync local"),
        ({"sync": "diloco", "mixed_precision": "float16"}, "expected bfloat16 with --sync diloco"),
        ({"sync": "local", "sync_every": 4, "steps_per_execution": 8},
         "`--steps-per-execution`: received 8; expected a divisor of --sync-every 4"),
        ({"sync_balance": True}, "`--sync-balance`: received True; expected no value without "
         "--sync local or --sync diloco"),
        ({"sync": "local", "sync_balance": True, "deterministic": True},
         "`--sync-balance`: received True; expected no value with --deterministic"),
        ({"sync": "diloco", "sync_balance": True, "checkpoint_every": 5},
         "expected no value with --checkpoint-every"),
        ({"sync": "local", "sync_balance": True, "elastic": True},
         "expected no value with --elastic"),
    ],
)  # fmt: skip
def test_bad_combinations_are_one_line(options, words):
    with pytest.raises(HvdtrainError, match=None) as e:
        make_config(**options)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "steps, every, speeds, unit",
    [(10, 4, [1.0, 1.0], 1), (37, 16, [1.07, 1.0], 1), (37, 16, [1.07, 1.0], 4),
     (10, 16, [2.0, 1.0], 1), (64, 8, [5.0, 1.0, 2.5], 2), (9, 3, [100.0, 1.0], 1),
     (468, 16, [469.0, 246.0], 4), (468, 16, [100.0, 1.0], 4), (200, 16, [1.0, 3.0], 4)],
)  # fmt: skip
def test_balanced_shares_cover_the_epoch_with_every_ranks_exchanges(steps, every, speeds, unit):
    """`--sync-balance`: the ranks' shares are runs of the epoch's batches, one after the
    other, covering it; the faster rank takes more; every rank exchanges as often, between
    whole executions; the weights make the ranks' mean a mean weighted by steps."""
    from hvdtrain.data.shares import plan_epoch

    shares = plan_epoch(steps, every, speeds, unit)
    ranks = len(speeds)
    assert [s.first for s in shares] == [sum(s.steps for s in shares[:r]) for r in range(ranks)]
    assert sum(s.steps for s in shares) == steps * ranks
    rounds = -(-steps // every)
    for share, speed in zip(shares, speeds, strict=True):
        points = [k for k in range(1, share.steps + 1) if share.exchange_due(k)]
        assert len(points) == rounds and points[-1] == share.steps
        assert all(p % unit == 0 for p in points[:-1])
        if speed == max(speeds):
            assert share.steps >= steps
        if len(set(speeds)) == 1:
            assert share.steps == steps and points[:-1] == list(range(every, steps, every))
    for k in range(rounds):  # each round's weights: ranks x its steps over all the steps
        assert sum(s.weights[k] for s in shares) == pytest.approx(ranks)
    fast, slow = max(shares, key=lambda s: s.steps), min(shares, key=lambda s: s.steps)
    if len(set(speeds)) > 1 and unit == 1 and rounds > 1:  # in proportion, within a step
        ratio = max(speeds) / min(speeds)
        assert fast.steps / slow.steps == pytest.approx(ratio, rel=0.5) or slow.steps == rounds


def test_balance_times_executions_and_shares_equally_until_an_epoch_is_timed():
    """The speed is the median time a step of an epoch's executions, its first (tracing)
    left out; an epoch not timed (synchronous steps) or a rank that timed nothing gives equal
    shares next; equal shares gather nothing (no collective)."""
    from hvdtrain.data import ArrayData, Placement
    from hvdtrain.data.shares import Balance, EqualShares

    balance, sent = Balance(), []

    def allgather(value):
        sent.append(value)
        return [value, value / 2]  # rank 1 half as fast

    data = ArrayData(np.arange(400, dtype="float32").reshape(400, 1), np.zeros(400))
    data.prepare(Placement(0, 1, 0, 1, "here"), 0)

    def share(sharing, rank):
        """`rank`'s epoch 1 of 40 steps a rank at H=8, on executions of 4 steps."""
        sharing.plan(8, 4, 0)
        sharing.train_dataset(data, 4, Placement(rank, 2, rank, 2, "here"), seed=0, first=40,
                              steps=40, epochs=2, todo=40)  # fmt: skip
        return sharing.current

    assert share(balance, 0) is None and balance.execution_steps(16, 16) == 4
    balance.begin_epoch(timed=True)
    for step, seconds in ((4, 9.0), (8, 0.04), (12, 0.04), (16, 0.08)):  # 10 ms a step
        balance.clock(step, seconds)
    balance.gather(allgather)
    assert sent == [pytest.approx(100.0)] and balance.speeds == [pytest.approx(100), 50]
    fast, slow = share(balance, 0), share(balance, 1)
    assert fast.steps > 40 > slow.steps and fast.steps + slow.steps == 80
    balance.begin_epoch(timed=False)  # an epoch of synchronous steps
    balance.clock(4, 0.04)
    balance.gather(allgather)
    assert sent[-1] == 0.0 and balance.speeds is None and share(balance, 0) is None
    equal = EqualShares()
    equal.gather(allgather)
    assert len(sent) == 2 and share(equal, 0) is None
    assert equal.execution_steps(16, 16) == 16


def test_balanced_shares_of_arrays_train_each_sample_once_an_epoch():
    """`ArrayData.train_share`: shares of any sizes train each sample of an epoch once, in
    an order that differs from epoch to epoch and depends only on (seed, epoch)."""
    from hvdtrain.data import ArrayData

    x = np.arange(103, dtype="int64")
    data = ArrayData(x, x % 3)

    def ids(epoch, first, steps):
        batches = data.train_share(4, seed=7, epoch=epoch, first=first, steps=steps)
        return [int(v) for xb, _ in batches for v in xb.numpy()]

    epoch0 = ids(0, 0, 19) + ids(0, 19, 6)  # 25 batches of 4: 100 of the 103 samples
    assert len(epoch0) == len(set(epoch0)) == 100
    assert ids(0, 19, 6) == epoch0[76:]  # a share is a run of the epoch's order
    epoch1 = ids(1, 0, 10) + ids(1, 10, 15)
    assert len(set(epoch1)) == 100 and epoch1 != epoch0


def test_balanced_shares_of_files_read_each_record_once_an_epoch(tmp_path):
    """`FileData.train_share`: shares of any sizes over files of unequal counts read each
    record of an epoch's batches once (a run of the files in the epoch's order), the files'
    order drawn anew each epoch; a host's own files (`per_host`) are not shared out."""
    import tensorflow as tf

    import hvdtrain
    from hvdtrain.data import Placement
    from hvdtrain.data.files import FileData

    hvdtrain.init(threads=1)  # (one rank: `prepare` agrees through Horovod)
    ids = iter(range(103))
    for name, count in (("a", 41), ("b", 7), ("c", 55)):
        with tf.io.TFRecordWriter(str(tmp_path / f"{name}.tfrecord")) as w:
            for _ in range(count):
                w.write(str(next(ids)).encode())

    def parse(record):
        return tf.strings.to_number(record, tf.int64), tf.constant(0)

    data = FileData(str(tmp_path / "*.tfrecord"), parse, shuffle_buffer=8)
    data.prepare(Placement(0, 1))
    assert data.shares and not FileData("x", parse, per_host=True).shares

    def read(epoch, first, steps):
        batches = data.train_share(4, seed=7, epoch=epoch, first=first, steps=steps)
        return [int(v) for xb, _ in batches for v in xb.numpy()]

    epoch0 = read(0, 0, 19), read(0, 19, 6)  # 25 batches of 4: 100 of the 103 records
    assert sum(map(len, epoch0)) == len(set(epoch0[0] + epoch0[1])) == 100
    assert read(0, 19, 6) == epoch0[1]  # the same share, the same batches
    epoch1 = read(1, 0, 10), read(1, 10, 15)
    assert len(set(epoch1[0] + epoch1[1])) == 100
    assert set(epoch1[0]) != set(epoch0[0][:40])  # another order of the files


def test_balance_refuses_data_it_cannot_share_out_in_one_line():
    from hvdtrain.data import ArrayData, DatasetData, shares

    sharing = shares.for_config(make_config(sync="local", sync_balance=True))
    sharing.check(ArrayData(np.zeros((8, 2)), np.zeros(8)))
    with pytest.raises(HvdtrainError) as e:
        sharing.check(DatasetData(lambda rank, size, seed, epoch: None, num_samples=8))
    assert "`--sync-balance`: received True; expected data in memory" in str(e.value)
    assert "\n" not in str(e.value) and "`hvdtrain.FileData` without per_host" in str(e.value)
    assert shares.for_config(make_config(sync="local")).per_epoch is False


@pytest.mark.parametrize(
    "mode, overlap, names",
    [("step", False, ("EveryStep", None, None)),
     ("local", False, ("Rounds", "LocalSGD", "Blocking")),
     ("diloco", False, ("Rounds", "DiLoCo", "Blocking")),
     ("diloco", True, ("Rounds", "DiLoCo", "InFlight"))],
)  # fmt: skip
def test_a_mode_holding_an_averager_is_built_from_the_config(mode, overlap, names):
    from hvdtrain import exchange
    from hvdtrain.data.shares import EqualShares

    options = {"sync_every": 8, "sync_overlap": overlap} if mode != "step" else {}
    ex = exchange.for_config(make_config(sync=mode, **options))
    held = (type(getattr(ex, "mode", None)).__name__, type(getattr(ex, "averager", None)).__name__)
    assert (type(ex).__name__, *held) == tuple(n or "NoneType" for n in names)
    assert ex.exchanges_rarely == (mode != "step")
    assert ex.configure(None, 16, EqualShares()) == (16 if mode == "step" else 8)
    assert set(exchange.MODES) == {"step", "local", "diloco"}


def test_building_a_strategy_leaves_tensorflow_unstarted_for_hvdtrain_init():
    """`hvdtrain.fit` builds the strategy before `hvdtrain.init` sets TensorFlow's threads: a
    variable made then started TensorFlow with its default threads, and local SGD ran at
    about 0.7 of the synchronous mode at -np 2."""
    code = (
        "from hvdtrain import exchange\n"
        "from hvdtrain.recipe.flags import make_config\n"
        "for mode in ('step', 'local', 'diloco'):\n"
        "    for overlap in (False, True):\n"
        "        extra = {'sync_every': 8, 'sync_overlap': overlap} if mode != 'step' else {}\n"
        "        exchange.for_config(make_config(sync=mode, **extra))\n"
        "import tensorflow as tf\n"
        "tf.config.threading.set_intra_op_parallelism_threads(1)\n"  # raises once started
        "print('unstarted')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "unstarted" in proc.stdout, proc.stderr[-2000:]


def test_a_restart_that_refits_dilocos_outer_rate_applies_it_in_the_traced_exchange():
    """An elastic reset calls `begin` again, which refits the outer rate to the new ranks;
    the traced exchange (blocking) and the traced round (overlapped) hold the rate they were
    traced with, so `begin` traces them anew. One process: H=4 fits 0.1, then H=64 0.2; a
    change of 1 from the anchor moves it by rate x (1 + 0.9 x 10) at the first outer step
    (the momentum's bias correction: 1 / (1 - 0.9))."""
    code = (
        "import numpy as np, tensorflow as tf, hvdtrain\n"
        "from hvdtrain import exchange\n"
        "from hvdtrain.data.shares import EqualShares\n"
        "from hvdtrain.recipe.flags import make_config\n"
        "hvdtrain.init(threads=1)\n"
        "class Model:\n"
        "    pass\n"
        "for overlap in (False, True):\n"
        "    m, w = Model(), tf.Variable([1.0])\n"
        "    m.trainable_variables, m.non_trainable_variables = [w], []\n"
        "    s = exchange.for_config(make_config(sync='diloco', sync_every=4,\n"
        "                                        sync_overlap=overlap))\n"
        "    s.configure(None, 4, EqualShares())\n"
        "    s.attach(m, [])\n"
        "    for every in (4, 64):\n"
        "        s.every = s.mode.every = every\n"
        "        w.assign([1.0])\n"
        "        s.mode.outer.momentum[0].assign([0.0])\n"
        "        s.mode.steps.count.assign(0)\n"
        "        s.begin(0, 0)\n"
        "        w.assign([0.0])\n"
        "        s.replica.step = 1\n"
        "        s.now()\n"
        "        print(overlap, s.mode.outer_lr, round(float(1 - w.numpy()[0]), 4))\n"
        "        s.now(whole=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=job_env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    for overlap in ("False", "True"):
        assert f"{overlap} 0.1 1.0" in lines and f"{overlap} 0.2 2.0" in lines, proc.stdout


def test_the_synchronous_exchange_does_nothing_between_steps():
    from hvdtrain import exchange

    step = exchange.for_config(make_config())
    assert step.configure("mixed_float16", 16, sharing=None) == 16
    assert step.attach(model=None, optimizers=[]) == {}
    step.begin(start_step=5, lr_warmup_steps=10)
    step.before_checkpoint()
    assert step.callbacks(10, 0, check=None) == []
    assert [type(c).__name__ for c in step.callbacks(10, 0, check=print)] == ["FirstSteps"]
    assert step.ready_to_commit() and step.describe() == "" and step.rank_figures() == {}
    assert step.summary() == {"mode": "step"}


def test_each_mode_and_averager_is_a_small_class_and_none_reads_anothers_privates():
    """docs/development.md: a mode or an averager is one class in hvdtrain/exchange/ and one
    line in its table; no class reads another's private attributes."""
    import ast

    folder = os.path.join(ROOT, "hvdtrain", "exchange")
    for name in os.listdir(folder):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(folder, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                assert lines <= 250, f"{name}: {node.name} has {lines} lines"
            if not isinstance(node, ast.Attribute):
                continue
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                assert isinstance(owner, ast.Name) and owner.id in ("self", "cls"), (
                    f"{name}:{node.lineno}: .{node.attr} of another object"
                )


def test_h_is_resolved_once_with_its_default():
    assert make_config(sync="local").exchange_every == 16
    assert make_config(sync="diloco", sync_every=4).exchange_every == 4


def test_diloco_outer_rate_is_fitted_to_h_and_the_ranks():
    """The rule of docs/exchanging-less.md: 0.1 up to H=16 on 2 ranks (the measured best),
    rising as sqrt(H/16) up to H=64 and sqrt(ranks/2) above them, at most the paper's 0.7."""
    from hvdtrain.exchange import outer_step

    assert [outer_step(h, 2) for h in (1, 4, 16)] == [0.1, 0.1, 0.1]
    assert outer_step(64, 2) == 0.2 and outer_step(16, 8) == 0.2 and outer_step(16, 1) == 0.1
    assert outer_step(500, 64) == 0.7  # the paper's setting: its own rate, no more
    rates = [outer_step(h, n) for n in (2, 4, 8) for h in (4, 16, 64, 256)]
    assert all(0.1 <= r <= 0.7 for r in rates)
    assert outer_step(64, 4) > outer_step(64, 2)
    # Above the H measured the rate rises no more: 0.4 at H=256 on 2 ranks diverged.
    assert outer_step(256, 2) == outer_step(128, 2) == outer_step(64, 2) == 0.2


@pytest.mark.parametrize("keras", ["2", "3"])
def test_an_optimizers_own_state_leaves_out_its_step_and_learning_rate(keras):
    """What the exchange averages of an optimizer at whole exchanges: Adam's two moments per
    weight, not its step counter, its learning-rate variable or a warmup's single-worker
    rate, found by what they are (a float learning rate, and a `WarmupSchedule`)."""
    import tensorflow as tf

    from hvdtrain.exchange import wire
    from hvdtrain.optimizers import rates

    if keras == "3":
        import keras as k

        weights = [k.Variable(np.ones((3, 2), "float32")), k.Variable(np.zeros(2, "float32"))]
    else:
        k = tf.keras
        weights = [tf.Variable(np.ones((3, 2), "float32")), tf.Variable(np.zeros(2, "float32"))]
    for lr in (0.01, rates.WarmupSchedule(0.01, size=2, warmup_steps=4)):
        opt = k.optimizers.Adam(lr)
        opt.build(weights)
        slots = wire.slot_variables(opt)
        assert sorted(tuple(v.shape) for v in slots) == [(2,), (2,), (3, 2), (3, 2)]
        assert all(v.dtype.is_floating for v in slots)


def test_the_gate_averages_in_the_warmup_only_and_keeps_none_gradients():
    import tensorflow as tf

    from hvdtrain.optimizers.hooks import Gate, gated

    gate = Gate()
    grads = [tf.ones(2), None, tf.IndexedSlices(tf.ones((1, 2)), tf.constant([1]), [3, 2])]
    double = lambda gs: [g * 2 for g in gs]  # noqa: E731  (stands for the allreduce)
    on = gated(gate, double, grads)
    assert on[1] is None and np.allclose(on[0], 2) and np.allclose(on[2], [[0, 0], [2, 2], [0, 0]])
    gate.on.assign(False)
    off = gated(gate, double, grads)
    assert off[1] is None and np.allclose(off[0], 1) and np.allclose(off[2][1], 1)
    assert gated(None, double, [tf.ones(1)])[0].numpy() == 2  # --sync step: no gate


def _run(jobs, out, *flags, keras="2"):
    jobs.get(2, "gloo").run_script(
        [
            CHECKS,
            "--out",
            out,
            "--keras",
            keras,
            "--steps-per-execution",
            "1",
            "--metrics-json",
            out / "m.json",
            *flags,
        ]  # fmt: skip
    )
    weights = []
    for rank in range(2):
        z = np.load(out / f"rank{rank}.npz")
        weights.append([z[f"arr_{i}"] for i in range(len(z.files))])
    return weights, json.loads((out / "m.json").read_text())


def _largest_difference(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def test_local_sgd_at_h1_with_plain_sgd_is_the_synchronous_mode(shared_jobs, tmp_path):
    """Averaging the weights after each step of plain SGD is averaging the gradients."""
    (step, _), m_step = _run(shared_jobs, tmp_path / "step", "--optimizer", "sgd")
    (local, _), m = _run(shared_jobs, tmp_path / "local", "--optimizer", "sgd", "--sync", "local",
                         "--sync-every", "1", "--sync-warmup-steps", "0")  # fmt: skip
    assert m_step["sync"] == {"mode": "step"}
    assert m["sync"]["exchanges"] == 20 and m["sync"]["warmup_steps"] == 0
    assert _largest_difference(step, local) < 1e-5
    # (Not asserted: that the two differ bitwise. The mean of the weights and the step of the
    # mean gradient round alike or not by chance; the 20 exchanges show the local path ran.)


@pytest.mark.parametrize("keras", ["2", "3"])
def test_diloco_with_outer_sgd_of_rate_1_is_local_sgd_and_ranks_agree_at_exchanges(
    keras, shared_jobs, tmp_path
):
    """Adam inside, BatchNorm: 2 epochs of 10 steps, H=4: exchanges after steps 4, 8, 10 of
    each epoch, and the ranks' weights differ after every other step. Both runs checkpoint
    each epoch: Adam's moments are averaged before each checkpoint."""
    (local, local1), m = _run(shared_jobs, tmp_path / "local", "--sync", "local", "--sync-every",
                              "4", "--sync-warmup-steps", "0", "--checkpoint-dir",
                              tmp_path / "local" / "ck", keras=keras)  # fmt: skip
    (diloco, diloco1), d = _run(shared_jobs, tmp_path / "diloco", "--sync", "diloco",
                                "--sync-every", "4", "--outer-lr", "1", "--outer-momentum", "0",
                                "--checkpoint-dir", tmp_path / "diloco" / "ck",
                                keras=keras)  # fmt: skip
    assert _largest_difference(local, diloco) < 1e-6
    # after the end, every variable (BatchNorm's statistics, too) the same on both ranks
    assert _largest_difference(local, local1) == 0 and _largest_difference(diloco, diloco1) == 0
    for run in ("local", "diloco"):
        trace = json.loads((tmp_path / run / "trace.json").read_text())
        assert [i + 1 for i, agreed in enumerate(trace) if agreed] == [4, 8, 10, 14, 18, 20]
    assert m["sync"]["exchanges"] == d["sync"]["exchanges"] == 6
    assert d["sync"]["mode"] == "diloco" and d["sync"]["outer_lr"] == 1.0
    assert d["sync"]["outer_lr_from"] == "--outer-lr"
    # An exchange moves the weights and BatchNorm's 2 x 16 statistics; Adam's two moments are
    # averaged before the two epoch ends' checkpoints only.
    trainable = 12 * 16 + 16 + 2 * 16 + 16 * 4 + 4
    assert m["sync"]["bytes_per_exchange"] == 4 * (trainable + 2 * 16)
    assert m["sync"]["bytes_sent"] == 6 * m["sync"]["bytes_per_exchange"] + 2 * 4 * 2 * trainable
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1


@pytest.mark.parametrize("sync, extra", [("local", []), ("diloco", ["--fp16-allreduce"])])
def test_a_resume_where_the_synchronous_warmup_ends_is_exact(sync, extra, shared_jobs, tmp_path):
    """10 synchronous steps (epoch 1), then H=4: resumed from the epoch-1 checkpoint, the run
    ends on the uninterrupted run's weights bit for bit (the anchor of the first local steps
    is the weights where the warmup ends, in both); DiLoCo's change sent in 16 bits."""
    flags = ["--sync", sync, "--sync-every", "4", "--sync-warmup-steps", "10", "--deterministic"]
    flags += extra
    (whole, _), w = _run(shared_jobs, tmp_path / "whole", *flags)
    ckpt = str(tmp_path / "ckpt")
    _run(shared_jobs, tmp_path / "cut", *flags, "--epochs", "1", "--checkpoint-dir", ckpt)
    (resumed, _), m = _run(shared_jobs, tmp_path / "cut", *flags, "--checkpoint-dir", ckpt)
    assert m["resumed_from"]["epoch"] == 1 and m["sync"]["exchanges"] == 3
    # Adam's moments go on the wire before a checkpoint only: not in the run without one.
    assert w["sync"]["bytes_sent"] == 3 * w["sync"]["bytes_per_exchange"]
    assert m["sync"]["bytes_sent"] > 3 * m["sync"]["bytes_per_exchange"]
    assert _largest_difference(whole, resumed) == 0


@pytest.mark.parametrize(
    "keras, flags",
    [
        ("2", ["--sync", "local"]),
        ("3", ["--sync", "diloco", "--sync-overlap", "--data", "batches"]),
        ("2", ["--sync", "local", "--sync-overlap", "--data", "files"]),
    ],
)
def test_balanced_ranks_take_steps_in_proportion_to_their_speed(
    keras, flags, shared_jobs, tmp_path
):
    """`--sync-balance`, rank 1 slowed on purpose (30 ms a step), 3 epochs of 10 steps a rank,
    H=4: the first epoch is shared equally and timed, the next two give the faster rank more
    of their 20 batches; both ranks exchange as often (after 2 rounds and at each epoch's
    end) and end with every variable the same. Arrays on Keras 2, a `PyDataset` on Keras 3,
    TFRecord files (`FileData`) on Keras 2."""
    (w0, w1), m = _run(shared_jobs, tmp_path, *flags, "--sync-every", "4", "--sync-warmup-steps",
                       "0", "--sync-balance", "--epochs", "3", "--slow-rank", "1", "--slow-ms",
                       "30", keras=keras)  # fmt: skip
    fast, slow = (r["balanced_epoch_steps"] for r in m["ranks"])
    assert len(fast) == len(slow) == 2, m["ranks"]
    assert all(f + s == 20 and f > 10 > s for f, s in zip(fast, slow, strict=True)), (fast, slow)
    assert m["sync"]["balance"] and m["sync"]["exchanges"] == 9
    assert _largest_difference(w0, w1) == 0
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1
    assert all(len(v) == 3 for v in m["history"].values())


def test_a_callbacks_stop_within_a_balanced_epoch_is_agreed_at_an_exchange(shared_jobs, tmp_path):
    """A callback of rank 0 stops training after step 2 of the third epoch, whose shares
    are unequal: the ranks agree on it at the next exchange (a collective at every step
    would wait for batches the other rank does not take) and stop together."""
    (w0, w1), m = _run(shared_jobs, tmp_path, "--sync", "local", "--sync-every", "4",
                       "--sync-warmup-steps", "0", "--sync-balance", "--epochs", "4",
                       "--slow-rank", "1", "--slow-ms", "30", "--stop-at", "3,2")  # fmt: skip
    fast, slow = (r["balanced_epoch_steps"] for r in m["ranks"])
    assert len(fast) == 2 and fast[-1] > slow[-1], (fast, slow)
    assert m["status"] == "finished" and m["stopped_early"] == 3
    assert all(len(v) == 3 for v in m["history"].values())
    assert _largest_difference(w0, w1) == 0


@pytest.mark.parametrize("keras, mode", [("2", "local"), ("3", "diloco")])
def test_an_overlapped_runs_stop_within_an_epoch_travels_with_the_exchanges(
    keras, mode, shared_jobs, tmp_path
):
    """Under the overlap a callback's stop is carried by the next round's exchange, not by a
    collective of its own (which would wait for the slower rank at every exchange point).
    Rank 0 asks after step 3 of epoch 3 (H=2: points at 2, 4, 6, ...): the round started
    at step 4 carries the ask and lands at step 6, where both ranks stop: 5 exchanges in
    each of epochs 1-2 and 3 in epoch 3 (a stop agreed at the epoch's end would make 15, a
    blocking agreement at step 4 12), one model at the end."""
    (w0, w1), m = _run(shared_jobs, tmp_path, "--sync", mode, "--sync-every", "2",
                       "--sync-warmup-steps", "0", "--sync-overlap", "--epochs", "4",
                       "--stop-at", "3,3", keras=keras)  # fmt: skip
    assert m["status"] == "finished" and m["stopped_early"] == 3
    assert m["sync"]["exchanges"] == 13, m["sync"]
    assert all(len(v) == 3 for v in m["history"].values())
    assert _largest_difference(w0, w1) == 0
    # Under these modes each rank is bound to its own share of the cores (hvdtrain.runtime.tuning),
    # where nothing bound them before (a pytest confined to some cores leaves them be).
    cores = [r["cores"] for r in m["ranks"]]
    if len(os.sched_getaffinity(0)) == os.cpu_count() >= 2:
        assert all(len(c) == os.cpu_count() // 2 for c in cores) and not set(cores[0]) & set(
            cores[1]
        ), cores
    else:
        assert cores == [None, None]


def test_diloco_momentum_moves_past_local_sgd_and_fp16_halves_the_deltas(shared_jobs, tmp_path):
    (local, _), _ = _run(shared_jobs, tmp_path / "local", "--sync", "local", "--sync-every", "4",
                         "--sync-warmup-steps", "0")  # fmt: skip
    (diloco, _), d = _run(shared_jobs, tmp_path / "diloco", "--sync", "diloco", "--sync-every",
                          "4", "--fp16-allreduce")  # fmt: skip
    assert _largest_difference(local, diloco) > 1e-3  # the default outer step acts
    # The default pair is the rule's for H=4 on 2 ranks and the run's exchanges, and the run
    # says so (a short run: a shorter memory, the rate that keeps the steady step).
    from hvdtrain.exchange.diloco import outer_momentum, outer_step

    sync = d["sync"]
    exchanges = int(sync["outer_momentum_from"].split()[2])
    assert sync["outer_momentum"] == outer_momentum(exchanges)
    assert sync["outer_lr"] == outer_step(4, 2, outer_momentum(exchanges))
    assert sync["outer_lr_from"] == "fitted to H=4 and 2 ranks"
    trainable = 12 * 16 + 16 + 2 * 16 + 16 * 4 + 4
    assert d["sync"]["fp16"] and d["sync"]["bytes_per_exchange"] == 2 * trainable + 4 * 2 * 16
    assert d["status"] == "finished" and len({r["weights_digest"] for r in d["ranks"]}) == 1


@pytest.mark.parametrize(
    "data, sync, keras", [("tfrecord", "local", "2"), ("batches", "diloco", "3")]
)
def test_data_from_files_and_from_python_under_exchanging_less(
    data, sync, keras, shared_jobs, tmp_path
):
    """A user's recipe (tests/workers/recipe.py: BatchNorm, AUC) on TFRecord files of uneven
    sizes with a test set of unknown length, and on a `Sequence` (Keras 2) or `PyDataset`
    (Keras 3), with mid-epoch checkpoints, then resumed to a second epoch in the process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("recipe", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    recipe.write_tfrecords(str(tmp_path / "files"), "train", [50, 130, 200, 220], seed=0)
    recipe.write_tfrecords(str(tmp_path / "files"), "test", [40, 61], seed=1)
    m = tmp_path / "m.json"
    shared_jobs.get(2, "gloo").run(
        "recipe:main",
        argv=["--data", data, "--files", str(tmp_path / "files"), "--epochs", "1",
              "--then-epochs", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
              "--checkpoint-every", "6", "--metrics-json", str(m), "--eval-batch-size", "8",
              "--keras", keras, "--sync", sync, "--sync-every", "4"],
    )  # fmt: skip
    out = json.loads(m.read_text())
    assert out["status"] == "finished" and out["epochs"] == 2
    assert out["resumed_from"]["epoch"] == 1 and out["test_samples"] == 101
    assert len({r["weights_digest"] for r in out["ranks"]}) == 1, out["ranks"]
    assert out["sync"]["mode"] == sync and out["sync"]["exchanges"] > 0
    assert all(len(values) == 2 for values in out["history"].values()), out["history"]


@pytest.mark.parametrize("keras", ["2", "3"])
def test_an_overlapped_run_holds_one_model_at_whole_exchanges(keras, shared_jobs, tmp_path):
    """Through `hvdtrain.fit`, Adam, BatchNorm, H=4: the ranks differ after every step but an
    epoch's last (its whole exchange) and end with every variable the same; the metrics JSON
    says what each rank waited and what was hidden."""
    (w0, w1), m = _run(shared_jobs, tmp_path, "--sync", "local", "--sync-every", "4",
                       "--sync-warmup-steps", "0", "--sync-overlap", keras=keras)  # fmt: skip
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace == [step % 10 == 0 for step in range(1, 21)]  # 2 epochs of 10 steps
    assert _largest_difference(w0, w1) == 0
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1
    sync = m["sync"]
    assert sync["overlap"] and sync["exchanges"] == 6 and sync["mode"] == "local"
    for r in m["ranks"]:
        assert r["exchange_waited_seconds"] >= 0 and 0 <= r["exchange_hidden"] <= 1


OVERLAP = worker("overlap_checks.py")
TARGETS = np.array([[1.0, -2.0, 0.5], [-3.0, 4.0, 2.0]], "float32")  # as the worker's


def _reference(overlap, every, steps, outer_lr=None, momentum=0.0):
    """tests/workers/overlap_checks.py's run in numpy: each rank's weights after every step,
    and after the whole exchange at the end. `outer_lr` None: local SGD; else DiLoCo."""
    lr = np.float32(0.1)
    w = [np.ones(3, "float32") for _ in TARGETS]
    anchor, m, t = np.ones(3, "float32"), np.zeros(3, "float32"), 0
    start, pending, round_start, trace = [x.copy() for x in w], None, 0, []

    def unbias(steps):  # DiLoCo's momentum, bias-corrected after `steps` outer steps
        return 1 / (1 - momentum**steps) if momentum else 1.0

    def move(mean):
        nonlocal anchor, m, t
        if outer_lr is None:
            anchor = anchor - mean
        else:
            t, m = t + 1, momentum * m + mean
            anchor = anchor - outer_lr * (mean + momentum * m * unbias(t))

    def stand_in(own):  # the outer step on a rank's own change, its momentum left as is
        if outer_lr is None:
            return anchor - own
        return anchor - outer_lr * (own + momentum * (momentum * m + own) * unbias(t + 1))

    for step in range(1, steps + 1):
        w = [x - lr * (x - t) for x, t in zip(w, TARGETS, strict=True)]
        if overlap and step >= steps:  # the epoch's last step: a whole exchange
            if pending is not None:
                move(np.mean(pending, axis=0))
            move(np.mean([s - x for s, x in zip(start, w, strict=True)], axis=0))
            pending, w = None, [anchor.copy() for _ in w]
            start, round_start = [x.copy() for x in w], step
        elif step % every == 0 or step >= steps:
            if overlap:
                own = [s - x for s, x in zip(start, w, strict=True)]
                if pending is not None:
                    move(np.mean(pending, axis=0))
                pending = own
                start = [stand_in(o) for o in own]
                w = [x.copy() for x in start]
            else:
                move(np.mean([anchor - x for x in w], axis=0))
                w = [anchor.copy() for _ in w]
            round_start = step
        trace.append([x.copy() for x in w])
    if overlap:
        if pending is not None:
            move(np.mean(pending, axis=0))
        if steps > round_start:
            move(np.mean([s - x for s, x in zip(start, w, strict=True)], axis=0))
        w = [anchor.copy() for _ in w]
    return trace, w


@pytest.mark.parametrize(
    "flags, outer",
    [
        (["--sync", "local", "--sync-overlap"], None),
        (["--sync", "diloco", "--sync-overlap", "--outer-lr", "0.7", "--outer-momentum", "0.9"],
         (0.7, 0.9)),
        (["--sync", "local"], None),  # the reference of the blocking exchange, too
    ],
)  # fmt: skip
def test_the_overlapped_exchange_is_the_eager_update_formula(flags, outer, shared_jobs, tmp_path):
    """Plain SGD on each rank's own quadratic, H=3 over 10 steps: the weights after every
    step on both ranks, and after the end, equal the numpy replay of the formula (the mean
    of a round lands at the next exchange; each rank continues from the anchor moved by its
    own change meanwhile)."""
    shared_jobs.get(2, "gloo").run_script(
        [OVERLAP, "--out", tmp_path, "--sync-every", "3", "--steps", "10", *flags]
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    overlap = "--sync-overlap" in flags
    lr, momentum = outer or (None, 0.0)
    trace, end = _reference(overlap, 3, 10, lr, momentum)
    for r, got in enumerate(ranks):
        assert np.allclose(got["steps"], [t[r] for t in trace], atol=1e-5)
        assert np.allclose(got["end"], end[r], atol=1e-5)
    assert ranks[0]["end"] == ranks[1]["end"]  # one model after the whole exchange
    if overlap:  # the ranks differ between exchanges, and the stand-in is not the mean
        assert ranks[0]["steps"][2] != ranks[1]["steps"][2]
        assert ranks[0]["sync"]["overlap"] and ranks[0]["sync"]["exchanges"] == 4
        assert 0 <= ranks[0]["sync"]["exchange_hidden"] <= 1


def test_dilocos_momentum_fits_the_runs_exchanges_and_its_rate_keeps_the_step():
    """docs/exchanging-less.md, "DiLoCo on a short run": 0.9 from 30 exchanges on, a memory
    of a third of the run's exchanges below it, and a rate keeping the reach rate / (1 -
    momentum) where it is one; above one, its excess kept in proportion to the momentum (a
    single exchange at H=256 moved the anchor by twice the mean change: the convnet 72.9 %)."""
    from hvdtrain.exchange.diloco import outer_momentum, outer_step

    assert [outer_momentum(e) for e in (None, 30, 500)] == [0.9, 0.9, 0.9]
    assert [outer_momentum(e) for e in (1, 3, 6, 12)] == [0.0, 0.0, 0.5, 0.75]
    for exchanges in (1, 6, 12, 30):
        m = outer_momentum(exchanges)
        assert outer_step(16, 2, m) / (1 - m) == pytest.approx(1.0, 1e-2)
        reach = outer_step(64, 2, m) / (1 - m)
        assert reach == pytest.approx(1 + (2.0 - 1) * m / 0.9, 1e-2)
    assert outer_step(256, 2, 0.0) == 1.0 and outer_step(64, 2, 0.9) == 0.2


def test_auto_chooses_the_smallest_h_whose_exchange_hides_up_to_the_cap():
    """docs/exchanging-less.md, `--sync-every auto`: candidates are powers of two times the
    steps per execution from 4 to the cap; blocking, the exchange is at most 5 % of a round;
    overlapped, at most 3/4 of its steps in flight and 5 % waited; none fits: the
    cap, and it says so."""
    from hvdtrain.exchange.auto import CAP, candidates, choose

    assert candidates(16) == [16, 32, 64, 128, 256] and candidates(1)[:3] == [4, 8, 16]
    assert candidates(3) == [6, 12, 24, 48, 96, 192] and candidates(16)[-1] == CAP
    options = candidates(1)
    assert choose(3.0, options, overlap=True) == (4, False)  # 3 <= 0.75 x 4
    assert choose(40.0, options, overlap=True) == (64, False)
    assert choose(3.0, options, overlap=False) == (64, False)  # 3 <= 0.05/0.95 x 64
    assert choose(1e6, options, overlap=True) == (CAP, True)
    # Overlapped, what the steps still wait for at the point keeps to the blocking margin.
    assert choose(3.0, options, overlap=True, blocked=3.0) == (64, False)  # 3 <= 0.05/0.95 x 64
    assert choose(40.0, options, overlap=True, blocked=1.0) == (64, False)
    # ... with the steps' time it takes from the steps beside it (copies on one core).
    assert choose(40.0, options, overlap=True, blocked=1.0, slowed=4.0) == (128, False)
    # A revisit keeps H where only noise moved: a smaller H must fit within 3/4 of the margins.
    assert choose(3.0, options, overlap=False, current=128) == (128, False)  # 64: 3 > 2.5
    assert choose(2.0, options, overlap=False, current=128) == (64, False)  # 2 <= 0.75 x 3.37
    assert choose(45.0, options, overlap=True, current=64) == (64, False)  # 32: > 0.75 x 24
    assert choose(17.0, options, overlap=True, current=64) == (32, False)  # 32: <= 18
    assert choose(60.0, options, overlap=True, current=64) == (128, False)  # up: at the margin


def test_auto_times_the_steps_alone_not_beside_an_exchange_in_flight():
    """A step beside an exchange in flight shares the CPU with it (the convnet's: 62 ms alone,
    115 ms beside one): auto's ratio takes the steps timed alone, the others only where no
    step ran alone; the time the exchange takes from the steps beside it is a cost the steps
    pay, as their wait is; and the ranks agree on the smallest exchange (the rank that came
    last to it waited for the wire alone) and the most steps' time it takes."""
    from hvdtrain.exchange.auto import AutoEvery

    auto = AutoEvery(overlap=True, revisit=True)
    auto.start(1)
    auto.exchange_seconds = [1.0, 1.0, 1.0]
    for seconds, beside in [(0.0625, True)] * 6 + [(0.0625, False)] * 2:
        auto.time_steps(seconds, beside)  # an exchange that costs the steps beside it nothing
    assert auto.choose(lambda xs: xs, step=5) == 32  # 16 steps alone: 16 <= 0.75 x 32
    assert auto.measured["slowed_ratio"] == 0.0
    auto.exchange_seconds = [1.0, 1.0, 1.0]
    for seconds, beside in [(0.09375, True)] * 6 + [(0.0625, False)] * 2:
        auto.time_steps(seconds, beside, steps=4)
    # Beside the 3 exchanges 24 steps took 1.5 times as long, 0.75 s more than alone: 4
    # steps' time an exchange, which a round must pay within 5 %: 4 <= 0.05/0.95 x 128.
    assert auto.choose(lambda xs: xs, step=10) == 128
    assert auto.measured["step_seconds"] == 0.0625 and auto.measured["steps_alone"]
    assert auto.measured["slowed_ratio"] == 4.0 and auto.measured["beside_seconds"] == 0.09375
    auto.exchange_seconds = [1.0, 1.0, 1.0]
    for seconds, beside in [(0.0625, True)] * 2 + [(0.0625, False)] * 2:
        auto.time_steps(seconds, beside, steps=16)  # a long exchange that starves, not slows
    assert auto.choose(lambda xs: xs, step=15) == 32 and auto.measured["slowed_ratio"] == 0.0
    auto.exchange_seconds = [1.0, 1.0, 1.0]
    for seconds, beside in [(0.05, True), (0.075, True)] + [(0.0625, False)] * 2:
        auto.time_steps(seconds, beside, steps=16)  # noise about the steps' pace: no cost
    assert auto.choose(lambda xs: xs, step=17) == 32 and auto.measured["slowed_ratio"] == 0.0
    auto.slowed = 4.0
    auto.exchange_seconds = [1.0]
    auto.time_steps(0.125, beside=True)  # none alone: the steps beside it, the cost timed last
    assert auto.choose(lambda xs: xs, step=20) == 128 and not auto.measured["steps_alone"]
    assert auto.measured["slowed_ratio"] == 4.0  # 4 <= 0.05/0.95 x 128
    auto.slowed = 0.0
    auto.exchange_seconds = [1.0]
    auto.time_steps(0.0625, beside=False)
    # Another rank waited 0.25 s for the same exchange: 4 steps; 4 <= 0.75 x 8.
    assert auto.choose(lambda xs: [max(x, -4.0) if i < 2 else x for i, x in enumerate(xs)],
                       step=30) == 8  # fmt: skip
    auto.exchange_seconds = [1e3] * 3
    auto.time_steps(0.0625, beside=False)
    assert auto.choose(lambda xs: xs, step=40) == 256 and auto.capped
    assert auto.choices == [[5, 32], [10, 128], [15, 32], [17, 32], [20, 128], [30, 8], [40, 256]]
    # Again at an epoch's end, once PROBE exchanges were timed since the last choice.
    auto.exchange_seconds = [1.0]
    assert not auto.due(epoch_end=True)
    auto.exchange_seconds = [1.0] * 3
    assert auto.due(epoch_end=True) and not auto.due(epoch_end=False)


def test_sync_every_auto_is_a_value_of_its_own_and_refused_where_it_means_nothing():
    assert make_config(sync="local", sync_every="auto").sync_every == "auto"
    assert make_config(sync="local", sync_every="auto").exchange_every == 16  # from where
    # The overlap's default: on with auto (a run for a slow link), off at a fixed H.
    assert make_config(sync="diloco", sync_every="auto").overlapped is True
    assert make_config(sync="local", sync_every="auto", sync_overlap=False).overlapped is False
    assert make_config(sync="local", sync_every=16).overlapped is False
    assert make_config(sync="local", sync_every=16, sync_overlap=True).overlapped is True
    assert make_config().overlapped is False  # --sync step
    with pytest.raises(HvdtrainError, match="no value without --sync local or --sync diloco"):
        make_config(sync_every="auto")
    parser = hvdtrain.ArgumentParser()
    assert parser.parse_args(["--sync", "diloco", "--sync-every", "auto"]).sync_every == "auto"
    with pytest.raises(HvdtrainError, match="--sync-every"):
        parser.parse_args(["--sync", "local", "--sync-every", "often"])


def test_auto_measures_chooses_says_so_and_a_resume_keeps_its_h(shared_jobs, tmp_path):
    """Epoch 1 synchronous, epoch 2 local at the smallest H (4) while timed; H chosen at its
    end and said on rank 0, in the metrics JSON and in the checkpoint; the resumed epoch 3
    goes on with it (fixed under --deterministic: not chosen again)."""
    ckpt = str(tmp_path / "ckpt")
    flags = ["--sync", "local", "--sync-every", "auto", "--sync-warmup-steps", "10",
             "--deterministic", "--checkpoint-dir", ckpt]  # fmt: skip
    _, first = _run(shared_jobs, tmp_path / "a", *flags)  # overlapped: auto's default
    assert first["sync"]["overlap"] is True
    auto = first["sync"]["auto"]
    assert auto["candidates"][0] == 4 and auto["chosen"] in auto["candidates"]
    assert [step for step, _ in auto["choices"]] == [20] and auto["revisited"] is False
    assert auto["measured"]["exchange_seconds"] > 0 and auto["measured"]["step_seconds"] > 0
    assert auto["measured"]["blocked_seconds"] > 0  # the points' own wait, timed too
    assert auto["measured"]["slowed_ratio"] >= 0  # and what it took from the steps beside it
    assert first["sync"]["every"] == auto["chosen"]
    _, resumed = _run(shared_jobs, tmp_path / "a", *flags, "--epochs", "3")
    assert resumed["resumed_from"] is not None
    assert resumed["sync"]["auto"]["chosen"] == auto["chosen"]
    assert resumed["sync"]["auto"]["choices"] == [] and resumed["sync"]["every"] == auto["chosen"]
