"""`hvdtrain-run chaos` (hvdtrain.launcher.chaos): its pure parts without processes, then
real chaos runs on a small script."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import BIN, job_env, worker

from hvdtrain.launcher import chaos, chaoselastic, chaosreport, cli, faults

MNIST = ["python", "-m", "hvdtrain.mnist", "--model", "mlp", "--limit-samples", "512"]


def test_the_schedule_is_drawn_from_the_seed_and_takes_every_kind_in_turn():
    n = len(chaos.KINDS)
    first = chaos.schedule(2 * n + 2, seed=3, hosts=3)
    assert first == chaos.schedule(2 * n + 2, seed=3, hosts=3)
    assert first != chaos.schedule(2 * n + 2, seed=4, hosts=3)
    kinds = [f.kind for f in first]
    assert all(2 <= kinds.count(k) <= 3 for k in chaos.KINDS), kinds  # each in turn
    links = [i for i, k in enumerate(kinds) if k in ("slow-link", "lossy-link")]
    assert links == list(range(len(kinds) - len(links), len(kinds))), kinds  # the last ones
    cuts = [i for i, k in enumerate(kinds) if k == "cut-host"]  # just before them
    assert cuts == list(range(links[0] - len(cuts), links[0])), kinds
    assert [f.index for f in first] == list(range(1, 2 * n + 3))
    assert {f.host for f in first if f.kind in faults.HOST_KINDS} <= {0, 1, 2}
    timed = ("slow-link", "lossy-link", "cut-host")
    assert all(5 <= f.seconds <= 20 for f in first if f.kind in timed)
    assert all(0 <= f.fraction < 1 and f.rank in (0, 1) for f in first)
    assert all(f.rank == 0 for f in first if f.kind == "kill-in-checkpoint")  # the writer
    few = chaos.schedule(3, seed=0, kinds=("kill-rank",), np=4)
    assert [f.kind for f in few] == ["kill-rank"] * 3 and all(f.rank < 4 for f in few)


@pytest.mark.parametrize(
    "fraction, checkpoints, in_a_write, expected",
    [
        (0.1, 5, False, ("start-up", 0.5)),
        (0.2, 5, False, ("after", 0, 0.0)),
        (0.7, 5, False, ("after", 2, 0.5)),
        (0.999, 5, False, ("after", 3, 0.995)),
        (0.999, 5, True, ("after", 2, 0.996)),
        (0.6, 1, False, ("start-up", 0.5)),
        (0.6, 2, True, ("start-up", 0.5)),
    ],
)
def test_a_fault_strikes_at_start_up_or_between_two_checkpoints(
    fraction, checkpoints, in_a_write, expected
):
    assert chaos.moment(fraction, checkpoints, in_a_write) == expected


def test_a_cut_is_anchored_seconds_before_the_runs_last_checkpoint():
    """A cut takes effect seconds after its moment: its anchors end `lead` seconds before
    the last checkpoint (in the run's order, not the names'), after the one resumed from."""
    timeline = {"epoch-0001-step-000008": 3.0, "epoch-0001": 6.0,
                "epoch-0002-step-000008": 8.0, "epoch-0002": 9.5}  # fmt: skip
    assert faults.anchors(timeline) == list(timeline)
    assert faults.anchors(timeline, "epoch-0001-step-000008") == list(timeline)[1:]
    assert faults.anchors(timeline, lead=6.0) == ["epoch-0001-step-000008"]
    assert faults.anchors(timeline, "epoch-0001", lead=6.0) == []  # so: in the start-up
    assert chaos.moment(0.99, len(faults.anchors(timeline, "epoch-0001", 6.0))) == (
        "start-up",
        0.988,
    )


def test_the_command_gets_this_runs_folders_and_determinism():
    out = chaos.job_command(["python", "t.py", "--epochs", "2"], "/w/ck", "/w/m.json")
    assert out == ["python", "t.py", "--epochs", "2", "--checkpoint-dir", "/w/ck",
                   "--metrics-json", "/w/m.json", "--deterministic"]  # fmt: skip
    mine = [
        "python",
        "t.py",
        "--checkpoint-dir",
        "mine",
        "--metrics-json=m.json",
        "--deterministic",
    ]
    assert chaos.job_command(mine, "/w/ck", "/w/m.json") == [
        "python", "t.py", "--checkpoint-dir", "/w/ck", "--metrics-json=/w/m.json",
        "--deterministic",
    ]  # fmt: skip
    launch = chaos.launch_command("/v/python", 2, "gloo", ["python", "t.py"])
    assert launch == ["/v/python", "-m", "hvdtrain.launcher.cli", "-q", "-np", "2",
                      "--backend", "gloo", "--", "python", "t.py"]  # fmt: skip
    assert "--backend" not in chaos.launch_command("/v/python", 2, None, ["t"])
    elastic = chaos.job_command(["python", "t.py"], "/w/ck", "/w/m.json", ("--elastic",))
    assert elastic[-1] == "--elastic" and "--deterministic" not in elastic
    assert chaoselastic.launch_options(["-H", "a:1,b:1"]) == [
        "-H", "a:1,b:1", "--elastic", "--min-np", "1", "--blacklist-cooldown-range", "5", "10",
    ]  # fmt: skip


def test_each_fault_promises_an_end():
    assert chaos.promise("kill-launcher") < chaos.promise("kill-rank", grace=10)
    assert chaos.promise("stop-rank", stall=20) < chaos.promise("stop-rank", stall=60)
    assert chaos.promise("full-disk", expected=100) > 100
    # a rank waiting on a stopped or cut-off peer: the watchdog's 2 stall times in training,
    # 12 where the peer may be in a long phase of its own (the start-up, after training)
    for kind in ("stop-rank", "cut-host"):
        training = chaos.promise(kind, stall=20, grace=10)
        for phase in ("start-up", "after training"):
            assert chaos.promise(kind, stall=20, grace=10, phase=phase) == training + 10 * 20
    assert {k for k in chaos.KINDS if chaos.promise(k) > 0} == set(chaos.KINDS)


def _record(index, kind, **changes):
    record = {
        "index": index, "kind": kind, "rank": 1, "injected": True, "exit_status": 137,
        "when": {"epoch": 1, "step": 4, "phase": "training", "seconds": 3.2},
        "line": "hvdtrain-run: rank 1 on host h was killed by signal 9 (SIGKILL) first",
        "seconds_to_end": 2.5, "promise": 40, "hang": False, "processes_left": 0,
        "traceback": False, "checkpoint_lost": False, "survived": True,
    }  # fmt: skip
    return {**record, **changes}


def test_totals_table_and_lines_say_what_failed():
    records = [
        _record(1, "kill-rank"),
        _record(2, "stop-rank", hang=True, processes_left=2, survived=False, seconds_to_end=81),
        _record(
            3,
            "kill-in-checkpoint",
            injected=False,
            when=None,
            survived=False,
            line="the run ended before the fault's moment",
        ),  # fmt: skip
        _record(4, "term-launcher", traceback=True, survived=False),
    ]
    sums = chaosreport.totals(records, digests_equal=True)
    assert sums == {"faults": 3, "not_injected": 1, "survived": 1, "digests_equal": True,
                    "hangs": 1, "left_behind": 2, "tracebacks": 1,
                    "checkpoints_lost": 0, "failed_alone": 0}  # fmt: skip
    lines = chaosreport.table(records).splitlines()
    assert lines[0].split()[:3] == ["#", "kind", "hit"] and len(lines) == 5
    assert [row.split()[2] for row in lines[1:]] == ["1", "1", "-", "launcher"]  # what each hit
    assert lines[2].split()[-1] == "FAILED" and lines[3].endswith("not injected")
    line = chaosreport.progress_line(records[1], 4)
    assert line.startswith("fault 2/4 stop-rank (rank 1) at epoch 1 step 4 (training): ")
    assert "HANG (over 40 s); 2 process(es) left behind" in line
    assert chaosreport.progress_line(records[0], 4).endswith(f"ok: {records[0]['line']}")
    assert "not injected" in chaosreport.progress_line(records[2], 4)
    assert chaosreport.progress_line(records[3], 4).startswith(
        "fault 4/4 term-launcher (launcher) at "
    )
    assert chaosreport.digest_line("ab" * 32, "ab" * 32).startswith("final weights digest equal")
    differs = chaosreport.digest_line("ab" * 32, "cd" * 32)
    assert "differs from the uninterrupted run's" in differs and "\n" not in differs


@pytest.mark.parametrize(
    "argv, words",
    [
        (["chaos", "-np", "2"], "no command to run"),
        (["chaos", "--faults", "x", "--", "python", "t.py"], "`--faults`: received 'x'"),
        (
            ["chaos", "--kinds", "kill-rank,nuke", "--", "python", "t.py"],
            "`--kinds`: received 'nuke'",
        ),
        (
            ["chaos", "-H", "localhost:2", "--kinds", "kill-host", "--", "python", "t.py"],
            "cannot inject kill-host: the job has no host other than this one",
        ),
        (["chaos", "--hostfile", "/nonexistent/hosts", "--", "python", "t.py"], "hosts"),
        (
            ["chaos", "-H", "nodeb:1,nodec:1", "--kinds", "slow-link", "--", "python", "t.py"],
            "cannot inject slow-link: it needs --network-interface",
        ),
        (
            ["chaos", "-H", "nodeb:1,nodec:1", "--kinds", "cut-host", "--", "python", "t.py"],
            "cannot inject cut-host: it needs --network-interface",
        ),
        (["chaos", "--elastic", "--", "python", "t.py"], "--elastic: chaos loses a host other"),
        (
            ["chaos", "--elastic", "-H", "nodeb:1", "--backend", "mpi", "--", "python", "t.py"],
            "`--backend`: received 'mpi'; expected gloo (or none) under --elastic",
        ),
        (
            ["chaos", "--elastic", "-H", "nodeb:1", "--kinds", "cut-host", "--", "python", "t"],
            "`--kinds`: received 'cut-host'; expected kill-host under --elastic",
        ),
    ],
)
def test_a_mistake_in_the_options_is_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as ended:
        cli.main(argv)
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_the_chaos_command_never_imports_tensorflow():
    code = "import sys, hvdtrain.launcher.cli; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=job_env(), timeout=60)  # fmt: skip
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.timeout(120)
def test_chaos_ended_by_sigterm_leaves_no_job_and_no_tmpfs(tmp_path):
    """SIGTERM to chaos itself (the soak stopped, a scheduler) while its first run trains:
    the job's processes end with it, and the full-disk fault's tmpfs is not left mounted over
    the checkpoint folder (root only: the tmpfs)."""
    if os.geteuid() != 0:
        pytest.skip("the full-disk fault's tmpfs needs root")
    ckpt, marker = str(tmp_path / "work" / "chaos"), uuid.uuid4().hex
    mounted = lambda: any(line.split()[1] == ckpt for line in open("/proc/mounts"))  # noqa: E731
    proc = subprocess.Popen(
        [f"{BIN}/hvdtrain-run", "chaos", "-np", "2", "--faults", "1", "--kinds", "full-disk",
         "--workdir", str(tmp_path / "work"), "--", "python", "-c",
         f"import time; time.sleep(100)  # {marker}"],
        env=job_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (mounted() and len(_running(marker)) >= 4) and time.monotonic() < deadline:
            time.sleep(0.1)  # chaos, hvdtrain-run, its launcher and a rank
        assert mounted() and len(_running(marker)) >= 4, "the first run did not start"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert not mounted()
    assert not _running(marker), [open(f"/proc/{p}/cmdline").read() for p in _running(marker)]


def _running(marker):
    """The processes whose command line holds `marker` (Linux: /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _chaos(tmp_path, *options, timeout):
    report = tmp_path / "chaos.json"
    proc = subprocess.run(
        [f"{BIN}/hvdtrain-run", "chaos", "-np", "2", "--json", str(report), "--workdir",
         str(tmp_path / "work"), *options],
        env=job_env(), cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    return proc, proc.stdout + proc.stderr, json.loads(report.read_text())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_small_chaos_run_survives_and_ends_with_the_uninterrupted_weights(tmp_path):
    """Three faults (a rank killed, the launcher killed, the newest checkpoint damaged) on
    MNIST: each survived, nothing left running, no traceback, the same final weights."""
    kinds = "kill-rank,kill-launcher,damage-checkpoint"
    proc, text, report = _chaos(
        tmp_path, "--faults", "3", "--seed", "2", "--kinds", kinds, "--",
        *MNIST, "--epochs", "2", "--checkpoint-every", "4", timeout=840,
    )  # fmt: skip
    assert proc.returncode == 0, text[-6000:]
    assert report["faults"] + report["not_injected"] == 3, report
    assert report["faults"] >= 2, report
    assert report["survived"] == report["faults"] and report["digests_equal"], report
    assert report["hangs"] == report["left_behind"] == report["tracebacks"] == 0, report
    assert sorted(r["kind"] for r in report["records"]) == sorted(kinds.split(","))
    assert text.count("hvdtrain-run chaos: fault ") == 3, text[-6000:]
    assert "final weights digest equal to the uninterrupted run's" in text


@pytest.mark.timeout(600)
def test_a_script_that_does_not_resume_exactly_is_one_line_not_a_pass(tmp_path):
    """Its weights start from unseeded random numbers: the run without faults already ends
    elsewhere than the uninterrupted one, and chaos says so in one line, exit 1."""
    proc, text, report = _chaos(
        tmp_path, "--faults", "0", "--", "python", worker("unseeded.py"), timeout=540
    )
    assert proc.returncode == 1, text[-6000:]
    assert report["digests_equal"] is False and report["final_digest"], report
    differs = [line for line in text.splitlines() if "differs from the uninterrupted" in line]
    assert len(differs) == 1, text[-6000:]


def test_the_soak_deals_its_faults_over_the_matrix_and_sums_the_cells():
    from hvdtrain.bench import soak

    matrix = soak.cells("/repo")
    assert len(matrix) == 18 and set(matrix) == set(soak.CELLS)
    backend, command = matrix["elastic-gloo-k3"]
    assert backend == "gloo" and "--commit-every" in command and command[-1] == "3"
    backend, command = matrix["diloco-mpi-k3"]
    assert backend == "mpi" and command[-6:] == ("--sync", "diloco", "--sync-every", "4",
                                                 "--keras", "3")  # fmt: skip
    assert matrix["files-gloo"][1][1] == "/repo/examples/tfrecord_train.py"
    longer = soak.cells("/repo", samples=2048)["step-gloo-k2"][1]  # (across hosts)
    assert longer[longer.index("--limit-samples") + 1] == "2048"
    assert matrix["pydataset-mpi"][1][2] == "hvdtrain.bench.pydataset_job"
    plan = soak.spread(100, list(soak.CELLS)[:16])
    assert sum(plan.values()) == 100 and set(plan.values()) == {6, 7}
    assert soak.spread(2, ["a", "b", "c"]) == {"a": 1, "b": 1}
    one = {"faults": 2, "survived": 2, "hangs": 0, "left_behind": 0, "tracebacks": 0,
           "checkpoints_lost": 0, "not_injected": 0, "digests_equal": True,
           "records": [_record(1, "kill-rank"),
                       _record(2, "stop-rank", survived=False)]}  # fmt: skip
    elastic = {**one, "digests_equal": None, "accuracy_within_margin": True}
    sums = soak.sum_cells({"a": one, "b": {**one, "digests_equal": False}, "c": None,
                           "d": elastic})  # fmt: skip
    assert sums["faults"] == 6 and sums["digests_equal"] == 2 and sums["cells"] == 4
    assert sums["cells_failed_to_run"] == ["c"]
    assert sums["kinds"]["stop-rank"] == {"faults": 3, "survived": 0}


def test_the_soak_across_hosts_takes_two_or_three(capsys):
    from hvdtrain.bench import soak

    with pytest.raises(SystemExit) as ended:
        soak.main(["--hosts", "4", "--json", "/nonexistent/x.json"])
    assert ended.value.code == 2
    assert "`--hosts`: received '4'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ended:  # (an elastic cell loses another host)
        soak.main(["--cells", "elastic-gloo-k2", "--json", "/nonexistent/x.json"])
    assert ended.value.code == 2
    assert "an elastic cell with --hosts 2 or 3" in capsys.readouterr().err
