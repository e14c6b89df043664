"""`hvdtrain-run --elastic`: Horovod Elastic jobs, which go on when workers fail and grow when
hosts join (`horovodrun --gloo --min-np --max-np --host-discovery-script`; Gloo only).

The command every rank runs must train under `hvd.elastic.run` (`python -m hvdtrain.mnist
--elastic`, see `hvdtrain.recipe.elastic`). The hosts come from a discovery script, which prints the
hosts available now, one `host:slots` per line; Horovod runs it every second::

    hvdtrain-run --elastic --min-np 1 --max-np 4 --host-discovery-script ./discover.sh \\
        --network-interface eth0 -- python -m hvdtrain.mnist --elastic
      -> horovodrun --gloo -np 1 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh
         --network-interfaces eth0 python -m hvdtrain.mnist --elastic

Without a script, `hvdtrain-run` writes the discovery command for you (no file is written):

* `--hostfile FILE` -> `python -m hvdtrain.launcher.elastic --hostfile /abs/FILE`, which
  prints the hostfile's hosts (every dialect `hvdtrain-run` reads) each time Horovod asks:
  edit the file to add or remove hosts while the job runs.
* `-H a:4,b:4`, a SLURM allocation, or nothing (this host, `--max-np` slots) ->
  `printf '%s\\n' a:4 b:4`: a fixed set of hosts, for fault tolerance only.

`-np` is the number of workers the job waits for before it starts (default: `--min-np`);
Horovod then starts as many as there are slots, up to `--max-np` (default: all the slots of
the given hosts; no limit with a script). `--min-np` defaults to 1.

Horovod 0.28.1 facts these choices follow (horovod/runner/elastic/):

* A worker that exits non-zero blacklists its whole host for the rest of the job (or for
  `--blacklist-cooldown-range MIN MAX` seconds). When every worker was on that one host, the
  job ends ("blacklisted slots count == N -> stop running"): on one host an elastic job can
  grow but not survive a failure. `hvdtrain-run` warns about it.
* The driver waits for two hosts at start to find a network interface they share, unless
  `--network-interface` is given. When every host given is this one, `hvdtrain-run` passes
  `lo`; with one other host it asks for the interface instead of letting the job wait for
  `--elastic-timeout` (600 s) and fail.
"""

import argparse
import os
import shlex
import sys
from dataclasses import dataclass, replace

from hvdtrain.errors import HvdtrainError, invalid_value
from hvdtrain.launcher.commands import horovodrun_command
from hvdtrain.launcher.hosts import (
    MAX_PROCESSES,
    format_hosts,
    is_local,
    local_hosts,
    read_hostfile,
    total_slots,
)
from hvdtrain.runtime.numbers import whole_number

__all__ = [
    "ElasticSpec",
    "add_options",
    "check_args",
    "discovery_command",
    "elastic_flags",
    "make_config",
    "build_command",
    "main",
]

_OPTIONS = (
    "min_np",
    "max_np",
    "host_discovery_script",
    "elastic_timeout",
    "reset_limit",
    "blacklist_cooldown_range",
)


@dataclass(frozen=True)
class ElasticSpec:
    """The elastic part of a launch (see `make_config`).

    Args:
        min_np: the fewest workers the job trains with.
        max_np: the most it starts; None for no limit.
        discovery: the discovery script or command (run by a shell every second).
        elastic_timeout: seconds to wait for `min_np` slots after a change (Horovod: 600).
        reset_limit: end the job after this many resets; None for no limit.
        cooldown_range: (min, max) seconds a failed host stays blacklisted; None: forever.
        warnings: lines to print before launching.
    """

    min_np: int
    max_np: int | None
    discovery: str
    elastic_timeout: int | None = None
    reset_limit: int | None = None
    cooldown_range: tuple | None = None
    warnings: tuple = ()


def add_options(parser):
    """Adds the elastic options to the `hvdtrain-run` parser."""
    g = parser.add_argument_group("elastic training (Gloo; the command must use --elastic too)")
    g.add_argument(
        "--elastic", action="store_true", help="survive failed workers, take in new hosts"
    )
    g.add_argument("--min-np", metavar="N", help="the fewest workers to train with (default 1)")
    g.add_argument("--max-np", metavar="N", help="the most workers (default: all slots)")
    g.add_argument(
        "--host-discovery-script",
        metavar="SCRIPT",
        help="prints the available host:slots lines (default: from -H/--hostfile)",
    )
    g.add_argument("--elastic-timeout", metavar="S", help="wait for --min-np slots (600)")
    g.add_argument("--reset-limit", metavar="N", help="end the job after N resets")
    g.add_argument(
        "--blacklist-cooldown-range",
        nargs=2,
        metavar=("MIN", "MAX"),
        help="seconds a failed host stays out (default: for good)",
    )


def _count(value, flag, minimum=1):
    if value is None:
        return None
    return whole_number(value, flag, minimum, MAX_PROCESSES, bound=True)


def check_args(args):
    """Converts and checks the elastic options in place (reads nothing but `args`)."""
    if not args.elastic:
        given = [name for name in _OPTIONS if getattr(args, name) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise HvdtrainError(
                f"{flag} needs --elastic; expected e.g. `hvdtrain-run --elastic --min-np 1 "
                "--max-np 4 --hostfile hosts.txt -- python -m hvdtrain.mnist --elastic`"
            )
        return args
    args.min_np = _count(args.min_np, "--min-np")
    args.max_np = _count(args.max_np, "--max-np")
    args.elastic_timeout = _count(args.elastic_timeout, "--elastic-timeout")
    args.reset_limit = _count(args.reset_limit, "--reset-limit", minimum=0)
    if args.blacklist_cooldown_range is not None:
        low, high = (_count(v, "--blacklist-cooldown-range") for v in args.blacklist_cooldown_range)
        if low > high or high > 3600:
            raise invalid_value(
                "--blacklist-cooldown-range",
                " ".join(args.blacklist_cooldown_range),
                "MIN MAX seconds with 1 <= MIN <= MAX <= 3600, e.g. 60 300",
            )
        args.blacklist_cooldown_range = (low, high)
    if args.host_discovery_script is not None and not args.host_discovery_script.strip():
        raise invalid_value("--host-discovery-script", "", "a script that prints host:slots")
    return args


def discovery_command(hosts=None, hostfile=None, python=sys.executable):
    """The discovery command for fixed `hosts` (`printf` of `host:slots` lines) or for a
    `hostfile` read again each time (so editing it adds and removes hosts). Pure."""
    if hostfile is not None:
        hostfile = os.path.abspath(hostfile)
        return shlex.join([python, "-m", "hvdtrain.launcher.elastic", "--hostfile", hostfile])
    return shlex.join(["printf", r"%s\n", *(f"{h.name}:{h.slots}" for h in hosts)])


def elastic_flags(spec):
    """The horovodrun flags of `spec`, in a fixed order."""
    flags = ["--min-np", str(spec.min_np)]
    if spec.max_np is not None:
        flags += ["--max-np", str(spec.max_np)]
    flags += ["--host-discovery-script", spec.discovery]
    if spec.elastic_timeout is not None:
        flags += ["--elastic-timeout", str(spec.elastic_timeout)]
    if spec.reset_limit is not None:
        flags += ["--reset-limit", str(spec.reset_limit)]
    if spec.cooldown_range is not None:
        flags += ["--blacklist-cooldown-range", *map(str, spec.cooldown_range)]
    # The driver says which host it blacklists only at INFO (`failures.OutputFilter`
    # turns that into one line and leaves the driver's other INFO lines out; see
    # `build_command` for the workers' own level).
    flags += ["--log-level", "INFO"]
    return flags


def make_config(args, environ, base_config, resolve_hosts, python=sys.executable):
    """(LaunchConfig, ElasticSpec) for `hvdtrain-run --elastic` (no processes, no files).

    Args:
        args: from `hvdtrain.launcher.cli.parse_args`, with `args.elastic` set.
        environ: the launcher's environment.
        base_config: `cli.make_config`, which checks what every launch shares.
        resolve_hosts: `cli.resolve_hosts`.
        python: the Python that runs the generated discovery command.
    """
    if args.backend not in (None, "gloo"):
        raise invalid_value(
            "--backend", args.backend, "gloo with --elastic (Horovod Elastic runs on Gloo only)"
        )
    script = args.host_discovery_script
    if script and (args.hosts or args.hostfile):
        flag = "-H" if args.hosts else "--hostfile"
        raise HvdtrainError(
            f"{flag} and --host-discovery-script both name the hosts; expected one of them "
            "(the script prints host:slots lines)"
        )
    min_np = args.min_np or 1
    np = args.np or min_np
    max_np, hosts, warnings = args.max_np, None, []
    if not script:
        hosts, source, allocation = resolve_hosts(args, environ)
        if not (args.hosts or args.hostfile or allocation):
            hosts, source = local_hosts(max_np or np), "localhost"
        slots = total_slots(hosts)
        if max_np is not None and max_np > slots:
            raise invalid_value(
                "--max-np", max_np, f"at most {slots}, the total slots of {source} "
                f"({format_hosts(hosts)})",
            )  # fmt: skip
        max_np = max_np or slots
        script = discovery_command(hosts, args.hostfile, python)
    if max_np is not None and min_np > max_np:
        raise invalid_value("--min-np", min_np, f"at most --max-np {max_np}")
    if np < min_np or (max_np is not None and np > max_np):
        expected = f"from --min-np {min_np} to --max-np {max_np}" if max_np else f">= {min_np}"
        raise invalid_value("-np", np, f"{expected} (the workers to wait for at start)")
    base = argparse.Namespace(**{**vars(args), "backend": "gloo", "np": np})
    if hosts is not None:  # the slots are checked on the generated hosts, not -H again
        base.hosts, base.hostfile = format_hosts(hosts), None
    config = base_config(base, environ)
    if not config.network_interfaces:
        names = {h.name for h in hosts or ()}
        if names and all(is_local(n) for n in names):
            config = replace(config, network_interfaces=("lo",))
        elif len(names) == 1:
            raise HvdtrainError(
                f"--elastic on the one host {next(iter(names))} needs --network-interface "
                "(e.g. eth0): Horovod Elastic otherwise waits for two hosts to find a shared "
                "interface, and fails after --elastic-timeout"
            )
        elif not names:
            warnings.append(
                "without --network-interface, Horovod Elastic waits until the discovery "
                "script lists two hosts"
            )
    if hosts is not None and len({h.name for h in hosts}) == 1:
        warnings.append(
            f"every slot is on {hosts[0].name}: a failed worker blacklists its whole host, "
            "which ends the job (Horovod 0.28.1); fault tolerance needs two hosts"
        )
    spec = ElasticSpec(
        min_np=min_np,
        max_np=max_np,
        discovery=script,
        elastic_timeout=args.elastic_timeout,
        reset_limit=args.reset_limit,
        cooldown_range=args.blacklist_cooldown_range,
        warnings=tuple(warnings),
    )
    return config, spec


def build_command(config, spec, environ, bindir="", program="horovodrun"):
    """`horovodrun --gloo` as for a fixed job (`commands.horovodrun_command`), with `-H hosts`
    replaced by the elastic flags. Pure: returns (argv, env)."""
    argv, env = horovodrun_command(config, environ, bindir, program)
    at = argv.index("-H")
    argv[at : at + 2] = elastic_flags(spec)
    # `--log-level INFO` (elastic_flags) also sets HOROVOD_LOG_LEVEL on the workers, whose
    # Horovod core would then log at INFO on every rank: they keep the level they had.
    level = environ.get("HOROVOD_LOG_LEVEL", "WARNING")
    command = len(config.command)
    argv[-command:-command] = ["env", f"HOROVOD_LOG_LEVEL={level}"]
    return argv, env


def main(argv=None):
    """`python -m hvdtrain.launcher.elastic --hostfile FILE`: prints the hostfile's hosts as
    `host:slots` lines (the discovery command `hvdtrain-run --elastic --hostfile` uses)."""
    p = argparse.ArgumentParser(prog="python -m hvdtrain.launcher.elastic")
    p.add_argument("--hostfile", required=True)
    args = p.parse_args(argv)
    try:
        hosts = read_hostfile(args.hostfile)
    except HvdtrainError as e:
        print(f"hvdtrain discovery: error: {e}", file=sys.stderr, flush=True)
        return 1
    sys.stdout.write("".join(f"{h.name}:{h.slots}\n" for h in hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
