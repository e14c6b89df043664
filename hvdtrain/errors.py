"""The one exception family for user mistakes, and how the command line reports it."""

import os
import re
import socket
import sys

__all__ = [
    "HvdtrainError",
    "TrainingDiverged",
    "OutputsNotWritten",
    "HostUnreachable",
    "JobFailed",
    "invalid_value",
    "kind_of",
    "one_line",
    "env_rank",
    "exit_with_error",
    "write_line",
    "in_your_code",
    "note_ending",
    "ENDING_DIR_ENV",
    "ENDING_HOST_ENV",
    "main",
]

# Set by hvdtrain-run: a folder where a rank of its own host (ENDING_HOST_ENV, the host's
# name) that is ending leaves its last line, so the launcher notices even when mpirun
# forwards nothing. Ranks of other hosts get the variables too (mpirun -x) and leave nothing,
# also where the folder's path exists there (a shared /tmp).
ENDING_DIR_ENV = "HVDTRAIN_ENDING_DIR"
ENDING_HOST_ENV = "HVDTRAIN_ENDING_HOST"

# Everything `str.splitlines` breaks a line on, written as its escape instead.
_LINE_BREAKS = {c: repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}


def one_line(error, *, named=False, whole=False, most=None):
    """`error` (a text or an exception) as one line: the one way hvdtrain makes one.

    A text (a message of hvdtrain's, which may quote a value the user gave: a file name, a
    flag) keeps all of itself, its line breaks escaped (`a\\nb`). An exception gives the line
    of its message that says what went wrong: an OSError's reason (`No space left on
    device`, unless `named`); for TensorFlow's op errors ("Graph execution error:", where
    the node was defined, the cause, then the node) the cause; for an error while tracing
    ("in user code:", the frames, then it) its last line; else its first line that is not
    empty; its type's name for an empty message.

    Args:
        error: a text or an exception.
        named: the exception's type's name before its message (`NameError: name 'x' is
            not defined`).
        whole: all of the exception's message, its whitespace (line breaks too) made single
            spaces, rather than the one line that says what went wrong.
        most: at most this many characters of the message (its type's name not counted).
    """
    if not isinstance(error, BaseException):
        return str(error).translate(str.maketrans(_LINE_BREAKS))
    text, name = str(error), type(error).__name__
    if whole:
        line = " ".join(text.split())
    elif isinstance(error, OSError) and error.strerror and not named:
        line = error.strerror
    else:
        line = " ".join(_TF_DECORATIONS.sub("", _cause(text)).split())
    if named:
        line = line.removeprefix(f"{name}: ")
    line = line[:most] if most else line
    if named and line:
        return f"{name}: {line}"
    return line or name


def _cause(message):
    """The line of an exception's message that names what went wrong (see `one_line`)."""
    lines = [line.strip() for line in message.splitlines()]
    if lines and lines[0] == "in user code:":  # a trace-time error: the frames, then it
        return next((line for line in reversed(lines) if line), "")
    if lines and lines[0] == "Graph execution error:":
        causes = [
            line
            for line in message.splitlines()
            if line.strip()
            and not line[0].isspace()
            and not line.startswith(("Graph execution", "Detected at node"))
        ]
        if causes:
            return causes[-1].strip()
    return next((line for line in lines if line), "")


# What TensorFlow's op errors put around their message: the function and the op.
_TF_DECORATIONS = re.compile(r"\{\{function_node [^}]*\}\}|\[Op:\w+\](?: name: ?\S*)?")


def note_ending(message):
    """Leaves `message` (this rank's last line: it is ending abnormally) in the folder of
    `ENDING_DIR_ENV`, when this is hvdtrain-run's host. No locks: the watchdog calls it
    while the main thread may hold one."""
    folder = os.environ.get(ENDING_DIR_ENV)
    if not folder or os.environ.get(ENDING_HOST_ENV) != socket.gethostname():
        return
    try:
        fd = os.open(os.path.join(folder, str(os.getpid())), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.write(fd, message.encode("utf-8", "replace"))
        finally:
            os.close(fd)
    except OSError:
        pass  # the folder is gone (the launcher ended), or a full disk


class HvdtrainError(Exception):
    """A user-facing error: printed as one line, no traceback, non-zero exit.

    Args:
        message: what is wrong and how to fix it.
        every_rank: True when every rank raises the same error (bad flags, data agreed
            across ranks), so rank 0 alone prints it; False when only some ranks see it,
            so each of them prints it with its rank.
    """

    exit_code = 2  # the process's exit status (docs/fault-tolerance.md, "Exit codes")

    def __init__(self, message, every_rank=True):
        super().__init__(one_line(str(message)))
        self.every_rank = every_rank


class TrainingDiverged(HvdtrainError):
    """The loss or the weights became NaN or infinite, or the weights blew up: every rank
    stops at the same step, nothing is checkpointed after it. Exit status 3."""

    exit_code = 3
    status = "diverged"  # in the metrics JSON


class OutputsNotWritten(HvdtrainError):
    """Training finished but a file at its end could not be written (the message says what
    was and what was not written). Exit status 4."""

    exit_code = 4


class HostUnreachable(HvdtrainError):
    """`hvdtrain-run` found a host it cannot reach over ssh before launching: nothing was
    started. Exit status 5."""

    exit_code = 5


class JobFailed(HvdtrainError, RuntimeError):
    """A job that `hvdtrain.launch` started failed: its message is the one line that says
    which rank failed first and why, as `hvdtrain-run` says it in a shell (`rank 1 failed:
    ValueError: ... (raised in train, Cell In[4], line 7); exit status 1`).

    An `HvdtrainError` (hvdtrain's one family: `except hvdtrain.HvdtrainError` catches it with
    the rest) and a `RuntimeError` (what a failed job is in Python, as `horovod.run` raises
    it). Uncaught in a script, it is one line and the job's exit status, as `hvdtrain-run`'s.

    Attributes:
        exit_code: the job's exit status (the failed rank's; 128+N for signal N).
        rank: the rank that failed first, or None where no rank was named (a lost host).
        rank_error: the exception that rank raised, where it could be sent back, else None.
    """

    def __init__(self, message, exit_code=1, rank=None, rank_error=None):
        super().__init__(message)
        self.exit_code, self.rank, self.rank_error = exit_code, rank, rank_error


def kind_of(value):
    """`value`'s type name with its article: "an Intracomm", "a list"."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def invalid_value(name, received, expected):
    """Builds the error every check uses: which value, what it was, what would be right."""
    return HvdtrainError(f"Invalid value for `{name}`: received {received!r}; expected {expected}.")


def env_rank():
    """The global rank from the launcher's environment (usable before `hvd.init()`)."""
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def write_line(text, stream=None):
    """Writes `text` and its line end in one write, then flushes: with unbuffered output
    (PYTHONUNBUFFERED) print()'s two writes reach mpirun --tag-output and horovodrun as two
    pieces, and another rank's line could land between the text and its line end."""
    stream = stream or sys.stderr
    stream.write(f"{text}\n")
    stream.flush()


def exit_with_error(prog, error, code=None):
    """Prints `error` once (see `HvdtrainError.every_rank`) and exits with `code` (default:
    the error's `exit_code`, else 2).

    A mistake every rank makes is printed by rank 0, which may reach it last (a slower
    import, a loaded host): and `mpirun` and `horovodrun` end the whole job as soon as one
    rank exits non-zero, which killed rank 0 before its line was out. So the other ranks
    leave after rank 0 has written it: once Horovod runs, all ranks meet in one last
    collective after rank 0's line (`_after_rank_0s_line`); before `hvd.init()` there is no
    way to meet, and they exit with status 0, leaving the job's status to rank 0's."""
    if code is None:
        code = getattr(error, "exit_code", 2)
    rank, every_rank = env_rank(), getattr(error, "every_rank", True)
    if rank == 0 or not every_rank:
        where = f" [rank {rank}]" if rank else ""
        write_line(f"{prog}{where}: error: {error}")
    if every_rank and _env_size() > 1 and not _after_rank_0s_line() and rank != 0:
        code = 0
    sys.exit(code)


_LAST_MEETING_SECONDS = 120  # a rank that never comes (it failed otherwise) is not awaited


def _after_rank_0s_line():
    """Where Horovod runs in this process: every rank meets the others in one collective
    (rank 0 after writing its line) and True; else False. A rank that never comes is
    awaited `_LAST_MEETING_SECONDS` at most."""
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is None or not hvd.is_initialized() or hvd.size() < 2:
        return False
    import threading

    def meet():
        try:
            hvd.allreduce(sys.modules["tensorflow"].constant(0), name="hvdtrain.error_line")
        except Exception:  # noqa: BLE001 (a rank that ended: nothing left to wait for)
            pass

    meeting = threading.Thread(target=meet, daemon=True)
    meeting.start()
    meeting.join(_LAST_MEETING_SECONDS)
    return True


def _env_size():
    for var in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 1


def in_your_code(error, what, where):
    """`error`, raised by the user's code while hvdtrain ran it for `what` (`Images[9]`),
    marked so that the hook of uncaught errors (`report_uncaught`) names `what` and `where`
    (`__getitem__ (train.py:12)`) also when its traceback went through a loader process.
    Marks travel with the error (pickled as its attributes)."""
    error.hvdtrain_what, error.hvdtrain_where = what, where
    return error


def main(run, argv=None, prog=None):
    """The CLI edge of an entry point: `run(argv)`; a user error prints one line and exits
    with its status (2), Ctrl-C exits 130. No TensorFlow here: an entry point that imports
    its training code inside `run` rejects a bad flag before TensorFlow loads."""
    try:
        return run(argv)
    except HvdtrainError as e:
        exit_with_error(prog or os.path.basename(sys.argv[0] or "hvdtrain"), e)
    except KeyboardInterrupt:
        sys.exit(130)
