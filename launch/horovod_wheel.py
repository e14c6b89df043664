"""The patched Horovod wheel's key and its per-user cache (used by launch/install_horovod.sh).

Standard library only: it runs under the environment's Python before hvdtrain is installed.

    PYTHON launch/horovod_wheel.py key PATCH...            # the key's text (JSON) for this Python
    PYTHON launch/horovod_wheel.py version PATCH...        # 0.28.1+hvdtrain.<short key>
    PYTHON launch/horovod_wheel.py stamp SRC PATCH...      # the key into the source to build
    PYTHON launch/horovod_wheel.py find CACHE PATCH...     # the usable cached wheel, or exit 1
    PYTHON launch/horovod_wheel.py store CACHE WHEEL PATCH...   # keep a built wheel
    PYTHON launch/horovod_wheel.py drop CACHE PATCH...     # forget the key's entry
    PYTHON launch/horovod_wheel.py locked CACHE PATCH... -- COMMAND...   # run it holding the lock

A wheel is built once per key: Horovod's version, the patch series (every file's SHA-256, in
order), the TensorFlow distribution and version, Python's major.minor, the MPI (`mpirun
--version`'s first line), the GPU operations (HOROVOD_GPU_OPERATIONS) and the machine.
HVDTRAIN_WHEEL_KEY_EXTRA, when set, is part of the key too (a new key without a new input).
The short key (12 hex digits of the key's SHA-256) is the wheel's local version
(`horovod-0.28.1+hvdtrain.<short>-cp313-...whl`) and the cache entry's folder name; the key
itself is built into the wheel (`horovod/_hvdtrain_build.py`) and kept beside it (key.json),
with the wheel's SHA-256 (`<wheel>.sha256`). `find` uses an entry only when the wheel's
hash, its zip, its version and the key built into it all match; otherwise it prints one
line that says why on stderr, removes the entry and exits 1 (the caller builds again).

One set-up per key at a time: `find`, `store` and `drop` hold the key's lock (an `flock` on
`<cache>/<short key>.lock`), and `locked` holds it for a whole command (install_horovod.sh
runs itself under it, from its look-up to its store): a second set-up of the same key waits,
saying so in one line, then finds the first one's wheel and builds nothing. `store` keeps a
valid wheel already stored for the key rather than replacing it. The lock passes to the
command (its file stays open in it) and `HVDTRAIN_WHEEL_LOCK` names it there, so that the
tool's calls below it do not wait for their own set-up.
"""

import ast
import contextlib
import fcntl
import hashlib
import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

__all__ = [
    "HOROVOD_VERSION",
    "BUILD_MODULE",
    "build_key",
    "short_key",
    "local_version",
    "environment_inputs",
    "wheel_problem",
    "find",
    "store",
    "drop",
    "lock",
    "run_locked",
    "main",
]

HOROVOD_VERSION = "0.28.1"
BUILD_MODULE = "horovod/_hvdtrain_build.py"  # the key, built into the wheel
TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "intel-tensorflow")
PREFIX = "install_horovod"
LOCK_ENV = "HVDTRAIN_WHEEL_LOCK"  # the lock file that a caller of this process holds


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_key(horovod, patches, tensorflow, python, mpi, gpu_operations, machine, extra=""):
    """The key of a build, a dict of strings. Pure: `patches` is a list of (name, sha256)."""
    key = {
        "horovod": horovod,
        "patches": [f"{name} {digest}" for name, digest in patches],
        "tensorflow": tensorflow,
        "python": python,
        "mpi": mpi,
        "gpu_operations": gpu_operations or "none",
        "machine": machine,
    }
    if extra:
        key["extra"] = extra
    return key


def short_key(key):
    """12 hex digits that name `key` (the wheel's local version, the cache entry's folder)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def local_version(key):
    """`0.28.1+hvdtrain.<short key>`: the version the wheel and the installed Horovod carry."""
    return f"{key['horovod']}+hvdtrain.{short_key(key)}"


def _tensorflow():
    for name in TENSORFLOW_DISTRIBUTIONS:
        try:
            return f"{name} {md.version(name)}"
        except md.PackageNotFoundError:
            pass
    return None


def _mpi():
    try:
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "none"
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0].strip() if lines else "none"


def environment_inputs(patch_files):
    """This Python's key: its TensorFlow, Python, MPI, GPU operations and machine."""
    tensorflow = _tensorflow()
    if tensorflow is None:
        raise SystemExit(f"{PREFIX}: error: no TensorFlow installed for {sys.executable}")
    return build_key(
        HOROVOD_VERSION,
        [(os.path.basename(p), _sha256(p)) for p in patch_files],
        tensorflow,
        "{}.{}".format(*sys.version_info[:2]),
        _mpi(),
        os.environ.get("HOROVOD_GPU_OPERATIONS", ""),
        platform.machine(),
        os.environ.get("HVDTRAIN_WHEEL_KEY_EXTRA", ""),
    )


def _built_key(wheel):
    """The key built into `wheel` (None when it has none)."""
    with zipfile.ZipFile(wheel) as z:
        try:
            text = z.read(BUILD_MODULE).decode()
        except KeyError:
            return None
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "KEY":
            return ast.literal_eval(node.value)
    return None


def _wheel_version(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if not names:
            return None
        found = re.search(r"^Version: (\S+)", z.read(names[0]).decode(), re.MULTILINE)
    return found.group(1) if found else None


def wheel_problem(wheel, recorded_sha256, key):
    """Why the cached `wheel` must not be installed for `key`, or None when it may be.

    Checks, in this order: the file's SHA-256 against the one recorded when it was stored
    (a truncated or altered file), the zip's own checksums, its version (METADATA) and
    the key built into it (a wheel of another TensorFlow, Python, patch ... under this
    key's name)."""
    if not os.path.isfile(wheel):
        return "its wheel is missing"
    actual = _sha256(wheel)
    if actual != recorded_sha256:
        return f"its SHA-256 is {actual[:12]}..., recorded {(recorded_sha256 or 'none')[:12]}..."
    try:
        with zipfile.ZipFile(wheel) as z:
            bad = z.testzip()
        if bad:
            return f"its zip is damaged ({bad})"
        version, built = _wheel_version(wheel), _built_key(wheel)
    except (zipfile.BadZipFile, OSError, SyntaxError, ValueError) as e:
        return f"it is not a readable wheel ({e})"
    if version != local_version(key):
        return f"its version is {version}; expected {local_version(key)}"
    if built != key:
        if not built:
            return "it carries no build key"
        differ = [k for k in sorted(set(key) | set(built)) if key.get(k) != built.get(k)]
        what = ", ".join(f"{k} {built.get(k)!r} (expected {key.get(k)!r})" for k in differ)
        return f"it was built for another key: {what}"
    return None


def _entry(cache, key):
    return os.path.join(cache, short_key(key))


def _lock_path(cache, key):
    return os.path.join(cache, f"{short_key(key)}.lock")


def _acquire(cache, key):
    """Takes the key's lock; returns (its open file descriptor, its path). The descriptor is
    None when a caller of this process holds the lock already (`LOCK_ENV`), or when the
    cache cannot hold a lock file (a read-only cache: nothing is stored there either)."""
    path = _lock_path(cache, key)
    if os.environ.get(LOCK_ENV) == path:
        return None, path
    try:
        os.makedirs(cache, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return None, path
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(
            f"{PREFIX}: waiting for another set-up of the same Horovod wheel to finish ({path})",
            file=sys.stderr,
            flush=True,
        )
        fcntl.flock(fd, fcntl.LOCK_EX)
    return fd, path


@contextlib.contextmanager
def lock(cache, key):
    """Holds the key's lock for the `with` block (see the module's docstring)."""
    fd, path = _acquire(cache, key)
    try:
        yield path
    finally:
        if fd is not None:
            os.close(fd)


def run_locked(cache, key, argv):
    """Replaces this process with `argv`, which then holds the key's lock (its file stays
    open there, and in what it starts) until it ends; `LOCK_ENV` names the lock for it."""
    fd, path = _acquire(cache, key)
    if fd is not None:
        os.set_inheritable(fd, True)
    os.execvpe(argv[0], argv, {**os.environ, LOCK_ENV: path})


def _usable(cache, key):
    """(the key's cached wheel, why it must not be used or None); (None, None) when the
    cache holds no wheel for the key."""
    entry = _entry(cache, key)
    if not os.path.isdir(entry):
        return None, None
    wheels = sorted(n for n in os.listdir(entry) if n.endswith(".whl"))
    if not wheels:
        return None, None
    wheel = os.path.join(entry, wheels[0])
    try:
        with open(wheel + ".sha256") as f:
            recorded = f.read().split()[0]
    except (OSError, IndexError):
        recorded = None
    return wheel, wheel_problem(wheel, recorded, key)


def find(cache, key):
    """The usable cached wheel for `key`, or None. A damaged or mismatched entry is removed,
    with one line on stderr saying why."""
    with lock(cache, key):
        wheel, problem = _usable(cache, key)
        if problem:
            print(
                f"{PREFIX}: the cached wheel {wheel} is not used: {problem}; building again",
                file=sys.stderr,
            )
            shutil.rmtree(_entry(cache, key), ignore_errors=True)
            return None
        return wheel


def store(cache, key, wheel):
    """Keep `wheel` (just built for `key`) in the cache; returns its path there. Under the
    key's lock: a valid wheel stored for the key meanwhile (by a set-up that ran beside this
    one) is kept, and its path returned; else the entry appears whole (renamed into place),
    so that a set-up never sees half of one."""
    os.makedirs(cache, exist_ok=True)
    with lock(cache, key):
        kept, problem = _usable(cache, key)
        if kept and not problem:
            return kept
        entry = _entry(cache, key)
        work = tempfile.mkdtemp(prefix=".store-", dir=cache)
        try:
            target = os.path.join(work, os.path.basename(wheel))
            shutil.copyfile(wheel, target)
            with open(target + ".sha256", "w") as f:
                f.write(f"{_sha256(target)}  {os.path.basename(target)}\n")
            with open(os.path.join(work, "key.json"), "w") as f:
                json.dump(key, f, indent=1, sort_keys=True)
                f.write("\n")
            shutil.rmtree(entry, ignore_errors=True)
            os.rename(work, entry)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return os.path.join(entry, os.path.basename(wheel))


def drop(cache, key):
    """Forget the key's entry (under its lock)."""
    with lock(cache, key):
        shutil.rmtree(_entry(cache, key), ignore_errors=True)


def stamp(src, key):
    """Give the unpacked sdist at `src` the key's version and the key, before it is built."""
    init = os.path.join(src, "horovod", "__init__.py")
    text = open(init).read()
    text, n = re.subn(
        r"^__version__ = .*$",
        f"__version__ = {local_version(key)!r}",
        text,
        count=1,
        flags=re.MULTILINE,
    )
    if n != 1:
        raise SystemExit(f"{PREFIX}: error: no __version__ line in {init}")
    with open(init, "w") as f:
        f.write(text)
    with open(os.path.join(src, BUILD_MODULE), "w") as f:
        f.write('"""What this Horovod was built from (hvdtrain: launch/horovod_wheel.py)."""\n')
        f.write(f"KEY = {key!r}\n")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    command, rest = argv[0], argv[1:]
    if command in ("key", "version"):
        key = environment_inputs(rest)
        print(json.dumps(key, sort_keys=True) if command == "key" else local_version(key))
    elif command == "stamp":
        stamp(rest[0], environment_inputs(rest[1:]))
    elif command == "find":
        wheel = find(rest[0], environment_inputs(rest[1:]))
        if wheel is None:
            return 1
        print(wheel)
    elif command == "store":
        print(store(rest[0], environment_inputs(rest[2:]), rest[1]))
    elif command == "drop":
        drop(rest[0], environment_inputs(rest[1:]))
    elif command == "locked" and "--" in rest[1:]:
        at = rest.index("--", 1)
        if at + 1 == len(rest):
            raise SystemExit(f"{PREFIX}: error: `locked` needs a command after `--`")
        run_locked(rest[0], environment_inputs(rest[1:at]), rest[at + 1 :])
    else:
        raise SystemExit(f"{PREFIX}: error: Invalid value for `command`: received {command!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
