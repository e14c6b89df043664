"""Pure command builders: a `LaunchConfig` -> the argv and environment that run the job.

One config, four launchers (uid 0 adds `--allow-run-as-root` to plain mpirun)::

    hvdtrain-run -np 4 -H a:2,b:2 --backend gloo   -- python -m hvdtrain.mnist
      -> horovodrun --gloo -np 4 -H a:2,b:2 python -m hvdtrain.mnist
    hvdtrain-run -np 4 -H a:2,b:2 --backend mpi    -- python -m hvdtrain.mnist
      -> horovodrun --mpi -np 4 -H a:2,b:2 python -m hvdtrain.mnist
    hvdtrain-run -np 4 -H a:2,b:2 --backend mpirun -- python -m hvdtrain.mnist
      -> mpirun -np 4 -H a:2,b:2 --bind-to none --map-by slot --tag-output
         -mca pml ob1 -mca btl ^openib -x PATH -x LD_LIBRARY_PATH ... python -m hvdtrain.mnist
    hvdtrain-run --backend srun -- python -m hvdtrain.mnist     # inside sbatch/salloc
      -> srun --mpi=pmix -n 4 --kill-on-bad-exit=1 python -m hvdtrain.mnist

Plain mpirun gets what `horovodrun --mpi` would give it: no process binding (Horovod pins
one GPU per local rank itself), slots filled host by host, Open MPI's TCP/shared-memory
transports (`-mca pml ob1 -mca btl ^openib`; pass `--mpi-args` for UCX/InfiniBand), and
`-x NAME` for every variable the ranks need that is set here: PATH, LD_LIBRARY_PATH,
PYTHONPATH, VIRTUAL_ENV, PYTHONUNBUFFERED and all HOROVOD_*, HVDTRAIN_*, NCCL_*, TF_*
(never Horovod's private `_HOROVOD_SECRET_KEY`). Horovod tunables become horovodrun flags
or HOROVOD_* variables (`TUNABLES`). Every backend sets `TF_CPP_MIN_LOG_LEVEL=2` for the
ranks unless the environment sets it (`RANK_ENV`: TensorFlow's start-up lines off), and with
TensorFlow >= 2.16 `TF_USE_LEGACY_KERAS=1` (`KERAS2_ENV`: Keras 2 for tf.keras); plain
mpirun gets them as `-x`, since across hosts it forwards nothing else.

The directory of the launching Python (the virtualenv's bin) is put first on PATH, so
`python` in the command is the launcher's Python on every rank, as after `source activate`.

`format_command` prints a command as one shell line with secrets replaced by `***`: values
of variables or options named like *SECRET*, *TOKEN*, *KEY*, *PASSWORD*, and under any name
the password of a URL and tokens of well-known shapes (`mask_secrets`).
"""

import os
import re
import shlex
import shutil
from dataclasses import dataclass, field

from hvdtrain.errors import HvdtrainError
from hvdtrain.launcher.hosts import format_hosts
from hvdtrain.runtime.compat import legacy_keras_needed, tensorflow_version

__all__ = [
    "BACKENDS",
    "RANK_ENV",
    "TUNABLES",
    "EXPORTED_NAMES",
    "EXPORTED_PREFIXES",
    "Tunable",
    "LaunchConfig",
    "build_command",
    "horovodrun_command",
    "mpirun_command",
    "srun_command",
    "program_for",
    "find_program",
    "path_with",
    "exported_names",
    "is_secret",
    "redact_argv",
    "redact_text",
    "mask_secrets",
    "format_command",
]

BACKENDS = ("gloo", "mpi", "mpirun", "srun")
# What every rank needs whatever the user's environment says (`LaunchConfig.keras2`): Keras 2
# for tf.keras from TensorFlow 2.16 on (Horovod has no Keras 3 path; see `hvdtrain.runtime.compat`).
# A value the user set wins, so that a wrong one fails with hvdtrain's clear error.
KERAS2_ENV = {"TF_USE_LEGACY_KERAS": "1"}
# What every rank gets unless the environment sets it: TensorFlow's INFO and WARNING lines
# off (set TF_CPP_MIN_LOG_LEVEL=0 to see them); its errors still show.
RANK_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
EXPORTED_NAMES = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONUNBUFFERED")
EXPORTED_PREFIXES = ("HOROVOD_", "HVDTRAIN_", "NCCL_", "TF_")
_SECRET = re.compile(r"SECRET|TOKEN|KEY|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
_NAME = re.compile(r"-{0,2}[A-Za-z_][A-Za-z0-9_.\-]*")
_MASK = "***"
_SECRET_WORD = re.compile(rf"(\S*(?:{_SECRET.pattern})\S*?)(=|\s+)(\S+)", re.IGNORECASE)
# Secrets whatever the variable's name: the password of a URL (`https://user:pw@host`), and
# tokens of well-known shapes (GitHub, GitLab, Slack, AWS access keys, Hugging Face, OpenAI-
# style `sk-`, Google API keys, JWTs).
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]*:)[^/\s@]+@")
_TOKEN = re.compile(
    r"\b(?:gh[oprsu]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_\-]{20,}"
    r"|xox[abposr]-[A-Za-z0-9\-]{10,}|A[KS]IA[0-9A-Z]{16}|hf_[A-Za-z0-9]{30,}"
    r"|sk-[A-Za-z0-9_\-]{20,}|AIza[0-9A-Za-z_\-]{35}"
    r"|eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,})"
)


@dataclass(frozen=True)
class Tunable:
    """A Horovod setting: the horovodrun flag, the variable Horovod reads, the conversion."""

    flag: str
    env: str
    to_env: object = str


TUNABLES = {
    "fusion_threshold_mb": Tunable(
        "--fusion-threshold-mb", "HOROVOD_FUSION_THRESHOLD", lambda mb: str(mb * 1024 * 1024)
    ),
    "cycle_time_ms": Tunable("--cycle-time-ms", "HOROVOD_CYCLE_TIME", lambda ms: f"{ms:g}"),
    "timeline_filename": Tunable("--timeline-filename", "HOROVOD_TIMELINE"),
    "stall_check_warning_time_seconds": Tunable(
        "--stall-check-warning-time-seconds", "HOROVOD_STALL_CHECK_TIME_SECONDS"
    ),
    "stall_check_shutdown_time_seconds": Tunable(
        "--stall-check-shutdown-time-seconds", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
    ),
}


@dataclass(frozen=True)
class LaunchConfig:
    """Everything a launch needs, already checked (see `hvdtrain.launcher.cli.make_config`).

    Args:
        backend: one of `BACKENDS`.
        np: the number of processes.
        hosts: a sequence of `Host`; ignored by srun (SLURM places the tasks).
        command: the user's command, e.g. ("python", "-m", "hvdtrain.mnist").
        tunables: {name in `TUNABLES`: value}, only those given.
        network_interfaces: NICs for Horovod, MPI and NCCL traffic, e.g. ("eth0",).
        ssh_port, ssh_identity_file: how horovodrun/mpirun reach the other hosts.
        exports: (name, value or None) pairs to set on every rank; None forwards the
            launcher's own value.
        mpi_args: extra mpirun arguments, already split (backends mpi and mpirun).
        keras2: set `RANK_ENV` on every rank (TensorFlow >= 2.16; on 2.15 it would break
            tf.keras); by default from the local TensorFlow's version (package metadata).
    """

    backend: str
    np: int
    hosts: tuple
    command: tuple
    tunables: dict = field(default_factory=dict)
    network_interfaces: tuple = ()
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    exports: tuple = ()
    mpi_args: tuple = ()
    keras2: bool = field(default_factory=lambda: legacy_keras_needed(tensorflow_version()))


def program_for(backend):
    """The program a backend runs: horovodrun, mpirun or srun."""
    return {"gloo": "horovodrun", "mpi": "horovodrun", "mpirun": "mpirun", "srun": "srun"}[backend]


def find_program(name, bindir, path):
    """`bindir/name` when it is executable (the virtualenv's own horovodrun), else the first
    `name` on `path` (a PATH string), else None."""
    candidate = os.path.join(bindir, name) if bindir else None
    if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
        return candidate
    return shutil.which(name, path=path)


def path_with(bindir, path):
    """PATH with `bindir` first, or None when it is first already (nothing to change)."""
    entries = path.split(os.pathsep) if path else []
    if not bindir or (entries and entries[0] == bindir):
        return None
    return os.pathsep.join([bindir, *entries])


def exported_names(environ):
    """The variables, set in `environ`, that plain mpirun forwards with `-x NAME`."""
    return sorted(
        name for name in environ if name in EXPORTED_NAMES or name.startswith(EXPORTED_PREFIXES)
    )


def _tunables(config):
    """The given tunables as (name, value), always in `TUNABLES` order."""
    return [(name, config.tunables[name]) for name in TUNABLES if name in config.tunables]


def _word(value):
    """A flag's value as text: 2.5 -> '2.5', 5.0 -> '5', 64 -> '64'."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def _tunable_env(config):
    return {TUNABLES[name].env: TUNABLES[name].to_env(value) for name, value in _tunables(config)}


def _exports_env(config):
    """The values `-x NAME=VALUE` options set; `-x NAME` needs nothing (inherited)."""
    return {name: value for name, value in config.exports if value is not None}


def _rank_env(config, environ):
    """`RANK_ENV`'s variables, and `KERAS2_ENV`'s with `keras2`, that `environ` does not set."""
    wanted = {**RANK_ENV, **(KERAS2_ENV if config.keras2 else {})}
    return {name: value for name, value in wanted.items() if name not in environ}


def horovodrun_command(config, environ, bindir="", program="horovodrun"):
    """`horovodrun --gloo|--mpi -np N -H hosts [tunables] command`, and its environment."""
    argv = [program, f"--{config.backend}", "-np", str(config.np), "-H", format_hosts(config.hosts)]
    for name, value in _tunables(config):
        argv += [TUNABLES[name].flag, _word(value)]
    if config.network_interfaces:
        argv += ["--network-interfaces", ",".join(config.network_interfaces)]
    if config.ssh_port:
        argv += ["-p", str(config.ssh_port)]
    if config.ssh_identity_file:
        argv += ["-i", config.ssh_identity_file]
    if config.mpi_args:
        argv.append("--mpi-args=" + shlex.join(config.mpi_args))
    env = {**_rank_env(config, environ), **_exports_env(config)}  # horovodrun passes its env on
    path = path_with(bindir, environ.get("PATH", ""))
    if path:
        env["PATH"] = path
    return argv + list(config.command), env


def mpirun_command(config, environ, uid, bindir="", program="mpirun"):
    """Plain Open MPI `mpirun` with Horovod's settings passed as `-x` variables.

    Args:
        uid: the effective user id; 0 (root) adds `--allow-run-as-root`, which Open MPI
            refuses to run without, and nothing else does.
    """
    argv = [program]
    if uid == 0:
        argv.append("--allow-run-as-root")
    argv += ["-np", str(config.np), "-H", format_hosts(config.hosts)]
    argv += ["--bind-to", "none", "--map-by", "slot", "--tag-output"]
    argv += ["-mca", "pml", "ob1", "-mca", "btl", "^openib"]
    if config.network_interfaces:
        nics = ",".join(config.network_interfaces)
        argv += ["-mca", "btl_tcp_if_include", nics, "-mca", "oob_tcp_if_include", nics]
    ssh = []
    if config.ssh_port:
        ssh += ["-p", str(config.ssh_port)]
    if config.ssh_identity_file:
        ssh += ["-i", config.ssh_identity_file]
    if ssh:
        argv += ["-mca", "plm_rsh_args", shlex.join(ssh)]

    env = {}
    path = path_with(bindir, environ.get("PATH", ""))
    if path:
        env["PATH"] = path
    set_here = {**_rank_env(config, environ), **_tunable_env(config)}
    if config.network_interfaces:
        set_here["NCCL_SOCKET_IFNAME"] = ",".join(config.network_interfaces)
    set_here.update(_exports_env(config))
    for name, value in set_here.items():
        argv += ["-x", f"{name}={value}"]
    forwarded = set(exported_names({**environ, **env}))
    forwarded |= {name for name, value in config.exports if value is None and name in environ}
    for name in sorted(forwarded - set(set_here)):
        argv += ["-x", name]
    argv += list(config.mpi_args)
    return argv + list(config.command), env


def srun_command(config, environ, bindir="", program="srun"):
    """`srun --mpi=pmix -n N --kill-on-bad-exit=1 command` inside a SLURM allocation.

    srun hands the whole environment to the tasks, so tunables travel as variables.
    `--kill-on-bad-exit=1` ends every task as soon as one fails, so a crash cannot leave
    the others waiting for it forever.
    """
    argv = [program, "--mpi=pmix", "-n", str(config.np), "--kill-on-bad-exit=1"]
    env = {**_rank_env(config, environ), **_tunable_env(config)}
    if config.network_interfaces:
        nics = ",".join(config.network_interfaces)
        env.update(NCCL_SOCKET_IFNAME=nics, OMPI_MCA_btl_tcp_if_include=nics)
    env.update(_exports_env(config))
    path = path_with(bindir, environ.get("PATH", ""))
    if path:
        env["PATH"] = path
    return argv + list(config.command), env


def build_command(config, environ, uid, bindir="", program=None):
    """The (argv, env) that run `config`: pure, so every backend is tested without processes.

    Args:
        config: a `LaunchConfig`.
        environ: the launcher's environment (a mapping; read, never changed).
        uid: the effective user id (see `mpirun_command`).
        bindir: the launching Python's directory, put first on PATH ("" leaves PATH alone).
        program: the launcher program's path (see `find_program`); default its bare name.

    Returns:
        (argv, env): the command as a list, and the variables to set on top of `environ`.
    """
    if config.backend not in COMMANDS:
        raise HvdtrainError(f"unknown backend {config.backend!r}; expected one of {BACKENDS}")
    program = program or program_for(config.backend)
    return COMMANDS[config.backend](config, environ, uid, bindir, program)


# Each backend's command builder, `(config, environ, uid, bindir, program) -> (argv, env)`: a
# new backend is one builder above and one line here (and its program in `program_for`).
COMMANDS = {
    "gloo": lambda c, environ, uid, bindir, program: horovodrun_command(
        c, environ, bindir, program
    ),
    "mpi": lambda c, environ, uid, bindir, program: horovodrun_command(c, environ, bindir, program),
    "mpirun": mpirun_command,
    "srun": lambda c, environ, uid, bindir, program: srun_command(c, environ, bindir, program),
}


def is_secret(name):
    """True for names that look like they hold a secret (HOROVOD_SECRET_KEY, --api-token)."""
    return bool(_SECRET.search(name))


def mask_secrets(text):
    """`text` with URL passwords and well-known token shapes masked, whatever names them:
    `https://u:pw@host` -> `https://u:***@host`, `ghp_...` -> `***`. Pure."""
    return _TOKEN.sub(_MASK, _URL_PASSWORD.sub(rf"\g<1>{_MASK}@", text))


def redact_argv(argv):
    """`argv` with secret values replaced: `NAME=value` and `--opt=value` when the name
    looks secret, the word after a secret-looking option (`--password hunter2`), and URL
    passwords and token shapes anywhere (`mask_secrets`)."""
    out, hide_next = [], False
    for arg in map(mask_secrets, argv):
        if hide_next:
            out.append(_MASK)
            hide_next = False
            continue
        name, sep, value = arg.partition("=")
        if sep and _NAME.fullmatch(name) and is_secret(name):
            out.append(f"{name}={_MASK}")
        elif sep and name.startswith("-") and any(c.isspace() for c in value):
            out.append(f"{name}={redact_text(value)}")  # --mpi-args="--password x"
        elif arg.startswith("-") and not sep and is_secret(arg):
            out.append(arg)
            hide_next = True
        else:
            out.append(arg)
    return out


def redact_text(text):
    """`text` (shell words, perhaps unbalanced) with the word after or in each secret-looking
    name masked: `--password x --token=y` -> `--password *** --token=***`."""
    text = mask_secrets(text)
    try:
        words = shlex.split(text)
        masked = redact_argv(words)
        return text if masked == words else shlex.join(masked)
    except ValueError:  # an unclosed quote: mask by pattern
        return _SECRET_WORD.sub(lambda m: f"{m.group(1)}{m.group(2)}{_MASK}", text)


def format_command(argv, env=None, environ=None):
    """One shell line: `NAME=value ... argv`, quoted, with secrets masked.

    A PATH that only puts a directory in front of `environ`'s PATH prints as
    `PATH=/venv/bin:"$PATH"` rather than in full.
    """
    words = []
    for name, value in (env or {}).items():
        old = (environ or {}).get(name)
        if is_secret(name):
            words.append(f"{name}={shlex.quote(_MASK)}")
        elif old and value.endswith(os.pathsep + old):
            head = value[: -len(old)]
            words.append(f'{name}={shlex.quote(head)}"${name}"')
        else:
            words.append(f"{name}={shlex.quote(mask_secrets(value))}")
    return " ".join(words + [shlex.quote(arg) for arg in redact_argv(argv)])
