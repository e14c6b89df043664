"""Timed windows of steps: the one way the benchmark's workers time what they run.

    windows = Windows()                    # wall, CPU and thread CPU of each window
    windows.run(lambda: step(16), 1 + 5)   # the first window is the warm-up
    windows.begin(); ...; windows.end()    # or around work that is not one call (Keras' epochs)
    statistics.median(windows.walls()[1:])

A window holds its wall seconds and, with `usage` (the training workers'), this process's
CPU seconds, the machine's busy CPU seconds (/proc/stat) and each thread's CPU seconds
(Linux's schedstat), from which `thread_groups` tells where this process's time went.
Without `usage` (the allreduce sweep, the floor) only the wall time: the reads would weigh
on a call of microseconds. Never imports TensorFlow.
"""

import os
import time

__all__ = ["Windows", "machine_busy_seconds", "thread_cpu_seconds", "thread_groups"]

THREAD_GROUPS = ("main", "tensorflow", "horovod", "other")


def machine_busy_seconds(steal=False):
    """CPU seconds all cores of this machine spent busy since boot (/proc/stat), or None;
    with `steal`, the time the hypervisor took from them counts as busy."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1 : 9 if steal else 8]]
    except (OSError, ValueError):
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def thread_cpu_seconds():
    """{thread id: (name, CPU seconds)} of this process's threads: Linux's schedstat, in
    nanoseconds (the tick counts of /proc/.../stat are 10 ms coarse); {} elsewhere."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                seconds = int(f.read().split()[0]) / 1e9
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
        out[int(tid)] = (name, seconds)
    return out


def thread_groups(before, after, horovod_tids, main_tid):
    """The CPU seconds spent between two `thread_cpu_seconds` snapshots, by group (pure):
    `main` (the Python thread: Keras's loop, and the ops TensorFlow runs inline on it),
    `tensorflow` (its tf_* pools), `horovod` (the threads `hvd.init` started: its
    background thread, MPI's or Gloo's), `other`."""
    groups = dict.fromkeys(THREAD_GROUPS, 0.0)
    for tid, (name, seconds) in after.items():
        spent = seconds - before.get(tid, (name, 0.0))[1]
        if tid == main_tid:
            group = "main"
        elif name.startswith("tf_"):
            group = "tensorflow"
        elif tid in horovod_tids:
            group = "horovod"
        else:
            group = "other"
        groups[group] += spent
    return {k: round(v, 4) for k, v in groups.items()}


class Windows(list):
    """The windows timed so far, in order: dicts of `wall` seconds and, with `usage`, `cpu`
    (this process), `busy` (the machine; None where /proc/stat is missing) and `threads`
    (the two `thread_cpu_seconds` snapshots around the window)."""

    def __init__(self, usage=True):
        super().__init__()
        self.usage = usage

    def _snapshot(self):
        if not self.usage:
            return {"wall": time.perf_counter()}
        t = os.times()
        return {"wall": time.perf_counter(), "cpu": t.user + t.system,
                "busy": machine_busy_seconds(), "threads": thread_cpu_seconds()}  # fmt: skip

    def begin(self):
        self._start = self._snapshot()

    def end(self):
        end, start = self._snapshot(), self._start
        window = {"wall": end["wall"] - start["wall"]}
        if self.usage:
            window["cpu"] = end["cpu"] - start["cpu"]
            window["busy"] = None if end["busy"] is None else end["busy"] - start["busy"]
            window["threads"] = (start["threads"], end["threads"])
        self.append(window)

    def run(self, fn, count):
        """Times `count` windows, each one call of `fn`."""
        for _ in range(count):
            self.begin()
            fn()
            self.end()
        return self

    def walls(self):
        return [w["wall"] for w in self]
