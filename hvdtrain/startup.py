"""TensorFlow's start-up noise, left out when TensorFlow is imported after hvdtrain.

On CPUs where TensorFlow turns oneDNN on (AVX512_VNNI, AVX512_BF16, AMX: most current
servers), TensorFlow 2.21 logs, twice per process, while it loads and before its log level
applies, so whatever TF_CPP_MIN_LOG_LEVEL says::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:1795511589.155556   31604 port.cc:153] oneDNN custom operations are on. ...

that is eight lines on two ranks, from every rank. `import hvdtrain` (standard library only)
puts a hook on the import of `tensorflow` in its own process (`quiet_tensorflow_import`):
that import runs with file descriptor 2 going through a small filter process, which passes
every line on to stderr as it comes but those two kinds (`is_startup_noise`). The filter
outlives a process that dies while importing (TensorFlow aborting on a CPU it cannot use),
so no line is lost. Nothing is filtered when TF_CPP_MIN_LOG_LEVEL is 0 (TensorFlow's INFO
lines were asked for) or when the filter cannot start.

A script that imports TensorFlow before hvdtrain prints the lines before any of our code
runs; `hvdtrain-run` leaves them out of what the launcher prints (`OutputFilter` in
`hvdtrain.launcher.failures`); under plain launchers `TF_ENABLE_ONEDNN_OPTS=0` quiets them
(docs/getting-started.md). Nothing of hvdtrain runs in a process that does not import it.
"""

import contextlib
import importlib.abc
import importlib.util
import os
import re
import subprocess
import sys

__all__ = ["is_startup_noise", "noise_unwanted", "quiet_tensorflow_import"]

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
