"""Elastic training (`--elastic`): the trainer's loop under Horovod Elastic, so a job keeps
training when workers fail and takes in workers that join.

Launch it with a discovery script (it prints the available `host:slots`, one per line; Horovod
runs it every second) or a hostfile that `hvdtrain-run` turns into one; Gloo only::

    hvdtrain-run --elastic --min-np 1 --max-np 4 --host-discovery-script ./discover.sh \\
        -- python -m hvdtrain.mnist --elastic --checkpoint-dir ckpt
    hvdtrain-run --elastic --min-np 2 --hostfile hosts.txt -- python -m hvdtrain.mnist --elastic
    horovodrun --gloo -np 1 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh \\
        python -m hvdtrain.mnist --elastic

How it works. Set-up without collectives (model, optimizer with its slots, Horovod's
`KerasState(model, optimizer, epoch=0, batch=0, ...)`), then one function under
`hvd.elastic.run` that does everything else: data, resume from a checkpoint, `fit`, the final
evaluation. Horovod broadcasts rank 0's state (weights, optimizer slots, epoch, step) each
time the function starts, so a worker that joins starts from the others' state.

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
  another number of ranks: `hvdtrain.trainer.resume_step`) and the optimizer's step. Rank 0
  writes checkpoints and the metrics, whichever worker is rank 0 by then.

Horovod 0.28.1 pitfalls handled here (see README, "Elastic training"):

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
  when the size changes (`rescale_schedule`).
* Horovod turns the failures of the training function into a rollback, not those of the
  broadcast of rank 0's state before it: a worker dying then ended every worker.
  `KerasState.sync` turns them into one too.
* The epoch's last step is committed once, at the epoch end, not also before the epoch-end
  evaluation as Horovod's `CommitStateCallback` does (a failure in between would restart
  one step past the epoch's end).

Tests: tests/test_elastic.py (a worker killed mid-training, a worker that joins, each
pitfall above shown with Horovod's piece and with hvdtrain's).
"""

import hashlib
import logging
import os
import time

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

from hvdtrain.errors import HvdtrainError

__all__ = [
    "train",
    "rescale_schedule",
    "KerasState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "CommitStateCallback",
]

log = logging.getLogger("hvdtrain")


class KerasState(hvd_keras.elastic.KerasState):
    """Horovod's state of a Keras model and optimizer (plus the keyword attributes), whose
    `sync` turns a failed broadcast into `HorovodInternalError`.

    Horovod converts the errors of the training function only; a worker that dies while
    rank 0's state is broadcast (as one joins, say) would otherwise end every worker.
    """

    def sync(self):
        try:
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
    """Horovod's commit every `batches_per_commit` steps and at each epoch end, calling
    `on_commit()` first (the commit itself may then raise `HostsUpdatedInterrupt`).

    The epoch's last step is not committed on its own: Horovod's version commits it, then
    the epoch end again, and a failure between the two (in the epoch-end evaluation) would
    restart at a step past the epoch's last.
    """

    def __init__(self, state, batches_per_commit, on_commit=None):
        super().__init__(state, batches_per_commit)
        self.on_commit = on_commit

    def on_batch_end(self, batch, logs=None):
        if batch + 1 == self.params.get("steps"):  # on_epoch_end commits next
            self.batches_remaining = self.batches_per_commit
            return
        super().on_batch_end(batch, logs)

    def commit(self):
        if self.on_commit:
            self.on_commit()
        super().commit()


class _EpochLogs(tf.keras.callbacks.Callback):
    """Records each epoch's (rank-averaged) logs by absolute epoch; a redone epoch replaces."""

    def __init__(self, epochs):
        super().__init__()
        self.epochs = epochs

    def on_epoch_end(self, epoch, logs=None):
        self.epochs[epoch] = {k: float(v) for k, v in (logs or {}).items()}


def rescale_schedule(model, schedule, size, warmup_steps):
    """Points `schedule` (a `hvdtrain.WarmupSchedule`) at `size` ranks and `warmup_steps`.

    Keras evaluates the schedule while tracing the train step, so the rate is a constant in
    the traced step: it is dropped (traced again by the next `fit`) when anything changed.
    Returns True when it was. `schedule` must be the model optimizer's own object
    (`optimizer.learning_rate = schedule`): `hvd.DistributedOptimizer` rebuilds the
    optimizer from its config, so the schedule given to the wrapped optimizer is a copy.
    """
    if (schedule.size, schedule.warmup_steps) == (int(size), int(warmup_steps)):
        return False
    schedule.size, schedule.warmup_steps = int(size), int(warmup_steps)
    model.train_function = None
    return True


def _is_horovod_failure(error):
    """A TensorFlow error raised by a Horovod collective: a peer died or Horovod shut down."""
    return isinstance(error, tf.errors.OpError) and "Horovod" in str(error)


def _digest(variables):
    h = hashlib.sha256()
    for v in variables:
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return h.hexdigest()


def _where(epoch, batch, steps):
    return {"epoch": int(epoch), "batch": int(batch), "step": int(epoch * steps + batch)}


class _ElasticRun:
    """One process's elastic run: the set-up, the function under `hvd.elastic.run`, and
    the record of its (re)starts, commits and resets for the metrics."""

    def __init__(self, args, prog, build_model, load_data, optimizer):
        self.args, self.prog = args, prog
        self.build_model, self.load_data, self.optimizer = build_model, load_data, optimizer
        self.starts, self.resets, self.epoch_logs = [], [], {}
        self.commits, self.last_commit, self.interrupt = 0, None, None
        self.size = self.steps = self._state = None
        self.announced = False

    # -- set-up: no collectives (a worker that joins runs it while the others wait) -------
    def setup(self):
        import hvdtrain
        from hvdtrain.trainer import _mixed_precision_policy

        args = self.args
        hvdtrain.init(threads=args.threads)
        self.size = hvd.size()
        tf.keras.utils.set_random_seed(args.seed + hvd.rank())
        if args.deterministic:
            tf.config.experimental.enable_op_determinism()
            tf.keras.backend.experimental.enable_tf_random_generator()
        self.policy = policy = _mixed_precision_policy(args.mixed_precision)
        if policy:
            tf.keras.mixed_precision.set_global_policy(policy)
        model = self.build_model()
        if policy:
            inputs = tf.keras.Input(model.input_shape[1:])
            logits = tf.keras.layers.Activation("linear", dtype="float32")(model(inputs))
            model = tf.keras.Model(inputs, logits, name=model.name)
        # Horovod: the scale and warmup follow the number of ranks at each (re)start.
        self.schedule = hvdtrain.WarmupSchedule(args.lr, self.size, 0)
        if self.optimizer == "sgd":
            base = tf.keras.optimizers.SGD(self.schedule, momentum=0.9)
        else:
            base = tf.keras.optimizers.Adam(self.schedule)
        opt = hvdtrain.distributed_optimizer(
            base, compression=hvdtrain.fp16_compression() if args.fp16_allreduce else None
        )
        # Horovod made the distributed optimizer from `base`'s config, with a copy of the
        # schedule: point it at the one that `rescale_schedule` changes.
        opt.learning_rate = self.schedule
        if policy == "mixed_float16":
            opt = tf.keras.mixed_precision.LossScaleOptimizer(opt)
        loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=opt, loss=loss, metrics=["accuracy"])
        # Horovod: slots exist before the state is made, so every worker, joining or not,
        # has the same variables for rank 0's broadcast (horovod/horovod#2652).
        opt.build(model.trainable_variables)
        self.model, self.opt = model, opt
        self.manager = None
        if args.checkpoint_dir:
            self.manager = hvdtrain.CheckpointManager(
                args.checkpoint_dir, model, opt, keep=args.keep_checkpoints
            )
        # epoch, batch: where training is (batch in steps of `global_batch` samples).
        state = KerasState(
            model, opt, epoch=0, batch=0, global_batch=0, started=False, resumed=None
        )
        state.register_reset_callbacks([self.on_reset])
        return state

    # -- the elastic function -------------------------------------------------------------
    def run(self, state):
        """`_train` under `hvd.elastic.run`, with the interruption recorded for `on_reset`
        and every Horovod failure made recoverable (see the module's pitfalls)."""
        try:
            return self._train(state)
        except tf.errors.OpError as e:
            if not _is_horovod_failure(e):
                raise RuntimeError(f"{type(e).__name__}: {e}") from e  # not swallowed
            self._interrupted("a worker failed", state)
            raise HorovodInternalError(e) from e
        except HorovodInternalError:
            self._interrupted("a worker failed", state)
            raise
        except HostsUpdatedInterrupt:
            self._interrupted("hosts changed", state)
            raise

    def _interrupted(self, reason, state):
        where = _where(state.epoch, state.batch, self.steps or 0) if self.steps else None
        self.interrupt = {"reason": reason, "interrupted_at": where}

    def on_reset(self):
        """Horovod calls this after a reset, before rank 0's state is broadcast: the new
        size is known, the state rolled back to the last commit (after a failure)."""
        import hvdtrain

        new_size, rank = hvd.size(), hvd.rank()
        hvdtrain.get_logger(rank)  # rank 0 may be another worker now: it does the talking
        interrupt = self.interrupt or {"reason": "reset", "interrupted_at": None}
        self.interrupt = None
        restored = _where(self._state.epoch, self._state.batch, self.steps or 0)
        record = {
            **interrupt,
            "size_before": self.size,
            "size_after": new_size,
            "rank_after": rank,
            "last_commit": self.last_commit,
            "restored": restored,
            "redone_steps": (
                interrupt["interrupted_at"]["step"] - restored["step"]
                if interrupt["interrupted_at"]
                else 0
            ),
        }
        self.resets.append(record)
        # Horovod: the LR scale follows the new number of ranks (warmup and steps per epoch
        # follow too, once the function knows the data size again).
        rescale_schedule(self.model, self.schedule, new_size, self.schedule.warmup_steps)
        self.size = new_size
        log.info(
            "elastic: %s; %d -> %d rank(s); back to epoch %d, step %d (last commit), "
            "%d step(s) to do again",
            record["reason"],
            record["size_before"],
            new_size,
            restored["epoch"] + 1,
            restored["batch"],
            record["redone_steps"],
        )

    def _train(self, state):
        import hvdtrain
        from hvdtrain import callbacks as callbacks_mod
        from hvdtrain import data, runtime
        from hvdtrain.trainer import resume_step

        args, model, opt = self.args, self.model, self.opt
        self._state = state
        rank, size = hvd.rank(), hvd.size()
        self.size = size
        hvdtrain.get_logger(rank)
        # Every worker, old or new, loads at each start: a loader may use collectives.
        d = runtime.agree(self.load_data)
        (x_train, y_train), (x_test, y_test) = d.train, d.test
        if args.limit_samples:
            x_train, y_train = x_train[: args.limit_samples], y_train[: args.limit_samples]
        if not self.announced:
            log.info("data: %s; %d train, %d test samples", d.notice, len(x_train), len(x_test))
            self.announced = True
        self.data_source, self.train_samples = d.source, len(x_train)
        # Horovod: steps, warmup, LR scale and global batch follow the current size.
        steps = data.steps_per_epoch(len(x_train), args.batch_size, size)
        warmup_steps = round(args.warmup_epochs * steps)
        global_batch = args.batch_size * size
        rescale_schedule(model, self.schedule, size, warmup_steps)

        if not state.started:  # the job's first start: resume from a checkpoint
            state.resumed = self._resume(steps, global_batch, resume_step)
            if state.resumed:
                state.epoch, state.batch = divmod(state.resumed["optimizer_iterations"], steps)
            state.global_batch, state.started = global_batch, True
        elif state.global_batch != global_batch and state.batch:
            # Another number of ranks: keep the samples seen in this epoch (resume's rule).
            saved = {"epoch": 0, "step": state.batch, "global_batch": state.global_batch}
            state.batch = resume_step(saved, steps, global_batch)
        state.global_batch = global_batch
        self.steps = steps
        start_step = state.epoch * steps + state.batch
        opt.iterations.assign(start_step)  # the LR schedule follows this step
        start = {
            "size": size,
            "rank": rank,
            **_where(state.epoch, state.batch, steps),
            "steps_per_epoch": steps,
            "global_batch": global_batch,
            "warmup_steps": warmup_steps,
            "lr_scaled": hvdtrain.scaled_lr(args.lr, size),
            "lr_now": float(self.schedule(start_step)),
        }
        self.starts.append(start)
        log.info(
            "elastic: training on %d rank(s) from epoch %d, step %d of %d (global step %d); "
            "batch %d/rank (%d global), lr %g -> %g over %d steps; commit every %d steps",
            size,
            state.epoch + 1,
            state.batch,
            steps,
            start_step,
            args.batch_size,
            global_batch,
            args.lr,
            start["lr_scaled"],
            warmup_steps,
            args.commit_every,
        )

        def train_ds(step):
            return data.train_dataset(
                x_train, y_train, args.batch_size, rank, size, seed=args.seed,
                map_fn=d.train_map, start_step=step, steps=steps,
            )  # fmt: skip

        test_ds = data.eval_dataset(x_test, y_test, 256, rank, size, map_fn=d.eval_map)
        self.throughput = hvdtrain.ThroughputCallback(global_batch)
        callbacks = [
            callbacks_mod.ModelStateAverageCallback(),
            hvdtrain.MetricAverageCallback(
                steps * args.batch_size, evaluate_fn=lambda: hvdtrain.evaluate(model, test_ds)
            ),
            _EpochLogs(self.epoch_logs),
            self.throughput,
            # Horovod: epoch and step in the state, then checkpoint, then commit.
            UpdateBatchStateCallback(state),
            UpdateEpochStateCallback(state),
        ]
        if args.deterministic:
            callbacks.insert(0, callbacks_mod.DeterministicRandomness(args.seed, rank, start_step))
        if self.manager:
            extra = {"size": size, "global_batch": global_batch, "steps_per_epoch": steps}
            callbacks.append(
                hvdtrain.CheckpointCallback(
                    self.manager, {**extra, "prog": self.prog}, steps, args.checkpoint_every,
                    start_step,
                )
            )  # fmt: skip
        callbacks.append(CommitStateCallback(state, args.commit_every, self._record_commit))
        callbacks += callbacks_mod.rank0_callbacks(args.log_dir)

        def fit(epochs, steps_this_epoch):
            model.fit(
                train_ds(state.epoch * steps + state.batch),
                epochs=epochs,
                initial_epoch=state.epoch,
                steps_per_epoch=steps_this_epoch,
                callbacks=callbacks,
                verbose=2 if rank == 0 else 0,
            )

        if state.batch and state.epoch < args.epochs:  # finish the interrupted epoch
            fit(state.epoch + 1, steps - state.batch)
        if state.epoch < args.epochs:
            fit(args.epochs, steps)

        result = hvdtrain.evaluate(model, test_ds)
        ranks = runtime.rank_report(model)
        mine = {"rank": rank, "optimizer_sha256": _digest(opt.variables())}
        optimizers = [mine] if size == 1 else hvd.allgather_object(mine, name="hvdtrain.opt")
        if len({r["weights_sha256"] for r in ranks}) != 1:
            raise HvdtrainError("ranks ended with different weights; this is a bug, please report")
        return {"result": result, "ranks": ranks, "optimizers": optimizers, "steps": steps}

    def _resume(self, steps, global_batch, resume_step):
        """The job's first start: rank 0 restores the newest checkpoint, every rank gets it."""
        import hvdtrain
        from hvdtrain import runtime

        if not self.manager:
            return None
        manager = self.manager

        def resume():
            manager.check_writable()
            found = manager.latest()
            if not found:
                return None
            manager.restore(found[1], found[2])
            return {k: found[2].get(k) for k in ("epoch", "step", "global_batch", "size")}

        saved = runtime.agree(resume, root_only=True)
        saved = hvd.broadcast_object(saved, root_rank=0, name="hvdtrain.resume")
        if not saved:
            return None
        hvdtrain.broadcast_initial_state(self.model, self.opt)  # rank 0's restored state
        step = resume_step(saved, steps, global_batch)
        log.info(
            "resuming at epoch %d, step %d of %d (global step %d) from %s",
            step // steps + 1,
            step % steps,
            steps,
            step,
            manager.directory,
        )
        return {"epoch": saved["epoch"], "step": saved["step"] or 0, "optimizer_iterations": step}

    def _record_commit(self):
        state = self._state
        self.commits += 1
        self.last_commit = {**_where(state.epoch, state.batch, self.steps), "size": hvd.size()}
        log.debug("elastic: commit at epoch %d, step %d", state.epoch + 1, state.batch)

    # -- after the function ---------------------------------------------------------------
    def metrics(self, out, wall_seconds):
        import hvdtrain

        args, size, steps = self.args, hvd.size(), out["steps"]
        history = {}
        for epoch in sorted(self.epoch_logs):
            for k, v in self.epoch_logs[epoch].items():
                history.setdefault(k, []).append(v)
        resumed = self._state.resumed
        by_rank = {o["rank"]: o["optimizer_sha256"] for o in out["optimizers"]}
        return {
            "prog": self.prog,
            "size": size,
            "epochs": args.epochs,
            "initial_epoch": resumed["optimizer_iterations"] // steps if resumed else 0,
            "resumed_from": resumed,
            "steps_per_epoch": steps,
            "batch_size": args.batch_size,
            "global_batch_size": args.batch_size * size,
            "deterministic": bool(args.deterministic),
            "accumulate": 1,
            "mixed_precision": self.policy,
            "fp16_allreduce": bool(args.fp16_allreduce),
            "lr_base": args.lr,
            "lr_scaled": hvdtrain.scaled_lr(args.lr, size),
            "lr_final": float(self.schedule(self.opt.iterations)),
            "warmup_steps": self.schedule.warmup_steps,
            "optimizer_iterations": int(self.opt.iterations),
            "data_source": self.data_source,
            "train_samples": self.train_samples,
            "test_samples": out["result"]["samples"],
            "test_loss": out["result"]["loss"],
            "test_accuracy": out["result"]["accuracy"],
            "train_samples_per_sec": self.throughput.samples_per_sec,
            "epoch_samples_per_sec": self.throughput.epoch_samples_per_sec,
            "wall_seconds": wall_seconds,
            "history": history,
            "ranks": [{**r, "optimizer_sha256": by_rank.get(r["rank"])} for r in out["ranks"]],
            "elastic": {
                "commit_every": args.commit_every,
                "commits": self.commits,
                "last_commit": self.last_commit,
                "starts": self.starts,
                "resets": self.resets,
            },
        }


def train(args, *, prog, build_model, load_data, optimizer="adam"):
    """`hvdtrain.trainer.train` for `--elastic`: the same flags, checkpoints and metrics
    (plus an `elastic` section: this process's starts, commits and resets).

    Launched without Horovod Elastic (no `--host-discovery-script`/`--min-np`) it runs as a
    fixed-size job that cannot recover from failures.
    """
    import hvdtrain

    start = time.perf_counter()
    run = _ElasticRun(args, prog, build_model, load_data, optimizer)
    state = run.setup()
    run._state = state
    out = hvd_keras.elastic.run(run.run)(state)
    if out is None:  # only if Horovod swallowed an error that run() did not see
        raise HvdtrainError("elastic training stopped on an error Horovod did not report")
    metrics = run.metrics(out, time.perf_counter() - start)
    if hvd.rank() == 0:
        if run.manager:
            path = hvdtrain.export_model(
                run.model,
                build_model,
                os.path.join(run.manager.directory, "model.keras"),
                run.policy,
            )
            metrics["exported_model"] = path
        if args.metrics_json:
            hvdtrain.write_json(args.metrics_json, metrics)
        result = out["result"]
        log.info(
            "test accuracy %.4f, loss %.4f on %d samples; %d reset(s); %.1f s",
            result["accuracy"],
            result["loss"],
            result["samples"],
            len(run.resets),
            metrics["wall_seconds"],
        )
    return metrics
