"""The pure command builders: exact argv and environment for every backend, no processes."""

import os

import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.launcher.commands import (
    LaunchConfig,
    build_command,
    exported_names,
    find_program,
    format_command,
    is_secret,
    path_with,
    redact_argv,
    redact_text,
)
from hvdtrain.launcher.hosts import Host

HOSTS = (Host("a", 2), Host("b", 2))
CMD = ("python", "-m", "hvdtrain.mnist", "--epochs", "1")
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LD_LIBRARY_PATH": "/opt/lib"}
MPI_FIXED = ["--bind-to", "none", "--map-by", "slot", "--tag-output"]
MPI_FIXED += ["-mca", "pml", "ob1", "-mca", "btl", "^openib"]
# Every backend gives them to every rank: TensorFlow's start-up lines off, Keras 2 for tf.keras.
KERAS2 = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}


def config(backend, **kw):
    kw.setdefault("keras2", True)  # TensorFlow >= 2.16, whatever this environment has
    return LaunchConfig(backend=backend, np=4, hosts=HOSTS, command=CMD, **kw)


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_horovodrun(backend):
    argv, env = build_command(config(backend), ENV, uid=1000)
    assert argv == ["horovodrun", f"--{backend}", "-np", "4", "-H", "a:2,b:2", *CMD]
    assert env == KERAS2


@pytest.mark.parametrize("backend", ["gloo", "mpi", "mpirun", "srun"])
def test_keras2_reaches_every_rank_and_the_users_value_wins(backend):
    """TF_USE_LEGACY_KERAS=1 is set for the ranks of every backend (plain mpirun as -x,
    since across hosts it forwards nothing it is not told to); a value the user set is
    passed on unchanged (mpirun: forwarded by name), so a wrong one fails clearly."""
    argv, env = build_command(config(backend), ENV, uid=1000)
    if backend == "mpirun":
        assert (
            "TF_USE_LEGACY_KERAS=1" in argv
            and argv[argv.index("TF_USE_LEGACY_KERAS=1") - 1] == "-x"
        )
    else:
        assert env["TF_USE_LEGACY_KERAS"] == "1"
    argv, env = build_command(config(backend), dict(ENV, TF_USE_LEGACY_KERAS="0"), uid=1000)
    assert "TF_USE_LEGACY_KERAS" not in env
    assert "TF_USE_LEGACY_KERAS=1" not in argv
    if backend == "mpirun":
        assert argv[argv.index("TF_USE_LEGACY_KERAS") - 1] == "-x"
    # TensorFlow 2.15 (the CLI reads the version): the variable would break tf.keras there.
    argv, env = build_command(config(backend, keras2=False), ENV, uid=1000)
    assert "TF_USE_LEGACY_KERAS" not in env and "TF_USE_LEGACY_KERAS=1" not in argv
    # TensorFlow's log level: 2 unless set (then forwarded as it is).
    argv, env = build_command(config(backend), dict(ENV, TF_CPP_MIN_LOG_LEVEL="0"), uid=1000)
    assert "TF_CPP_MIN_LOG_LEVEL" not in env and "TF_CPP_MIN_LOG_LEVEL=2" not in argv


def test_horovodrun_options_and_venv_path():
    cfg = config(
        "gloo",
        tunables={"fusion_threshold_mb": 64, "cycle_time_ms": 2.5, "timeline_filename": "t.json"},
        network_interfaces=("eth0", "ib0"),
        ssh_port=2222,
        ssh_identity_file="/k/id",
        exports=(("NCCL_DEBUG", "INFO"), ("HOME", None)),
    )
    argv, env = build_command(cfg, ENV, uid=0, bindir="/venv/bin", program="/venv/bin/horovodrun")
    assert argv == [
        "/venv/bin/horovodrun", "--gloo", "-np", "4", "-H", "a:2,b:2",
        "--fusion-threshold-mb", "64", "--cycle-time-ms", "2.5", "--timeline-filename", "t.json",
        "--network-interfaces", "eth0,ib0", "-p", "2222", "-i", "/k/id", *CMD,
    ]  # fmt: skip
    assert env == {**KERAS2, "NCCL_DEBUG": "INFO", "PATH": "/venv/bin:/usr/bin:/bin"}
    mpi = config("mpi", mpi_args=("--report-bindings", "--mca", "x", "a b"))
    argv, _ = build_command(mpi, ENV, uid=0)
    assert "--mpi-args=--report-bindings --mca x 'a b'" in argv


@pytest.mark.parametrize("uid, root", [(1000, []), (0, ["--allow-run-as-root"])])
def test_mpirun_as_user_and_as_root(uid, root):
    argv, env = build_command(config("mpirun"), ENV, uid=uid)
    exports = ["-x", "TF_CPP_MIN_LOG_LEVEL=2", "-x", "TF_USE_LEGACY_KERAS=1"]
    exports += ["-x", "LD_LIBRARY_PATH", "-x", "PATH"]
    assert argv == ["mpirun", *root, "-np", "4", "-H", "a:2,b:2", *MPI_FIXED, *exports, *CMD]
    assert env == {}


def test_mpirun_tunables_nics_ssh_and_forwarding():
    environ = dict(ENV, HOROVOD_LOG_LEVEL="INFO", NCCL_DEBUG="WARN", HVDTRAIN_OFFLINE="1")
    environ.update(TF_CPP_MIN_LOG_LEVEL="2", _HOROVOD_SECRET_KEY="x", CUDA_VISIBLE_DEVICES="0")
    environ.update(MY_VAR="1", OTHER="2")
    cfg = config(
        "mpirun",
        tunables={
            "fusion_threshold_mb": 32,
            "cycle_time_ms": 3.0,
            "timeline_filename": "/tmp/tl.json",
            "stall_check_warning_time_seconds": 120,
            "stall_check_shutdown_time_seconds": 600,
        },
        network_interfaces=("eth0",),
        ssh_port=2222,
        ssh_identity_file="/k/id",
        exports=(("MY_VAR", None), ("HOROVOD_LOG_LEVEL", "DEBUG")),
        mpi_args=("--report-bindings",),
    )
    argv, env = build_command(cfg, environ, uid=1000, bindir="/venv/bin", program="/usr/bin/mpirun")
    assert argv == [
        "/usr/bin/mpirun", "-np", "4", "-H", "a:2,b:2", *MPI_FIXED,
        "-mca", "btl_tcp_if_include", "eth0", "-mca", "oob_tcp_if_include", "eth0",
        "-mca", "plm_rsh_args", "-p 2222 -i /k/id",
        "-x", "TF_USE_LEGACY_KERAS=1",
        "-x", f"HOROVOD_FUSION_THRESHOLD={32 * 1024 * 1024}",
        "-x", "HOROVOD_CYCLE_TIME=3",
        "-x", "HOROVOD_TIMELINE=/tmp/tl.json",
        "-x", "HOROVOD_STALL_CHECK_TIME_SECONDS=120",
        "-x", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=600",
        "-x", "NCCL_SOCKET_IFNAME=eth0",
        "-x", "HOROVOD_LOG_LEVEL=DEBUG",
        "-x", "HVDTRAIN_OFFLINE", "-x", "LD_LIBRARY_PATH", "-x", "MY_VAR", "-x", "NCCL_DEBUG",
        "-x", "PATH", "-x", "TF_CPP_MIN_LOG_LEVEL",
        "--report-bindings", *CMD,
    ]  # fmt: skip
    assert env == {"PATH": "/venv/bin:/usr/bin:/bin"}


def test_srun():
    cfg = config("srun", tunables={"fusion_threshold_mb": 1}, network_interfaces=("ib0",))
    argv, env = build_command(cfg, ENV, uid=0, bindir="/usr/bin")
    assert argv == ["srun", "--mpi=pmix", "-n", "4", "--kill-on-bad-exit=1", *CMD]
    assert env == {
        **KERAS2,
        "HOROVOD_FUSION_THRESHOLD": "1048576",
        "NCCL_SOCKET_IFNAME": "ib0",
        "OMPI_MCA_btl_tcp_if_include": "ib0",
    }  # /usr/bin is first on PATH already: PATH is left alone


def test_unknown_backend():
    with pytest.raises(HvdtrainError, match="unknown backend 'pbs'"):
        build_command(config("pbs"), ENV, uid=0)


def test_builders_do_not_touch_the_environment():
    environ = dict(ENV)
    build_command(config("mpirun", exports=(("A", "1"),)), environ, uid=0, bindir="/v/bin")
    assert environ == ENV


def test_path_with_and_exported_names():
    assert path_with("/v/bin", "/usr/bin") == "/v/bin" + os.pathsep + "/usr/bin"
    assert path_with("/v/bin", "/v/bin:/usr/bin") is None
    assert path_with("", "/usr/bin") is None
    assert path_with("/v/bin", "") == "/v/bin"
    names = exported_names({"PATH": "", "HOROVOD_X": "", "_HOROVOD_SECRET_KEY": "", "FOO": ""})
    assert names == ["HOROVOD_X", "PATH"]


def test_find_program(tmp_path):
    tool = tmp_path / "horovodrun"
    tool.write_text("#!/bin/sh\n")
    assert find_program("horovodrun", str(tmp_path), "") is None  # not executable
    tool.chmod(0o755)
    assert find_program("horovodrun", str(tmp_path), "/usr/bin") == str(tool)
    assert find_program("sh", str(tmp_path / "none"), "/usr/bin:/bin") in ("/usr/bin/sh", "/bin/sh")
    assert find_program("no-such-tool-here", str(tmp_path), "/usr/bin") is None


def test_secrets_are_masked():
    assert is_secret("HOROVOD_SECRET_KEY") and is_secret("--api-token") and is_secret("db_password")
    assert not is_secret("--fusion-threshold-mb") and not is_secret("--ssh-identity-file")
    argv = ["mpirun", "-x", "WANDB_API_KEY=abc123", "-x", "HOME", "python", "t.py"]
    argv += ["--password", "hunter2", "--token=tok456", "-c", "print('KEY=1')", "--lr=0.1"]
    assert redact_argv(argv) == [
        "mpirun", "-x", "WANDB_API_KEY=***", "-x", "HOME", "python", "t.py",
        "--password", "***", "--token=***", "-c", "print('KEY=1')", "--lr=0.1",
    ]  # fmt: skip
    line = format_command(argv, {"HOROVOD_SECRET_KEY": "s3cr3t", "A": "b c"}, {})
    for secret in ("abc123", "hunter2", "tok456", "s3cr3t"):
        assert secret not in line
    assert line.startswith("HOROVOD_SECRET_KEY='***' A='b c' mpirun -x 'WANDB_API_KEY=***' -x HOME")


@pytest.mark.parametrize(
    "secret, shown",
    [
        ("https://user:pa55word@mlflow.example:5000/x", "https://user:***@mlflow.example:5000/x"),
        ("s3://AKIAIOSFODNN7EXAMPLE:x@bucket/k", "s3://***:***@bucket/k"),
        ("ghp_" + "a1" * 18, "***"),
        ("github_pat_" + "B2" * 15, "***"),
        ("glpat-" + "c3" * 10, "***"),
        ("xoxb-123456789012-abcdef", "***"),
        ("hf_" + "d4" * 17, "***"),
        ("sk-" + "e5" * 12, "***"),
        ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N", "***"),
    ],
)
def test_urls_and_token_shapes_are_masked_whatever_their_name(secret, shown):
    """Credentials in URLs and well-known token shapes are masked under any variable name,
    in the command, the exported variables and --mpi-args text."""
    argv = ["horovodrun", "-x", f"GH_PAT={secret}", "python", "t.py", f"--url={secret}"]
    line = format_command(argv, {"TRACKING": secret}, {})
    assert line.count(shown) == 3 and secret not in line, line
    assert secret not in redact_text(f"-x TRACKING_URI={secret} --bind-to none")
    assert redact_text("-x A=https://example.org/x") == "-x A=https://example.org/x"


def test_format_command_shortens_path_and_quotes():
    environ = {"PATH": "/usr/bin:/bin"}
    env = {"PATH": "/my venv/bin:/usr/bin:/bin"}
    line = format_command(["horovodrun", "-np", "2", "python", "-c", "print('hi')"], env, environ)
    assert (
        line == "PATH='/my venv/bin:'\"$PATH\" horovodrun -np 2 python -c 'print('\"'\"'hi'\"'\"')'"
    )


def test_each_backend_is_one_builder_in_one_table():
    from hvdtrain.launcher.commands import BACKENDS, COMMANDS, program_for

    assert tuple(COMMANDS) == BACKENDS and all(program_for(b) for b in BACKENDS)
