"""Elastic training (`--elastic`): the recipe of `hvdtrain.fit` (its `Run`, unchanged) under
Horovod Elastic, so a job keeps training when workers fail and takes in workers that join.

Launch it with a discovery script (it prints the available `host:slots`, one per line; Horovod
runs it every second) or a hostfile that `hvdtrain-run` turns into one; Gloo only::

    hvdtrain-run --elastic --min-np 1 --max-np 4 --host-discovery-script ./discover.sh \\
        -- python -m hvdtrain.mnist --elastic --checkpoint-dir ckpt
    hvdtrain-run --elastic --min-np 2 --hostfile hosts.txt -- python -m hvdtrain.mnist --elastic
    horovodrun --gloo -np 1 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh \\
        python -m hvdtrain.mnist --elastic

How it works. The recipe's set-up, which has no collectives (model, optimizer with its slots),
and hvdtrain's `ModelState(model, optimizer, epoch=0, batch=0, ...)`, for Keras 2 and Keras 3
alike (Horovod's `KerasState` is Keras 2 only); then one function under
`hvd.elastic.run` that does everything else with the recipe's own steps: data, resume from a
checkpoint, `fit` (watchdog and steps per execution included), the final evaluation.
Horovod broadcasts rank 0's state (weights, optimizer slots, epoch, step) each time the
function starts, so a worker that joins starts from the others' state.

* Every `--commit-every` steps and at the end of each epoch the state is committed (copied in
  memory); rank 0 then tells every rank, at the same step, whether hosts changed. A change
  interrupts the function on every rank at that commit (`HostsUpdatedInterrupt`): nothing
  is lost.
* A worker that dies makes the next collective fail on the others (`HorovodInternalError`):
  they roll back to the last commit, never further (at most `--commit-every` steps are done
  again); Horovod blacklists the failed worker's host and forms the ranks again.
* After either, the function starts again at the committed epoch and step, and whatever
  depends on the number of ranks follows the new size: the LR scale of `WarmupSchedule` (the
  traced train step is dropped, since it holds the old rate), steps per epoch, warmup steps,
  the data shards, the step within the epoch (the samples seen are kept, as for a resume on
  another number of ranks: `hvdtrain.recipe.trainer.resume_step`) and the optimizer's step. Rank 0
  writes checkpoints and the metrics, whichever worker is rank 0 by then; the job's record
  (epochs' metrics, commits, resets, its start) is in the state too (`state.ledger`), so
  the metrics describe the whole job even when written by a worker that joined late. With
  several steps per execution, a commit happens at the end of the execution that passed
  `--commit-every` steps: a failure redoes at most `--commit-every` + steps per execution - 1
  steps.

Horovod 0.28.1 pitfalls handled here (docs/fault-tolerance.md, "Elastic training"):

* Its `UpdateBatchStateCallback` stores the index of the last batch of the current `fit`
  call: one less than the steps done (a rollback would apply a step twice), and relative to
  where `fit` started after a mid-epoch restart. Its shortening of the first epoch after a
  reset writes `params["steps"]`, which Keras 2's loop does not read. Replaced below.
* Its `UpdateEpochStateCallback` adds the epoch `fit` started at to Keras' epoch, which is
  already absolute with `fit(initial_epoch=state.epoch)`: state.epoch doubles after a reset
  (horovod/horovod#2844). Fixed below.
* A new worker must find the same variables as the others when rank 0's are broadcast:
  the optimizer is built before the state is made (horovod/horovod#2652), and no collective
  runs outside the elastic function (a new worker would block in it while the others
  synchronise).
* `hvd.elastic.run` turns a `tf.errors.UnknownError` into a recoverable failure only when it
  names a Horovod op, and silently returns None for any other: training would end as if it
  had succeeded. Such errors are re-raised here as they are.
* `hvd.DistributedOptimizer` rebuilds the optimizer from its config, schedule included:
  changing the schedule object given to it changes nothing. The optimizer is pointed back at
  that object, and the traced train step, which holds the rate as a constant, is dropped
  when the size changes (`hvdtrain.optimizers.rates.rescale_schedule`).
* Horovod turns the failures of the training function into a rollback, not those of the
  broadcast of rank 0's state before it: a worker dying then ended every worker.
  `ModelState.sync` turns them into one too.
* The epoch's last step is committed once, at the epoch end, not also before the epoch-end
  evaluation as Horovod's `CommitStateCallback` does (a failure in between would restart
  one step past the epoch's end). Its count of batches also assumes one step per call, so
  with several steps per execution it would commit every `--commit-every` executions.
* The watchdog is stopped when a worker fails: forming the ranks again may take longer than
  the stall time (waiting for `--min-np` hosts), and the next `fit` starts it again.

Tests: tests/test_elastic.py (a worker killed mid-training, a worker that joins, each
pitfall above shown with Horovod's piece and with hvdtrain's).
"""

import hashlib
import logging
import sys
import time

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf
from horovod.common.elastic import ObjectState
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

from hvdtrain.errors import HvdtrainError, one_line, write_line
from hvdtrain.recipe import optim
from hvdtrain.runtime import watchdog
from hvdtrain.runtime.uncaught import because_of_another_rank

__all__ = [
    "run",
    "guarded",
    "ModelState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "CommitStateCallback",
]

log = logging.getLogger("hvdtrain")


class ModelState(ObjectState):
    """Horovod's elastic state of a Keras 2 or Keras 3 model and optimizer (plus the keyword
    attributes, as Horovod's `ObjectState`): `commit` copies their variables in memory,
    `restore` puts the copy back, `sync` hands rank 0's to every rank.

    In place of Horovod's `KerasState`, which is Keras 2 only (it calls `optimizer.variables()`,
    and broadcasts Keras 3 variables not at all), and names its broadcasts by the variables'
    names, which can differ between ranks (`hvdtrain.recipe.optim.broadcast_initial_state` goes
    by position). A worker that dies during the broadcast (as one joins, say) becomes
    `HorovodInternalError`, a rollback: Horovod converts the errors of the training function
    only, and would otherwise end every worker.
    """

    def __init__(self, model, optimizer, **kwargs):
        self.model, self.optimizer = model, optimizer
        self._save_variables()
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)

    def _variables(self):
        return optim.state_variables(self.model, self.optimizer)

    def _save_variables(self):
        self._saved = [tf.identity(v) for v in self._variables()]

    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        for v, saved in zip(self._variables(), self._saved, strict=True):
            v.assign(saved)
        super().restore()

    def _bcast_model(self):  # Horovod's name for this step
        optim.broadcast_initial_state(self.model, self.optimizer)

    def sync(self):
        try:
            self._bcast_model()
            self._save_variables()
            super().sync()
        except tf.errors.OpError as e:
            if not _is_horovod_failure(e):
                raise
            raise HorovodInternalError(e) from e


class UpdateBatchStateCallback(hvd_keras.elastic.UpdateBatchStateCallback):
    """Keeps `state.batch` = the steps done in the current epoch, counted from the epoch's
    start even when `fit` started mid-epoch; 0 after the epoch ends.

    Horovod's version stores the last batch index of the current `fit` call (one less than
    the steps done, and relative to where `fit` started).
    """

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._first = self.state.batch  # fit starts this many steps into the epoch

    def on_epoch_begin(self, epoch, logs=None):
        pass  # Horovod's shortens params["steps"], which Keras 2's loop ignores: fit is told

    def on_batch_end(self, batch, logs=None):
        self.state.batch = self._first + batch + 1

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._first = 0


class UpdateEpochStateCallback(hvd_keras.elastic.UpdateEpochStateCallback):
    """Keeps `state.epoch` = the epochs completed, for `fit(initial_epoch=state.epoch)`.

    Keras then numbers epochs from `state.epoch` already; Horovod's version adds it a second
    time after every reset (horovod/horovod#2844).
    """

    def on_train_begin(self, logs=None):
        self.initial_epoch = 0


class CommitStateCallback(hvd_keras.elastic.CommitStateCallback):
    """Commits when `state.batch` passes a multiple of `batches_per_commit` steps (once per
    execution of several steps) and at each epoch end, calling `on_commit()` first (the
    commit itself may then raise `HostsUpdatedInterrupt`); after `UpdateBatchStateCallback`.

    With `ready` (`() -> bool`, called on every rank where a commit is due), a commit waits
    for a point where it is True: under `--sync local/diloco`, the first exchange after the
    steps (the ranks differ between exchanges); with `--sync-overlap`, at once
    (`Exchange.ready_to_commit`).

    The epoch's last step is not committed on its own: Horovod's version commits it, then
    the epoch end again, and a failure between the two (in the epoch-end evaluation) would
    restart at a step past the epoch's last.
    """

    def __init__(self, state, batches_per_commit, on_commit=None, ready=None):
        super().__init__(state, batches_per_commit)
        self.on_commit, self.ready = on_commit, ready
        self._committed = state.batch

    def on_batch_end(self, batch, logs=None):
        done, every = self.state.batch, self.batches_per_commit
        if done == self.params.get("steps", -1) + self._first:  # on_epoch_end commits next
            return
        if done // every <= self._committed // every:
            return
        if self.ready is not None and not self.ready():  # --sync local: at exchanges only
            return
        self.commit()

    def on_train_begin(self, logs=None):
        self._first = self._committed = self.state.batch

    def on_epoch_end(self, epoch, logs=None):
        self._first = 0
        super().on_epoch_end(epoch, logs)

    def commit(self):
        if self.on_commit:
            self.on_commit()
        self._committed = self.state.batch
        watchdog.doing(
            "committing the elastic state (asks the other ranks for host changes)",
            watchdog.OTHER_RANKS,
        )
        super().commit()


class _EpochLogs(tf.keras.callbacks.Callback):
    """Records each epoch's (rank-averaged) logs by absolute epoch; a redone epoch replaces."""

    def __init__(self, record):
        super().__init__()
        self.record = record

    def on_epoch_end(self, epoch, logs=None):
        self.record.epoch_ended(epoch, {k: float(v) for k, v in (logs or {}).items()})


def _is_horovod_failure(error):
    """A TensorFlow error raised by a Horovod collective: a peer died or Horovod shut down.
    Gloo's own error of a dead peer's connection ("Read error ...: Connection reset by
    peer", a collective of a thread of hvdtrain's) names no Horovod op: a lost peer too."""
    if not isinstance(error, tf.errors.OpError):
        return False
    return "Horovod" in str(error) or because_of_another_rank(str(error)) is not None


def _digest(variables):
    h = hashlib.sha256()
    for v in variables:
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return h.hexdigest()


class _Record:
    """The elastic run's record. The job's part (`state.ledger`: epochs' logs, commits,
    resets, when the job began) lives in Horovod's state, so it is committed and rolled
    back with the weights and a worker that joins receives it with them: whichever worker
    is rank 0 at the end writes the whole job's. This process's starts are its own."""

    def __init__(self, recipe, state):
        self.recipe, self.state = recipe, state
        self.starts, self.interrupt, self.size = [], None, None
        self.commit_at = (0, 0)  # (epoch, batch) of this process's last commit or start
        self.began = time.time()

    @staticmethod
    def new_ledger():
        return {"began": None, "history_before": {}, "epochs": {}, "commits": 0,
                "last_commit": None, "resets": []}  # fmt: skip

    def _update(self, **changes):
        # A new dict each time: Horovod's commit keeps a reference, not a copy.
        self.state.ledger = {**self.state.ledger, **changes}

    def where(self):
        steps, state = self._steps(), self.state
        return {
            "epoch": int(state.epoch),
            "batch": int(state.batch),
            "step": int(state.epoch * steps + state.batch),
        }

    def _steps(self):
        plan = self.recipe.plan
        return plan.steps if plan else 0

    def started(self):
        r, plan = self.recipe, self.recipe.plan
        self.size = plan.place.size
        self.commit_at = (int(self.state.epoch), int(self.state.batch))
        if self.state.ledger["began"] is None:  # the job's first start
            self._update(began=self.began, history_before=r.history_before)
        self.starts.append(
            {
                "size": plan.place.size,
                "rank": plan.place.rank,
                **self.where(),
                "steps_per_epoch": plan.steps,
                "global_batch": plan.global_batch,
                "warmup_steps": plan.warmup_steps,
                "lr_scaled": r.built.lr_scaled(),
                "lr_now": float(r.built.schedule(plan.start_step)),
            }
        )

    def epoch_ended(self, epoch, logs):
        self._update(epochs={**self.state.ledger["epochs"], epoch: logs})

    def committed(self):
        self.commit_at = (int(self.state.epoch), int(self.state.batch))
        ledger = self.state.ledger
        self._update(
            commits=ledger["commits"] + 1, last_commit={**self.where(), "size": hvd.size()}
        )

    def interrupted(self, reason):
        # The steps since this process's last commit, counted in this process's steps per
        # epoch (the size may change before the reset is logged).
        epoch, batch = int(self.state.epoch), int(self.state.batch)
        steps = self._steps()
        redone = (epoch - self.commit_at[0]) * steps + batch - self.commit_at[1]
        self.interrupt = {
            "reason": reason,
            "interrupted_at": self.where() if steps else None,
            "redone_steps": max(0, redone) if steps else 0,
        }
        wd = self.recipe.watchdog
        if wd is not None and wd.watchdog is not None:
            wd.watchdog.stop()  # forming the ranks again may take longer than the stall time

    def on_reset(self):
        """Horovod calls this after a reset, before rank 0's state is broadcast: the new
        size is known, the state rolled back to the last commit (after a failure)."""
        from hvdtrain.runtime.logs import get_logger

        get_logger(hvd.rank())  # rank 0 may be another worker now: it does the talking
        interrupt, self.interrupt = (
            self.interrupt or {"reason": "reset", "interrupted_at": None, "redone_steps": 0},
            None,
        )
        restored = self.where()
        record = {
            **interrupt,
            "size_before": self.size,
            "size_after": hvd.size(),
            "rank_after": hvd.rank(),
            "last_commit": self.state.ledger["last_commit"],
            "restored": restored,
        }
        self._update(resets=[*self.state.ledger["resets"], record])
        self.state.save()  # with the reset in the ledger: rank 0's is broadcast next
        log.info(
            "elastic: %s; %s -> %d rank(s); back to epoch %d, step %d (last commit), "
            "%d step(s) to do again",
            record["reason"],
            self.size,
            hvd.size(),
            restored["epoch"] + 1,
            restored["batch"],
            record["redone_steps"],
        )

    def history(self):
        """The job's history: the epochs before its first start (from the checkpoint it
        resumed) and every committed epoch since."""
        ledger = self.state.ledger
        history = {k: list(v) for k, v in ledger["history_before"].items()}
        before = max((len(v) for v in history.values()), default=0)
        for epoch in sorted(e for e in ledger["epochs"] if e >= before):
            for k, v in ledger["epochs"][epoch].items():
                history.setdefault(k, []).append(v)
        return history

    def wall_seconds(self):
        """Seconds since the job's first start (rank 0's clock then, this host's now)."""
        return time.time() - (self.state.ledger["began"] or self.began)

    def section(self):
        ledger = self.state.ledger
        return {
            "commit_every": self.recipe.cfg.commit_every,
            "commits": ledger["commits"],
            "last_commit": ledger["last_commit"],
            "starts": self.starts,
            "resets": ledger["resets"],
            "process_wall_seconds": time.time() - self.began,
        }


def guarded(body, interrupted=None):
    """`body(state)` for `hvd.elastic.run`, with every Horovod failure made recoverable
    (`HorovodInternalError`) and any other TensorFlow error raised as it is (Horovod would
    swallow it: see the module's pitfalls); `interrupted(reason)` is told first."""

    def run(state):
        try:
            return body(state)
        except tf.errors.OpError as e:
            if not _is_horovod_failure(e):
                raise RuntimeError(f"{type(e).__name__}: {e}") from e  # not swallowed
            if interrupted:
                interrupted("a worker failed")
            raise HorovodInternalError(e) from e
        except HorovodInternalError:
            if interrupted:
                interrupted("a worker failed")
            raise
        except HostsUpdatedInterrupt:
            if interrupted:
                interrupted("hosts changed")
            raise

    return run


def quiet_refusals():
    """Horovod's services in this process (an elastic worker's notification service, on every
    interface) refuse a request not signed with the job's key, and Python's socketserver
    printed a 20-line traceback for each (`Exception: Security error: digest did not match
    the message.`). Here each is one line, counted; the refusal itself is Horovod's."""
    from horovod.runner.common.util import network

    made = network.BasicService.__init__
    if getattr(made, "_hvdtrain", False):
        return
    refused = [0]

    def handle_error(service, request, client_address):
        refused[0] += 1
        error = sys.exc_info()[1]
        why = "not signed with this job's key" if "Security error" in str(error) else (
            one_line(error))  # fmt: skip
        write_line(
            f"hvdtrain: rank {hvd.rank() if hvd.is_initialized() else '?'}: Horovod's "
            f"{service._service_name} refused a request from {client_address[0]}: {why} "
            f"({refused[0]} refused so far)"
        )

    def __init__(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self._server.handle_error = lambda request, address: handle_error(self, request, address)

    __init__._hvdtrain = True
    network.BasicService.__init__ = __init__


def run(recipe):
    """`hvdtrain.fit(..., elastic=True)`: `recipe` (a `hvdtrain.recipe.trainer.Run`) under
    `hvd.elastic.run`; returns its metrics, with an `elastic` section (this process's
    starts, commits and resets). Launched without Horovod Elastic (no
    `--host-discovery-script`/`--min-np`) it is a fixed-size job that cannot recover."""
    quiet_refusals()  # before Horovod starts this worker's service
    recipe.setup()
    state = ModelState(
        recipe.built.model,
        recipe.built.state_holders(),
        epoch=0,
        batch=0,
        global_batch=0,
        started=False,
        resumed=None,
        stopped=None,  # the epoch after which a callback stopped training: kept by a reset
        ledger=_Record.new_ledger(),
    )
    record = _Record(recipe, state)
    state.register_reset_callbacks([record.on_reset])

    def body(state):
        position = (state.epoch, state.batch, state.global_batch) if state.started else None
        step = recipe.start(position)
        if state.started:  # (the first start reads it from the checkpoint, if any)
            recipe.stopped = state.stopped
        recipe.on_stop = lambda epoch: setattr(state, "stopped", epoch)
        if not state.started:
            state.started, state.resumed, state.stopped = True, recipe.resumed, recipe.stopped
        recipe.resumed = state.resumed
        state.epoch, state.batch = divmod(step, recipe.plan.steps)
        state.global_batch = recipe.plan.global_batch
        record.started()
        # The ranks agree at exchanges only under --sync local/diloco: commits wait for one.
        commit = CommitStateCallback(
            state, recipe.cfg.commit_every, record.committed, recipe.built.exchange.ready_to_commit
        )
        # Horovod: epoch and step into the state, then checkpoint, then commit.
        recipe.train(
            state_callbacks=[
                _EpochLogs(record),
                UpdateBatchStateCallback(state),
                UpdateEpochStateCallback(state),
            ],
            commit=commit,
        )
        result, ranks = recipe.evaluate(), recipe.check()
        digest = _digest(recipe.built.optimizers.main.variables)
        mine = {"rank": hvd.rank(), "optimizer_digest": digest}
        optimizers = hvd.allgather_object(mine, name="hvdtrain.opt") if hvd.size() > 1 else [mine]
        by_rank = {o["rank"]: o["optimizer_digest"] for o in optimizers}
        return result, [{**r, "optimizer_digest": by_rank.get(r["rank"])} for r in ranks]

    out = hvd.elastic.run(guarded(body, record.interrupted))(state)
    if out is None:  # only if Horovod swallowed an error that body() did not see
        raise HvdtrainError("elastic training stopped on an error Horovod did not report")
    result, ranks = out
    return recipe.finish(
        result,
        ranks,
        history=record.history(),
        wall_seconds=record.wall_seconds(),
        elastic=record.section(),
    )
