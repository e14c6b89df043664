"""Hostile input to the launcher: `hvdtrain-run`'s flags, -H strings, hostfiles, SLURM's
environment and node lists, `hvdtrain-run k8s`, secrets.

Properties (hypothesis), in this process: any input either parses into something sane or
raises `HvdtrainError` with a one-line message; nothing else escapes, nothing hangs
(pytest-timeout), nothing is written, and `--dry-run` output and error messages never hold a
secret. Cases, as real `hvdtrain-run` processes (`CASES`, tests/helpers/hostile.py): exit 2
with one error line, no traceback, nothing written, within a bound.
"""

import contextlib
import io
import os
import string

import pytest
from helpers.hostile import BOUND, RUN, check_case, fifo, folder, ids, one_line, write
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hvdtrain.errors import HvdtrainError
from hvdtrain.launcher import cli
from hvdtrain.launcher.hosts import (
    format_hosts,
    parse_hostfile_text,
    parse_hosts_arg,
    read_hostfile,
)
from hvdtrain.launcher.kubernetes import render_mpijob
from hvdtrain.launcher.slurm import detect_allocation, expand_nodelist

pytestmark = pytest.mark.timeout(120)
FAST = settings(max_examples=300, deadline=None)

# Odd digits (`²` passes str.isdigit but not int(), `٣` passes both), signs, separators,
# line breaks of every kind, NUL.
ODD = ["²", "٣", "+3", " 3", "3 ", "1_0", "0", "-1", "nan", "inf", "1e400", "\x00", "\u2028"]
PIECES = st.sampled_from(
    ["node1", "n-2.x", "10.0.0.5", "a", "slots=", "max_slots=", ":", ",", " ", "\t", "#",
     "\n", "\r\n", "\x0b", "\x85", "=", "4", "[", "]", "-", *ODD]
)  # fmt: skip
HOSTISH = st.one_of(st.text(), st.lists(PIECES, max_size=30).map("".join))


def check_hosts(hosts):
    assert hosts and len({h.name for h in hosts}) == len(hosts)
    for host in hosts:
        assert type(host.slots) is int and host.slots >= 1
        assert host.name and host.name.isascii() and host.name.isprintable()
        assert not set(host.name) & set(" \t,:#=")


@FAST
@given(HOSTISH)
@example("n:²")
@example("n:٣")
def test_hosts_arg(text):
    try:
        hosts = parse_hosts_arg(text)
    except HvdtrainError as e:
        one_line(e)
        assert str(e).startswith("Invalid value for `-H`: received ")
        return
    check_hosts(hosts)
    assert parse_hosts_arg(format_hosts(hosts)) == hosts  # round trip


@FAST
@given(HOSTISH)
@example("node1 slots=²")
@example("node1 slots=2 max_slots=²")
@example("a\x0bb slots=2")
def test_hostfile_text(text):
    try:
        hosts = parse_hostfile_text(text, "hosts.txt")
    except HvdtrainError as e:
        one_line(e)
        assert str(e).startswith("hosts.txt:")
        return
    check_hosts(hosts)
    again = "\n".join(f"{h.name} slots={h.slots}" for h in hosts)
    assert parse_hostfile_text(again) == hosts


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2000))
def test_hostfile_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("hostfile") / "hosts.txt"
    path.write_bytes(data)
    try:
        check_hosts(read_hostfile(str(path)))
    except HvdtrainError as e:
        one_line(e)


def test_hostfile_that_is_not_a_regular_file(tmp_path):
    """A FIFO would block open() forever; /dev/zero never ends; a folder is no file."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero", tmp_path, tmp_path / "missing"):
        with pytest.raises(HvdtrainError, match="Invalid value for `--hostfile`") as e:
            read_hostfile(str(path))
        one_line(e.value)
    big = tmp_path / "big"
    big.write_text("node1 slots=1\n" + "# pad\n" * 300_000)
    with pytest.raises(HvdtrainError, match="larger than"):
        read_hostfile(str(big))


TASKS = st.lists(st.sampled_from(["2", "(x", "3)", ",", "1", "(x99999999999)", *ODD]), max_size=8)


@FAST
@given(st.lists(PIECES, max_size=20).map("".join), TASKS.map("".join))
@example("n[0-99999999]", "")
@example("n[0-9999],m[0-9999]", "")
@example("n[²]", "")
@example("n[1-2]", "2(x99999999999)")
def test_slurm_allocation(nodelist, tasks):
    environ = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": nodelist, "SLURM_NTASKS": "²"}
    for env in (
        environ,
        {**environ, "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "²"},
        {**environ, "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": tasks},
    ):
        try:
            allocation = detect_allocation(env)
        except HvdtrainError as e:
            one_line(e)
            continue
        if allocation is not None:
            check_hosts(allocation.hosts)
    try:
        expand_nodelist(nodelist)
    except HvdtrainError as e:
        one_line(e)


# -- hvdtrain-run flags ----------------------------------------------------------------

FLAGS = [
    "-np", "--num-proc", "-H", "--hosts", "--hostfile", "-hostfile", "--backend",
    "--quiet", "--fusion-threshold-mb", "--cycle-time-ms", "--timeline-filename",
    "--stall-check-warning-time-seconds", "--stall-check-shutdown-time-seconds",
    "--network-interface", "--ssh-port", "--ssh-identity-file", "-x", "--env",
    "--mpi-args", "--python", "--timeout", "--", "python", "-m", "hvdtrain.mnist",
]  # fmt: skip
VALUES = [
    "2", "4", "65536", "99999999999999999999", "a:2,b:2", "localhost:2", "gloo", "mpi",
    "mpirun", "srun", "eth0", "A=1", "B", "--report-bindings", "'unclosed", *ODD,
]  # fmt: skip
WORD = st.one_of(st.sampled_from(FLAGS), st.sampled_from(VALUES), st.text(max_size=12))


@contextlib.contextmanager
def environment(**values):
    """os.environ without SLURM_* and with `values`, put back afterwards."""
    saved = dict(os.environ)
    try:
        for name in [n for n in os.environ if n.startswith("SLURM_")]:
            del os.environ[name]
        os.environ.update(values)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_main(argv):
    """cli.main(argv) in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def check_run(code, out, err):
    if code == 0:
        assert not err
    else:
        assert code == 2 and not out, (code, out, err)
        one_line(err.rstrip("\n"))
        assert err.startswith("hvdtrain-run: error: ")


@settings(max_examples=400, deadline=None)
@given(st.lists(WORD, max_size=12))
@example(["-np", "²"])
@example(["--cycle-time-ms", "inf"])
@example(["--bogus\nflag"])
@example(["-x", "A\nB=1"])
def test_run_flags(tmp_path_factory, argv):
    cwd = tmp_path_factory.mktemp("cwd")
    with environment(), contextlib.chdir(cwd):
        code, out, err = run_main(["--dry-run", *argv])
    check_run(code, out, err)
    if code == 0:
        assert len(out.splitlines()) >= 1
    assert not os.listdir(cwd)  # a dry run writes nothing


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(
    ["--workers", "--gpus-per-worker", "--image", "--name", "--", "2", "x", "hvd", *ODD]
), st.text(max_size=10)), max_size=8))  # fmt: skip
def test_k8s_flags(argv):
    code, out, err = run_main(["k8s", *argv])
    check_run(code, out, err)


@FAST
@given(st.one_of(st.integers(-3, 5), st.text(max_size=5), st.sampled_from(ODD)))
def test_k8s_counts(value):
    try:
        text = render_mpijob(value, 1)
    except HvdtrainError as e:
        one_line(e)
    else:
        assert "replicas:" in text


# -- secrets ---------------------------------------------------------------------------

SECRET_NAMES = st.builds(
    lambda pre, word, post: f"{pre}{word}{post}",
    st.sampled_from(["", "MY_", "DB_", "horovod_", "X"]),
    st.sampled_from(["SECRET", "TOKEN", "KEY", "PASSWORD", "Token", "secret", "passwd"]),
    st.sampled_from(["", "_KEY", "_1", "S"]),
)
SECRET_VALUES = st.text(string.ascii_letters + string.digits + "/+=-_.", min_size=6, max_size=16)


@settings(max_examples=150, deadline=None)
@given(
    name=SECRET_NAMES,
    value=SECRET_VALUES,
    backend=st.sampled_from(["gloo", "mpi", "mpirun"]),
    how=st.sampled_from(["env", "-x NAME=VALUE", "--opt=VALUE", "--opt VALUE", "mpi-args"]),
)
def test_secrets_never_printed(name, value, backend, how):
    value = "Zq" + value  # never a word of the command itself
    argv, env = ["--backend", backend], {"HOROVOD_SECRET_KEY": "Zqhvdkey", "API_TOKEN": "Zqtok"}
    opt = "--" + name.lower().replace("_", "-")
    command = ["python", "-m", "hvdtrain.mnist"]
    if how == "env":
        env[name.upper()] = value
        argv += ["-x", name.upper(), "-x", "API_TOKEN"]
    elif how == "-x NAME=VALUE":
        argv += ["-x", f"{name}={value}"]
    elif how == "--opt=VALUE":
        command.append(f"{opt}={value}")
    elif how == "--opt VALUE":
        command += [opt, value]
    elif backend != "gloo":
        argv.append(f"--mpi-args={opt} {value}")
    with environment(**env):
        code, out, err = run_main(["--dry-run", *argv, "--", *command])
    assert code == 0, err
    for secret in (value, "Zqhvdkey", "Zqtok"):
        assert secret not in out + err


@pytest.mark.parametrize(
    "argv",
    [
        ["-x", "MY TOKEN=Zqsecret"],  # a bad name: the error must not echo the value
        ["-x", "DB-PASSWORD=Zqsecret"],
        ["--mpi-args=--password Zqsecret 'unclosed"],
        ["--backend", "gloo", "--mpi-args=--password Zqsecret"],
        ["--doctor", "--", "python", "--api-key", "Zqsecret"],
    ],
)
def test_errors_never_print_secrets(argv):
    with environment():
        code, out, err = run_main(argv)
    assert code == 2, err
    one_line(err.rstrip("\n"))
    assert "Zqsecret" not in out + err


# -- real hvdtrain-run processes ------------------------------------------------------

CASES = [
    # -- hvdtrain-run flags
    ("np-zero", RUN + ["-np", "0", "true"], {}, [], 2, "`-np`: received '0'", []),
    ("np-negative", RUN + ["-np", "-1", "true"], {}, [], 2, "`-np`: received '-1'", []),
    ("np-word", RUN + ["-np", "two", "true"], {}, [], 2, "`-np`: received 'two'", []),
    ("np-huge", RUN + ["-np", "1" + "0" * 23, "true"], {}, [], 2, "at most 65536", []),
    ("np-over-slots", RUN + ["-np", "3", "-H", "a:2", "true"], {}, [], 2, "at most 2", []),
    ("slots-zero", RUN + ["-H", "a:0", "true"], {}, [], 2, "`-H`: received 'a:0'", []),
    ("slots-huge", RUN + ["-H", "a:" + "9" * 23, "true"], {}, [], 2, "from 1 to 1024", []),
    ("host-twice", RUN + ["-H", "a:1,a:1", "true"], {}, [], 2, "listed twice", []),
    ("hosts-empty", RUN + ["-H", ",,", "true"], {}, [], 2, "`-H`: received ',,'", []),
    ("backend", RUN + ["--backend", "pbs", "true"], {}, [], 2, "invalid choice: 'pbs'", []),
    ("srun-no-slurm", RUN + ["--backend", "srun", "true"], {}, [], 2, "SLURM_JOB_ID", []),
    ("ssh-port", RUN + ["--ssh-port", "70000", "true"], {}, [], 2, "from 1 to 65535", []),
    ("ssh-port-0", RUN + ["--ssh-port", "0", "true"], {}, [], 2, "`--ssh-port`", []),
    ("fusion", RUN + ["--fusion-threshold-mb", "-1", "true"], {}, [], 2, "fusion-threshold", []),
    ("cycle-nan", RUN + ["--cycle-time-ms", "nan", "true"], {}, [], 2, "received 'nan'", []),
    ("cycle-inf", RUN + ["--cycle-time-ms", "inf", "true"], {}, [], 2, "received 'inf'", []),
    ("stall-0", RUN + ["--stall-check-warning-time-seconds", "0", "true"], {}, [], 2,
     "stall-check-warning", []),
    ("export-name", RUN + ["-x", "1BAD=2", "true"], {}, [], 2, "Invalid value for `-x`", []),
    ("export-unset", RUN + ["-x", "NOT_SET_ANYWHERE", "true"], {}, [], 2, "a variable set", []),
    ("nic", RUN + ["--network-interface", "eth0;rm", "true"], {}, [], 2, "interface names", []),
    ("timeline", RUN + ["--timeline-filename", "", "true"], {}, [], 2, "timeline-filename", []),
    ("unknown-flag", RUN + ["--bogus", "true"], {}, [], 2, "unrecognized arguments", []),
    ("no-command", RUN, {}, [], 2, "no command to run", []),
    ("no-program", RUN + ["-np", "2", "--backend", "mpi", "nosuch-program"], {}, [], 2,
     "`command`: received 'nosuch-program'; expected a program on PATH", []),
    ("max-np", RUN + ["--elastic", "--max-np", "70000", "true"], {}, [], 2, "`--max-np`", []),
    ("min-np-alone", RUN + ["--min-np", "1", "true"], {}, [], 2, "needs --elastic", []),
    ("cooldown", RUN + ["--elastic", "--blacklist-cooldown-range", "20", "10", "true"], {}, [],
     2, "MIN <= MAX", []),
    ("mpi-args-gloo", RUN + ["--backend", "gloo", "--mpi-args=-v", "true"], {}, [], 2,
     "expected --backend mpi", []),
    ("doctor-command", RUN + ["doctor", "-H", "localhost:1", "true"], {}, [], 2,
     "doctor takes no command", []),
    ("timeout", RUN + ["--timeout", "-5", "true"], {}, [], 2, "`--timeout`", []),
    # -- hostfiles
    ("hf-slots-0", RUN + ["--hostfile", "{d}/h", "true"], {}, [write("h", "a slots=0\n")], 2,
     "h:1: slots '0'", []),
    ("hf-slots-x", RUN + ["--hostfile", "{d}/h", "true"], {}, [write("h", "a:x\n")], 2,
     "h:1: slots 'x'", []),
    ("hf-slots-huge", RUN + ["--hostfile", "{d}/h", "true"], {},
     [write("h", "a slots=" + "9" * 30 + "\n")], 2, "from 1 to 1024", []),
    ("hf-twice", RUN + ["--hostfile", "{d}/h", "true"], {}, [write("h", "a\nb:2\na:1\n")], 2,
     "h:3: host 'a' is listed twice", []),
    ("hf-junk", RUN + ["--hostfile", "{d}/h", "true"], {}, [write("h", "a some junk\n")], 2,
     "h:1: cannot read", []),
    ("hf-empty", RUN + ["--hostfile", "{d}/h", "true"], {}, [write("h", "# none\n")], 2,
     "h: no hosts", []),
    ("hf-missing", RUN + ["--hostfile", "{d}/none", "true"], {}, [], 2, "a readable", []),
    ("hf-folder", RUN + ["--hostfile", "{d}/dir", "true"], {}, [folder("dir")], 2,
     "a readable", []),
    ("hf-binary", RUN + ["--hostfile", "{d}/h", "true"], {}, [write("h", b"\x00\xff\xfe\n")], 2,
     "not a text file; expected a hostfile", []),
    ("hf-fifo", RUN + ["--hostfile", "{d}/h", "true"], {}, [fifo("h")], 2, "--hostfile", []),
    ("hf-negative-with-comment", RUN + ["--hostfile", "{d}/h", "true"], {},
     [write("h", "a slots=-1 # ghp_" + "a" * 36 + "\n")], 2, "h:1: slots '-1'", []),
    # -- SLURM's environment
    ("slurm-ntasks", RUN + ["--backend", "srun", "true"],
     {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "abc", "SLURM_JOB_NODELIST": "n1"}, [], 2,
     "SLURM_NTASKS", []),
    ("slurm-nodelist", RUN + ["true"],
     {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[1-"}, [], 2,
     "SLURM_JOB_NODELIST", []),
]  # fmt: skip


@pytest.mark.timeout(BOUND * 2)
@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_hostile_input(tmp_path, case):
    check_case(tmp_path, case)
