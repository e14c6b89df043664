"""TensorFlow's start-up noise, left out when TensorFlow is imported after hvdtrain.

On CPUs where TensorFlow turns oneDNN on (AVX512_VNNI, AVX512_BF16, AMX: most current
servers), TensorFlow 2.21 logs, twice per process, while it loads and before its log level
applies, so whatever TF_CPP_MIN_LOG_LEVEL says::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:1795511589.155556   31604 port.cc:153] oneDNN custom operations are on. ...

that is eight lines on two ranks, from every rank. `import hvdtrain` (standard library only)
puts a hook on the import of `tensorflow` (`quiet_tensorflow_import`): that import runs with
file descriptor 2 passed through a pipe whose lines go on to stderr as they come, but those
two kinds (`is_startup_noise`). Everything else is kept, and nothing is hooked when
TF_CPP_MIN_LOG_LEVEL is 0 (the user asked for TensorFlow's INFO lines). A script that imports
TensorFlow before hvdtrain still gets the lines: TensorFlow prints them before any of our
code runs (`TF_ENABLE_ONEDNN_OPTS=0` silences them, by turning oneDNN off).
"""

import contextlib
import importlib.abc
import importlib.util
import os
import re
import sys
import threading

__all__ = ["is_startup_noise", "quiet_tensorflow_import", "startup_noise_filtered"]

_NOISE = re.compile(
    r"(\[[\d,]+\]<stderr>:)?"  # as horovodrun and mpirun --tag-output forward a rank's line
    r"(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:.]+ +\d+ port\.cc:\d+\] oneDNN custom operations are on\. .*)\s*$"
)


def is_startup_noise(line):
    """Whether `line` is one of the lines TensorFlow logs while it loads (see the module
    doc), also as a launcher forwards it (`[1]<stderr>:...`). Pure."""
    return bool(_NOISE.match(line))


@contextlib.contextmanager
def startup_noise_filtered():
    """File descriptor 2 (stderr, also C++'s) passes through a pipe for the duration; its
    lines go on to the real stderr as they come, but `is_startup_noise` ones."""
    sys.stderr.flush()
    real = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def forward():
        with os.fdopen(read, "rb") as pipe:
            for line in pipe:
                if not is_startup_noise(line.decode("utf-8", "replace")):
                    os.write(real, line)

    thread = threading.Thread(target=forward, name="hvdtrain-startup-noise", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)  # closes the pipe's write end: the thread reads to its end
        thread.join(timeout=10)
        if not thread.is_alive():  # else a child kept the pipe open: `real` stays, for it
            os.close(real)


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        try:
            with startup_noise_filtered():
                self.loader.exec_module(module)
        finally:  # the module keeps its own loader (resources, reloads)
            module.__loader__ = module.__spec__.loader = self.loader


class _QuietFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once, and so that the search below is the usual one
        spec = importlib.util.find_spec(fullname)
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _QuietLoader(spec.loader)
        return spec


def quiet_tensorflow_import(environ=None, name="tensorflow"):
    """Hooks the first import of `name` (TensorFlow) so that its start-up noise is left out;
    nothing when it is imported already or TF_CPP_MIN_LOG_LEVEL is 0. Returns whether it
    hooked."""
    environ = os.environ if environ is None else environ
    if name in sys.modules or environ.get("TF_CPP_MIN_LOG_LEVEL", "0").strip() in ("", "0"):
        return False
    if not any(isinstance(f, _QuietFinder) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietFinder(name))
    return True
