"""The patched Horovod wheel: its key, its cache, and the wheel alone (docs/horovod-wheel.md).

The key and the cache's checks are tested on a copy of the real wheel that the set-up built
and cached (launch/install_horovod.sh; HVDTRAIN_WHEEL_CACHE, else the per-user cache): CI
builds it where its key is new, that is, where an input of the build changed (.ci/run). The
slow tests install that wheel into a
clean virtual environment with TensorFlow and no hvdtrain, from the cache (building nothing:
HVDTRAIN_WHEEL_NO_BUILD=1), and run plain Horovod there: `--check-build`, two ranks of a
Keras script, and a failed Gloo job.
"""

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

# The slow tests share one clean environment (a module fixture): one pytest worker.
pytestmark = pytest.mark.xdist_group("horovod-wheel")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch")
PATCHES = sorted(
    os.path.join(LAUNCH, "horovod-patches", n)
    for n in os.listdir(os.path.join(LAUNCH, "horovod-patches"))
)
_spec = importlib.util.spec_from_file_location("hw", os.path.join(LAUNCH, "horovod_wheel.py"))
hw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hw)

ARGS = (
    "0.28.1",
    [("0001-a.patch", "1" * 64)],
    "tensorflow-cpu 2.21.0",
    "3.13",
    "mpirun (Open MPI) 4.1.4",
    "",
    "x86_64",
)
KEY = hw.build_key(*ARGS)


def test_a_changed_input_is_another_key_the_same_inputs_the_same():
    assert hw.short_key(KEY) == hw.short_key(hw.build_key(*ARGS))
    assert re.fullmatch(r"0\.28\.1\+hvdtrain\.[0-9a-f]{12}", hw.local_version(KEY))
    changed = [
        dict(KEY, patches=["0001-a.patch " + "2" * 64]),
        dict(KEY, tensorflow="tensorflow-cpu 2.20.0"),
        dict(KEY, python="3.12"),
        dict(KEY, mpi="mpirun (Open MPI) 5.0.3"),
        dict(KEY, gpu_operations="NCCL"),
        hw.build_key(*ARGS, extra="HVDTRAIN_WHEEL_KEY_EXTRA's value"),
    ]
    shorts = {hw.short_key(k) for k in changed} | {hw.short_key(KEY)}
    assert len(shorts) == len(changed) + 1


def test_the_patches_are_a_series_that_applies_in_order():
    names = [os.path.basename(p) for p in PATCHES]
    assert [n[:5] for n in names] == [f"{i:04d}-" for i in range(1, len(names) + 1)]
    for path in PATCHES:
        text = open(path).read()
        # git format-patch's form, with a message that says why
        assert text.startswith("From 0000000000000000000000000000000000000000 ")
        subject = re.search(r"^Subject: \[PATCH \d+/\d+\] (.+)$", text, re.MULTILINE)
        message = text[text.index("\n\n") : text.index("\n---\n")]
        assert subject and len(message.split()) > 30, path
    assert not os.path.exists(os.path.join(LAUNCH, "horovod-0.28.1.patch"))


def _real_wheel():
    """The set-up's cached wheel for this environment's key, or skip."""
    cache = os.environ.get("HVDTRAIN_WHEEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvdtrain", "wheels"
    )
    key = hw.environment_inputs(PATCHES)
    entry = os.path.join(cache, hw.short_key(key))
    wheels = [n for n in os.listdir(entry) if n.endswith(".whl")] if os.path.isdir(entry) else []
    if not wheels:
        pytest.skip(f"no cached Horovod wheel for this key in {cache}: run the set-up first")
    return os.path.join(entry, wheels[0]), key


@pytest.fixture
def cached(tmp_path):
    """A cache in tmp_path holding a copy of the real wheel (store() as after a build)."""
    wheel, key = _real_wheel()
    cache = str(tmp_path / "cache")
    return cache, key, hw.store(cache, key, wheel)


def _rewrite(wheel, replace):
    """Rewrite `wheel` in place with `replace(name, data) -> data or None (left out)`."""
    tmp = wheel + ".new"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            data = replace(info.filename, src.read(info))
            if data is not None:
                dst.writestr(info, data)
    os.replace(tmp, wheel)
    with open(wheel + ".sha256", "w") as f:  # recorded anew: only the content check is left
        f.write(hashlib.sha256(open(wheel, "rb").read()).hexdigest() + "\n")


def test_a_cached_wheel_is_used_when_whole_and_of_this_key(cached, capsys):
    cache, key, wheel = cached
    name = os.path.basename(wheel)
    assert name.startswith(f"horovod-{hw.local_version(key)}-cp"), name
    assert hw.find(cache, key) == wheel
    assert capsys.readouterr().err == ""
    # A changed key (a new patch, TensorFlow, Python ...) finds nothing: it builds.
    assert hw.find(cache, dict(key, extra="a new input")) is None
    assert capsys.readouterr().err == ""


def _refused(cache, key, capsys):
    assert hw.find(cache, key) is None  # never installed: the caller builds again
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.endswith("; building again\n"), err
    assert not os.path.exists(os.path.join(cache, hw.short_key(key)))  # the entry is gone
    return err


def test_a_truncated_cached_wheel_is_refused_in_one_line(cached, capsys):
    cache, key, wheel = cached
    with open(wheel, "r+b") as f:
        f.truncate(os.path.getsize(wheel) // 2)
    assert "its SHA-256 is" in _refused(cache, key, capsys)


def test_a_truncated_wheel_with_its_hash_recorded_anew_is_refused(cached, capsys):
    cache, key, wheel = cached
    with open(wheel, "r+b") as f:
        f.truncate(os.path.getsize(wheel) - 100)
    with open(wheel + ".sha256", "w") as f:
        f.write(hashlib.sha256(open(wheel, "rb").read()).hexdigest() + "\n")
    assert "not a readable wheel" in _refused(cache, key, capsys)


def test_another_tensorflows_wheel_under_the_key_is_refused(cached, capsys):
    cache, key, wheel = cached
    other = dict(key, tensorflow="tensorflow-cpu 2.20.0")

    def built_for_other(name, data):
        return f"KEY = {other!r}\n".encode() if name == hw.BUILD_MODULE else data

    _rewrite(wheel, built_for_other)
    err = _refused(cache, key, capsys)
    assert "built for another key: tensorflow 'tensorflow-cpu 2.20.0'" in err, err
    assert f"(expected {key['tensorflow']!r})" in err


# -- two set-ups at once: the key's lock ----------------------------------------------------


@pytest.fixture
def fake(tmp_path):
    """A patch of its own (so a key of its own), and a tiny wheel that passes every check
    for that key: (cache, [patch], key, wheel)."""
    patch = tmp_path / "0001-fake.patch"
    patch.write_text("a patch that only names the key\n")
    key = hw.environment_inputs([str(patch)])
    version = hw.local_version(key)
    wheel = str(tmp_path / f"horovod-{version}-py3-none-any.whl")
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"horovod-{version}.dist-info/METADATA", f"Version: {version}\n")
        z.writestr(hw.BUILD_MODULE, f"KEY = {key!r}\n")
    return str(tmp_path / "cache"), [str(patch)], key, wheel


def _tool(*args):
    return [sys.executable, os.path.join(LAUNCH, "horovod_wheel.py"), *args]


def _together(argvs, timeout=120):
    """Runs the commands at once; [(exit status, stdout, stderr)] in their order."""
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a in argvs]  # fmt: skip
    outputs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outputs, strict=True)]


def _one_valid_entry(cache, key):
    names = sorted(os.listdir(cache))
    assert names == [hw.short_key(key), f"{hw.short_key(key)}.lock"], names  # no half entry
    wheel = hw.find(cache, key)
    assert wheel and os.path.dirname(wheel) == os.path.join(cache, hw.short_key(key))
    return wheel


def test_two_set_ups_at_once_build_once_and_both_end_with_the_wheel(fake):
    """What install_horovod.sh does, twice at once: under the key's lock, find, else
    "build" (a line in a log, a second's wait) and store. The second waits, then finds
    the first one's wheel."""
    cache, patches, key, wheel = fake
    log = os.path.join(os.path.dirname(cache), "builds.log")
    tool = " ".join(_tool())
    set_up = (
        f"{tool} find {cache} {patches[0]} || {{ echo built >> {log}; sleep 1; "
        f"{tool} store {cache} {wheel} {patches[0]}; }}"
    )
    runs = _together([_tool("locked", cache, *patches, "--", "sh", "-c", set_up)] * 2)
    assert [code for code, _, _ in runs] == [0, 0], runs
    kept = _one_valid_entry(cache, key)
    assert [out.strip() for _, out, _ in runs] == [kept, kept]  # both end with the one wheel
    assert open(log).read() == "built\n"  # one build
    waited = [err for _, _, err in runs if "waiting for another set-up" in err]
    assert len(waited) == 1 and len(waited[0].splitlines()) == 1, runs


def test_two_stores_of_one_key_at_once_both_succeed_with_one_wheel(fake):
    """Two builds that end together (no `locked` around them): neither store fails, and the
    cache holds one whole entry, the first one's."""
    cache, patches, key, wheel = fake
    for _ in range(3):
        runs = _together([_tool("store", cache, wheel, *patches)] * 2)
        assert [code for code, _, _ in runs] == [0, 0], runs
        kept = _one_valid_entry(cache, key)
        assert [out.strip() for _, out, _ in runs] == [kept, kept]


def test_a_store_keeps_a_valid_wheel_and_replaces_a_damaged_one(fake):
    cache, _, key, wheel = fake
    kept = hw.store(cache, key, wheel)
    before = os.stat(kept).st_ino
    assert hw.store(cache, key, wheel) == kept and os.stat(kept).st_ino == before  # kept
    with open(kept, "r+b") as f:
        f.truncate(10)
    assert hw.store(cache, key, wheel) == kept and os.stat(kept).st_ino != before  # replaced
    assert hw.find(cache, key) == kept


def test_the_lock_passes_to_the_command_and_is_not_taken_twice(fake):
    """Under `locked`, the tool's own calls go on at once (no wait for their own set-up);
    another process's lock of the key waits until the command has ended."""
    cache, patches, key, _ = fake
    script = (
        "import fcntl, os, sys\n"
        f"path = os.environ[{hw.LOCK_ENV!r}]\n"
        "fd = os.open(path, os.O_RDWR)\n"
        "try:\n"
        "    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "except BlockingIOError:\n"
        "    print('held', path)\n"
    )
    runs = _together([_tool("locked", cache, *patches, "--", sys.executable, "-c", script)])
    assert runs == [(0, f"held {cache}/{hw.short_key(key)}.lock\n", "")], runs
    with hw.lock(cache, key):  # free again: the command's end released it
        pass
    missing = _together([_tool("locked", cache, *patches, "--")])
    assert missing[0][0] != 0 and "needs a command" in missing[0][2]


# -- the wheel alone, in a clean environment (slow: a TensorFlow install) ------------------

SCRIPT = textwrap.dedent(
    """\
    # A plain Horovod Keras script: local synthetic data, no hvdtrain.
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow.keras as hvd

    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("float32")
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(1, "sigmoid")])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1 * hvd.size()))
    model.compile(optimizer=opt, loss="binary_crossentropy")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()])
    digest = float(sum(float(np.sum(w)) for w in model.get_weights()))
    print(f"rank {hvd.rank()} of {hvd.size()}: weights {digest:.6f}", flush=True)
    """
)


EXITS_3 = """\
import os, sys
if os.environ["HOROVOD_RANK"] == "1":
    print("rank error: bad input", file=sys.stderr)
    sys.exit(3)
"""


def _cached_copy(base, key):
    entry = os.path.join(base, "cache", hw.short_key(key))
    return os.path.join(entry, [n for n in os.listdir(entry) if n.endswith(".whl")][0])


def _run(argv, env, timeout):
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory):
    """A virtual environment with TensorFlow (+ tf-keras) per constraints.txt, no hvdtrain,
    and a cache holding a copy of the real wheel."""
    wheel, key = _real_wheel()
    base = tmp_path_factory.mktemp("clean")
    venv = str(base / "venv")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    python = os.path.join(venv, "bin", "python")
    constraints = ["-c", os.path.join(ROOT, "constraints.txt")]
    pip = [python, "-m", "pip", "install", "-q", *constraints]
    subprocess.run([*pip, "tensorflow-cpu", "numpy"], check=True, timeout=900)
    subprocess.run([*pip, "--no-deps", "tf-keras"], check=True, timeout=300)
    cache = str(base / "cache")
    hw.store(cache, key, wheel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        PATH=os.path.join(venv, "bin") + os.pathsep + env["PATH"],
        TF_CPP_MIN_LOG_LEVEL="2",
        HVDTRAIN_WHEEL_CACHE=cache,
    )
    return python, env, str(base), key


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_second_environment_installs_from_the_cache_and_builds_nothing(clean_venv):
    python, env, base, key = clean_venv
    out_dir = os.path.join(base, "out")
    # HVDTRAIN_WHEEL_NO_BUILD=1: the script fails rather than build, so success means no build.
    env = dict(env, PYTHON=python, WHEEL_DIR=out_dir, HVDTRAIN_WHEEL_NO_BUILD="1")
    proc = _run([os.path.join(LAUNCH, "install_horovod.sh")], env, 600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "installed from the cache with: TensorFlow" in out and "(no build)" in out, out
    assert "building" not in out, out
    exported = os.listdir(out_dir)
    assert len(exported) == 1 and exported[0].startswith(f"horovod-{hw.local_version(key)}-")
    # A second run in that environment: nothing to do.
    proc = _run([os.path.join(LAUNCH, "install_horovod.sh")], dict(env, WHEEL_DIR=""), 300)
    assert proc.returncode == 0 and "already built" in proc.stdout, proc.stdout + proc.stderr
    # A changed key (here through HVDTRAIN_WHEEL_KEY_EXTRA) misses the cache: it would build.
    changed = dict(env, WHEEL_DIR="", HVDTRAIN_WHEEL_KEY_EXTRA="a changed input")
    proc = _run([os.path.join(LAUNCH, "install_horovod.sh")], changed, 300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().endswith("and HVDTRAIN_WHEEL_NO_BUILD=1"), proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_cached_wheel_whose_horovod_lacks_tensorflow_once_installed_is_dropped(clean_venv):
    python, env, base, key = clean_venv
    cache = os.path.join(base, "cache-broken")
    wheel = hw.store(cache, key, _cached_copy(base, key))
    # Whole, of this key, with the right hash, but without its TensorFlow extension library.
    _rewrite(wheel, lambda name, data: None if "tensorflow/mpi_lib" in name else data)
    env = dict(env, PYTHON=python, HVDTRAIN_WHEEL_CACHE=cache, HVDTRAIN_WHEEL_NO_BUILD="1")
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "horovod"], check=True)
    proc = _run([os.path.join(LAUNCH, "install_horovod.sh")], env, 600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if "is not used" in line]
    assert len(said) == 1 and said[0].endswith("building again"), proc.stderr
    assert "TensorFlow" not in said[0].split("has only")[1].split(" of ")[0], said[0]
    assert not os.path.exists(os.path.join(cache, hw.short_key(key)))  # dropped


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_exported_wheel_alone_runs_plain_horovod_on_two_ranks(clean_venv):
    python, env, base, key = clean_venv
    exported = os.path.join(base, "user", os.path.basename(_cached_copy(base, key)))
    os.makedirs(os.path.dirname(exported), exist_ok=True)
    shutil.copyfile(_cached_copy(base, key), exported)
    # As a user would: pip install the file (Horovod's own requirements come from PyPI).
    pip = [python, "-m", "pip"]
    subprocess.run([*pip, "uninstall", "-q", "-y", "horovod"], check=True, timeout=120)
    subprocess.run([*pip, "install", "-q", exported], check=True, timeout=300, env=env)
    proc = _run(["horovodrun", "--check-build"], env, 120)
    for name in ("TensorFlow", "MPI", "Gloo"):
        assert re.search(rf"\[X\] {name}\b", proc.stdout), proc.stdout + proc.stderr
    script = os.path.join(base, "plain_keras.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    for controller in ("--gloo", "--mpi"):
        argv = ["horovodrun", controller, "-np", "2", "-H", "localhost:2", python, script]
        proc = _run(argv, env, 300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        # The number alone: unbuffered (PYTHONUNBUFFERED), print writes the line and its end
        # apart, and mpirun's --tag-output may tag the end too ("2.391169[1,1]<stdout>:").
        digests = re.findall(r"rank (\d) of 2: weights (-?\d+\.\d+)", out)
        assert sorted(r for r, _ in digests) == ["0", "1"], out
        assert digests[0][1] == digests[1][1], out  # the same weights on both ranks


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_plain_horovodrun_gloo_ends_a_failed_job_in_one_line_with_the_ranks_status(clean_venv):
    python, env, base, key = clean_venv
    wheel = _cached_copy(base, key)
    pip = [python, "-m", "pip", "install", "-q", "--force-reinstall", wheel]
    subprocess.run(pip, check=True, timeout=300, env=env)
    script = os.path.join(base, "exits3.py")
    with open(script, "w") as f:
        f.write(EXITS_3)
    argv = ["horovodrun", "--gloo", "-np", "2", "-H", "localhost:2", python, script]
    proc = _run(argv, env, 300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "Traceback" not in out and "RuntimeError" not in out, out
    last = out.strip().splitlines()[-1]
    assert last == (
        "horovodrun: Horovod detected that one or more processes exited with non-zero status, "
        "so the job was stopped; the first: Process name: 1, Exit code: 3"
    ), out
    assert "rank error: bad input" in out
