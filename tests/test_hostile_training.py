"""Hostile input to the entry points and to a user's script: `python -m hvdtrain.mnist`'s
flags, environment variables, output paths, Keras (which one, its backend, a model that
mixes the two).

Properties (hypothesis), in this process: any flags either parse into settings training can
use or raise `HvdtrainError` with a one-line message; nothing else escapes. Cases, as real
processes (`CASES`, tests/helpers/hostile.py): exit 2 with one error line, no traceback,
nothing written outside the folders named, within a bound.
"""

import math
import sys

import pytest
from helpers.hostile import BOUND, KERAS3, MNIST, check_case, ids, one_line, write
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hvdtrain.errors import HvdtrainError
from hvdtrain.mnist import parse_args

pytestmark = pytest.mark.timeout(120)
ODD = ["²", "٣", "+3", " 3", "1_0", "0", "-1", "nan", "inf", "-inf", "1e400", "0x10", "\u2028"]

# -- python -m hvdtrain.mnist flags ----------------------------------------------------

FLAGS = [
    "--epochs", "--batch-size", "--lr", "--warmup-epochs", "--seed", "--limit-samples",
    "--threads", "--mixed-precision", "--fp16-allreduce", "--accumulate", "--checkpoint-dir",
    "--keep-checkpoints", "--metrics-json", "--log-dir", "--model", "--data-dir",
]  # fmt: skip
VALUES = ["1", "32", "0.001", "convnet", "mlp", "auto", "bfloat16", "/", "/nonexistent",
          "99999999999999999999", "4294967296", "1e-3", *ODD]  # fmt: skip
WORD = st.one_of(st.sampled_from(FLAGS), st.sampled_from(VALUES), st.text(max_size=10))


@settings(max_examples=400, deadline=None)
@given(st.lists(WORD, max_size=10))
@example(["--warmup-epochs", "inf"])
@example(["--lr", "inf"])
@example(["--seed", "-1"])
@example(["--seed", "4294967296"])
@example(["--threads", "99999999999"])
@example(["stray\nword"])
@example(["--he"])  # argparse's prefix of --help (hypothesis drew "-h" once: exit 0, help)
def test_mnist_flags(argv):
    try:
        args = parse_args(argv)
    except HvdtrainError as e:
        one_line(e)
        return
    except SystemExit as e:  # a word that asks for the help (`-h`, `--he`): printed, exit 0
        asks = [w for w in argv if w.startswith("-h") or len(w) > 2 and "--help".startswith(w)]
        assert e.code == 0 and asks, argv
        return
    # What training relies on: finite numbers in range (checked here, not mid-job).
    assert args.epochs >= 1 and args.batch_size >= 1 and args.keep_checkpoints >= 1
    assert math.isfinite(args.lr) and args.lr > 0
    assert math.isfinite(args.warmup_epochs) and args.warmup_epochs >= 0
    assert 0 <= args.seed < 2**31
    assert args.threads is None or 1 <= args.threads <= 4096


@pytest.mark.parametrize("entry", ["hvdtrain.mnist", "hvdtrain.cifar10", "hvdtrain.images"])
def test_an_entry_points_bad_flag_is_refused_before_tensorflow_loads(entry):
    """A mistake in the flags is answered at once: TensorFlow (seconds to load) is not
    imported for it (it was, for two stops, through `hvdtrain.data`'s package)."""
    import subprocess

    code = (
        "import runpy, sys\n"
        f"sys.argv = [{entry!r}, '--epochs', '0', '--data-dir', '.']\n"
        "try:\n"
        f"    runpy.run_module({entry!r}, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code, 'tensorflow' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.stdout.strip() == "exit 2 False", proc.stdout + proc.stderr
    assert "`--epochs`: received '0'" in proc.stderr


# A user's script whose model mixes the two Keras, or is compiled as Keras 2 takes it but
# not Keras 3, in the way its argument names.
MIXED = """import sys
import keras
import numpy as np
import tensorflow as tf
import hvdtrain

def build_model():
    how = sys.argv[1]
    if how == "k2-model-k3-optimizer":
        m = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    elif how == "k3-positional-metrics":  # Keras 3 reads the third as loss_weights
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        m.compile(keras.optimizers.SGD(0.1), "mse", [keras.metrics.MeanAbsoluteError()])
    elif how == "k3-model-k2-layer":
        m = keras.Sequential([keras.Input((4,)), tf.keras.layers.Dense(1)])
        m.compile(optimizer="sgd", loss="mse")
    elif how == "k2-layer-on-k3-input":  # raised inside tf.keras, naming no class
        x = keras.Input((4,))
        m = keras.Model(x, tf.keras.layers.Dense(1)(x))
        m.compile(optimizer="sgd", loss="mse")
    else:  # a Keras 3 layer called on tf.keras tensors: Keras 2 keeps only its variables
        x = tf.keras.Input((4,))
        m = tf.keras.Model(x, keras.layers.Dense(1)(x))
        m.compile(optimizer="sgd", loss="mse")
    return m

x = np.ones((32, 4), "float32")
args = hvdtrain.ArgumentParser(epochs=1, batch_size=8).parse_args(sys.argv[2:])
hvdtrain.fit(build_model, hvdtrain.ArrayData(x, x.sum(1)), args)
"""
MIXED_CASES = [
    (
        f"keras-mixed-{how}",
        [sys.executable, "{d}/mixed.py", how],
        {},
        [write("mixed.py", MIXED)],
        2,
        f"mixing the two Keras ({words}",
        [],
    )
    for how, words in (
        ("k2-model-k3-optimizer", "Keras 2 (tf.keras) refused an object of Keras 3"),
        ("k3-model-k2-layer", "Keras 3 (`import keras`) refused an object of Keras 2"),
        ("k2-layer-on-k3-input", "Keras 2 (tf.keras) refused an object of Keras 3"),
        ("k2-model-k3-layer-call", "a Keras 2 (tf-keras) model holds Variable"),
    )
]
MIXED_CASES.append(
    ("keras3-compile-positional-metrics", [sys.executable, "{d}/mixed.py", "k3-positional-metrics"],
     {}, [write("mixed.py", MIXED)], 2, "`loss_weights`: received [<MeanAbsoluteError", [])
)  # fmt: skip

# `class_weight` as Keras's fit refuses it (a model of two outputs; not a dict), checked
# before the first step.
CLASS_WEIGHT = """import sys
import numpy as np
import hvdtrain
if sys.argv[1] == "3":
    import keras
else:
    import tensorflow as tf
    keras = tf.keras

x = keras.Input((4,))
outputs = {"a": keras.layers.Dense(2, name="a")(x), "b": keras.layers.Dense(1, name="b")(x)}
two = sys.argv[2] == "two-outputs"
m = keras.Model(x, outputs if two else outputs["a"])
m.compile(optimizer="sgd", loss={"a": "sparse_categorical_crossentropy", "b": "mse"} if two
          else "sparse_categorical_crossentropy")
xs = np.ones((32, 4), "float32")
y = np.zeros(32, "int64")
y = {"a": y, "b": np.zeros((32, 1), "float32")} if two else y
weights = {0: 1.0, 1: 3.0} if two else [1.0, 3.0]
args = hvdtrain.ArgumentParser(epochs=1, batch_size=8).parse_args([])
hvdtrain.fit(lambda: m, hvdtrain.ArrayData(xs, y), args, class_weight=weights)
"""
MIXED_CASES += [
    ("keras3-compile-class-weight-two-outputs", [sys.executable, "{d}/cw.py", "3", "two-outputs"],
     {}, [write("cw.py", CLASS_WEIGHT)], 2,
     "`class_weight`: received {0: 1.0, 1: 3.0}; expected a model with one output", []),
    ("class-weight-a-list", [sys.executable, "{d}/cw.py", "2", "list"], {},
     [write("cw.py", CLASS_WEIGHT)], 2,
     "`class_weight`: received [1.0, 3.0]; expected {class index: weight}", []),
]  # fmt: skip

CASES = [
    # -- environment variables
    ("stall-env", MNIST, {"HVDTRAIN_STALL_SHUTDOWN_SECONDS": "abc"}, [], 2,
     "HVDTRAIN_STALL_SHUTDOWN_SECONDS", []),
    ("stall-env-negative", MNIST, {"HVDTRAIN_STALL_SHUTDOWN_SECONDS": "-1"}, [], 2,
     "HVDTRAIN_STALL_SHUTDOWN_SECONDS", []),
    ("keras3", MNIST, {"TF_USE_LEGACY_KERAS": "0"}, [], 2, "need Keras 2", []),
    # -- entry point flags (checked before TensorFlow loads)
    ("epochs-0", MNIST + ["--epochs", "0"], {}, [], 2, "`--epochs`: received '0'", []),
    ("batch", MNIST + ["--batch-size", "-3"], {}, [], 2, "`--batch-size`: received '-3'", []),
    ("lr-nan", MNIST + ["--lr", "nan"], {}, [], 2, "`--lr`: received nan", []),
    ("lr-negative", MNIST + ["--lr", "-1"], {}, [], 2, "`--lr`: received -1.0", []),
    ("warmup-inf", MNIST + ["--warmup-epochs", "inf"], {}, [], 2, "`--warmup-epochs`", []),
    ("seed", MNIST + ["--seed", "-1"], {}, [], 2, "`--seed`: received '-1'", []),
    ("threads", MNIST + ["--threads", "99999"], {}, [], 2, "at most 4096", []),
    ("every", MNIST + ["--checkpoint-every", "-1"], {}, [], 2, "`--checkpoint-every`", []),
    ("metrics-folder", MNIST + ["--metrics-json", "{d}"], {}, [], 2, "not a folder", []),
    ("require-alone", MNIST + ["--require-resume"], {}, [], 2, "--checkpoint-dir with it", []),
    ("progress", MNIST + ["--progress", "loud"], {}, [], 2, "invalid choice: 'loud'", []),
    ("elastic-accumulate", MNIST + ["--elastic", "--accumulate", "2"], {}, [], 2,
     "1 with --elastic", []),
    ("precision", MNIST + ["--mixed-precision", "float8"], {}, [], 2, "invalid choice", []),
    ("int-flag-word", MNIST + ["--epochs", "many"], {}, [], 2, "--epochs", []),
    # -- output paths (before the first step)
    ("metrics-proc", MNIST + ["--metrics-json", "/proc/hvdtrain/m.json"], {}, [], 2,
     "`--metrics-json`", []),
    ("logdir-file", MNIST + ["--log-dir", "{d}/f"], {}, [write("f", "x")], 2, "`--log-dir`", []),
    # -- Keras 3 (the model built with `import keras`), and a model that mixes the two
    ("keras-choice", MNIST + ["--keras", "4"], {}, [], 2, "invalid choice: '4'", []),
    ("keras3-backend-jax", KERAS3, {"KERAS_BACKEND": "jax"}, [], 2,
     "`KERAS_BACKEND`: received 'jax'", []),
    ("keras3-metrics-folder", KERAS3 + ["--metrics-json", "{d}"], {}, [], 2, "not a folder", []),
    *MIXED_CASES,
]  # fmt: skip


@pytest.mark.timeout(BOUND * 2)
@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_hostile_input(tmp_path, case):
    check_case(tmp_path, case)
