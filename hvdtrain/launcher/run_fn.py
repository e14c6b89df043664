"""A rank of `hvdtrain.launch`: `python -m hvdtrain.launcher.run_fn FOLDER`.

`hvdtrain.launch(fn, ...)` writes `FOLDER/payload.pkl` (the function by value with
cloudpickle, its arguments, the source of the notebook cells it came from) into a private
folder and starts this module on every rank under `hvdtrain-run`'s launcher. Each rank
calls the function and leaves `FOLDER/<rank>.result`: the value it returned (rank 0's, or
every rank's with `all_ranks=True`), or what it raised, where, and the exception itself
where it can be pickled. Then it exits as a script would: 0, or the error's status, the
error's lines printed by hvdtrain's hook of uncaught errors as they are in a shell.

No TensorFlow here: the function imports what it uses.
"""

import linecache
import os
import pickle
import sys

from hvdtrain.errors import HvdtrainError, env_rank, one_line, write_line
from hvdtrain.runtime import streams, tracebacks
from hvdtrain.runtime.uncaught import because_of_another_rank, report_uncaught

__all__ = ["PAYLOAD", "result_path", "main"]

PAYLOAD = "payload.pkl"


def result_path(folder, rank):
    """Where `rank` leaves its result in `folder`."""
    return os.path.join(folder, f"{rank}.result")


def _write(folder, rank, record):
    """`record` to this rank's result file, whole or not at all (a rename)."""
    path = result_path(folder, rank)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        pickle.dump(record, f)
    os.replace(tmp, path)


def _where(error):
    """(file, line, function) in the user's code where `error` was raised, or None."""
    frame = tracebacks.your_frame(error.__traceback__) or tracebacks.traced_frame(str(error))
    return (frame.filename, frame.lineno, frame.name) if frame else None


def _failed(error, rank):
    """The record of a rank whose function raised `error`."""
    import cloudpickle

    try:
        sent = cloudpickle.dumps(error)
        pickle.loads(sent)  # an exception whose arguments do not rebuild it is not sent
    except Exception:  # noqa: BLE001 (anything an object's pickling may raise)
        sent = None
    ours = isinstance(error, HvdtrainError)
    return {
        "rank": rank,
        "ok": False,
        "error": one_line(error) if ours else one_line(error, named=True, most=300),
        "where": None if ours else _where(error),
        "consequence": because_of_another_rank(str(error)) is not None,
        "exception": sent,
    }


def main(argv=None):
    """Runs the payload in folder `argv[0]` on this rank; see the module's docstring."""
    folder = (sys.argv[1:] if argv is None else argv)[0]
    streams.whole_lines()  # mpirun tags pieces of lines: see there
    report_uncaught()  # the function's errors are told as a script's are
    rank = env_rank()
    with open(os.path.join(folder, PAYLOAD), "rb") as f:
        payload = pickle.load(f)
    for name, lines in payload["sources"].items():  # a traceback shows the cells' lines
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
    fn = payload["fn"]
    sys.argv = [payload["prog"]]  # the function's own parse_args() reads no payload path
    try:
        value = fn(*payload["args"], **payload["kwargs"])
    except Exception as e:
        _write(folder, rank, _failed(e, rank))
        # Told as a script's error is (hvdtrain's hook), from the function's frame on.
        e = e.with_traceback(e.__traceback__.tb_next)
        sys.excepthook(type(e), e, e.__traceback__)
        sys.exit(1)
    if rank != 0 and not payload["all_ranks"]:
        return
    import cloudpickle

    try:
        sent = cloudpickle.dumps(value)
    except Exception as e:  # noqa: BLE001 (anything an object's pickling may raise)
        line = (
            f"the value {payload['prog']} returned on rank {rank} ({type(value).__name__}) "
            f"cannot be sent back to the caller: {one_line(e, named=True, most=200)}; return "
            "something that pickles: numbers, strings, lists and dicts of them, NumPy "
            "arrays, a path to a file the rank wrote"
        )
        _write(folder, rank, {"rank": rank, "ok": False, "error": line, "where": None,
                              "consequence": False, "exception": None})  # fmt: skip
        write_line(f"hvdtrain: rank {rank} failed: {line}")
        sys.exit(1)
    _write(folder, rank, {"rank": rank, "ok": True, "value": sent})


if __name__ == "__main__":
    main()
