"""Single-process tests of the pure pieces: device choice, threads, sharding, LR, parsing."""

import pytest

from hvdtrain.errors import HvdtrainError


def test_gpu_for_local_rank_is_a_no_op_without_gpus():
    from hvdtrain.runtime.process import gpu_for_local_rank

    assert gpu_for_local_rank(0, 0) is None
    assert gpu_for_local_rank(3, 0, local_size=4) is None


def test_gpu_for_local_rank_pins_one_gpu_per_local_rank():
    from hvdtrain.runtime.process import gpu_for_local_rank

    assert [gpu_for_local_rank(r, 4) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(HvdtrainError, match="at most one process per GPU"):
        gpu_for_local_rank(2, 2, local_size=3)


@pytest.mark.parametrize(
    "cpus, local_size, affinity, expected",
    [(2, 1, None, 2), (2, 2, None, 1), (16, 4, None, 4), (2, 4, None, 1), (16, 2, 1, 1)],
)
def test_threads_per_rank_splits_the_host(cpus, local_size, affinity, expected):
    from hvdtrain.runtime.process import threads_per_rank

    assert threads_per_rank(cpus, local_size, affinity) == expected


def test_shard_indices_and_steps():
    from hvdtrain.data import shard_indices, steps_per_epoch

    assert shard_indices(5, 0, 2).tolist() == [0, 2, 4]
    assert shard_indices(5, 1, 2).tolist() == [1, 3]
    assert steps_per_epoch(1001, 10, 2) == 50
    with pytest.raises(HvdtrainError, match="batch_size"):
        steps_per_epoch(10, 8, 2)
    with pytest.raises(HvdtrainError, match="rank"):
        shard_indices(10, 2, 2)


def test_warmup_lr_starts_at_base_and_reaches_base_times_size():
    from hvdtrain.optimizers.rates import WarmupSchedule, scaled_lr, warmup_lr

    assert scaled_lr(0.1, 4) == pytest.approx(0.4)
    assert warmup_lr(0, 0.1, 4, 100) == pytest.approx(0.1)
    assert warmup_lr(50, 0.1, 4, 100) == pytest.approx(0.25)
    assert warmup_lr(100, 0.1, 4, 100) == pytest.approx(0.4)
    assert warmup_lr(10_000, 0.1, 4, 100) == pytest.approx(0.4)
    assert warmup_lr(0, 0.1, 4, 0) == pytest.approx(0.4)
    schedule = WarmupSchedule(0.1, 4, 100)
    for step in (0, 50, 100, 500):
        assert float(schedule(step)) == pytest.approx(warmup_lr(step, 0.1, 4, 100))


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--batch-size", "0"], "`--batch-size`: received '0'; expected a positive integer"),
        (["--batch-size", "-3"], "`--batch-size`: received '-3'; expected a positive integer in"),
        (["--epochs", "0"], "`--epochs`: received '0'"),
        (["--lr", "-1"], "`--lr`"),
        (["--data-dir", "/nonexistent/mnist"], "`--data-dir`"),
        (["--epochs", "two"], "`--epochs`: received 'two'; expected a positive integer in"),
        (["--epochs", "+2"], "`--epochs`: received '\\+2'"),
        (["--epochs", "٣"], "`--epochs`: received '٣'"),
        (["--seed", "1_0"], "`--seed`: received '1_0'"),
    ],
)
def test_parse_args_rejects_bad_flags(argv, match):
    from hvdtrain.mnist import parse_args

    with pytest.raises(HvdtrainError, match=match):
        parse_args(argv)


def test_importing_hvdtrain_does_not_import_tensorflow():
    import subprocess
    import sys

    code = "import hvdtrain, sys; print('tensorflow' in sys.modules, 'horovod' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize(
    "option, words",
    [
        ("validation_data", "ArrayData(x, y, test=(x_test, y_test))"),
        ("sample_weight", "ArrayData(x, y, sample_weight=...)"),
        ("verbose", "progress=..., on rank 0 only"),
        ("epoch", "one of accumulate, batch_size"),  # a typo: the options, every one
    ],
)
def test_a_keyword_of_keras_fit_given_to_hvdtrain_fit_says_where_it_goes(option, words):
    from hvdtrain.recipe.flags import make_config

    with pytest.raises(HvdtrainError, match=f"`option`: received '{option}'") as raised:
        make_config(None, epochs=2, **{option: 1})
    assert words in str(raised.value) and "\n" not in str(raised.value)


def test_mistakes_with_the_building_blocks_are_clear_errors():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvdtrain

    with pytest.raises(HvdtrainError, match="Invalid value for `batch_size`: received 0"):
        hvdtrain.steps_per_epoch(100, 0, 2)
    with pytest.raises(HvdtrainError, match="Invalid value for `size`: received 0"):
        hvdtrain.steps_per_epoch(100, 10, 0)
    if not hvd.is_initialized():
        with pytest.raises(HvdtrainError, match=r"call hvdtrain\.init\(\) first"):
            hvdtrain.is_main_process()
    hvdtrain.init(threads=1)
    wrapped = hvdtrain.distributed_optimizer(tf.keras.optimizers.SGD(0.1))
    with pytest.raises(HvdtrainError, match="already distributed"):
        hvdtrain.distributed_optimizer(wrapped)  # Horovod itself recursed without end


def test_metrics_json_is_valid_json_whatever_the_numbers(tmp_path):
    """NaN and infinities (a diverged run's loss) become null: strict readers accept it."""
    import json
    import os

    from hvdtrain.recipe.outputs import write_json

    path = write_json(tmp_path / "sub" / "m.json", {"loss": [1.0, float("nan")], "x": float("inf")})

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    assert json.loads(open(path).read(), parse_constant=refuse) == {"loss": [1.0, None], "x": None}
    assert os.listdir(tmp_path / "sub") == ["m.json"]


def test_a_failed_download_gives_its_whole_reason_on_one_line(tmp_path, capsys, monkeypatch):
    """One process (Horovod of size 1): the download raises as Keras does offline; the
    fallback is used and the reason is shown whole, one line."""
    import hvdtrain
    from hvdtrain.data.sources import choose_source

    monkeypatch.delenv("HVDTRAIN_OFFLINE", raising=False)
    hvdtrain.init(threads=1)
    reason = "URL fetch failure on https://example.org/mnist.npz: None -- " + "x" * 200

    def download():
        raise Exception(f"{reason}\n  [Errno -3] Temporary failure in name resolution")

    assert choose_source(None, str(tmp_path / "none.npz"), download, "embedded", "p") == "embedded"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"p: download failed ({reason}")
    assert err[0].endswith("[Errno -3] Temporary failure in name resolution); using embedded")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Horovod has been shut down. This was caused by ...", "Horovod was shut down"),
        # The survivor of a killed container (tests/test_docker_image.py), Gloo's TCP pair.
        (
            "Graph execution error:\n[/tmp/horovod-0.28.1/third_party/compatible17_gloo/gloo/"
            "transport/tcp/pair.cc:589] Read error [10.232.7.3]:35227: Connection reset by peer",
            "the connection to another rank broke",
        ),
        # The survivor of a cut network (tests/test_lost_hosts.py): Gloo's receive timeout.
        (
            "Graph execution error:\n[/tmp/horovod-0.28.1/third_party/compatible17_gloo/gloo/"
            "transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation "
            "to complete",
            "nothing came from another rank within HOROVOD_GLOO_TIMEOUT_SECONDS",
        ),
        ("ValueError: my own mistake in the model", None),
    ],
)
def test_a_rank_that_failed_only_because_another_did_is_told_apart(text, expected):
    from hvdtrain.runtime.uncaught import because_of_another_rank

    assert because_of_another_rank(text) == expected


def test_an_elastic_run_takes_a_dead_peers_transport_error_for_a_lost_worker():
    """Under `--sync-overlap` a rank's exchange in flight met rank 1's death as Gloo's own
    error, which names no Horovod op: the elastic run ended (exit 1) instead of going on
    (test_customizing_fit.py's lost rank of an overlapped GAN, beside other jobs)."""
    import tensorflow as tf

    from hvdtrain.recipe.elastic import _is_horovod_failure

    gloo = (
        "Graph execution error:\n[/tmp/tmp.fqedPvPHMD/horovod-0.28.1/third_party/compatible17_"
        "gloo/gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:40165: Connection reset "
        "by peer"
    )
    assert _is_horovod_failure(tf.errors.UnknownError(None, None, gloo))
    assert _is_horovod_failure(tf.errors.UnknownError(None, None, "Horovod has been shut down"))
    assert not _is_horovod_failure(tf.errors.InvalidArgumentError(None, None, "shapes differ"))
    assert not _is_horovod_failure(ValueError("Connection reset by peer"))


def test_a_failed_ranks_line_names_the_cause_of_a_tensorflow_op_error():
    """TensorFlow's op errors start "Graph execution error:"; the cause is further down."""
    import tensorflow as tf

    from hvdtrain.errors import one_line

    @tf.function
    def loss(labels):  # a label out of range for 2 classes, as a user's data may hold
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.zeros([3, 2]))

    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        loss(tf.constant([0, 1, 6]))
    assert str(raised.value).startswith("Graph execution error:")
    assert one_line(raised.value).startswith("Received a label value of 6")
    assert one_line(ValueError("\nCould not interpret optimizer identifier: adma\n")) == (
        "Could not interpret optimizer identifier: adma"
    )

    @tf.function
    def step(x):  # an error while tracing a user's code: TensorFlow lists the frames first
        return x.no_such_method()

    with pytest.raises(AttributeError) as raised:
        step(tf.zeros(1))
    assert str(raised.value).startswith("in user code:")
    cause = one_line(raised.value)  # the tensor's class is named as TensorFlow's version has it
    assert cause.startswith("AttributeError: '")
    assert cause.endswith("object has no attribute 'no_such_method'")
    # Its traceback holds TensorFlow's generated code, not the user's function; the message
    # names it, and so does the first line of a failed rank (a FileData parse function).
    from hvdtrain.runtime.tracebacks import traced_frame

    frame = traced_frame(str(raised.value))
    assert frame.name == "step" and frame.filename == __file__ and frame.lineno > 0
    assert traced_frame("a plain message") is None


def test_one_helper_makes_an_error_one_line_in_each_presentation():
    """`errors.one_line` is the one way: a text keeps all its words (line breaks escaped);
    an exception gives what went wrong (an OSError's reason, the first line that is not
    empty, its type's name when it says nothing), or all of it, named or not, cut or not."""
    import errno

    from hvdtrain.errors import one_line

    full = OSError(errno.ENOSPC, "No space left on device", "/out/model.keras")
    assert one_line(full) == "No space left on device"
    assert one_line(full, named=True) == (
        "OSError: [Errno 28] No space left on device: '/out/model.keras'"
    )
    assert one_line(OSError("a reason of mine")) == "a reason of mine"
    many = ValueError("\n  first words\nsecond\r\nthird\u2028")
    assert one_line(many) == "first words"
    assert one_line(many, named=True, whole=True) == "ValueError: first words second third"
    assert one_line(many, named=True, most=5) == "ValueError: first"
    assert one_line(ValueError("ValueError: said twice"), named=True) == "ValueError: said twice"
    assert one_line(KeyError()) == "KeyError" and one_line(ValueError(" \n"), named=True) == (
        "ValueError"
    )
    assert one_line("a file\nname") == "a file\\nname"  # a text: every word, escaped


def test_the_hook_of_uncaught_errors_installs_once_and_knows_when_horovod_runs(tmp_path):
    """`hvdtrain.init()` installs it and tells it the rank (no second hook chained on it):
    an error in the user's code names the function, the traceback, then the rank's line; an
    HvdtrainError stays one line, exit 2."""
    import os
    import subprocess
    import sys

    script = tmp_path / "oops.py"
    script.write_text(
        "import sys\n"
        "import hvdtrain\n"
        "from hvdtrain.runtime import uncaught\n"
        "uncaught.report_uncaught()\n"
        "hook = sys.excepthook\n"
        "hvdtrain.init()\n"
        "uncaught.report_uncaught()\n"
        "print('one hook:', sys.excepthook is hook, flush=True)\n"
        "def load(path):\n"
        "    raise (hvdtrain.HvdtrainError if path == 'x' else ValueError)(f'no {path}')\n"
        "load(sys.argv[1])\n"
    )
    out = []
    for arg in ("y", "x"):
        proc = subprocess.run(
            [sys.executable, str(script), arg], capture_output=True, text=True, timeout=120,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )  # fmt: skip
        out.append(proc)
        assert proc.stdout == "one hook: True\n", proc.stdout + proc.stderr
    from hvdtrain.launcher.noise import is_startup_noise

    lines = [line for line in out[0].stderr.strip().splitlines() if not is_startup_noise(line)]
    assert out[0].returncode == 1
    assert lines[0] == "hvdtrain: the error below was raised in your code: load (oops.py:10)"
    assert lines[1] == "Traceback (most recent call last):" and lines.count(lines[1]) == 1
    assert lines[-1] == "hvdtrain: rank 0 failed: ValueError: no y"
    noise = [line for line in out[1].stderr.splitlines() if is_startup_noise(line)]
    assert out[1].returncode == 2 and out[1].stderr.splitlines()[len(noise) :] == [
        "oops.py: error: no x"
    ]


def test_gloo_hostname_problem_only_under_gloo_and_only_when_unresolvable():
    from hvdtrain.runtime.process import gloo_hostname_problem

    gloo = {"HOROVOD_CONTROLLER": "gloo"}
    assert gloo_hostname_problem({}, "nohost.invalid") is None  # MPI, or one process
    assert gloo_hostname_problem({"HOROVOD_CONTROLLER": "mpi"}, "nohost.invalid") is None
    assert gloo_hostname_problem(gloo, "localhost") is None
    problem = gloo_hostname_problem(gloo, "nohost.invalid")
    assert "'nohost.invalid' does not resolve" in problem and "127.0.1.1 nohost.invalid" in problem


def test_a_type_in_a_message_takes_its_article():
    from hvdtrain.errors import kind_of

    class Intracomm:
        pass

    assert kind_of(Intracomm()) == "an Intracomm" and kind_of([]) == "a list"


@pytest.mark.parametrize("unbuffered", [True, False])
def test_a_rank_s_streams_write_whole_lines(monkeypatch, unbuffered):
    """PYTHONUNBUFFERED=1: print("a", 1) wrote each piece on its own; block-buffered (a pipe's
    default), 8 KB at a time wherever the buffer ended, mid-character in a model's summary:
    mpirun tags each piece. After hvdtrain.init's `whole_lines` a line is one write."""
    import io
    import sys

    from hvdtrain.runtime import streams

    class Raw(io.RawIOBase):
        writes = []

        def writable(self):
            return True

        def write(self, b):
            self.writes.append(bytes(b))
            return len(b)

    size = 1 if unbuffered else 8192
    stream = io.TextIOWrapper(io.BufferedWriter(Raw(), size), write_through=unbuffered)
    monkeypatch.setattr(sys, "__stdout__", stream)
    streams.whole_lines()
    print("rank", 1, "says", "hello", file=stream)
    assert Raw.writes == [b"rank 1 says hello\n"]
    for _ in range(100):  # 30 KB of a summary's lines, 3 bytes a character
        print("\u2501" * 100, file=stream)
    assert all(w.endswith(b"\n") for w in Raw.writes) and len(Raw.writes) == 101
