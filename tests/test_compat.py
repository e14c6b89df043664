"""Keras 2 for tf.keras: hvdtrain sets it up, and a wrong Keras is one clear error."""

import os
import re
import subprocess
import sys

import pytest
from conftest import ours

from hvdtrain.runtime.compat import keras_problem, legacy_keras_needed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_old_tensorflow_needs_nothing():
    assert keras_problem("2.15.1", False, None, None, None) is None
    assert not legacy_keras_needed("2.15.1")  # the variable would break its tf.keras
    assert legacy_keras_needed("2.16.0") and legacy_keras_needed("2.21.0rc1")
    assert legacy_keras_needed(None)  # no TensorFlow here (a launch host): the ranks' is new


def test_new_tensorflow_needs_tf_keras():
    problem = keras_problem("2.21.0", False, None, None, "1")
    assert "pip install --no-deps 'tf-keras==2.21.*'" in problem


def test_keras3_as_tf_keras_names_the_fix():
    problem = keras_problem("2.21.0", True, "keras", "3.15.1", None)
    assert "tf.keras is Keras 3.15.1" in problem and "TF_USE_LEGACY_KERAS=unset" in problem
    assert "Set TF_USE_LEGACY_KERAS=1" in problem
    assert "TF_USE_LEGACY_KERAS=0" in keras_problem("2.21.0", True, "keras", "3.15.1", "0")
    late = keras_problem("2.21.0", True, "keras", "3.15.1", "1")  # set by hvdtrain, too late
    assert "tf.keras was used before TF_USE_LEGACY_KERAS=1 was set" in late


def test_tf_keras_is_fine():
    assert keras_problem("2.21.0", True, "tf_keras", "2.21.0", "1") is None


def run_script(tmp_path, source, **env):
    script = tmp_path / "train.py"
    script.write_text(source)
    environ = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    environ.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    environ.update(env)
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=environ
    )


def test_importing_hvdtrain_gives_keras2_even_after_tensorflow(tmp_path):
    """The usual order of a user's imports (tensorflow, then hvdtrain), nothing set in the
    environment: tf.keras is resolved on first use, after hvdtrain set the variable."""
    proc = run_script(
        tmp_path,
        "import tensorflow as tf\nimport hvdtrain\n"
        "print('KERAS', tf.keras.layers.Dense.__module__.split('.')[0])\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert "KERAS tf_keras" in proc.stdout or "KERAS keras" in proc.stdout  # 2.15: keras 2


@pytest.mark.parametrize("legacy", [None, "0"])
def test_keras3_fixed_before_hvdtrain_is_one_clear_error(tmp_path, legacy):
    """A script that used tf.keras (Keras 3) before importing hvdtrain, or that turned the
    variable off: one line naming the fix, no traceback (Horovod's or ours), exit 2."""
    import tensorflow as tf

    if tuple(int(p) for p in tf.__version__.split(".")[:2]) < (2, 16):
        pytest.skip(f"TensorFlow {tf.__version__}: tf.keras is always Keras 2")
    env = {} if legacy is None else {"TF_USE_LEGACY_KERAS": legacy}
    proc = run_script(
        tmp_path,
        "import tensorflow as tf\ntf.keras.layers.Dense(1)\nimport hvdtrain\nhvdtrain.init()\n",
        **env,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in ours(proc.stderr) if line.strip()]  # TensorFlow came first
    assert len(lines) == 1 and lines[0].startswith("train.py: error: tf.keras is Keras 3"), lines
    assert "Set TF_USE_LEGACY_KERAS=1" in lines[0]
    assert "Traceback" not in proc.stderr


# -- TensorFlow's start-up noise (hvdtrain.launcher.noise) ----------------------------------------
ABSL = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
ONEDNN = (
    "I0000 00:00:1795511589.155556   31604 port.cc:153] oneDNN custom operations are on. You "
    "may see slightly different numerical results due to floating-point round-off errors"
)


@pytest.mark.parametrize(
    ("line", "noise"),
    [
        (ABSL, True),
        (ONEDNN + "\n", True),
        (f"[1]<stderr>:{ONEDNN}", True),  # as horovodrun forwards it
        (f"[1,0]<stderr>:{ABSL}", True),  # as mpirun --tag-output does
        ("I0000 00:00:1.2   31604 cpu_feature_guard.cc:227] This TensorFlow binary", False),
        ("WARNING: something else", False),
        (f"hvdtrain: epoch 1/2: {ONEDNN}", False),
        ("E0000 00:00:1.2   31604 port.cc:153] oneDNN custom operations are on. x", False),
    ],
)
def test_startup_noise_is_only_those_two_lines(line, noise):
    from hvdtrain.launcher.noise import is_startup_noise

    assert is_startup_noise(line) is noise


IMPORT_CHECK = """
import os, subprocess, sys
import psutil
before = (sys.excepthook, list(sys.meta_path), dict(os.environ), sorted(sys.modules))
children = psutil.Process().children(recursive=True)
import hvdtrain
names = [getattr(hvdtrain, n) for n in ("ArgumentParser", "HvdtrainError", "TrainConfig")]
after = (sys.excepthook, list(sys.meta_path), dict(os.environ))
added = {k: v for k, v in after[2].items() if before[2].get(k) != v}
print("excepthook", after[0] is before[0])
print("meta_path", after[1] == before[1])
print("children", psutil.Process().children(recursive=True) == children)
print("environ", sorted(added.items()))
print("tensorflow", "tensorflow" in sys.modules)
"""


def test_import_hvdtrain_defines_names_and_changes_nothing_else(tmp_path):
    """A fresh interpreter: `import hvdtrain` (and the names a launcher-side script reads)
    leaves the excepthook, the import system, the child processes and the environment as
    they were, but for TF_USE_LEGACY_KERAS=1 (Keras 2 for tf.keras: docs/getting-started.md),
    and imports no TensorFlow."""
    proc = run_script(tmp_path, IMPORT_CHECK)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "excepthook True",
        "meta_path True",
        "children True",
        "environ [('TF_USE_LEGACY_KERAS', '1')]",
        "tensorflow False",
    ]
    proc = run_script(tmp_path, IMPORT_CHECK, TF_USE_LEGACY_KERAS="1")  # set: nothing at all
    assert "environ []" in proc.stdout.splitlines(), proc.stdout + proc.stderr


def test_the_calls_that_change_the_process_say_so(tmp_path):
    """What `import hvdtrain` no longer does happens in the calls a user makes: the hook of
    uncaught errors (one line for a mistake) is installed by `hvdtrain.ArgumentParser()`,
    `hvdtrain.init()` and `hvdtrain.fit`."""
    proc = run_script(
        tmp_path,
        "import sys\nimport hvdtrain\nhook = sys.excepthook\nhvdtrain.ArgumentParser()\n"
        "print(sys.excepthook is not hook)\n"
        "raise hvdtrain.HvdtrainError('Invalid value for `x`: received 1; expected 2')\n",
    )
    assert proc.stdout == "True\n" and proc.returncode == 2, proc.stderr
    assert proc.stderr == "train.py: error: Invalid value for `x`: received 1; expected 2\n"


def test_tensorflow_keras_submodules_are_keras2_when_tensorflow_came_first():
    """The README's order (`import tensorflow as tf`, then `import hvdtrain`) and then the
    common `from tensorflow.keras.preprocessing.image import ImageDataGenerator` made
    `tf.keras` Keras 3's for the rest of the process (TensorFlow chose its submodules' path
    before TF_USE_LEGACY_KERAS was set): Keras 2's deterministic set-up then failed."""
    script = (
        "import tensorflow as tf\nimport hvdtrain\n"
        "from tensorflow.keras.preprocessing.image import ImageDataGenerator\n"
        "print(tf.keras.Sequential.__module__, ImageDataGenerator.__module__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["tf_keras.src.engine.sequential",
                                        "tf_keras.src.preprocessing.image"]  # fmt: skip


# -- nothing of hvdtrain in a Python that does not import it ---------------------------------
OLD_PTH = "hvdtrain-quiet-start.pth"  # what set-ups before 2026-11-29 wrote


def _remove_old_pth(venv):
    """setup_host.sh's `remove_old_pth` step alone, on `venv`: its output."""
    script = open(os.path.join(ROOT, "launch", "setup_host.sh")).read()
    step = re.search(r"^remove_old_pth\(\) \{.*?^\}\n", script, re.MULTILINE | re.DOTALL)
    assert step, "launch/setup_host.sh: no remove_old_pth step"
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", step.group() + 'remove_old_pth "$1"',
                           "-", str(venv)], capture_output=True, text=True, timeout=30)  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return proc.stdout


def test_the_set_up_writes_no_pth_and_removes_the_old_one(tmp_path):
    """A set-up run again over an environment with the old `.pth` removes it, in one line,
    before it can stop early (nothing to do); the set-up and the image write none."""
    site = tmp_path / "lib" / "python3.13" / "site-packages"
    site.mkdir(parents=True)
    (site / OLD_PTH).write_text("import sys; exec('...')\n")
    (site / "distutils-precedence.pth").write_text("x\n")
    assert _remove_old_pth(tmp_path) == f"setup_host: removed {site / OLD_PTH} (no longer used)\n"
    assert sorted(p.name for p in site.iterdir()) == ["distutils-precedence.pth"]
    assert _remove_old_pth(tmp_path) == ""  # nothing left: nothing said
    setup = open(os.path.join(ROOT, "launch", "setup_host.sh")).read()
    assert setup.index('remove_old_pth "$venv"') < setup.index("exit 0")
    for path in ("launch/setup_host.sh", "Dockerfile"):
        text = open(os.path.join(ROOT, path)).read()
        assert "install_pth" not in text and "startup" not in text, path
    for folder, _, files in os.walk(os.path.join(ROOT, "hvdtrain")):
        for name in (f for f in files if f.endswith(".py")):
            assert "register_at_fork" not in open(os.path.join(folder, name)).read(), name


def test_plain_mpirun_shows_tensorflows_start_up_lines_and_one_setting_quiets_them(tmp_path):
    """docs/getting-started.md: two ranks under plain mpirun that import TensorFlow first,
    oneDNN on (as on AVX512_VNNI CPUs; forced here): its two start-up lines, twice in each
    rank, whatever TF_CPP_MIN_LOG_LEVEL says, nothing of hvdtrain loaded in them; with
    TF_ENABLE_ONEDNN_OPTS=0, none. Fails while an old set-up's `.pth` is in the environment."""
    import sysconfig

    from hvdtrain.launcher.noise import is_startup_noise

    old = os.path.join(sysconfig.get_paths()["purelib"], OLD_PTH)
    assert not os.path.exists(old), f"{old}: run the set-up again (make setup) to remove it"
    script = tmp_path / "tf_first.py"
    loaded = "[m for m in sys.modules if m.split('.')[0] == 'hvdtrain']"  # not pip's finder
    script.write_text(f"import sys, tensorflow as tf\nprint(tf.constant(2).numpy(), {loaded})\n")
    root = ["--allow-run-as-root"] if os.getuid() == 0 else []
    mpirun = ["mpirun", *root, "--oversubscribe", "-np", "2", sys.executable, str(script)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_USE_LEGACY_KERAS")}
    for onednn, lines in (("1", 8), ("0", 0)):
        env.update(TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS=onednn)
        job = subprocess.run(mpirun, capture_output=True, text=True, timeout=300, env=env)
        assert job.returncode == 0 and job.stdout == "2 []\n" * 2, job.stdout + job.stderr
        noise = [line for line in job.stderr.splitlines() if is_startup_noise(line)]
        assert len(noise) == lines and len(noise) == len(job.stderr.splitlines()), job.stderr
