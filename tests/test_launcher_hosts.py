"""Hosts for the launcher: -H, hostfiles in every dialect (and every mistake), SLURM."""

import os

import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.launcher.hosts import (
    Host,
    format_hosts,
    is_local,
    parse_hostfile_text,
    parse_hosts_arg,
    read_hostfile,
    total_slots,
)
from hvdtrain.launcher.slurm import detect_allocation, expand_nodelist, expand_tasks_per_node

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_hosts_arg():
    hosts = parse_hosts_arg("node1:4,node2:2,node3")
    assert hosts == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]
    assert total_slots(hosts) == 7
    assert format_hosts(hosts) == "node1:4,node2:2,node3:1"


@pytest.mark.parametrize("text", ["node1:0", "node1:-2", "node1:x", "a:2,,b:2", "", "a:2,a:2"])
def test_hosts_arg_errors(text):
    with pytest.raises(HvdtrainError, match=r"^Invalid value for `-H`: received .*; expected"):
        parse_hosts_arg(text)


def test_every_dialect_comments_and_blank_lines():
    text = """
# Open MPI / DeepSpeed / horovodrun
node1 slots=4
node2   slots=2    max_slots=8   # trailing comment
\t
node3:4
node4
10.0.0.5 slots=1
gpu-07.cluster.local:8\r
"""
    assert parse_hostfile_text(text, "h.txt") == [
        Host("node1", 4),
        Host("node2", 2),
        Host("node3", 4),
        Host("node4", 1),
        Host("10.0.0.5", 1),
        Host("gpu-07.cluster.local", 8),
    ]


def test_the_example_hostfile_parses():
    hosts = read_hostfile(os.path.join(ROOT, "launch", "hosts.example"))
    assert [h.name for h in hosts] == ["node1", "node2", "node3", "node4", "node5"]
    assert total_slots(hosts) == 15


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("node1 slots=4\nnode2 slot=4\n", 2, "cannot read 'node2 slot=4'"),
        ("node1 slots=0\n", 1, "slots '0' is not an integer from 1 to 1024"),
        ("node1 slots=-1\n", 1, "slots '-1' is not an integer from 1 to 1024"),
        ("node1 slots=two\n", 1, "slots 'two' is not an integer from 1 to 1024"),
        ("node1 slots=2.5\n", 1, "slots '2.5' is not an integer from 1 to 1024"),
        ("# c\nnode1:0\n", 2, "slots '0' is not an integer from 1 to 1024"),
        ("node1:x\n", 1, "slots 'x' is not an integer from 1 to 1024"),
        ("node1 slots=2 max_slots=0\n", 1, "max_slots '0' is not an integer from 1 to 1024"),
        ("node1 slots=2 extra\n", 1, "cannot read"),
        ("node1 node2\n", 1, "cannot read"),
        ("node1 slots=1\n\nnode2:2\nnode1:3\n", 4, "listed twice (first on line 1)"),
        ("-bad slots=1\n", 1, "cannot read"),
    ],
)
def test_hostfile_errors_name_file_and_line(text, line, words):
    with pytest.raises(HvdtrainError) as info:
        parse_hostfile_text(text, "hosts.txt")
    message = str(info.value)
    assert message.startswith(f"hosts.txt:{line}: ")
    assert words in message
    assert "\n" not in message


@pytest.mark.parametrize("text", ["", "\n\n", "# only\n  # comments\n\n"])
def test_hostfile_without_hosts(text):
    with pytest.raises(HvdtrainError, match=r"^hosts.txt: no hosts"):
        parse_hostfile_text(text, "hosts.txt")


def test_read_hostfile_missing_and_binary(tmp_path):
    with pytest.raises(HvdtrainError, match=r"^Invalid value for `--hostfile`: received .*nope"):
        read_hostfile(tmp_path / "nope")
    with pytest.raises(HvdtrainError, match="expected a readable hostfile"):
        read_hostfile(tmp_path)
    binary = tmp_path / "bin"
    binary.write_bytes(b"\xff\xfe\x00node")
    with pytest.raises(HvdtrainError, match="not a text file"):
        read_hostfile(binary)


def test_is_local():
    assert is_local("localhost") and is_local("127.0.0.1") and is_local("127.0.1.1")
    assert is_local("::1") and is_local("vm7", own_names=("vm7",))
    assert not is_local("node1", own_names=("vm7",))


# SLURM


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node1", ["node1"]),
        ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
        ("gpu-[001-002].cluster", ["gpu-001.cluster", "gpu-002.cluster"]),
    ],
)
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-", "node]1[", "n[3-1]", "n[a-b]", "a,,b", "n[[1]]", ""])
def test_expand_nodelist_errors(text):
    with pytest.raises(HvdtrainError, match=r"^Invalid value for `SLURM_JOB_NODELIST`"):
        expand_nodelist(text)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    for bad in ("", "2(x0)", "0", "x", "2(3)"):
        with pytest.raises(HvdtrainError, match="SLURM_TASKS_PER_NODE"):
            expand_tasks_per_node(bad)


def test_detect_allocation():
    assert detect_allocation({}) is None
    assert detect_allocation({"SLURM_JOB_ID": "7"}) is None  # no node list: not an allocation
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node[01-03],gpu5",
        "SLURM_TASKS_PER_NODE": "2(x3),1",
        "SLURM_NTASKS": "7",
    }
    alloc = detect_allocation(env)
    assert alloc.job_id == "42" and alloc.ntasks == 7
    assert alloc.hosts == [Host("node01", 2), Host("node02", 2), Host("node03", 2), Host("gpu5", 1)]


def test_detect_allocation_fallbacks():
    old = {"SLURM_JOBID": "1", "SLURM_NODELIST": "a,b", "SLURM_NTASKS_PER_NODE": "3"}
    assert detect_allocation(old).hosts == [Host("a", 3), Host("b", 3)]
    assert detect_allocation(old).ntasks == 6
    even = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "a,b", "SLURM_NTASKS": "4"}
    assert detect_allocation(even).hosts == [Host("a", 2), Host("b", 2)]
    bare = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "a,b"}
    assert detect_allocation(bare).hosts == [Host("a", 1), Host("b", 1)]


def test_detect_allocation_contradictions():
    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "a,b", "SLURM_TASKS_PER_NODE": "2(x3)"}
    with pytest.raises(HvdtrainError, match="3 task counts for the 2 hosts"):
        detect_allocation(env)
    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "a", "SLURM_NTASKS": "zero"}
    with pytest.raises(HvdtrainError, match="SLURM_NTASKS"):
        detect_allocation(env)
