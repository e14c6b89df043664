"""`hvdtrain-run k8s`: an MPIJob for the Kubeflow MPI Operator (kubeflow.org/v2beta1).

    hvdtrain-run k8s --workers 2 --gpus-per-worker 4 > mpijob.yaml
    hvdtrain-run k8s --workers 4 --gpus-per-worker 8 --image registry/hvdtrain:0.1.0 \\
        -- python -m hvdtrain.mnist --epochs 5 --checkpoint-dir /ckpt
    kubectl apply -f mpijob.yaml && kubectl logs -f job/hvdtrain-launcher

W worker pods each run sshd and get G GPUs (`nvidia.com/gpu: G`, `slotsPerWorker: G`).
One launcher pod runs `hvdtrain-run --backend mpirun --hostfile /etc/mpi/hostfile -np W*G
-- COMMAND`: the operator writes that hostfile (`...-worker-0... slots=G`) and the ssh
keys (`sshAuthMountPath`), and mpirun starts the ranks on the workers over ssh.
The pods fit the repository's Dockerfile: user `hvd` (uid 1000, keys in /home/hvd/.ssh),
workers running `/usr/sbin/sshd -De -f /home/hvd/.sshd_config` (port 2222). For an image
that runs as root, keep the keys in root's home (`~/.ssh`), drop `runAsUser` and run
plain `/usr/sbin/sshd -De`.
`launch/mpijob.yaml` is this render with 2 workers of 1 GPU.
"""

import json
import re
import shlex
import string

from hvdtrain.errors import invalid_value
from hvdtrain.launcher.hosts import MAX_PROCESSES
from hvdtrain.runtime.numbers import whole_number

__all__ = ["DEFAULT_IMAGE", "DEFAULT_COMMAND", "HOSTFILE", "launcher_command", "render_mpijob"]

DEFAULT_IMAGE = "hvdtrain:latest"
DEFAULT_COMMAND = ("python", "-m", "hvdtrain.mnist")
HOSTFILE = "/etc/mpi/hostfile"

_TEMPLATE = string.Template("""\
# Kubeflow MPI Operator job: $workers worker pod(s) x $gpus GPU(s) = $np Horovod ranks.
# Rendered by: $rendered_by
#   kubectl apply -f this.yaml; kubectl logs -f job/$name-launcher; kubectl delete mpijob $name
apiVersion: kubeflow.org/v2beta1
kind: MPIJob
metadata:
  name: $name
spec:
  slotsPerWorker: $gpus  # ranks per worker pod = GPUs per worker
  runPolicy:
    cleanPodPolicy: Running  # delete the worker pods once the launcher ends
  sshAuthMountPath: /home/hvd/.ssh  # the operator's ssh keys, for the image's user hvd
  mpiReplicaSpecs:
    Launcher:
      replicas: 1
      template:
        spec:
          containers:
            - name: launcher
              image: $image
              securityContext:
                runAsUser: 1000  # the image's user hvd
              env:
                - name: TF_USE_LEGACY_KERAS  # Keras 2 for tf.keras: Horovod has no Keras 3 path
                  value: "1"
              # mpirun -np $np over the operator's hostfile ($hostfile)
              command: $command
    Worker:
      replicas: $workers
      template:
        spec:
          containers:
            - name: worker
              image: $image
              securityContext:
                runAsUser: 1000
              env:
                - name: TF_USE_LEGACY_KERAS  # the ranks also get it from mpirun's -x
                  value: "1"
              # sshd on port 2222 as hvd; the launcher's mpirun starts the ranks through it
              command: ["/usr/sbin/sshd", "-De", "-f", "/home/hvd/.sshd_config"]
              resources:
                limits:
                  nvidia.com/gpu: $gpus
""")


def _count(value, flag):
    """A positive int from an int or its digits, else the one-line error."""
    return whole_number(value, flag, 1, MAX_PROCESSES, bound=True)


def launcher_command(np, command=DEFAULT_COMMAND):
    """What the launcher pod runs: hvdtrain-run with plain mpirun over the operator's hosts."""
    return [
        "hvdtrain-run",
        "--backend",
        "mpirun",
        "--hostfile",
        HOSTFILE,
        "-np",
        str(np),
        "--",
    ] + list(command)


def render_mpijob(
    workers, gpus_per_worker, image=DEFAULT_IMAGE, command=DEFAULT_COMMAND, name="hvdtrain"
):
    """The MPIJob's YAML text (pure).

    Args:
        workers: worker pods, a positive integer (an int or its decimal string).
        gpus_per_worker: GPUs (and ranks) per worker pod, a positive integer.
        image: the container image for the launcher and the workers.
        command: the training command every rank runs.
        name: the MPIJob's name, a DNS-1123 label (lower case, digits, '-').

    Raises:
        HvdtrainError: a count that is not a positive integer, a bad name, image or command.
    """
    workers = _count(workers, "--workers")
    gpus = _count(gpus_per_worker, "--gpus-per-worker")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?", name or ""):
        raise invalid_value("--name", name, "a DNS-1123 name: lower case letters, digits, '-'")
    if not image or re.search(r"\s", image):
        raise invalid_value("--image", image, "a container image such as hvdtrain:latest")
    command = list(command or DEFAULT_COMMAND)
    np = workers * gpus
    argv = ["hvdtrain-run", "k8s", "--workers", str(workers), "--gpus-per-worker", str(gpus)]
    if image != DEFAULT_IMAGE:
        argv += ["--image", image]
    if name != "hvdtrain":
        argv += ["--name", name]
    rendered_by = shlex.join(argv + ["--"] + command).replace("\n", " ")
    return _TEMPLATE.substitute(
        name=name,
        workers=workers,
        gpus=gpus,
        np=np,
        image=json.dumps(image),
        hostfile=HOSTFILE,
        command=json.dumps(launcher_command(np, command)),
        rendered_by=rendered_by,
    )
