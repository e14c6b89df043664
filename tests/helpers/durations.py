"""Where the test suite's time goes: runs pytest (any arguments, e.g. `-m "not slow"`) with a
probe in every Python process it starts, then prints a Markdown table of the time by test
file and by kind of test, with the share that is process start-up:

    python tests/helpers/durations.py -m "not slow and not gpu_image" --out out/durations
    python tests/helpers/durations.py --report out/durations   # the table again, from the files

- the time of each test: pytest's own (setup + call + teardown), from its JUnit XML;
- the jobs of each test: every rank-0 process (horovodrun, hvdtrain-run, mpirun, srun) and
  every other Python process that is neither a launcher nor pytest (a single-process job),
  from the probe (tests/helpers/probe/sitecustomize.py, on PYTHONPATH);
- the start-up of a job: a 2-rank job that imports hvdtrain and TensorFlow, calls
  `hvdtrain.init()` and ends, timed 3 times under Gloo and MPI before the run (a
  single-process job: the same with one process);
- the kind: Docker/SLURM/namespace hosts by file; else unit (no job), one job, several jobs.
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROBE = os.path.join(HERE, "probe")
HOSTS_FILES = {  # tests whose jobs run in Docker, SLURM or namespace hosts
    "test_docker_image.py": "Docker",
    "test_gpu_image.py": "Docker",
    "test_slurm.py": "SLURM",
    "test_multihost.py": "namespace hosts",
    "test_lost_hosts.py": "namespace hosts",
}
LAUNCHERS = ("horovodrun", "hvdtrain-run", "mpirun", "srun")
STARTUP = "import hvdtrain, tensorflow; hvdtrain.init()"


def calibrate(runs=3):
    """Seconds of a job that only starts: {"gloo": s, "mpi": s, "single": s} (medians)."""
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", "HVDTRAIN_OFFLINE": "1"}
    commands = {
        "gloo": [f"{bin_dir}/horovodrun", "-np", "2", "-H", "localhost:2", "--gloo"],
        "mpi": [f"{bin_dir}/horovodrun", "-np", "2", "-H", "localhost:2", "--mpi"],
        "single": [],
    }
    out = {}
    for name, prefix in commands.items():
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            subprocess.run([*prefix, sys.executable, "-c", STARTUP], env=env, check=True,
                           capture_output=True, timeout=300)  # fmt: skip
            times.append(time.perf_counter() - start)
        out[name] = sorted(times)[len(times) // 2]
    return out


def run(pytest_args, folder):
    folder = os.path.abspath(folder)  # the probe writes from processes in other folders
    os.makedirs(folder, exist_ok=True)
    log, xml = os.path.join(folder, "probe.jsonl"), os.path.join(folder, "junit.xml")
    if os.path.exists(log):
        os.remove(log)
    with open(os.path.join(folder, "startup.json"), "w") as f:
        json.dump(calibrate(), f)
    env = {**os.environ, "HVDTRAIN_PROBE_LOG": log,
           "PYTHONPATH": os.pathsep.join([PROBE, os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", *pytest_args, f"--junitxml={xml}"],
                          env=env, cwd=ROOT)  # fmt: skip
    with open(os.path.join(folder, "wall.json"), "w") as f:
        json.dump({"seconds": time.perf_counter() - start, "args": pytest_args}, f)
    return proc.returncode


def _tests(xml):
    """{test id (file::name[params]): seconds}."""
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        out[f"{os.path.basename(file)}::{case.get('name')}"] = float(case.get("time", 0))
    return out


def _jobs(log):
    """{test id: {"ranked": n, "single": n}}: the jobs each test started."""
    out = collections.defaultdict(lambda: {"ranked": 0, "single": 0})
    if not os.path.exists(log):
        return out
    for line in open(log):
        p = json.loads(line)
        test = p["test"].split("/")[-1]
        argv0 = os.path.basename(p["argv"][0] if p["argv"] else "")
        if not test or argv0 in LAUNCHERS or "pytest" in " ".join(p["argv"]):
            continue
        if p["rank"] == "0":
            out[test]["ranked"] += 1
        elif p["rank"] is None:
            out[test]["single"] += 1
    return out


def report(folder):
    tests = _tests(os.path.join(folder, "junit.xml"))
    jobs = _jobs(os.path.join(folder, "probe.jsonl"))
    startup = json.load(open(os.path.join(folder, "startup.json")))
    ranked = (startup["gloo"] + startup["mpi"]) / 2
    by_file = collections.defaultdict(lambda: collections.Counter())
    by_kind = collections.defaultdict(lambda: collections.Counter())
    for test, seconds in tests.items():
        file = test.split("::")[0]
        j = jobs.get(test, {"ranked": 0, "single": 0})
        n = j["ranked"] + j["single"]
        kind = HOSTS_FILES.get(file) or ("unit" if n == 0 else "one job" if n == 1 else
                                         "several jobs")  # fmt: skip
        start = min(seconds, j["ranked"] * ranked + j["single"] * startup["single"])
        for table, key in ((by_file, file), (by_kind, kind)):
            table[key].update(tests=1, seconds=seconds, jobs=n, startup=start)
    total = sum(tests.values())
    lines = [
        f"Start-up of a job here: 2 ranks {startup['gloo']:.1f} s (Gloo), "
        f"{startup['mpi']:.1f} s (MPI); one process {startup['single']:.1f} s.",
        "",
    ]
    for title, table in (("kind", by_kind), ("file", by_file)):
        lines += [f"| {title} | tests | jobs | time (s) | share of the run | of it start-up |",
                  "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for key, c in sorted(table.items(), key=lambda kv: -kv[1]["seconds"]):
            lines.append(
                f"| {key} | {c['tests']} | {c['jobs']} | {c['seconds']:.0f} | "
                f"{c['seconds'] / total:.0%} | "
                f"{(c['startup'] / c['seconds'] if c['seconds'] else 0):.0%} |"
            )
        lines.append("")
    startup_total = sum(c["startup"] for c in by_kind.values())
    lines.append(
        f"All: {len(tests)} tests, {total:.0f} s of test time, of it {startup_total:.0f} s "
        f"({startup_total / total:.0%}) starting jobs."
    )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/durations", help="where the run's files go")
    parser.add_argument("--report", help="only print the table of an earlier run's folder")
    args, pytest_args = parser.parse_known_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    code = run(pytest_args, args.out)
    text = report(args.out)
    with open(os.path.join(args.out, "durations.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
