"""hvdtrain-run: start a Horovod job on this host, a host list, or a SLURM allocation.

Usage::

    hvdtrain-run [-np N] [-H HOST:SLOTS,... | --hostfile FILE] [--backend B] [...] [--] COMMAND
    hvdtrain-run doctor [-H ... | --hostfile FILE] [--python PYTHON] [--timeout S]
    hvdtrain-run doctor --gpu [-np N] [-H ... | --hostfile FILE]     # on a GPU node
    hvdtrain-run chaos -np N --faults F [--seed S] [--json PATH] -- COMMAND   # see chaos.py
    hvdtrain-run k8s --workers W --gpus-per-worker G [--image IMAGE] [--name NAME] [-- COMMAND]
    hvdtrain-run --elastic [--min-np A] [--max-np B] [--host-discovery-script S | -H ... |
                 --hostfile FILE] [...] -- COMMAND --elastic

One host, two hosts, a hostfile, plain mpirun, a SLURM job, a look before launching::

    hvdtrain-run -np 2 -- python -m hvdtrain.mnist --epochs 1
    hvdtrain-run -H node1:4,node2:4 -- python -m hvdtrain.mnist
    hvdtrain-run --hostfile hosts.txt --backend mpirun -- python -m hvdtrain.mnist
    sbatch launch/hvdtrain.sbatch          # inside: hvdtrain-run -- python -m hvdtrain.mnist
    hvdtrain-run --dry-run -H node1:4,node2:4 -- python -m hvdtrain.mnist
    hvdtrain-run doctor --hostfile hosts.txt
    hvdtrain-run --elastic --min-np 2 --hostfile hosts.txt -- python -m hvdtrain.mnist --elastic

Elastic jobs (`--elastic`, Gloo) go on when workers fail and grow when hosts join; see
`hvdtrain.launcher.elastic` for the discovery script and its defaults.

Hosts: `-H` or `--hostfile` (Open MPI `host slots=N`, MPICH `host:N` or a bare `host`;
see launch/hosts.example); else the SLURM allocation (SLURM_JOB_ID and its node list);
else localhost with `-np` slots. `-np` defaults to all the slots.

Backends: `gloo` (`horovodrun --gloo`; the default for several hosts outside SLURM), `mpi`
(`horovodrun --mpi`; the default on one host when mpirun is installed: shared memory),
`mpirun` (plain Open MPI mpirun with Horovod's settings), `srun` (default inside SLURM;
`srun --mpi=pmix`). horovodrun and mpirun are taken from the launching Python's directory
first (the virtualenv), then PATH; that directory also goes first on the ranks' PATH.

Exit status: the job's own (non-zero when any rank fails); 128+N when it died of signal N;
2 for a mistake in the options, printed as one line; 5 when a host does not answer ssh
before the launch; 255 when one was lost during the job (see `failures`: a rank's failure
gives the launcher HVDTRAIN_LAUNCHER_GRACE_SECONDS, 30, to end before hvdtrain-run ends
it). SIGINT and SIGTERM are forwarded to the job's whole process group; the job's end is
then one line, `hvdtrain-run: received SIGTERM and passed it to the job, which ended`, with
the job's status (a preemption is not a rank's failure). `--dry-run` prints
the command as one shell line and exits 0; values of variables and options that look
secret (*SECRET*, *TOKEN*, *KEY*, *PASSWORD*) are never printed.
"""

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import sys

from hvdtrain.errors import (
    HostUnreachable,
    HvdtrainError,
    exit_with_error,
    invalid_value,
)
from hvdtrain.launcher import chaos, doctor, elastic, failures, gpu, kubernetes
from hvdtrain.launcher.commands import (
    BACKENDS,
    TUNABLES,
    LaunchConfig,
    build_command,
    find_program,
    format_command,
    program_for,
    redact_argv,
    redact_text,
)
from hvdtrain.launcher.hosts import (
    MAX_PROCESSES,
    format_hosts,
    is_local,
    local_hosts,
    parse_hosts_arg,
    read_hostfile,
    this_host_names,
    total_slots,
)
from hvdtrain.launcher.slurm import detect_allocation
from hvdtrain.launcher.supervise import PROG, run_command
from hvdtrain.recipe.flags import ArgumentParser
from hvdtrain.runtime import orphan
from hvdtrain.runtime.numbers import whole_number_type

__all__ = [
    "main",
    "parse_args",
    "make_config",
    "resolve_hosts",
    "prepare",
    "Job",
    "this_host_names",
    "run_command",
    "k8s_main",
]

_INSTALL_HINT = {
    "horovodrun": "install Horovod into this Python's environment (launch/setup_host.sh)",
    "mpirun": "install Open MPI (apt-get install openmpi-bin) or use --backend gloo",
    "srun": "run inside a SLURM allocation (sbatch/salloc) or choose --backend gloo or mpirun",
}


def _Parser(**kwargs):
    kwargs.pop("formatter_class", None)
    return ArgumentParser(training=False, **kwargs)


def _build_parser():
    p = _Parser(
        prog=PROG,
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "-np",
        "--num-proc",
        dest="np",
        metavar="N",
        type=whole_number_type("-np", maximum=MAX_PROCESSES, bound=True),
        help="processes (default: all slots)",
    )
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", dest="hosts", metavar="HOST:SLOTS,...", help="e.g. a:4,b:4")
    hosts.add_argument("--hostfile", "-hostfile", metavar="FILE", help="one host per line")
    p.add_argument(
        "--backend", choices=BACKENDS, help="default: srun in SLURM, mpi on one host, else gloo"
    )
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("-q", "--quiet", action="store_true", help="do not echo the command to stderr")
    tune = p.add_argument_group("Horovod settings (horovodrun flags, or HOROVOD_* variables)")
    tune.add_argument(
        "--fusion-threshold-mb",
        metavar="MB",
        type=whole_number_type("--fusion-threshold-mb", 0),
        help="fusion buffer (default 128)",
    )
    tune.add_argument(
        "--cycle-time-ms",
        metavar="MS",
        help="fusion cycle (default 0.1 under hvdtrain.init with several ranks, else 1)",
    )
    tune.add_argument("--timeline-filename", metavar="FILE", help="write a Horovod timeline")
    tune.add_argument(
        "--stall-check-warning-time-seconds",
        metavar="S",
        type=whole_number_type("--stall-check-warning-time-seconds"),
        help="default 60",
    )
    tune.add_argument(
        "--stall-check-shutdown-time-seconds",
        metavar="S",
        type=whole_number_type("--stall-check-shutdown-time-seconds", 0),
        help="0 is off; default 300 under hvdtrain.init, else Horovod's 0",
    )
    tune.add_argument(
        "--network-interface",
        action="append",
        metavar="NIC",
        help="NIC(s) for Horovod, MPI and NCCL, e.g. eth0 (repeat or comma-separate)",
    )
    net = p.add_argument_group("remote hosts and MPI")
    net.add_argument(
        "--ssh-port",
        metavar="PORT",
        type=whole_number_type("--ssh-port", maximum=65535),
        help="ssh port on every host",
    )
    net.add_argument("--ssh-identity-file", metavar="FILE", help="ssh private key")
    net.add_argument(
        "-x",
        "--env",
        dest="exports",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="set or forward a variable on every rank (repeatable)",
    )
    net.add_argument(
        "--mpi-args",
        metavar="ARGS",
        help='extra mpirun arguments, with =: --mpi-args="--report-bindings"',
    )
    doc = p.add_argument_group("doctor (also `hvdtrain-run doctor ...`)")
    doc.add_argument("--doctor", action="store_true", help="check the hosts instead of launching")
    doc.add_argument(
        "--gpu", action="store_true", help="on a GPU node: driver, pinning, MNIST, NCCL sweep"
    )
    doc.add_argument("--python", metavar="PATH", help="the Python on the hosts (default: this one)")
    doc.add_argument(
        "--timeout", metavar="S", help="seconds per host (default 120); --gpu: per step (900)"
    )
    elastic.add_options(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command every rank runs")
    return p


def _number(args, name, flag, minimum):
    """Option `name` as a finite float >= `minimum`; None when not given. (Whole numbers
    are read by their argparse type: `whole_number_type`.)"""
    text = getattr(args, name)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not minimum <= value < float("inf"):  # not nan, not inf
        raise invalid_value(flag, text, f"a number >= {minimum}, e.g. {flag} {max(minimum, 1)}")
    return value


def parse_args(argv=None):
    """Parses and checks the options (reads nothing but `argv`)."""
    args = _build_parser().parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    args.timeout = _number(args, "timeout", "--timeout", 1)
    args.cycle_time_ms = _number(args, "cycle_time_ms", TUNABLES["cycle_time_ms"].flag, 0.001)
    args.tunables = {}
    for name in (
        "fusion_threshold_mb",
        "cycle_time_ms",
        "stall_check_warning_time_seconds",
        "stall_check_shutdown_time_seconds",
    ):
        if getattr(args, name) is not None:
            args.tunables[name] = getattr(args, name)
    if args.timeline_filename is not None:
        if not args.timeline_filename:
            raise invalid_value("--timeline-filename", "", "a file path")
        args.tunables["timeline_filename"] = args.timeline_filename
    nics = [n.strip() for item in args.network_interface or [] for n in item.split(",")]
    if any(not re.fullmatch(r"[A-Za-z0-9_.:@\-]+", n) for n in nics):
        raise invalid_value("--network-interface", ",".join(nics), "interface names such as eth0")
    args.network_interfaces = tuple(nics)
    exports = []
    for item in args.exports:
        name, sep, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            shown = f"{name}=***" if sep else item  # the value may be a secret
            raise invalid_value("-x", shown, "NAME or NAME=VALUE with NAME a variable name")
        exports.append((name, value if sep else None))
    args.exports = tuple(exports)
    try:
        args.mpi_args = tuple(shlex.split(args.mpi_args or ""))
    except ValueError as e:
        shown = redact_text(args.mpi_args)
        raise invalid_value("--mpi-args", shown, f"shell words ({e})") from None
    return elastic.check_args(args)


def resolve_hosts(args, environ):
    """(hosts, where they came from, the SLURM allocation or None) for `args`."""
    allocation = detect_allocation(environ)
    if args.hosts:
        return parse_hosts_arg(args.hosts), "`-H`", allocation
    if args.hostfile:
        return read_hostfile(args.hostfile), args.hostfile, allocation
    if allocation:
        return allocation.hosts, f"SLURM job {allocation.job_id}", allocation
    return local_hosts(args.np or 1), "localhost", None


def default_backend(hosts, in_allocation, mpirun, own_names=()):
    """The backend when `--backend` is not given (pure): srun inside a SLURM allocation
    (hosts from SLURM); mpi when every host is this one and mpirun is installed (Open MPI
    moves the gradients through shared memory: on one host `python -m hvdtrain.bench`
    measured it 1.2 to 1.4 times faster than Gloo's TCP loopback for the MLP); else gloo."""
    if in_allocation:
        return "srun"
    if mpirun and all(is_local(host.name, own_names) for host in hosts):
        return "mpi"
    return "gloo"


def gloo_on_loopback(config, own_names=()):
    """`config`, and a warning, with `lo` for the interfaces given when Gloo's ranks are all on
    this host (pure): they meet on 127.0.0.1, which horovodrun looked for on the interfaces
    given and, not finding it there, ended in a traceback ("No interface is found for
    address 127.0.0.1")."""
    nics = config.network_interfaces
    if config.backend != "gloo" or not nics or "lo" in nics:
        return config, None
    if not all(is_local(host.name, own_names) for host in config.hosts):
        return config, None
    warning = (
        f"every host is this one: Gloo's ranks meet on its loopback, so --network-interface "
        f"{','.join(nics)} is replaced by lo (name it again for a job across hosts)"
    )
    return dataclasses.replace(config, network_interfaces=("lo",)), warning


def crowding_warning(args, np, environ, cores):
    """A warning when the hosts are this one by default (no -H, --hostfile or SLURM
    allocation) and `np` ranks are more than its `cores` (pure): horovodrun starts them all
    here without a word, and they take turns on the cores."""
    if args.hosts or args.hostfile or args.elastic or detect_allocation(environ):
        return None
    if np <= cores:
        return None
    return (
        f"{np} ranks on the {cores} cores of this host: they take turns on the cores, and a "
        f"step waits for the slowest; -np {cores} gives each its own core, and -H or "
        "--hostfile adds hosts"
    )


def make_config(args, environ):
    """Turns parsed `args` and the environment into a checked `LaunchConfig` (no processes).

    Raises:
        HvdtrainError: no command, -np above the slots, a backend that cannot run here, or
            options that the backend cannot use.
    """
    if not args.command:
        raise HvdtrainError(
            "no command to run; expected e.g. `hvdtrain-run -np 2 -- python -m hvdtrain.mnist`"
        )
    hosts, source, allocation = resolve_hosts(args, environ)
    explicit = bool(args.hosts or args.hostfile)
    slots = total_slots(hosts)
    np = args.np
    if np is None:
        np = allocation.ntasks if allocation and not explicit else slots
    if np > slots:
        raise invalid_value(
            "-np", np, f"at most {slots}, the total slots of {source} ({format_hosts(hosts)})"
        )
    if np > MAX_PROCESSES:
        raise invalid_value(
            "-np", np, f"at most {MAX_PROCESSES} (hvdtrain's bound; {source} has {slots} slots)"
        )
    backend = args.backend or default_backend(
        hosts,
        bool(allocation and not explicit),
        find_program("mpirun", os.path.dirname(sys.executable), environ.get("PATH", "")),
        this_host_names(),
    )
    if backend == "srun":
        if not allocation:
            raise invalid_value(
                "--backend",
                "srun",
                "gloo, mpi or mpirun outside a SLURM allocation (SLURM_JOB_ID and "
                "SLURM_JOB_NODELIST are not set); run inside sbatch or salloc",
            )
        if explicit:
            raise invalid_value(
                "--backend", "srun", "no -H/--hostfile (srun places tasks on the allocation)"
            )
        for flag, value in (
            ("--ssh-port", args.ssh_port),
            ("--ssh-identity-file", args.ssh_identity_file),
        ):
            if value:
                raise invalid_value(flag, value, "nothing with --backend srun, which uses no ssh")
    if args.mpi_args and backend not in ("mpi", "mpirun"):
        shown = shlex.join(redact_argv(args.mpi_args))
        raise invalid_value("--mpi-args", shown, "--backend mpi or mpirun")
    for name, value in args.exports:
        if value is None and name not in environ:
            raise invalid_value("-x", name, f"a variable set here, or {name}=VALUE")
    return LaunchConfig(
        backend=backend,
        np=np,
        hosts=tuple(hosts),
        command=tuple(args.command),
        tunables=dict(args.tunables),
        network_interfaces=args.network_interfaces,
        ssh_port=args.ssh_port,
        ssh_identity_file=args.ssh_identity_file,
        exports=args.exports,
        mpi_args=args.mpi_args,
    )


@dataclasses.dataclass(frozen=True)
class Job:
    """A launch checked and built (`prepare`): the command, and what watches it.

    Args:
        argv: the launcher's command (horovodrun, mpirun, srun).
        env: the launcher's whole environment.
        line: the command as one shell line, secrets masked (`format_command`).
        hosts: the host of each rank ([] under srun, where SLURM places them).
        grace: seconds the launcher has to end after a rank's end (`failures`).
        probe: `() -> {host: why}` for the other hosts that no longer answer, or None.
        elastic: the `elastic.ElasticSpec` of an elastic job, or None.
        warnings: lines to print before the job starts, unless quiet.
        remote: the hosts other than this one, each once.
    """

    argv: list
    env: dict
    line: str
    hosts: list
    grace: float
    probe: object = None
    elastic: object = None
    warnings: tuple = ()
    remote: tuple = ()


def prepare(args, environ, dry_run=False):
    """The `Job` that runs `args` (parsed, `parse_args`) from `environ`: the config checked,
    the launcher found, the other hosts reached over ssh and the program found where the
    ranks look for it (not for a `dry_run`). Starts nothing."""
    grace = failures.launcher_grace_seconds(environ)
    spec, warnings = None, []
    if args.elastic:  # horovodrun --gloo with a discovery script: hvdtrain.launcher.elastic
        config, spec = elastic.make_config(args, environ, make_config, resolve_hosts)
    else:
        config, loopback = gloo_on_loopback(make_config(args, environ), this_host_names())
        warnings += [loopback] if loopback else []
    bindir = os.path.dirname(sys.executable)
    name = program_for(config.backend)
    program = find_program(name, bindir, environ.get("PATH", ""))
    if program is None and not dry_run:
        raise HvdtrainError(f"{name} not found in {bindir} or on PATH; {_INSTALL_HINT[name]}")
    if spec:
        argv, env = elastic.build_command(config, spec, environ, bindir, program or name)
        warnings += spec.warnings
    else:
        argv, env = build_command(config, environ, os.geteuid(), bindir, program or name)
    line = format_command(argv, env, environ)
    hosts = failures.rank_hosts(config.hosts, config.np) if config.backend != "srun" else []
    remote = _remote_hosts(config) if config.backend != "srun" else []
    if not dry_run and not spec and remote:
        _check_reachable(config, remote, hosts)
    if not dry_run and not spec and not remote and config.backend != "srun":
        _check_program(config.command[0], {**environ, **env}.get("PATH", ""))
    if not dry_run:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        crowded = crowding_warning(args, config.np, environ, cores or os.cpu_count() or 1)
        warnings += [crowded] if crowded else []
    env = {**env, orphan.LAUNCHER_ENV: orphan.identity()}  # its ranks end when it is gone
    probe = None
    if remote and not spec:

        def probe():
            return doctor.unreachable(remote, config.ssh_port, config.ssh_identity_file, 15)

    return Job(
        argv, {**environ, **env}, line, hosts, grace, probe, spec, tuple(warnings), tuple(remote)
    )


def _launch(args):
    job = prepare(args, dict(os.environ), dry_run=args.dry_run)
    for warning in job.warnings if not args.quiet else ():
        print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    if args.dry_run:
        print(job.line, flush=True)
        return 0
    if not args.quiet:
        print(f"{PROG}: {job.line}", file=sys.stderr, flush=True)
    if job.elastic:  # a rank that ends is replaced; Horovod's driver decides
        return run_command(job.argv, job.env, job.hosts, elastic_spec=job.elastic)
    return run_command(job.argv, job.env, job.hosts, job.grace, job.probe)


def _remote_hosts(config):
    """The hosts of `config` other than this one, each once."""
    own = this_host_names()
    return list(dict.fromkeys(h.name for h in config.hosts if not is_local(h.name, own)))


def _check_reachable(config, remote, rank_hosts):
    """Every other host (`remote`) answers `ssh host true` before anything is launched
    (horovodrun and mpirun would otherwise fail with a traceback or a page of text)."""
    down = doctor.unreachable(remote, config.ssh_port, config.ssh_identity_file)
    if down:
        parts = [
            f"{host} ({failures.ranks_on(host, rank_hosts)}): {why}" for host, why in down.items()
        ]
        raise HostUnreachable(
            f"cannot reach {'; '.join(parts)}; nothing was started. Bring the host back or "
            "leave it out of the hosts, and check them with `hvdtrain-run doctor`"
        )


def _check_program(program, path):
    """`program` is on `path`, the PATH the ranks get (the launching Python's bin first), on
    this host where every rank runs: mpirun would print a page and exit 134 for one that is
    not, Gloo's ranks exit 127."""
    if shutil.which(program, path=path) is None:
        raise invalid_value("command", program, "a program on PATH, or a path to one, on this host")


def _doctor(args):
    if args.command:
        raise HvdtrainError(
            f"doctor takes no command (received {shlex.join(redact_argv(args.command))!r}); "
            "expected e.g. `hvdtrain-run doctor --hostfile hosts.txt`"
        )
    if args.gpu:
        return _gpu_check(args)
    hosts, _, _ = resolve_hosts(args, os.environ)
    return doctor.run_doctor(
        hosts,
        python=args.python or sys.executable,
        launch_python=sys.executable,
        own_names=this_host_names(),
        ssh_port=args.ssh_port,
        ssh_identity_file=args.ssh_identity_file,
        timeout=args.timeout or 120,
    )


def _gpu_check(args):
    """`hvdtrain-run doctor --gpu [-np N] [-H ... | --hostfile F] [--backend B] [-x ...]`."""
    launch = [sys.executable, "-m", "hvdtrain.launcher.cli"]
    hosts = 0
    if args.hosts or args.hostfile:
        found, _, _ = resolve_hosts(args, os.environ)  # checked here, one line if wrong
        hosts = len(found)
        launch += ["-H", args.hosts] if args.hosts else ["--hostfile", args.hostfile]
    if args.backend:
        launch += ["--backend", args.backend]
    for name in args.exports:
        launch += ["-x", name]
    for nic in args.network_interface or []:
        launch += ["--network-interface", nic]
    for flag in ("ssh_port", "ssh_identity_file"):
        if getattr(args, flag):
            launch += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    return gpu.run_gpu_check(launch, hosts, args.np, args.python, args.timeout or 900)


def k8s_main(argv):
    """`hvdtrain-run k8s ...`: prints the MPIJob YAML (see `hvdtrain.launcher.kubernetes`)."""
    p = _Parser(
        prog=f"{PROG} k8s",
        description=kubernetes.__doc__.split("\n")[0],
        epilog=kubernetes.__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--workers", required=True, metavar="W", help="worker pods")
    p.add_argument("--gpus-per-worker", required=True, metavar="G", help="GPUs (ranks) per pod")
    p.add_argument("--image", default=kubernetes.DEFAULT_IMAGE, help="default hvdtrain:latest")
    p.add_argument("--name", default="hvdtrain", help="the MPIJob's name (default hvdtrain)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="default: python -m hvdtrain.mnist")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    text = kubernetes.render_mpijob(
        args.workers, args.gpus_per_worker, args.image, command or None, args.name
    )
    sys.stdout.write(text)
    return 0


def main(argv=None):
    """`hvdtrain-run`: parse -> config -> build -> run; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["k8s"]:
            return k8s_main(argv[1:])
        if argv[:1] == ["chaos"]:  # see hvdtrain.launcher.chaos
            return chaos.main(argv[1:])
        if argv[:1] == ["doctor"]:
            args = parse_args(argv[1:])
            args.doctor = True
        else:
            args = parse_args(argv)
        if args.doctor:
            return _doctor(args)
        return _launch(args)
    except HvdtrainError as e:
        exit_with_error(PROG, e)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
