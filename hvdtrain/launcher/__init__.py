"""The launcher side of hvdtrain: hosts, commands, SLURM, doctor, Kubernetes; never TensorFlow.

    hvdtrain-run -np 2 -- python -m hvdtrain.mnist             # this host, horovodrun --gloo
    hvdtrain-run --hostfile hosts.txt --backend mpirun -- python -m hvdtrain.mnist
    hvdtrain-run doctor --hostfile hosts.txt                   # check the hosts first
    hvdtrain-run --elastic --hostfile hosts.txt -- python -m hvdtrain.mnist --elastic
    hvdtrain-run k8s --workers 2 --gpus-per-worker 4 > mpijob.yaml

Modules: `hosts` (-H and hostfiles), `slurm` (allocations), `commands` (pure builders:
config -> argv and environment), `elastic` (`--elastic`: horovodrun's elastic flags and the
discovery script), `doctor` (host checks), `kubernetes` (MPIJob YAML), `cli` (the
`hvdtrain-run` console script), `supervise` (running the job), `tags` (a rank's pieces of a
line joined), `notebook` (`hvdtrain.launch`: a function run on the ranks) and `run_fn` (its
rank's side). None of them imports TensorFlow or Horovod.
"""

from hvdtrain.launcher.commands import LaunchConfig, build_command, format_command
from hvdtrain.launcher.hosts import Host, parse_hostfile_text, parse_hosts_arg, read_hostfile
from hvdtrain.launcher.kubernetes import render_mpijob
from hvdtrain.launcher.slurm import detect_allocation, expand_nodelist

__all__ = [
    "Host",
    "LaunchConfig",
    "build_command",
    "detect_allocation",
    "expand_nodelist",
    "format_command",
    "parse_hostfile_text",
    "parse_hosts_arg",
    "read_hostfile",
    "render_mpijob",
]
