"""`hvdtrain-run doctor`: is every host ready, and does it match the launch host?

    hvdtrain-run doctor                             # this host (or the SLURM allocation)
    hvdtrain-run doctor -H node1:4,node2:4
    hvdtrain-run doctor --hostfile hosts.txt --python /opt/venv/bin/python
    hvdtrain-run --doctor --hostfile hosts.txt      # the same, as an option

For each host it runs a small probe, locally for localhost/127.0.0.1/this host's name and
otherwise over `ssh -o BatchMode=yes -o ConnectTimeout=5 host PYTHON -c ...` (PYTHON is
the launcher's own `sys.executable` unless `--python` is given). The probe never imports
TensorFlow: it reads versions with `importlib.metadata`, runs `horovodrun --check-build`
(as `PYTHON -m horovod.runner.launch --check-build`; frameworks count as built only when
their extension library exists, since --check-build claims PyTorch whenever
`horovod.torch` imports) and counts `/dev/nvidia[0-9]*` (or `nvidia-smi -L`). Then it
prints one line per host::

    launch host vm: ok (Python 3.12.1, TensorFlow 2.21.0 (tf-keras 2.21.0), Horovod 0.28.1 [...
    node1: ok (Python 3.12.1, TensorFlow 2.21.0 (tf-keras 2.21.0), Horovod 0.28.1 [TensorF...
    node2: problem: Horovod 0.28.0 (launch host: 0.28.1); Horovod built without MPI
    doctor: problem on 1 of 3 hosts (node2)

and exits 1 when any host has a problem: unreachable, a package missing (tf-keras too, from
TensorFlow 2.16 on), Horovod built without TensorFlow, Gloo or MPI, a hostname that does
not resolve (Horovod's Gloo crashes on it), versions that differ from the launch host
(Python by major.minor; TensorFlow, tf-keras, Horovod and hvdtrain exactly), Horovod of
another build than the launch host's (its local version, `0.28.1+hvdtrain.<key>`, names
the build: docs/horovod-wheel.md), or more slots than GPUs.
"""

import base64
import concurrent.futures
import json
import shlex
import subprocess

from hvdtrain.launcher.hosts import is_local
from hvdtrain.runtime.compat import keras_problem

__all__ = [
    "PROBE",
    "MARKER",
    "REQUIRED_BUILD",
    "PACKAGES",
    "probe_argv",
    "ssh_argv",
    "unreachable",
    "parse_probe",
    "run_probe",
    "host_problems",
    "summary",
    "host_line",
    "final_line",
    "run_doctor",
]

MARKER = "HVDTRAIN_DOCTOR "
REQUIRED_BUILD = ("TensorFlow", "Gloo", "MPI")
PACKAGES = (("tensorflow", "TensorFlow"), ("horovod", "Horovod"), ("hvdtrain", "hvdtrain"))

# Runs on every host under the Python that will train there; standard library only.
PROBE = r"""
import glob, importlib.metadata as md, importlib.util, json, os, platform, re, shutil, socket
import subprocess, sys

def version(*names):
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            pass
    return None

report = {
    "hostname": socket.gethostname(),
    "executable": sys.executable,
    "python": platform.python_version(),
    "tensorflow": version("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "intel-tensorflow"),
    "tf_keras": version("tf-keras", "tf_keras"),
    "horovod": version("horovod"),
    "hvdtrain": version("hvdtrain"),
    "build": {},
}
gpus = len(glob.glob("/dev/nvidia[0-9]*"))
if not gpus and shutil.which("nvidia-smi"):
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        gpus = sum(line.startswith("GPU ") for line in out.stdout.splitlines())
    except (OSError, subprocess.SubprocessError):
        pass
report["gpus"] = gpus
try:
    socket.getaddrinfo(report["hostname"], None)
    report["hostname_resolves"] = True
except OSError:
    report["hostname_resolves"] = False
if report["horovod"]:
    try:
        out = subprocess.run(
            [sys.executable, "-m", "horovod.runner.launch", "--check-build"],
            capture_output=True, text=True, timeout=__TIMEOUT__,
        )
        for line in out.stdout.splitlines():
            found = re.match(r"\s*\[([Xx ])\]\s+(\S+)", line)
            if found:
                report["build"][found.group(2)] = found.group(1) != " "
        if not report["build"]:
            tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
            report["check_build_error"] = f"exit {out.returncode}: {tail[:200]}"
    except (OSError, subprocess.SubprocessError) as e:
        report["check_build_error"] = str(e)[:200]
    # --check-build counts a framework as built when `import horovod.torch` works, which it
    # can with no PyTorch extension: a framework is built when its extension library exists.
    spec = importlib.util.find_spec("horovod")
    where = list(spec.submodule_search_locations or []) if spec else []
    for name, lib in (("TensorFlow", "tensorflow/mpi_lib"), ("PyTorch", "torch/mpi_lib_v2"),
                      ("MXNet", "mxnet/mpi_lib")):
        if report["build"] and where:
            report["build"][name] = bool(glob.glob(os.path.join(where[0], lib + "*.so")))
print("__MARKER__" + json.dumps(report))
"""


def _probe_source(timeout):
    return PROBE.replace("__TIMEOUT__", str(max(1, int(timeout)))).replace("__MARKER__", MARKER)


def probe_argv(host, python, local, ssh_port=None, ssh_identity_file=None, timeout=110):
    """The command that probes `host` with `python`: `python -c PROBE` when `local`, else
    `ssh -o BatchMode=yes -o ConnectTimeout=5 [-p P] [-i F] host 'python -c ...'`.

    Over ssh the probe travels base64-encoded, so any login shell (sh, bash, zsh, csh)
    passes it through unchanged.
    """
    source = _probe_source(timeout)
    if local:
        return [python, "-c", source]
    encoded = base64.b64encode(source.encode()).decode()
    remote = [python, "-c", f"import base64; exec(base64.b64decode('{encoded}').decode())"]
    return ssh_argv(host, ssh_port, ssh_identity_file) + [shlex.join(remote)]


def ssh_argv(host, ssh_port=None, ssh_identity_file=None):
    """`ssh -o BatchMode=yes -o ConnectTimeout=5 [-p P] [-i F] host`: never prompts."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
    if ssh_port:
        argv += ["-p", str(ssh_port)]
    if ssh_identity_file:
        argv += ["-i", ssh_identity_file]
    return argv + [host]


def unreachable(hosts, ssh_port=None, ssh_identity_file=None, timeout=20):
    """{host: why} for each of `hosts` where `ssh host true` fails (all tried at once): the
    check `hvdtrain-run` makes before launching on other hosts."""

    def attempt(host):
        argv = ssh_argv(host, ssh_port, ssh_identity_file) + ["true"]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            return f"ssh did not answer within {timeout} s"
        except OSError as e:
            return f"cannot run ssh: {e.strerror or e}"
        return None if done.returncode == 0 else _last_line(done.stderr)

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts) or 1)) as pool:
        results = dict(zip(hosts, pool.map(attempt, hosts), strict=True))
    return {host: why for host, why in results.items() if why}


def _last_line(text):
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def parse_probe(returncode, stdout, stderr, via_ssh):
    """The probe's report (a dict), or {"error": "..."} saying what went wrong."""
    for line in reversed((stdout or "").splitlines()):
        if line.startswith(MARKER):
            try:
                return json.loads(line[len(MARKER) :])
            except ValueError:
                break
    if returncode is None:
        return {"error": "the probe timed out"}
    if via_ssh and returncode == 255:
        return {"error": f"ssh failed: {_last_line(stderr)}"}
    return {"error": f"probe failed (exit {returncode}): {_last_line(stderr)}"}


def run_probe(argv, timeout=120):
    """Runs one probe command and parses what it printed (see `parse_probe`)."""
    via_ssh = argv[0] == "ssh"
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return parse_probe(None, "", "", via_ssh)
    except OSError as e:
        return {"error": f"cannot run {argv[0]}: {e.strerror or e}"}
    return parse_probe(done.returncode, done.stdout, done.stderr, via_ssh)


def _python_minor(version):
    return ".".join((version or "").split(".")[:2])


def _version_problem(label, mine, theirs):
    """Horovod's local version is its build (`0.28.1+hvdtrain.<key>`: hvdtrain's patches,
    TensorFlow, Python, MPI; docs/horovod-wheel.md): the same release built otherwise, or
    without the patches, is named as another build. A rank of another build may not even
    reach the job (its rendezvous wants the patches' token)."""
    if label == "Horovod" and mine.split("+")[0] == theirs.split("+")[0]:
        return (
            f"Horovod {mine} is not the launch host's build ({theirs}); install the launch "
            "host's wheel there (make horovod-wheel, docs/horovod-wheel.md)"
        )
    return f"{label} {mine} (launch host: {theirs})"


def host_problems(report, reference=None, slots=None):
    """What is wrong with one host's `report`, compared with the launch host's `reference`.

    Pure. Returns a list of short phrases, empty when the host is ready.
    """
    if report.get("error"):
        return [report["error"]]
    problems = []
    for key, label in PACKAGES:
        if not report.get(key):
            problems.append(f"{label} not installed for {report.get('executable', 'python')}")
    if reference and not reference.get("error"):
        if _python_minor(report.get("python")) != _python_minor(reference.get("python")):
            problems.append(
                f"Python {report.get('python')} (launch host: {reference.get('python')})"
            )
        for key, label in PACKAGES:
            mine, theirs = report.get(key), reference.get(key)
            if mine and theirs and mine != theirs:
                problems.append(_version_problem(label, mine, theirs))
    tf_version, has_tf_keras = report.get("tensorflow"), bool(report.get("tf_keras"))
    keras = tf_version and keras_problem(tf_version, has_tf_keras, None, None, None)
    if keras:
        problems.append(keras)
    if reference and not reference.get("error"):
        mine, theirs = report.get("tf_keras"), reference.get("tf_keras")
        if mine != theirs and (mine or theirs):
            problems.append(f"tf-keras {mine or 'missing'} (launch host: {theirs or 'missing'})")
    if report.get("horovod"):
        if report.get("check_build_error"):
            problems.append(f"horovodrun --check-build failed: {report['check_build_error']}")
        else:
            missing = [name for name in REQUIRED_BUILD if not report.get("build", {}).get(name)]
            if missing:
                problems.append(f"Horovod built without {', '.join(missing)}")
    if report.get("hostname_resolves") is False:
        # Horovod's Gloo process sets look the host's own name up and crash (SIGSEGV) if not.
        problems.append(
            f"hostname {report.get('hostname')!r} does not resolve; add it to /etc/hosts or DNS"
        )
    gpus = report.get("gpus") or 0
    if slots and gpus and slots > gpus:
        problems.append(f"{slots} slots but {gpus} GPUs (one process per GPU)")
    return problems


def summary(report, slots=None):
    """`Python 3.11.2, TensorFlow 2.15.1, Horovod 0.28.1 [TensorFlow Gloo MPI], ...`"""
    built = " ".join(name for name, yes in report.get("build", {}).items() if yes)
    parts = [
        f"Python {report.get('python')}",
        f"TensorFlow {report.get('tensorflow')}"
        + (f" (tf-keras {report['tf_keras']})" if report.get("tf_keras") else ""),
        f"Horovod {report.get('horovod')} [{built}]",
        f"hvdtrain {report.get('hvdtrain')}",
        _count(report.get("gpus", 0), "GPU"),
    ]
    if slots:
        parts.append(_count(slots, "slot"))
    return ", ".join(parts)


def _count(n, noun):
    return f"{n} {noun}" + ("" if n == 1 else "s")


def host_line(label, report, problems, slots=None):
    """`label: ok (summary)` or `label: problem: what; what`."""
    if problems:
        return f"{label}: problem: {'; '.join(problems)}"
    return f"{label}: ok ({summary(report, slots)})"


def final_line(results):
    """The verdict over [(label, problems)], the launch host first: the hosts counted are
    the hostfile's (a one-line hostfile is one host, the launch host among them or not)."""
    bad = [label for label, problems in results if problems]
    hosts = _count(len(results) - 1, "host")
    if not bad:
        return f"doctor: ok: {hosts} ready and matching the launch host"
    return f"doctor: problem on {', '.join(bad)} (of {hosts} and the launch host)"


def run_doctor(
    hosts,
    python,
    launch_python,
    own_names=(),
    ssh_port=None,
    ssh_identity_file=None,
    timeout=120,
    out=print,
):
    """Probes the launch host and every host in `hosts`; prints the lines; returns 0 or 1.

    Args:
        hosts: a list of `Host`.
        python: the Python to probe on the hosts; `launch_python` is this host's own.
        own_names: this host's names (treated as local, like localhost).
        out: where each line goes (print by default).
    """
    inner = max(1, timeout - 10)
    reference_argv = probe_argv("localhost", launch_python, True, timeout=inner)
    jobs = {tuple(reference_argv): None}
    argv_of = {}
    for host in hosts:
        argv = probe_argv(
            host.name, python, is_local(host.name, own_names), ssh_port, ssh_identity_file, inner
        )
        argv_of[host.name] = tuple(argv)
        jobs.setdefault(tuple(argv), None)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(jobs))) as pool:
        futures = {argv: pool.submit(run_probe, list(argv), timeout) for argv in jobs}
        reports = {argv: future.result() for argv, future in futures.items()}

    reference = reports[tuple(reference_argv)]
    label = f"launch host {reference.get('hostname', own_names[0] if own_names else 'localhost')}"
    results = [(label, host_problems(reference))]
    out(host_line(label, reference, results[0][1]))
    for host in hosts:
        report = reports[argv_of[host.name]]
        problems = host_problems(report, reference, host.slots)
        results.append((host.name, problems))
        out(host_line(host.name, report, problems, host.slots))
    out(final_line(results))
    return 1 if any(problems for _, problems in results) else 0
