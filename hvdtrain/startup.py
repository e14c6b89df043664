"""TensorFlow's start-up noise, left out when TensorFlow is imported after hvdtrain.

On CPUs where TensorFlow turns oneDNN on (AVX512_VNNI, AVX512_BF16, AMX: most current
servers), TensorFlow 2.21 logs, twice per process, while it loads and before its log level
applies, so whatever TF_CPP_MIN_LOG_LEVEL says::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:1795511589.155556   31604 port.cc:153] oneDNN custom operations are on. ...

that is eight lines on two ranks, from every rank. `import hvdtrain` (standard library only)
puts a hook on the import of `tensorflow` (`quiet_tensorflow_import`): that import runs with
file descriptor 2 going through a small filter process, which passes every line on to
stderr as it comes but those two kinds (`is_startup_noise`). The filter outlives a process
that dies while importing (TensorFlow aborting on a CPU it cannot use), so no line is lost.
Nothing is filtered when TF_CPP_MIN_LOG_LEVEL is 0 (TensorFlow's INFO lines were asked for)
or when the filter cannot start.

A script that imports TensorFlow before hvdtrain would print the lines before any of our
code runs. So the set-up (`launch/setup_host.sh`, the Docker image) also writes a `.pth`
file into the environment's site-packages (`install_pth`): as Python starts, before the
script, a process that a launcher started (a rank, or `horovodrun` itself, whose build
check imports TensorFlow) gets the same hook and TF_CPP_MIN_LOG_LEVEL=2 unless set
(`at_start`). It loads this file alone, not the hvdtrain package, and any other process
pays one look at its environment.
"""

import contextlib
import importlib.abc
import importlib.util
import os
import re
import subprocess
import sys
import sysconfig

__all__ = [
    "at_start",
    "install_pth",
    "is_startup_noise",
    "launched",
    "noise_unwanted",
    "pth_text",
    "quiet_tensorflow_import",
]

# Set in each process a launcher starts: Open MPI's mpirun, Horovod's Gloo, PMI and PMIx
# (MPICH, Slurm's srun).
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "PMI_RANK", "PMIX_RANK")
# Set to 1 by `at_start` for the process's children (horovodrun checks its build in a child
# process that loads TensorFlow).
QUIET_START = "HVDTRAIN_QUIET_START"
PTH_NAME = "hvdtrain-quiet-start.pth"
# What the `.pth` runs as Python starts (`site` executes its lines that begin with `import`):
# one look at the environment; in a launched process, this file loaded alone, and `at_start`.
# Never an error: a moved or removed hvdtrain leaves a process as it would be without it.
_PTH_CODE = """\
import os, sys
try:
    env, name = os.environ, os.path.basename((sys.argv or [""])[0])
    if any(env.get(v) for v in {variables!r}) or env.get({quiet!r}) == "1" or name == "horovodrun":
        module = sys.modules.get("hvdtrain.startup")
        if module is None:
            from importlib import util
            spec = util.spec_from_file_location("hvdtrain.startup", {path!r})
            module = util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[spec.name] = module
        module.at_start()
except Exception:
    pass
"""

_NOISE = re.compile(
    r"(\[[\d,]+\]<stderr>:)?"  # as horovodrun and mpirun --tag-output forward a rank's line
    r"(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:.]+ +\d+ port\.cc:\d+\] oneDNN custom operations are on\. .*)\s*$"
)
# The filter process: stdin (the importing process's fd 2) to stdout (its real stderr).
_FILTER = """import re, sys
noise = re.compile(sys.argv[1])
for line in sys.stdin.buffer:
    if not noise.match(line.decode("utf-8", "replace")):
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()
"""


def is_startup_noise(line):
    """Whether `line` is one of the lines TensorFlow logs while it loads (see the module
    doc), also as a launcher forwards it (`[1]<stderr>:...`). Pure."""
    return bool(_NOISE.match(line))


def noise_unwanted(environ):
    """Whether `environ` leaves the noise out: TF_CPP_MIN_LOG_LEVEL is set and not 0."""
    return environ.get("TF_CPP_MIN_LOG_LEVEL", "0").strip() not in ("", "0")


@contextlib.contextmanager
def _noise_filtered():
    """File descriptor 2 (stderr, also C++'s) goes through the filter process for the
    duration; without a stderr or a filter process, nothing changes."""
    try:
        if sys.stderr is not None:
            sys.stderr.flush()
        real = os.dup(2)
    except OSError:  # no stderr (2>&-)
        yield
        return
    try:
        filter_ = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _FILTER, _NOISE.pattern],
            stdin=subprocess.PIPE, stdout=real, stderr=real,
        )  # fmt: skip
        os.dup2(filter_.stdin.fileno(), 2)
    except (OSError, ValueError):
        os.close(real)
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            if sys.stderr is not None:
                sys.stderr.flush()
        os.dup2(real, 2)
        os.close(real)
        filter_.stdin.close()  # its end of input, once no process holds the pipe (a child)
        with contextlib.suppress(subprocess.TimeoutExpired):
            filter_.wait(timeout=10)  # all passed on; else it goes on for that child


class _QuietLoader:
    """`loader`, whose module runs with its start-up noise filtered."""

    def __init__(self, loader, finder):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        if self.finder in sys.meta_path:  # the import happens: once is enough
            sys.meta_path.remove(self.finder)
        try:
            with _noise_filtered() if noise_unwanted(os.environ) else contextlib.nullcontext():
                self.loader.exec_module(module)
        finally:  # the module keeps its own loader (resources, reloads)
            module.__loader__ = module.__spec__.loader = self.loader

    def __getattr__(self, name):  # get_data, get_resource_reader, ... during the import
        if name in ("loader", "finder"):
            raise AttributeError(name)
        return getattr(self.loader, name)


class _QuietFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name):
        self.name, self._searching = name, False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._searching:
            return None
        self._searching = True  # the usual search, without this finder
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _QuietLoader(spec.loader, self)
        return spec


_STARTED = []  # `at_start` ran: `site` may run the `.pth` twice (lib and lib64)
_FOR_LIFE = []  # in a forked child, its filter


def launched(environ, argv):
    """Whether this process is one a launcher started (`RANK_VARIABLES`), `horovodrun`
    itself, or a child of one of them (`QUIET_START`). Pure."""
    return (
        any(environ.get(v) for v in RANK_VARIABLES)
        or environ.get(QUIET_START) == "1"
        or _is_horovodrun(argv)
    )


def _is_horovodrun(argv):
    return bool(argv) and os.path.basename(argv[0]) == "horovodrun"


def at_start():
    """As Python starts (the `.pth` of `install_pth`): in a launched process, TensorFlow's
    start-up noise left out whatever the script imports first, as after `import hvdtrain`.
    Returns whether it hooked TensorFlow's import."""
    if _STARTED or not launched(os.environ, sys.argv):
        return False
    _STARTED.append(True)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ[QUIET_START] = "1"  # for its children too
    if _is_horovodrun(sys.argv) and noise_unwanted(os.environ):
        # Its build check loads Horovod's library in a forked child, without an import of
        # TensorFlow to hook: that child's file descriptor 2 goes through the filter.
        os.register_at_fork(after_in_child=_filter_for_life)
    return quiet_tensorflow_import()


def _filter_for_life():
    """In a forked child: its file descriptor 2 through the filter until it exits."""
    quiet = _noise_filtered()
    quiet.__enter__()
    _FOR_LIFE.append(quiet)  # held: its exit would put fd 2 back


def pth_text(path=__file__):
    """The `.pth` file's one line, which loads `path` (this file). Pure."""
    code = _PTH_CODE.format(variables=RANK_VARIABLES, quiet=QUIET_START, path=os.path.abspath(path))
    return f"import sys; exec({code!r}, {{}})\n"  # its own namespace, not `site`'s


def install_pth(site_packages=None):
    """Writes `PTH_NAME` into `site_packages` (this environment's by default) unless it is
    there as it should be; the set-up calls it after installing hvdtrain:

        python -c 'from hvdtrain.startup import install_pth; install_pth()'

    Returns its path."""
    site_packages = site_packages or sysconfig.get_paths()["purelib"]
    path = os.path.join(site_packages, PTH_NAME)
    text = pth_text()
    try:
        with open(path) as f:
            if f.read() == text:
                return path
    except OSError:
        pass
    with open(path, "w") as f:
        f.write(text)
    return path


def quiet_tensorflow_import(environ=None, name="tensorflow"):
    """Hooks the import of `name` (TensorFlow) so that its start-up noise is left out;
    nothing when it is imported already or TF_CPP_MIN_LOG_LEVEL is 0. Returns whether it
    hooked."""
    environ = os.environ if environ is None else environ
    if name in sys.modules or not noise_unwanted(environ):
        return False
    if not any(isinstance(f, _QuietFinder) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietFinder(name))
    return True
