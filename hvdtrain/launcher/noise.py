"""TensorFlow's start-up lines, which `hvdtrain-run` leaves out of what the ranks print.

On CPUs where TensorFlow turns oneDNN on (AVX512_VNNI, AVX512_BF16, AMX: most current
servers), TensorFlow 2.21 logs, twice per process, while it loads and before its log level
applies, so whatever TF_CPP_MIN_LOG_LEVEL says::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:1795511589.155556   31604 port.cc:153] oneDNN custom operations are on. ...

`hvdtrain-run` drops those lines from the ranks' output (`OutputFilter` in
`hvdtrain.launcher.failures`) unless TF_CPP_MIN_LOG_LEVEL is 0; under other launchers
`TF_ENABLE_ONEDNN_OPTS=0` quiets them (docs/getting-started.md). Pure functions: nothing of
hvdtrain touches a rank's file descriptors.
"""

import re

__all__ = ["is_startup_noise", "noise_unwanted"]

_NOISE = re.compile(
    r"(\[[\d,]+\]<stderr>:)?"  # as horovodrun and mpirun --tag-output forward a rank's line
    r"(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:.]+ +\d+ port\.cc:\d+\] oneDNN custom operations are on\. .*)\s*$"
)


def is_startup_noise(line):
    """Whether `line` is one of the lines TensorFlow logs while it loads (see the module
    doc), also as a launcher forwards it (`[1]<stderr>:...`)."""
    return bool(_NOISE.match(line))


def noise_unwanted(environ):
    """Whether `environ` leaves the noise out: TF_CPP_MIN_LOG_LEVEL is set and not 0."""
    return environ.get("TF_CPP_MIN_LOG_LEVEL", "0").strip() not in ("", "0")
