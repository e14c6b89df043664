"""`hvdtrain-run k8s`: the MPIJob parses, and its fields agree with each other."""

import os
import subprocess
import sys

import pytest
import yaml

from hvdtrain.errors import HvdtrainError
from hvdtrain.launcher import cli
from hvdtrain.launcher.kubernetes import HOSTFILE, launcher_command, render_mpijob

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(os.path.dirname(sys.executable), "hvdtrain-run")


def check_job(job, workers, gpus, image="hvdtrain:latest", command=None):
    """The fields the MPI Operator needs, and that they agree with each other."""
    assert job["apiVersion"] == "kubeflow.org/v2beta1" and job["kind"] == "MPIJob"
    assert job["metadata"]["name"]
    spec = job["spec"]
    assert spec["slotsPerWorker"] == gpus
    assert spec["runPolicy"]["cleanPodPolicy"] == "Running"
    assert spec["sshAuthMountPath"].endswith("/.ssh")
    launcher, worker = spec["mpiReplicaSpecs"]["Launcher"], spec["mpiReplicaSpecs"]["Worker"]
    assert launcher["replicas"] == 1 and worker["replicas"] == workers
    (lc,) = launcher["template"]["spec"]["containers"]
    (wc,) = worker["template"]["spec"]["containers"]
    assert lc["image"] == wc["image"] == image
    assert wc["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert "resources" not in lc  # the launcher needs no GPU
    assert "sshd" in wc["command"][0]
    argv = lc["command"]
    assert all(isinstance(word, str) for word in argv)
    assert argv[:3] == ["hvdtrain-run", "--backend", "mpirun"]
    assert argv[argv.index("-np") + 1] == str(workers * gpus)
    assert argv[argv.index("--hostfile") + 1] == HOSTFILE
    if command is not None:
        assert argv[argv.index("--") + 1 :] == list(command)
    return argv


@pytest.mark.parametrize("workers, gpus", [(1, 1), (2, 4), (16, 8)])
def test_render_is_consistent(workers, gpus):
    job = yaml.safe_load(render_mpijob(workers, gpus))
    check_job(job, workers, gpus, command=["python", "-m", "hvdtrain.mnist"])


def test_render_image_command_name_and_strings():
    command = ["python", "-c", 'print("a: b # c")', "--x=$HOME", "'q'", "yes", "1", ""]
    text = render_mpijob("3", "2", image="reg.io/team/hvdtrain:0.1.0", command=command, name="mn-1")
    job = yaml.safe_load(text)
    check_job(job, 3, 2, image="reg.io/team/hvdtrain:0.1.0", command=command)
    assert job["metadata"]["name"] == "mn-1"


@pytest.mark.parametrize("bad", [0, -1, "0", "-2", "two", "1.5", 1.5, True, "", None])
@pytest.mark.parametrize("which", ["--workers", "--gpus-per-worker"])
def test_bad_counts(bad, which):
    args = {"workers": 2, "gpus_per_worker": 2}
    args["workers" if which == "--workers" else "gpus_per_worker"] = bad
    with pytest.raises(HvdtrainError) as info:
        render_mpijob(**args)
    message = str(info.value)
    assert message.startswith(f"Invalid value for `{which}`: received ")
    assert "expected a positive integer" in message and "\n" not in message


@pytest.mark.parametrize("name", ["Hvd", "-x", "a_b", ""])
def test_bad_name(name):
    with pytest.raises(HvdtrainError, match="`--name`"):
        render_mpijob(1, 1, name=name)


def test_launch_file_is_the_default_render():
    with open(os.path.join(ROOT, "launch", "mpijob.yaml"), encoding="utf-8") as f:
        assert f.read() == render_mpijob(2, 1)


def test_launcher_command_runs_over_the_operators_hostfile(tmp_path):
    """The launcher's hvdtrain-run command is valid for the hostfile the operator writes."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"job-worker-{i}.job.ns.svc slots=4\n" for i in range(3)))
    argv = launcher_command(12, ["python", "-m", "hvdtrain.mnist"])
    argv[argv.index("--hostfile") + 1] = str(hostfile)
    config = cli.make_config(cli.parse_args(argv[1:]), {"PATH": "/usr/bin"})
    assert config.backend == "mpirun" and config.np == 12 and len(config.hosts) == 3


def test_cli_renders(capsys):
    assert cli.main(["k8s", "--workers", "2", "--gpus-per-worker", "8", "--image", "i:1"]) == 0
    check_job(yaml.safe_load(capsys.readouterr().out), 2, 8, image="i:1")
    cli.main(["k8s", "--workers", "1", "--gpus-per-worker", "1", "--", "python", "t.py", "-x"])
    check_job(yaml.safe_load(capsys.readouterr().out), 1, 1, command=["python", "t.py", "-x"])


@pytest.mark.parametrize(
    "args, words",
    [
        (["--workers", "0", "--gpus-per-worker", "1"], "Invalid value for `--workers`: received"),
        (["--workers", "2", "--gpus-per-worker", "-4"], "`--gpus-per-worker`: received '-4'"),
        (["--workers", "x", "--gpus-per-worker", "1"], "received 'x'; expected a positive"),
        (["--gpus-per-worker", "1"], "the following arguments are required: --workers"),
    ],
)
def test_cli_errors_are_one_line(args, words):
    proc = subprocess.run([RUN, "k8s", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hvdtrain-run: error: ") and words in lines[0]
