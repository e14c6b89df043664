"""Two hosts for real: network namespaces with sshd, MNIST trained with ranks on both."""

import json

import pytest
from netns_hosts import NamespaceHosts, cannot_make_namespaces

why_not = cannot_make_namespaces()
pytestmark = pytest.mark.skipif(why_not is not None, reason=why_not or "")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with NamespaceHosts(2, tmp_path_factory.mktemp("hosts")) as h:
        yield h


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_mnist_epoch_with_ranks_on_two_hosts(hosts, backend, tmp_path):
    import sys

    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(
        "# two namespace hosts\n" + "".join(f"{a} slots=1\n" for a in hosts.addresses)
    )
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.json"
    argv = [
        "horovodrun",
        "-np",
        "2",
        "-H",
        hosts.hostlist(1),
        f"--{backend}",
        "--network-interface",
        "eth0",
        sys.executable,
        "-m",
        "hvdtrain.mnist",
        "--epochs",
        "1",
        "--limit-samples",
        "2048",
        "--checkpoint-dir",
        str(ckpt),
        "--metrics-json",
        str(metrics),
    ]
    proc = hosts.run(0, argv, timeout=300, HVDTRAIN_OFFLINE="1", TF_CPP_MIN_LOG_LEVEL="2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    m = json.loads(metrics.read_text())
    by_host = {r["hostname"]: r for r in m["ranks"]}
    assert set(by_host) == set(hosts.hostnames)
    assert {r["local_rank"] for r in m["ranks"]} == {0}  # local rank 0 on each host
    assert len({r["weights_sha256"] for r in m["ranks"]}) == 1
    manifest = json.loads((ckpt / "epoch-0001" / "manifest.json").read_text())
    rank0 = next(r for r in m["ranks"] if r["rank"] == 0)
    assert manifest["written_by"] == {"host": rank0["hostname"], "pid": rank0["pid"]}
