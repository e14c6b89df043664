"""What ended a failed job, in one line: the first rank that failed, with its host.

`hvdtrain-run` reads the launcher's stderr as it passes through (`OutputFilter`), drops
horovodrun's own Python traceback (Gloo: `RuntimeError: Horovod detected that one or more
processes exited ...`), and after the job prints `explain(...)`:

    hvdtrain-run: rank 1 on host node2 failed first: exit status 3 (training diverged); the
    job was ended
    hvdtrain-run: rank 1 on host node2 was killed by signal 9 (SIGKILL) first; the job was ended
    hvdtrain-run: rank 1 on host node2 stopped making progress first: the other ranks waited
    for it in a collective for over 300 s, and Horovod's stall check ended the job; ...
    hvdtrain-run: lost host node2 (rank 1): Open MPI lost its connection there (the host went
    down or its network did); the job was ended
    hvdtrain-run: lost host node2 (rank 1): it no longer answers ssh (...); the job was ended

A host whose network is cut sends nothing: no launcher notices it. The ranks that wait for it
end (Gloo's receive timeout, hvdtrain's watchdog), but mpirun then waits for the lost host's
daemon forever. So once a line says a rank is ending (`is_ending`), the launcher has
`LAUNCHER_GRACE_SECONDS` to end too, or `hvdtrain-run` ends its process group; after a failed
job it asks every other host `ssh host true`, and a host that no longer answers is named as
lost (`explain_unanswered`).

Pure: tested on the launchers' real messages without running them.
"""

import re
import signal
import time
from collections import deque
from dataclasses import dataclass

from hvdtrain.errors import invalid_value, one_line
from hvdtrain.launcher.noise import is_startup_noise
from hvdtrain.runtime.tracebacks import same_text
from hvdtrain.runtime.watchdog import stalls, without_marker

__all__ = [
    "Failure",
    "OutputFilter",
    "find_failure",
    "explain",
    "rank_hosts",
    "ranks_on",
    "blacklisted",
    "is_ending",
    "explain_unanswered",
    "launcher_grace_seconds",
    "EXIT_CODES",
    "LAUNCHER_GRACE_SECONDS",
]

# hvdtrain's exit statuses (docs/fault-tolerance.md, "Exit codes").
EXIT_CODES = {
    1: "an error in the program",
    2: "a user error, printed above",
    3: "training diverged",
    4: "training finished but an output was not written",
    5: "a host could not be reached over ssh; nothing was started",
    124: "it made no progress for the stall time: its line above says where it was",
    255: "a host was lost mid-run (its ssh connection or Open MPI's daemon there)",
}
# horovodrun's status for a rank whose ssh session ended with the host (killed, unplugged).
SSH_LOST = 255
_GLOO_ERROR = "RuntimeError: Horovod detected that one or more processes exited with non-zero"
# The same, as hvdtrain's patched horovodrun says it: one line (launch/horovod-patches/0007).
_GLOO_LINE = "horovodrun: Horovod detected that one or more processes exited with non-zero"
# mpirun's [[job,step],rank], horovodrun's rank, or elastic horovodrun's host[local rank]
_NAME = re.compile(r"Process name:\s*(?:\[\[\d+,\d+\],(\d+)\]|(\S+)\[\d+\]|(\d+))")
_CODE = re.compile(r"Exit code:\s*(-?\d+)")
_SIGNALED = re.compile(
    r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)", re.IGNORECASE
)
# Horovod's stall check (rank 0's log): the ranks it found missing past the shutdown time,
# marked `!`, one per line after "Missing ranks:" (with a launcher's tag before each).
_STALL_SHUTDOWN = re.compile(r"is stalled for longer than (\d+) seconds\. Will shutdown")
_STALLED = re.compile(r"(?<![\w,\[])(\d+)!: \[")
STALLED = 124  # as the watchdog's exit status: the job was ended for taking too long
# A rank is ending: hvdtrain's watchdog (its marker) or error lines, mpirun's abort, Gloo's
# launcher.
_ENDING = re.compile(
    r"\[hvdtrain:stall |hvdtrain: rank \d+ stopped|the job has been aborted|MPI_ABORT was invoked"
    r"|exited on signal \d+|Horovod detected that one or more processes exited"
)
LAUNCHER_GRACE_SECONDS = 30  # for the launcher to end after a rank did (HVDTRAIN_LAUNCHER_GRACE)
_GRACE_ENV = "HVDTRAIN_LAUNCHER_GRACE_SECONDS"
_BLACKLIST = re.compile(r"blacklist failing host: (\S+)")
_LOST = re.compile(
    r"lost communication with a remote daemon.*?Remote daemon:\s*\S+ on node (\S+)"
    r"|peer process has unexpectedly disconnected.*?Peer host:\s*(\S+)"
    r"|unable to complete a TCP connection to another process:\s*Local host:\s*(\S+)"
    r"\s*Remote host:\s*(\S+)"
)


@dataclass
class Failure:
    """The first failure: `rank` (None if unknown), its `host`, its `code` (exit status) or
    `signal`; or `lost_host`, a host whose daemon was lost."""

    rank: int | None = None
    host: str | None = None
    code: int | None = None
    signal: int | None = None
    lost_host: str | None = None
    # `lost_host` from Open MPI's "peer process has unexpectedly disconnected" banner: a
    # rank's process there ended (a kill, a crash) or the host did; a host that still
    # answers lost the process only (`explain`'s `answers`).
    peer: bool = False
    # `lost_host` from Open MPI's "unable to complete a TCP connection" banner: its daemon
    # could not connect back to this host (`unreached`, by its own name) as the job started.
    unreached: str | None = None
    # The rank the launcher named only stopped because another rank ended (it said so); the
    # one that did is not known (it exited without an error line: `sys.exit(7)`).
    consequence: bool = False
    # hvdtrain's own error line was seen (`prog: error: ...`): statuses 2 to 4 are its own.
    said: bool = True
    # Horovod's stall check ended the job: the seconds, and every rank it found stalled.
    stalled: int | None = None
    stalled_ranks: tuple = ()
    # The rank's watchdog ended it while it waited for the others, none of which said it
    # was stuck (one froze whole).
    waited: bool = False
    # Every rank failed alike (an error the ranks agreed on, or the same traceback on each).
    alike: bool = False
    # What its error line (`prog: error: ...`) said, where one was seen: the words the end
    # line gives for statuses 2 to 4 (a full disk is not a user's mistake).
    reason: str | None = None

    @property
    def exit_code(self):
        """The status `hvdtrain-run` exits with: the rank's own, 128 + N for signal N, 255
        for a lost host (as ssh's own status for a lost connection)."""
        if self.lost_host:
            return SSH_LOST
        if self.signal:
            return 128 + self.signal
        if self.code is not None and self.code < 0:
            return 128 - self.code
        return self.code or None


_TAGGED = re.compile(r"(\[(?:\d+,)?(\d+)\]<stderr>:)(.*)", re.DOTALL)  # [job,rank] or [rank]
_TRACEBACK_STARTS = ("Traceback (most recent call last):", "hvdtrain: the error below")
_TRACEBACK_ENDS = re.compile(r"hvdtrain: rank \d+ (failed|stopped):")
REPEAT_HOLD_SECONDS = 5  # a rank's traceback without hvdtrain's last line: shown after this
# Open MPI's end-of-job banners, each between two dashed lines: they repeat, in 4 and 7
# lines, what hvdtrain-run's own last line says (`mpirun --quiet` would drop them, and with
# them the rank that exited first, which `find_failure` reads).
_RULE = re.compile(r"-{20,}\s*")
_BANNERS = (
    "Primary job  terminated normally, but",
    "Primary job terminated normally, but",
    "mpirun detected that one or more processes exited with non-zero status",
    "mpirun noticed that process rank",  # a signal: `was killed by signal 9 (SIGKILL)`
)


class _Repeats:
    """Shows a traceback that several ranks print alike once. A rank's block (from its
    `Traceback` line, or hvdtrain's line before it, to hvdtrain's `rank N failed:` line) is
    held until that last line, a few milliseconds, then shown, or, when another rank showed
    the same block line for line, replaced by one line naming that rank. A block that never
    gets hvdtrain's line (a traceback that did not end the process) is shown as it was
    after `REPEAT_HOLD_SECONDS`, at the next line of the job's output, or at its end."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.shown = {}  # the bodies of each complete block shown: the rank that showed it
        self.open = {}  # tag: (rank, since, the lines held, their bodies as compared)

    def feed(self, line):
        out = self._expired()
        m = _TAGGED.fullmatch(line)
        if not m:
            return out + [line]
        tag, rank, body = m.groups()
        if tag not in self.open:
            if not body.startswith(_TRACEBACK_STARTS):
                return out + [line]
            self.open[tag] = (rank, self.clock(), [], [])
        _, _, held, bodies = self.open[tag]
        held.append(line)
        if not _TRACEBACK_ENDS.match(body):
            bodies.append(same_text(body))
            return out
        del self.open[tag]
        first = self.shown.setdefault(tuple(bodies), rank)
        if first == rank:
            return out + held
        return out + [f"{tag}(the same traceback as rank {first}'s above)\n", line]

    def _expired(self):
        now, out = self.clock(), []
        for tag, (_, since, held, _) in list(self.open.items()):
            if now - since > REPEAT_HOLD_SECONDS:
                out += held
                del self.open[tag]
        return out

    def flush(self):
        held = [line for _, _, lines, _ in self.open.values() for line in lines]
        self.open = {}
        return held


class OutputFilter:
    """Passes the launcher's stderr through line by line, minus horovodrun's traceback
    after a failed rank and the marker of a watchdog's line (`hvdtrain.runtime.watchdog`), and
    keeps the recent lines, as they came, for `find_failure`.

    `elastic`: the job is elastic (horovodrun `--log-level INFO`): the driver's INFO lines
    are left out, but the one saying it blacklists a host becomes a line of hvdtrain-run's
    (`blacklisted`), with `cooldown` the (min, max) seconds it stays out, None for good.
    `quiet`: TensorFlow's start-up noise is left out (`hvdtrain.launcher.noise`: from horovodrun's
    own build checks, and from ranks that import TensorFlow before hvdtrain)."""

    def __init__(self, elastic=False, cooldown=None, quiet=True):
        self.seen = deque(maxlen=500)
        self._held = []  # a traceback of the launcher's own, until its last line tells
        self._tail = 0  # the lines after the Gloo error that belong to it
        self.elastic, self.cooldown, self.quiet = elastic, cooldown, quiet
        self._repeats = _Repeats()
        self._rule = None  # a dashed line of mpirun's, until the next says what it opens
        self._banner = False  # inside one of mpirun's end-of-job banners (`_BANNERS`)

    def feed(self, line):
        """The lines to print now for `line` (read from the launcher)."""
        if self.quiet and is_startup_noise(line):
            return []
        self.seen.append(line)  # a banner too: `find_failure` reads it
        line = without_marker(line)
        out = []
        if self._rule is not None:
            rule, self._rule = self._rule, None
            if line.startswith(_BANNERS):
                self._banner = True
                return []
            out = [rule]
        if self._banner:
            self._banner = not _RULE.fullmatch(line)
            return []
        if _RULE.fullmatch(line):
            self._rule = line
            return out
        return out + self._passed(line)

    def _passed(self, line):
        if self.elastic and line.startswith(("INFO:", "DEBUG:")):
            host = _BLACKLIST.search(line)
            return [f"hvdtrain-run: {blacklisted(host.group(1), self.cooldown)}\n"] if host else []
        if self._tail:
            if _NAME.search(line) or _CODE.search(line) or not line.strip():
                self._tail -= 1
                return []
            self._tail = 0
        if line.startswith(_GLOO_LINE):
            return []  # hvdtrain-run says it in its own words when the job ends
        if self._held:
            if line.startswith(" "):
                self._held.append(line)
                return []
            held, self._held = self._held + [line], []
            if line.startswith(_GLOO_ERROR):
                self._tail = 3
                return []
            return held
        if line.startswith("Traceback (most recent call last):"):
            self._held = [line]
            return []
        return self._repeats.feed(line)

    def flush(self):
        """Whatever is held back when the launcher's output ends."""
        held, self._held = self._held, []
        rule, self._rule = [self._rule] if self._rule else [], None
        return held + self._repeats.flush() + rule


def find_failure(lines, hosts=()):
    """The first failure the launcher's `lines` report (Gloo's horovodrun, Open MPI's
    mpirun), or None. `hosts`: the host of each rank (`rank_hosts`)."""
    text = " ".join(" ".join(line.split()) for line in lines)  # mpirun wraps its messages
    found = None
    lost = _LOST.search(text)
    if lost and lost.group(3):  # a daemon that could not connect back, at the start
        return Failure(lost_host=lost.group(3), unreached=lost.group(4))
    if lost:
        host = (lost.group(1) or lost.group(2)).rstrip(".,")
        return Failure(lost_host=host, peer=lost.group(1) is None)
    stall = _STALL_SHUTDOWN.search(text)
    stalled = sorted({int(r) for r in _STALLED.findall(text)}) if stall else []
    signaled = _SIGNALED.search(text)
    if stalled:  # the other ranks' errors followed from it
        found = Failure(stalled[0], code=STALLED, said=False)
        found.stalled, found.stalled_ranks = int(stall.group(1)), tuple(stalled)
    elif signaled:
        found = Failure(int(signaled.group(1)), signaled.group(2), signal=int(signaled.group(3)))
    else:
        name, code = _NAME.search(text), _CODE.search(text)
        if name and code:
            rank = name.group(1) or name.group(3)
            found = Failure(
                int(rank) if rank else None, host=name.group(2), code=int(code.group(1))
            )
            found = _first_to_fail(found, text)
            found = _stuck_not_waiting(found, text)
            found = _whose_words(found, lines, len(hosts) or None)
    if found and not found.stalled:
        found.said = ": error: " in text
    if found and found.host is None and found.rank is not None and found.rank < len(hosts):
        found.host = hosts[found.rank]
    return found


_STOPPED = "hvdtrain: rank {} stopped:"
_FAILED = re.compile(r"hvdtrain: rank (\d+) failed:")


def _first_to_fail(found, text):
    """mpirun names the first rank to exit, which may be one that stopped because another
    rank failed (it exits at once; the failed one is still unwinding): then the rank whose
    error line says it failed (an uncaught exception: status 1), else a `consequence`."""
    if _STOPPED.format(found.rank) not in text:
        return found
    failed = {int(r) for r in _FAILED.findall(text)} - {found.rank}
    if len(failed) == 1:
        return Failure(failed.pop(), code=1)
    found.consequence = True
    return found


_ERROR_LINE = re.compile(r"\S+(?: \[rank (\d+)\])?: error: (.*)", re.DOTALL)
_FAILED_LINE = re.compile(
    r"hvdtrain: rank (\d+) failed: (.*?)(?:; its traceback is the same as rank \d+'s)?"
    r"(?: \(last: .*\))?\s*",
    re.DOTALL,
)


def _whose_words(found, lines, size=None):
    """The launcher names the first rank to exit, which may be one that only exited under
    hvdtrain's error protocol (an error every rank agreed on is printed by rank 0 alone;
    the others leave after it, with its status): then every rank failed alike. So did they
    when every rank (of `size`, where known) printed the same `failed:` line."""
    if found.consequence or found.code == STALLED:
        return found
    said, failed = {}, {}
    for line in lines:
        tagged = _TAGGED.fullmatch(line)
        body = tagged.group(3) if tagged else line
        error, fail = _ERROR_LINE.fullmatch(body.strip()), _FAILED_LINE.fullmatch(body.strip())
        if error:  # `prog [rank N]: error: ...`; rank 0 names none
            rank = error.group(1) or (tagged.group(2) if tagged else 0)
            said.setdefault(int(rank), error.group(2))
        elif fail:
            failed.setdefault(int(fail.group(1)), fail.group(2))
    found.reason = said.get(found.rank, said.get(0))
    agreed = list(said) == [0] and found.rank not in said and found.code in (2, 3, 4)
    same = len(failed) > 1 and len(set(failed.values())) == 1 and found.rank in failed
    if agreed or (same and len(failed) == (size or len(failed))):
        found.alike = True
    return found


def _stuck_not_waiting(found, text):
    """A watchdog's status (124) names the rank stuck on its own, whose line said so, not
    one that waited for it and exited first; if only waiting ranks' watchdogs fired, the
    one named is `waited`. The watchdogs' lines are read by their marker, not their words."""
    if found.code != STALLED:
        return found
    lines = stalls(text)
    stuck = [rank for rank, waited in lines if not waited]
    if stuck and stuck[0] != found.rank:
        return Failure(stuck[0], code=STALLED)
    found.waited = not stuck and (found.rank, True) in lines
    return found


def explain(failure, hosts=(), answers=False):
    """One line on `failure` (from `find_failure`). `answers`: its `lost_host` still
    answers (this host, or a probe after the job), so a peer's banner lost a process."""
    if failure.lost_host:
        ranks = ranks_on(failure.lost_host, hosts)
        which = f" ({ranks})" if ranks else ""
        if failure.unreached:
            return (
                f"lost host {failure.lost_host}{which}: Open MPI's daemon there could not "
                f"connect back to {failure.unreached} as the job started (the network between "
                "them was down, or a firewall blocks it); the job was ended. `hvdtrain-run "
                "doctor` checks the hosts before a new launch."
            )
        if failure.peer and answers:
            return (
                f"a rank on host {failure.lost_host}{which} ended without a word: Open MPI's "
                "other ranks lost their connection to it while the host still answers (the "
                "process was killed or crashed: a kill, the out-of-memory killer); the job "
                "was ended"
            )
        return (
            f"lost host {failure.lost_host}{which}: Open MPI lost its connection there (the "
            "host went down or its network did); the job was ended. `hvdtrain-run doctor` "
            "checks the hosts before a new launch."
        )
    who = "a worker" if failure.rank is None else f"rank {failure.rank}"  # elastic: by host
    who += f" on host {failure.host}" if failure.host else ""
    code = failure.exit_code
    if failure.stalled:
        many = len(failure.stalled_ranks) > 1
        if many:  # each with its host, where known
            who = "ranks " + ", ".join(
                f"{r}" + (f" (host {hosts[r]})" if r < len(hosts) else "")
                for r in failure.stalled_ranks
            )
        return (
            f"{who} stopped making progress first: the other ranks waited for "
            f"{'them' if many else 'it'} in a collective for over "
            f"{failure.stalled} s, and Horovod's stall check ended the job (the time: "
            "HVDTRAIN_STALL_SHUTDOWN_SECONDS, and one check); the job was ended"
        )
    if code == SSH_LOST:
        return (
            f"{who} was lost first: exit status 255, ssh's when its connection ends (the host "
            "went down, its network did, or its sshd stopped) or a signal ended the process "
            "there (SIGKILL: the out-of-memory killer, a kill); the job was ended. "
            "`hvdtrain-run doctor` checks the hosts before a new launch."
        )
    if code and 128 < code <= 128 + 64:
        try:
            name = f" ({signal.Signals(code - 128).name})"
        except ValueError:
            name = ""
        return f"{who} was killed by signal {code - 128}{name} first; the job was ended"
    if failure.waited:
        return (
            f"{who} waited for the other ranks until its watchdog ended it (exit status "
            f"{code}), and no rank said it was stuck: one of them froze whole (a stopped "
            "process, a host that stopped answering); its line above says where it waited; "
            "the job was ended"
        )
    meaning = EXIT_CODES.get(code, "see its output above")
    if code in (2, 3, 4) and failure.said and failure.reason:
        meaning = one_line(failure.reason, most=160)
    if failure.alike:
        return f"every rank failed alike: exit status {code} ({meaning}); the job was ended"
    if failure.consequence:
        return (
            f"{who} exited first (exit status {code}), stopped because another rank ended or "
            "failed: see the ranks' output above; the job was ended"
        )
    if code in (2, 3, 4) and not failure.said:  # a script's own sys.exit(3) means its own
        meaning = "see its output above"
    return f"{who} failed first: exit status {code} ({meaning}); the job was ended"


def is_ending(line):
    """Whether the launcher's `line` says a rank is ending (the job is failing)."""
    return bool(_ENDING.search(line))


def launcher_grace_seconds(environ):
    """HVDTRAIN_LAUNCHER_GRACE_SECONDS from `environ`, else `LAUNCHER_GRACE_SECONDS`.

    Raises:
        HvdtrainError: not a number of seconds > 0.
    """
    text = environ.get(_GRACE_ENV, "").strip()
    if not text:
        return LAUNCHER_GRACE_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise invalid_value(_GRACE_ENV, text, "a number of seconds > 0, e.g. 30")
    return value


def explain_unanswered(down, hosts, ended_after=None):
    """One line on the hosts that stopped answering ssh during the job: `down` is {host:
    ssh's reason} (`doctor.unreachable`); `ended_after`: the grace after which hvdtrain-run
    ended the launcher, if it had to."""
    parts = []
    for host in down:
        ranks = ranks_on(host, hosts)
        parts.append(f"{host}{f' ({ranks})' if ranks else ''}")
    reasons = "; ".join(dict.fromkeys(down.values()))
    ended = (
        f"; the launcher was still waiting for it {ended_after:g} s after a rank ended, so "
        "hvdtrain-run ended it"
        if ended_after
        else ""
    )
    return (
        f"lost host {', '.join(parts)}: it no longer answers ssh ({reasons}), so its network "
        f"or the host went down during the job{ended}; the job was ended. `hvdtrain-run "
        "doctor` checks the hosts before a new launch."
    )


def blacklisted(host, cooldown=None):
    """One line: elastic Horovod left `host` out after a worker there failed."""
    if cooldown:
        return (
            f"host {host} is left out for {cooldown[0]}-{cooldown[1]} s: a worker there failed "
            "and Horovod blacklists its host (--blacklist-cooldown-range)"
        )
    return (
        f"host {host} is left out for the rest of this job: a worker there failed and Horovod "
        "blacklists its host. To use it again, run the job again once the host is fixed (it "
        "resumes from the last checkpoint)"
    )


def ranks_on(host, hosts):
    """'rank 1' or 'ranks 1, 2': the ranks that `hosts` (`rank_hosts`) puts on `host`."""
    ranks = [str(r) for r, h in enumerate(hosts) if h == host]
    return f"{'ranks' if len(ranks) > 1 else 'rank'} {', '.join(ranks)}" if ranks else ""


def rank_hosts(hosts, np):
    """The host of each of `np` ranks: slots filled host by host, as horovodrun and
    mpirun place them. Pure."""
    out = [host.name for host in hosts for _ in range(host.slots)]
    return out[:np]
