"""The allreduce sweep: one process per rank, started by `hvdtrain.bench` under horovodrun.

    horovodrun -np 2 -H localhost:2 --mpi python -m hvdtrain.bench.allreduce --sizes 4096,1048576

For each message size (bytes of float32), rank 0 reports the median time of a Horovod
allreduce (sum) through its TensorFlow op, after `hvdtrain.init()`, so with hvdtrain's
settings and Horovod's whole path (queue, cycle, fusion buffer copies, the collective); under
MPI (`--raw-mpi`) also the bare `MPI_Allreduce` of the same buffer through mpi4py, timed
first, before Horovod starts: the transport's own limit. Bandwidths follow nccl-tests:
algbw = bytes / time and busbw = algbw x 2(n-1)/n, the bytes each rank's link carries in a
ring allreduce.

Before the sweep rank 0 measures this machine's memory-copy bandwidth (bytes copied per
second by one core, `numpy.copyto` of 64 MiB), the yardstick for a shared-memory transport.
"""

import argparse
import json
import os
import statistics
import sys
import time

from hvdtrain.bench.workers import MARKER, _bind

__all__ = ["main", "bus_bandwidth", "memcpy_bandwidth"]


def bus_bandwidth(nbytes, seconds, n):
    """(algbw, busbw) in bytes/s for an allreduce of `nbytes` on `n` ranks (nccl-tests)."""
    algbw = nbytes / seconds
    return algbw, algbw * (2 * (n - 1) / n if n > 1 else 1.0)


def memcpy_bandwidth(nbytes=64 << 20, repeats=7):
    """Bytes per second that `numpy.copyto` moves from one buffer to another (median)."""
    import numpy as np

    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


def _iterations(nbytes):
    return max(10, min(200, int(64 * (1 << 20) / max(nbytes, 1)) // 4))


def _raw_mpi(comm, sizes):
    """{bytes: median seconds} of MPI_Allreduce (sum) of float32 buffers, through mpi4py."""
    import numpy as np

    out = {}
    for nbytes in sizes:
        buf = np.ones(max(1, nbytes // 4), np.float32)
        res = np.empty_like(buf)
        for _ in range(3):
            comm.Allreduce(buf, res)
        times = []
        for _ in range(_iterations(nbytes)):
            start = time.perf_counter()
            comm.Allreduce(buf, res)
            times.append(time.perf_counter() - start)
        out[nbytes] = statistics.median(times)
    return out


def main(argv=None):
    cores = _bind()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    p = argparse.ArgumentParser(prog="python -m hvdtrain.bench.allreduce")
    p.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    p.add_argument("--raw-mpi", action="store_true", help="also time MPI_Allreduce (mpi4py)")
    p.add_argument("--label", default="")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    raw = {}
    if args.raw_mpi:  # first, alone: Horovod's background thread would share the MPI library
        from mpi4py import MPI  # before Horovod, so mpi4py owns MPI_Init/Finalize

        raw = _raw_mpi(MPI.COMM_WORLD, sizes)
    import tensorflow as tf

    import hvdtrain

    hvdtrain.init()
    import horovod.tensorflow as hvd

    rank, size = hvd.rank(), hvd.size()
    backend = "mpi" if hvd.mpi_enabled() else "gloo"
    memcpy = memcpy_bandwidth() if rank == 0 else None
    hvd.allreduce(tf.constant(0.0), name="sweep.barrier")
    for nbytes in sizes:
        tensor = tf.ones([max(1, nbytes // 4)], tf.float32)
        name = f"sweep.{nbytes}"

        @tf.function
        def reduce(t, name=name):  # one element back: on a GPU, no copy of the whole result
            return hvd.allreduce(t, op=hvd.Sum, name=name)[0]

        iters = _iterations(nbytes)
        for _ in range(3):
            reduce(tensor).numpy()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            reduce(tensor).numpy()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        if rank == 0:
            algbw, busbw = bus_bandwidth(nbytes, seconds, size)
            result = {
                "kind": "allreduce",
                "label": args.label,
                "backend": backend,
                "np": size,
                "bytes": nbytes,
                "iterations": iters,
                "seconds": seconds,
                "algbw": algbw,
                "busbw": busbw,
                "memcpy_bytes_per_sec": memcpy,
                "cores": cores,
            }
            if nbytes in raw:
                result["raw_mpi_seconds"] = raw[nbytes]
                result["raw_mpi_busbw"] = bus_bandwidth(nbytes, raw[nbytes], size)[1]
            print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
