"""The `hvdtrain-run` console script, run for real: dry runs for every backend, one-line
errors for every bad hostfile, secrets, SLURM, the sbatch template, exit codes, signals,
and real 2-rank jobs under horovodrun (Gloo) and plain mpirun."""

import hashlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.launcher.supervise import run_command

BIN = os.path.dirname(sys.executable)
RUN = os.path.join(BIN, "hvdtrain-run")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST = ["python", "-m", "hvdtrain.mnist", "--epochs", "1"]
ROOT_FLAG = ["--allow-run-as-root"] if os.geteuid() == 0 else []
JOB_TIMEOUT = 240  # every multi-process run is bounded: a hang fails instead of blocking


def clean_env(**extra):
    """This environment without SLURM variables or the venv on PATH, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != BIN]
    env["PATH"] = os.pathsep.join(path or ["/usr/bin", "/bin"])
    env.update(extra)
    return env


def run(*args, env=None, timeout=60, cwd=None):
    return subprocess.run(
        [RUN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or clean_env(),
        cwd=cwd,
    )


def dry(*args, env=None):
    proc = run("--dry-run", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    (line,) = proc.stdout.splitlines()
    return line


def one_line_error(proc):
    """The error's one line: exit 2, nothing on stdout, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("hvdtrain-run: error: ")
    return lines[0]


def test_launcher_never_imports_tensorflow_or_horovod():
    code = (
        "import sys, hvdtrain.launcher, hvdtrain.launcher.cli, hvdtrain.launcher.doctor, "
        "hvdtrain.launcher.kubernetes, hvdtrain.launcher.slurm, hvdtrain.launcher.notebook, "
        "hvdtrain.launcher.run_fn; "
        "bad = [m for m in ('tensorflow', 'horovod', 'keras') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_horovodruns_build_check_loads_the_library_without_importing_tensorflow():
    """Our Horovod patch: horovodrun asks before every launch whether Horovod was built with
    MPI or Gloo; it used to import all of TensorFlow for that (about 5 s of CPU)."""
    code = (
        "import sys; from horovod.common.util import _extension_library; "
        "ext = _extension_library('tensorflow'); "
        "print(ext.mpi_built(), ext.gloo_built(), 'tensorflow' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert proc.stdout.split() == ["True", "True", "False"], proc.stdout + proc.stderr


# Dry runs: the exact command per backend.

VENV_PATH = f'PATH={BIN}:"$PATH"'


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_dry_run_horovodrun(backend):
    line = dry("-np", "2", "--backend", backend, "--", *MNIST)
    want = [f"{BIN}/horovodrun", f"--{backend}", "-np", "2", "-H", "localhost:2", *MNIST]
    assert line == f"{VENV_PATH} {shlex.join(want)}"


def test_dry_run_default_is_mpi_on_one_host_and_dash_dash_is_optional():
    assert dry("-np", "2", "--", *MNIST) == dry("-np", "2", *MNIST)
    # One host and mpirun installed: Open MPI's shared memory (hvdtrain.bench measures it).
    assert f"{BIN}/horovodrun --mpi -np 2 -H localhost:2 python" in dry("-np", "2", *MNIST)
    # Options after the command belong to the command.
    assert dry("python", "t.py", "-np", "9").endswith("-np 1 -H localhost:1 python t.py -np 9")
    assert dry("-np", "2", "--", "python", "t.py", "--", "x").endswith("python t.py -- x")


def test_a_network_interface_for_gloo_on_this_host_alone_becomes_lo_with_a_warning(tmp_path):
    """horovodrun ended in a traceback ("No interface is found for address 127.0.0.1")."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost slots=2\n")
    argv = ["--hostfile", str(hostfile), "--backend", "gloo", "--network-interface", "eth0"]
    proc = run("--dry-run", *argv, "--", *MNIST)
    assert proc.returncode == 0 and "--network-interfaces lo python" in proc.stdout
    assert proc.stderr == (
        "hvdtrain-run: warning: every host is this one: Gloo's ranks meet on its loopback, so "
        "--network-interface eth0 is replaced by lo (name it again for a job across hosts)\n"
    )
    # Across hosts, and under MPI, the interface given is passed on as it is.
    assert "--network-interfaces eth0" in dry(
        "-H",
        "localhost:1,node2:1",
        "--backend",
        "gloo",
        "--network-interface",
        "eth0",
        "--",
        *MNIST,
    )
    assert "btl_tcp_if_include eth0" in dry(
        "--hostfile",
        str(hostfile),
        "--backend",
        "mpirun",
        "--network-interface",
        "eth0",
        "--",
        *MNIST,
    )


def test_dry_run_mpirun():
    env = clean_env(NCCL_DEBUG="INFO", HOROVOD_LOG_LEVEL="warning")
    env.pop("LD_LIBRARY_PATH", None)
    line = dry(
        "-H", "a:2,b:2", "--backend", "mpirun", "--fusion-threshold-mb", "64", *MNIST, env=env
    )
    words = shlex.split(line.split(" ", 1)[1])
    assert line.startswith(VENV_PATH + " ")
    assert words[0].endswith("/mpirun")
    assert words[1 : 5 + len(ROOT_FLAG)] == [*ROOT_FLAG, "-np", "4", "-H", "a:2,b:2"]
    joined = " ".join(words)
    assert "--bind-to none --map-by slot --tag-output -mca pml ob1 -mca btl ^openib" in joined
    assert f"-x HOROVOD_FUSION_THRESHOLD={64 << 20}" in joined
    for name in ("HOROVOD_LOG_LEVEL", "NCCL_DEBUG", "PATH"):
        assert f"-x {name} " in joined
    assert joined.endswith(shlex.join(MNIST))


def test_dry_run_tunables_and_ssh_for_horovodrun():
    line = dry(
        "-np", "1", "-H", "node1:1", "--backend", "gloo", "--cycle-time-ms", "5",
        "--timeline-filename", "/tmp/tl.json", "--stall-check-warning-time-seconds", "30",
        "--stall-check-shutdown-time-seconds", "90", "--network-interface", "eth0",
        "--ssh-port", "2222", "--ssh-identity-file", "/k/id", "true",
    )  # fmt: skip
    assert line.endswith(
        "--cycle-time-ms 5 --timeline-filename /tmp/tl.json "
        "--stall-check-warning-time-seconds 30 --stall-check-shutdown-time-seconds 90 "
        "--network-interfaces eth0 -p 2222 -i /k/id true"
    )


SLURM = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NODELIST": "node[01-02]",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_NTASKS": "4",
}


def test_dry_run_inside_slurm():
    env = clean_env(**SLURM)
    assert dry(*MNIST, env=env).endswith(
        "srun --mpi=pmix -n 4 --kill-on-bad-exit=1 " + shlex.join(MNIST)
    )
    assert "srun --mpi=pmix -n 3 " in dry("-np", "3", *MNIST, env=env)
    mpirun = dry("--backend", "mpirun", *MNIST, env=env)
    assert "/mpirun " in mpirun and " -np 4 -H node01:2,node02:2 " in mpirun
    gloo = dry("--backend", "gloo", *MNIST, env=env)
    assert "horovodrun --gloo -np 4 -H node01:2,node02:2 python" in gloo
    assert "--gloo -np 2 -H a:2 " in dry("-H", "a:2", *MNIST, env=env)  # explicit hosts win


def test_dry_run_hostfile_sets_np(tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("# two boxes\nnode1 slots=4\nnode2:2  # small\n")
    assert "-np 6 -H node1:4,node2:2 " in dry("--hostfile", str(hostfile), "true")
    assert "-np 5 -H node1:4,node2:2 " in dry("--hostfile", str(hostfile), "-np", "5", "true")


GH_PAT = "ghp_" + "A1b2C3d4E5" * 3 + "F6g7H8"  # a GitHub token's shape (36 after ghp_)


def test_secrets_are_never_printed():
    env = clean_env(HOROVOD_SECRET_KEY="s3cr3t-env", MY_API_TOKEN="t0ken-env")
    args = ["-x", "MY_API_TOKEN", "-x", "DB_PASSWORD=pa55-arg", "-x", "PLAIN=visible"]
    # Whatever the name: a URL's password, a token of a well-known shape (the cases).
    args += ["-x", "MLFLOW_TRACKING_URI=https://user:pa55-url@mlflow.example:5000"]
    mpi_args = f"--mpi-args=-x GH_PAT={GH_PAT} -x STORE=s3://ak:pa55-mpi@bucket/x"
    command = ["python", "t.py", "--api-key", "k3y-arg", "--token=t0k-arg"]
    for backend in ("gloo", "mpirun"):
        extra = [mpi_args] if backend == "mpirun" else []
        proc = run("--dry-run", "--backend", backend, *args, *extra, "--", *command, env=env)
        assert proc.returncode == 0, proc.stderr
        for secret in ("s3cr3t-env", "t0ken-env", "pa55-arg", "k3y-arg", "t0k-arg", "pa55-url"):
            assert secret not in proc.stdout + proc.stderr
        assert "PLAIN=visible" in proc.stdout
        assert "https://user:***@mlflow.example:5000" in proc.stdout
        if extra:
            assert GH_PAT[4:] not in proc.stdout + proc.stderr and "pa55-mpi" not in proc.stdout
            assert "GH_PAT=***" in proc.stdout and "s3://ak:***@bucket/x" in proc.stdout


@pytest.mark.timeout(120)
def test_exports_reach_the_ranks_but_are_not_echoed():
    """A real mpirun job: -x values arrive on the rank; the echoed command masks secrets."""
    digest = hashlib.sha256(b"z3cret").hexdigest()  # the command must not hold the secret
    check = f'test "$(printf %s "$API_KEY" | sha256sum)" = "{digest}  -" && test "$PLAIN" = 1'
    check += " && echo rank-ok"
    proc = run(
        "-np", "1", "--backend", "mpirun", "-x", "API_KEY=z3cret", "-x", "PLAIN=1",
        f"--mpi-args=-x GH_PAT={GH_PAT} -x URI=https://u:z3cretpw@h", "--", "sh", "-c", check,
        timeout=JOB_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank-ok" in proc.stdout
    assert proc.stderr.startswith("hvdtrain-run: ") and "API_KEY=***" in proc.stderr
    assert "z3cret" not in proc.stderr and GH_PAT[4:] not in proc.stderr
    assert "GH_PAT=***" in proc.stderr and "URI=https://u:***@h" in proc.stderr


# Errors: one line, exit 2, no traceback.

BAD_HOSTFILES = [
    ("node1 slots=4\nnode2 slot=4\n", 2, "cannot read 'node2 slot=4'"),
    ("node1 slots=0\n", 1, "slots '0' is not an integer from 1 to 1024"),
    ("node1 slots=-3\n", 1, "slots '-3' is not an integer from 1 to 1024"),
    ("node1 slots=x\n", 1, "slots 'x' is not an integer from 1 to 1024"),
    ("node1:0\n", 1, "slots '0' is not an integer from 1 to 1024"),
    ("# a\n\nnode1:two\n", 3, "slots 'two' is not an integer from 1 to 1024"),
    ("node1 slots=2 max_slots=-1\n", 1, "max_slots '-1'"),
    ("node1 slots=2\nnode2:2\nnode1\n", 3, "host 'node1' is listed twice (first on line 1)"),
    ("node1 some junk\n", 1, "cannot read"),
    ("node1 slots=100000000000000000000000\n", 1, "is not an integer from 1 to 1024"),
    ("node1:1025\n", 1, "slots '1025' is not an integer from 1 to 1024"),
]


@pytest.mark.parametrize("text, line, words", BAD_HOSTFILES)
def test_bad_hostfile_is_one_line_with_file_and_line(tmp_path, text, line, words):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(text)
    message = one_line_error(run("--hostfile", str(hostfile), "--", *MNIST))
    assert f"{hostfile}:{line}: " in message and words in message


@pytest.mark.parametrize("text", ["", "\n# only comments\n\n"])
def test_hostfile_without_hosts(tmp_path, text):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(text)
    assert f"{hostfile}: no hosts" in one_line_error(run("--hostfile", str(hostfile), "true"))


def test_missing_hostfile(tmp_path):
    for path in (tmp_path / "missing.txt", tmp_path):
        message = one_line_error(run("--hostfile", str(path), "true"))
        assert f"Invalid value for `--hostfile`: received '{path}'; expected a readable" in message


@pytest.mark.parametrize(
    "args, words",
    [
        (["-np", "0", "true"], "Invalid value for `-np`: received '0'; expected a positive int"),
        (["-np", "two", "true"], "`-np`: received 'two'"),
        (["-np", "3", "-H", "a:2", "true"], "`-np`: received 3; expected at most 2, the total"),
        (["-H", "a:0", "true"], "Invalid value for `-H`: received 'a:0'"),
        (["-np", "1" + "0" * 23, "true"], "expected at most 65536 (hvdtrain's bound"),
        (["-H", "a:" + "9" * 23, "true"], "slots an integer from 1 to 1024"),
        (["--elastic", "--max-np", "70000", "true"], "`--max-np`: received '70000'"),
        (["-H", "a:1", "--hostfile", "h", "true"], "not allowed with argument"),
        (["--bogus", "true"], "unrecognized arguments: --bogus"),
        (["--backend", "pbs", "true"], "invalid choice: 'pbs'"),
        ([], "no command to run"),
        (["--backend", "srun", "true"], "SLURM_JOB_ID"),
        (
            ["--backend", "gloo", "--mpi-args=-v", "true"],
            "`--mpi-args`: received '-v'; expected --backend mpi",
        ),
        (["-x", "NOT_SET_ANYWHERE", "true"], "expected a variable set here"),
        (["-x", "1BAD=2", "true"], "Invalid value for `-x`"),
        (
            ["--ssh-port", "70000", "true"],
            "`--ssh-port`: received '70000'; expected an integer from 1 to 65535",
        ),
        (["--fusion-threshold-mb", "-1", "true"], "`--fusion-threshold-mb`: received '-1'"),
        (["--cycle-time-ms", "nan", "true"], "`--cycle-time-ms`: received 'nan'"),
        (["doctor", "true"], "doctor takes no command"),
    ],
)
def test_option_errors_are_one_line(args, words):
    if args[:1] == ["doctor"]:
        args = ["doctor", "-H", "localhost:1", *args[1:]]
    assert words in one_line_error(run(*args))


def test_bad_slurm_environment_is_one_line():
    env = clean_env(SLURM_JOB_ID="1", SLURM_JOB_NODELIST="node[1-")
    assert "SLURM_JOB_NODELIST" in one_line_error(run("true", env=env))


def test_missing_launcher_program_is_one_line(tmp_path):
    """Outside --dry-run, a backend whose program is missing says what to install."""
    env = clean_env(**SLURM)
    env["PATH"] = str(tmp_path)  # no srun anywhere
    assert "srun not found" in one_line_error(run("true", env=env))


def test_an_unreachable_host_is_one_line_before_anything_starts():
    """Every other host must answer `ssh host true` first: one line naming the host and its
    ranks, exit 5, nothing launched (horovodrun would print a traceback, mpirun a page)."""
    for backend in ("gloo", "mpi"):
        proc = run("-H", "localhost:1,nosuchhost.invalid:2", "--backend", backend, "true")
        assert proc.returncode == 5, (proc.returncode, proc.stderr)
        (line,) = proc.stderr.splitlines()
        assert line.startswith("hvdtrain-run: error: cannot reach nosuchhost.invalid (ranks 1, 2):")
        assert "nothing was started" in line and "Could not resolve hostname" in line, line


# The scripts in launch/.


def test_launch_script_matches_console_script():
    script = os.path.join(ROOT, "launch", "hvdtrain-run")
    proc = subprocess.run(
        [script, "--dry-run", "-np", "2", *MNIST],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == dry("-np", "2", *MNIST)
    proc = subprocess.run(
        [script, "true"], capture_output=True, text=True, timeout=60,
        env=clean_env(HVDTRAIN_VENV="/no/such/venv"),
    )  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1


def test_sbatch_template_runs_srun(tmp_path):
    """Runs launch/hvdtrain.sbatch as SLURM would, with an `srun` stand-in that reports."""
    sbatch = os.path.join(ROOT, "launch", "hvdtrain.sbatch")
    with open(sbatch, encoding="utf-8") as f:
        text = f.read()
    for directive in ("--ntasks=", "--cpus-per-task=", "--nodes=", "--time="):
        assert f"#SBATCH {directive}" in text
    (tmp_path / "srun").write_text('#!/bin/sh\necho "srun $* cpus=$SRUN_CPUS_PER_TASK"\n')
    (tmp_path / "srun").chmod(0o755)
    env = clean_env(**SLURM, SLURM_SUBMIT_DIR=ROOT, SLURM_CPUS_PER_TASK="3")
    env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(
        ["bash", sbatch, "--epochs", "2"], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "srun --mpi=pmix -n 4 --kill-on-bad-exit=1 python -m hvdtrain.mnist --epochs 2 cpus=3"
    )


# Exit codes and signals (run_command in-process, then real jobs).


def test_run_command_returns_the_exit_code_and_signal_codes():
    env = dict(os.environ)
    assert run_command(["sh", "-c", "exit 3"], env) == 3
    assert run_command(["sh", "-c", "kill -KILL $$"], env) == 128 + signal.SIGKILL
    with pytest.raises(HvdtrainError, match="cannot run /no/such/launcher: No such file"):
        run_command(["/no/such/launcher"], env)


@pytest.mark.timeout(60)
def test_run_command_forwards_sigterm_to_the_process_group():
    """SIGTERM to the launcher reaches the job's process group, child processes included."""
    script = "trap 'exit 7' TERM; sleep 30 & wait"
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    start = time.monotonic()
    try:
        assert run_command(["sh", "-c", script], dict(os.environ)) == 7
    finally:
        timer.cancel()
    assert time.monotonic() - start < 20
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler was put back


@pytest.mark.timeout(120)
def test_sigterm_ends_a_real_mpirun_job(tmp_path):
    code = f"import os, time; open('{tmp_path}/%d' % os.getpid(), 'w').close(); time.sleep(300)"
    proc = subprocess.Popen(
        [RUN, "-q", "-np", "2", "--backend", "mpirun", "--", "python", "-c", code],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [int(name) for name in os.listdir(tmp_path)]
        assert len(pids) == 2, "the ranks did not start"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, output
    assert "hvdtrain-run: received SIGTERM and passed it to the job, which ended" in output
    assert "killed by signal" not in output  # (a rank named as the first to fail: misleading)
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids), "ranks outlived the launcher"


HVD_CHECK = (
    "import horovod.tensorflow as hvd; hvd.init(); assert hvd.size() == 2; "
    "print(f'rank {hvd.rank()} of {hvd.size()}')"
)
FAIL_RANK_1 = (
    "import os, sys\n"
    "rank = int(os.environ.get('HOROVOD_RANK') or os.environ.get('OMPI_COMM_WORLD_RANK'))\n"
    "if rank == 1:\n"
    "    print('rank 1 gives up: exit 3', file=sys.stderr)\n"
    "    sys.exit(3)\n"
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["gloo", "mpirun"])
def test_real_two_rank_job(backend):
    """Two real Horovod ranks on this host; `python` is the venv's though PATH lacks it."""
    proc = run(
        "-np", "2", "--backend", backend, "--", "python", "-c", HVD_CHECK,
        env=clean_env(TF_CPP_MIN_LOG_LEVEL="2"), timeout=JOB_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 of 2" in proc.stdout and "rank 1 of 2" in proc.stdout


@pytest.mark.timeout(120)
def test_a_program_is_looked_up_where_the_ranks_look_for_it():
    """The ranks' PATH has the launching Python's bin first: a program only there (the venv
    not on this PATH) runs; one nowhere is one line before anything starts."""
    proc = run("-np", "1", "--backend", "gloo", "--", "hvdtrain-run", "--help",
               env=clean_env(), timeout=JOB_TIMEOUT)  # fmt: skip
    assert proc.returncode == 0 and "usage: hvdtrain-run" in proc.stdout, proc.stderr[-3000:]
    line = one_line_error(run("-np", "1", "--backend", "gloo", "--", "nosuch-program"))
    assert "received 'nosuch-program'; expected a program on PATH" in line


def test_more_ranks_than_this_hosts_cores_is_a_warning_unless_the_hosts_are_given():
    """`-np` above the cores with no hosts given: the job runs, after one warning line;
    the same ranks asked for with -H, or with -q: no warning."""
    from hvdtrain.launcher.cli import crowding_warning, parse_args

    cores = len(os.sched_getaffinity(0))
    n = str(cores + 1)
    proc = run("-np", n, "--backend", "gloo", "--", sys.executable, "-c", "pass",
               env=clean_env(), timeout=JOB_TIMEOUT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert warnings == [
        f"hvdtrain-run: warning: {n} ranks on the {cores} cores of this host: they take turns "
        f"on the cores, and a step waits for the slowest; -np {cores} gives each its own "
        "core, and -H or --hostfile adds hosts"
    ]
    for given in (["-H", f"localhost:{n}"], ["-q"]):
        proc = run("-np", n, *given, "--backend", "gloo", "--", sys.executable, "-c", "pass",
                   env=clean_env(), timeout=JOB_TIMEOUT)  # fmt: skip
        assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr[-3000:]
    # Hosts from a hostfile or SLURM, or an elastic job, are the user's choice too (pure).
    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS": "8"}
    for argv, environ in (
        (["-np", "8", "--hostfile", "hosts.txt"], {}),
        (["-np", "8"], slurm),
        (["--elastic", "--min-np", "2", "-np", "8", "-H", "a:4,b:4"], {}),
        (["-np", "2"], {}),
    ):
        args = parse_args([*argv, "--", "python", "train.py"])
        assert crowding_warning(args, 8 if "8" in argv else 2, environ, 2) is None, argv


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["gloo", "mpirun"])
def test_failing_rank_fails_the_launch(backend):
    proc = run(
        "-np", "2", "--backend", backend, "--", "python", "-c", FAIL_RANK_1,
        env=clean_env(), timeout=JOB_TIMEOUT,
    )  # fmt: skip
    assert "rank 1 gives up: exit 3" in proc.stdout + proc.stderr
    # One line names the rank that failed first and its host; its status is the job's;
    # horovodrun's own traceback is left out.
    assert proc.returncode == 3 and "Traceback" not in proc.stderr
    # A script's own sys.exit(3), not hvdtrain's: not hvdtrain's meaning of 3.
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "hvdtrain-run: rank 1 on host localhost failed first: exit status 3 (see its output "
        "above); the job was ended"
    )


def test_default_backend_per_topology():
    from hvdtrain.launcher.cli import default_backend
    from hvdtrain.launcher.hosts import Host

    one = [Host("localhost", 2)]
    assert default_backend(one, False, "/usr/bin/mpirun") == "mpi"
    assert default_backend([Host("node1", 2)], False, "/x/mpirun", ("node1",)) == "mpi"
    assert default_backend(one, False, None) == "gloo"  # no Open MPI here
    assert default_backend([Host("a", 2), Host("b", 2)], False, "/usr/bin/mpirun") == "gloo"
    assert default_backend(one, True, "/usr/bin/mpirun") == "srun"
