"""A Gloo job's rendezvous lets in only the job (docs/launching.md, "What a job
exposes"): horovodrun's HTTP store listens only where the ranks reach it and refuses (403)
a request without the job's token or from an address that is not one of the job's hosts;
the token never shows. The elastic services' own checks (Horovod's HMAC) are tested too."""

import contextlib
import http.client
import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import time
from functools import partial

import psutil
import pytest
from conftest import BIN, job_env, launch_argv, run_job, start_job, worker
from horovod.runner.common.util import secret
from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.common.util.network import PingRequest
from horovod.runner.driver.driver_service import HorovodRunDriverService
from horovod.runner.http.http_server import TOKEN_HEADER, RendezvousServer
from horovod.runner.task.task_service import HorovodRunTaskService

from hvdtrain.bench.netns import NamespaceHosts, cannot_make_namespaces
from hvdtrain.launcher.commands import is_secret, redact_text

JOB = ["-m", "hvdtrain.mnist", "--deterministic", "--epochs", "1", "--limit-samples", "1024",
       "--threads", "1"]  # fmt: skip
# What a probe may see from a server that refuses it: 403, or the server gone at the end,
# or no answer within the probe's 5 s (seen once on a loaded machine): never a 200.
REFUSED = {"403", "refused", "ConnectionResetError", "RemoteDisconnected", "BrokenPipeError",
           "TimeoutError"}  # fmt: skip


def _ask(port, method, path, body=None, token=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, body=body, headers={TOKEN_HEADER: token} if token else {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_the_server_answers_only_its_token_from_its_hosts(capfd):
    server = RendezvousServer()
    port = server.start(host="127.0.0.1", token="job-token")
    server.init(get_host_assignments(parse_hosts("localhost:2"), 2))
    try:
        assert server._httpd.server_address == ("127.0.0.1", port)  # not every interface
        assert _ask(port, "PUT", "/global/0", b"rank 0", token="job-token")[0] == 200
        for token in (None, "wrong", "job-token-", "JOB-TOKEN"):
            assert _ask(port, "GET", "/global/0", token=token)[0] == 403
            assert _ask(port, "PUT", "/global/0", b"garbage", token=token)[0] == 403
            assert _ask(port, "DELETE", "/global/0", token=token)[0] == 403
        assert _ask(port, "GET", "/global/0", token="job-token") == (200, b"rank 0")
        # An address that none of the job's hosts resolves to: refused, even with the token.
        httpd = server._httpd
        assert httpd.refusal("192.0.2.7", "job-token") == "not one of the job's hosts"
        assert httpd.refusal("127.0.0.1", "job-token") is None
    finally:
        server.stop()
    err = capfd.readouterr().err
    # One line per refused address, and never the token.
    refused = "horovodrun: refused a rendezvous request from"
    assert err.count(f"{refused} 127.0.0.1: it lacks the job's token") == 1
    assert f"{refused} 192.0.2.7: not one of the job's hosts" in err
    assert "job-token" not in err


def test_a_server_started_without_a_token_answers_as_before():
    """Horovod's other users of the server (Spark, Ray) start it without a token."""
    server = RendezvousServer()
    port = server.start()
    server.init(get_host_assignments(parse_hosts("localhost:1"), 1))
    try:
        assert server._httpd.server_address[0] == "0.0.0.0"
        assert _ask(port, "PUT", "/s/k", b"v")[0] == 200 and _ask(port, "GET", "/s/k") == (
            200,
            b"v",
        )
    finally:
        server.stop()


def test_a_workers_service_refuses_an_unsigned_request_in_one_line_counted(capfd):
    """An elastic worker's notification service (Horovod's, made as `hvdtrain.fit` makes it
    under --elastic): each refused request is one line on stderr, not socketserver's
    20-line traceback (issue 51)."""
    from horovod.runner.common.util.network import BasicService

    from hvdtrain.recipe.elastic import quiet_refusals

    quiet_refusals()
    made = BasicService("worker notification service", secret.make_secret_key(), None)
    try:
        assert _unsigned(made.get_port()) == b"" and _unsigned(made.get_port()) == b""
    finally:
        made.shutdown()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Security error" not in err
    lines = [line for line in err.splitlines() if "refused a request" in line]
    assert len(lines) == 2, err
    said = "Horovod's worker notification service refused a request from 127.0.0.1: not signed "
    assert all(said + "with this job's key (" in line for line in lines), lines
    counts = [int(line.rsplit("(", 1)[1].split()[0]) for line in lines]
    assert counts[1] == counts[0] + 1  # counted (over the process's services)


@pytest.mark.parametrize("service", ["driver", "task"])
def test_horovodruns_own_services_answer_only_requests_signed_with_the_jobs_key(service):
    """The driver and task services horovodrun starts to find the hosts' common interfaces
    (Horovod's, real, in this process) listen on every interface and answer only requests
    signed (HMAC) with the job's key: unsigned, the connection closes unanswered."""
    key = secret.make_secret_key()
    made = HorovodRunDriverService(1, key, None) if service == "driver" else None
    made = made or HorovodRunTaskService(0, key, None)
    try:
        assert made._server.server_address[0] == "0.0.0.0"
        assert _unsigned(made.get_port()) == b""
        assert _unsigned(made.get_port(), key) != b""  # the same request, signed: answered
    finally:
        made.shutdown()


def test_the_token_is_masked_in_what_hvdtrain_run_prints():
    assert is_secret("HOROVOD_GLOO_RENDEZVOUS_TOKEN")
    line = redact_text("horovodrun -x HOROVOD_GLOO_RENDEZVOUS_TOKEN=0123abcd python t.py")
    assert "0123abcd" not in line and "HOROVOD_GLOO_RENDEZVOUS_TOKEN" in line


def _rank_processes(launcher):
    """{process: its environment} for the ranks under `launcher` now: the processes that
    hold the rendezvous variables (one may start, or end, between two calls)."""
    found = {}
    for p in launcher.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            env = p.environ()
            if "HOROVOD_RANK" in env and "HOROVOD_GLOO_RENDEZVOUS_PORT" in env:
                found[p] = env
    return found


def _ranks(launcher, count):
    """{pid: environment} of the rank processes under `launcher` once `count` of them hold
    the rendezvous variables (polls the process tree; fails after 120 s)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = _rank_processes(launcher)
        if len(found) == count:
            return {p.pid: env for p, env in found.items()}
        psutil.wait_procs([launcher], timeout=0.1)
    pytest.fail(f"the ranks of {launcher.pid} did not start")


def _probe(address, port, launcher_pid, unpickled, token=None, where=list, env=None):
    """rendezvous_probe.py: until the launcher ends, requests from outside the job; it puts
    a value that creates the file `unpickled` if the server unpickles it. `where(argv)` is
    the command that runs argv there (another host)."""
    argv = [sys.executable, worker("rendezvous_probe.py"), address, str(port),
            str(launcher_pid), str(unpickled)] + ([token] if token else [])  # fmt: skip
    return subprocess.Popen(where(argv), env=env, stdout=subprocess.PIPE, text=True)


def _refused_and_unchanged(out, probes, unpickled, metrics, reference):
    """Once the job has ended: it succeeded, each probe was answered only with refusals
    (at least once per kind of request), nothing it sent was unpickled, and the ranks hold
    the weights of the reference run. Returns the job's output."""
    code = out.rest()
    answers = [json.loads(p.communicate(timeout=330)[0]) for p in probes]
    text = "".join(out.lines)
    assert code == 0, text[-6000:]
    for a in answers:
        assert set(a["answers"]) <= REFUSED and a["answers"].get("403", 0) >= 7, a
    assert not unpickled.exists()  # what the probes sent was never unpickled
    m, ref = json.loads(metrics.read_text()), json.loads(reference.read_text())
    assert {r["weights_digest"] for r in m["ranks"]} == {ref["ranks"][0]["weights_digest"]}
    assert len(m["ranks"]) == 2
    return text


def test_a_gloo_job_refuses_probes_and_trains_to_the_same_weights(tmp_path):
    """While a 2-rank Gloo job starts and trains, two processes on this host (one without a
    token, one with a wrong one) read, overwrite and delete the ranks' entries as fast as
    they can: every request is refused, and the job ends on the weights of a run without
    them. The server listens on loopback only, and the token never shows."""
    reference = tmp_path / "reference.json"
    run_job(2, "gloo", [*JOB, "--metrics-json", str(reference)])

    metrics, ckpt = tmp_path / "m.json", tmp_path / "ckpt"
    argv = [*launch_argv(2, "gloo"), "--verbose", sys.executable, *JOB,
            "--metrics-json", str(metrics), "--checkpoint-dir", str(ckpt)]  # fmt: skip
    proc, out = start_job(argv)
    launcher = psutil.Process(proc.pid)
    ranks = _ranks(launcher, 2)
    (env,) = {(e["HOROVOD_GLOO_RENDEZVOUS_ADDR"], e["HOROVOD_GLOO_RENDEZVOUS_PORT"],
               e["HOROVOD_GLOO_RENDEZVOUS_TOKEN"]) for e in ranks.values()}  # fmt: skip
    address, port, token = env[0], int(env[1]), env[2]
    assert address == "127.0.0.1" and len(token) >= 32
    unpickled = tmp_path / "unpickled"
    probes = [_probe(address, port, proc.pid, unpickled),
              _probe(address, port, proc.pid, unpickled, "0" * 32)]  # fmt: skip

    listening = {c.laddr for c in launcher.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert listening == {("127.0.0.1", port)}  # not 0.0.0.0
    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not a.address.startswith("127.")]  # fmt: skip
    for other in others:  # this host's other addresses: nothing listens there
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((other, port), timeout=5).close()
    commands = [" ".join(p.cmdline()) for p in [launcher, *launcher.children(recursive=True)]]

    text = _refused_and_unchanged(out, probes, unpickled, metrics, reference)
    assert "refused a rendezvous request from 127.0.0.1: it lacks the job's token" in text

    # The token: not in the output (horovodrun --verbose prints the ranks' commands), the
    # launcher's or the ranks' command lines, the metrics, or a checkpoint's files.
    assert token not in text
    assert not [c for c in commands if token in c]
    assert token not in metrics.read_text()
    for f in ckpt.rglob("*"):
        assert not f.is_file() or token.encode() not in f.read_bytes(), f


def _listening(processes):
    """The TCP addresses the processes listen on."""
    found = set()
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            found |= {c.laddr for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    return found


def _services(launcher):
    """The ports the ranks under `launcher` listen on on every interface."""
    return {a.port for a in _listening(_rank_processes(launcher)) if a.ip == "0.0.0.0"}


def _unsigned(port, key=None):
    """What a Horovod service (HMAC-signed requests) answers a PingRequest written as
    Horovod's Wire writes it, signed with `key`, or with a digest of zeros."""
    message = pickle.dumps(PingRequest())
    digest = secret.compute_digest(key, message) if key else b"\0" * secret.DIGEST_LENGTH
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(digest + struct.pack("i", len(message)) + message)
        s.shutdown(socket.SHUT_WR)
        return s.recv(4096)


@pytest.mark.slow
def test_an_elastic_job_refuses_probes_and_its_services_refuse_unsigned_requests(tmp_path):
    """An elastic job's rendezvous listens on the chosen interface only and refuses probes
    as a static job's does; each worker's notification service (Horovod's, on every
    interface) answers nothing to a request without Horovod's secret; the job ends on the
    weights of an elastic run without the probes."""
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\n")
    discover.chmod(0o755)

    def elastic(metrics):  # three epochs: the workers' services stay up a while
        argv = [os.path.join(BIN, "hvdtrain-run"), "--elastic", "--min-np", "2", "--max-np", "2",
                "--host-discovery-script", str(discover), "--network-interface", "lo", "--",
                sys.executable, *JOB, "--elastic", "--metrics-json", str(metrics),
                "--epochs", "3"]  # fmt: skip
        return start_job(argv, job_env(HOROVOD_GLOO_TIMEOUT_SECONDS="60"))

    reference = tmp_path / "reference.json"
    proc, out = elastic(reference)
    assert out.rest() == 0, "".join(out.lines[-60:])

    metrics = tmp_path / "m.json"
    proc, out = elastic(metrics)
    launcher = psutil.Process(proc.pid)
    ranks = _ranks(launcher, 2)
    (env,) = {(e["HOROVOD_GLOO_RENDEZVOUS_ADDR"], e["HOROVOD_GLOO_RENDEZVOUS_PORT"])
              for e in ranks.values()}  # fmt: skip
    address, port = env[0], int(env[1])
    unpickled = tmp_path / "unpickled"
    probes = [_probe(address, port, proc.pid, unpickled),
              _probe(address, port, proc.pid, unpickled, "0" * 32)]  # fmt: skip
    launchers = [launcher, *(p for p in launcher.children(recursive=True) if p.pid not in ranks)]
    assert ("127.0.0.1", port) in _listening(launchers)
    assert not [a for a in _listening(launchers) if a.port == port and a.ip != "127.0.0.1"]

    # The workers' notification services (Horovod's, one per worker, on every interface)
    # answer only requests signed with Horovod's secret. Polled: a worker starts its service
    # once it has joined; each is asked as soon as it is seen, while its worker still runs.
    deadline, answers = time.monotonic() + 120, {}
    while len(answers) < 2 and time.monotonic() < deadline:
        for service in _services(launcher) - set(answers):
            answers[service] = _unsigned(service)
        psutil.wait_procs([launcher], timeout=0.2)
    assert list(answers.values()) == [b"", b""], answers

    _refused_and_unchanged(out, probes, unpickled, metrics, reference)
    text = "".join(out.lines)  # each refusal one line, no traceback (issue 51)
    assert "Security error" not in text and text.count("refused a request from") == 2, text


@pytest.mark.slow
def test_across_hosts_a_host_outside_the_job_is_refused_even_with_the_token(tmp_path):
    """Three namespace hosts; a Gloo job on the first two. The rendezvous listens on the
    first host's eth0 address only; the third host (not in the job) is refused even with
    the job's token, the second (in the job) without it; the remote rank got the token
    over ssh (what horovodrun --verbose prints says ***), and the job ends on the weights of
    a run (`hvdtrain-run`) without the probes."""
    why = cannot_make_namespaces()
    if why:
        pytest.skip(why)
    with NamespaceHosts(3, tmp_path / "hosts") as hosts:
        hostfile = tmp_path / "hosts.txt"
        hostfile.write_text("".join(f"{a} slots=1\n" for a in hosts.addresses[:2]))

        def job(metrics):
            return [os.path.join(BIN, "hvdtrain-run"), "--hostfile", str(hostfile),
                    "--backend", "gloo", "--network-interface", "eth0", "--",
                    sys.executable, *JOB, "--metrics-json", str(metrics)]  # fmt: skip

        env = hosts.env(HVDTRAIN_OFFLINE="1", TF_CPP_MIN_LOG_LEVEL="2")
        reference = tmp_path / "reference.json"
        proc = hosts.run(0, job(reference), timeout=300, **env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

        # The probed run: horovodrun itself, --verbose (it prints the ranks' commands).
        metrics = tmp_path / "m.json"
        hostlist = ",".join(f"{a}:1" for a in hosts.addresses[:2])
        verbose = [os.path.join(BIN, "horovodrun"), "-np", "2", "-H", hostlist, "--gloo",
                   "--network-interface", "eth0", "--verbose", sys.executable, *JOB,
                   "--metrics-json", str(metrics)]  # fmt: skip
        proc, out = start_job(hosts.inside(0, verbose), env=env)
        launcher = psutil.Process(proc.pid)
        ranks = _ranks(launcher, 1)  # the first host's rank; the other is under ssh there
        (rank,) = ranks.values()
        address, port = rank["HOROVOD_GLOO_RENDEZVOUS_ADDR"], rank["HOROVOD_GLOO_RENDEZVOUS_PORT"]
        token = rank["HOROVOD_GLOO_RENDEZVOUS_TOKEN"]
        assert address == hosts.addresses[0]
        unpickled = tmp_path / "unpickled"
        probes = [  # from the host outside the job, with the token; from the other, without
            _probe(address, port, proc.pid, unpickled, token, partial(hosts.inside, 2), env),
            _probe(address, port, proc.pid, unpickled, None, partial(hosts.inside, 1), env),
        ]
        text = _refused_and_unchanged(out, probes, unpickled, metrics, reference)
        assert f"from {hosts.addresses[2]}: not one of the job's hosts" in text
        assert f"from {hosts.addresses[1]}: it lacks the job's token" in text
        assert token not in text
        assert "HOROVOD_GLOO_RENDEZVOUS_TOKEN=***" in text  # the remote rank's command, shown
