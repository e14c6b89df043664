"""The training recipe every run goes through: `hvdtrain.fit(build_model, data, config)`.

Your model, compiled as for one device, your data in any form (`hvdtrain.data`), hvdtrain's
flags::

    import tensorflow as tf
    import hvdtrain

    def build_model():
        model = tf.keras.Sequential([tf.keras.Input((784,)), tf.keras.layers.Dense(10)])
        model.compile(tf.keras.optimizers.Adam(1e-3),
                      tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"])
        return model

    if __name__ == "__main__":
        args = hvdtrain.ArgumentParser(epochs=10, batch_size=64).parse_args()
        hvdtrain.fit(build_model, hvdtrain.FileData("data/*.tfrecord", parse), args)

    horovodrun -np 4 -H localhost:4 python train.py --checkpoint-dir ckpt --metrics-json m.json
    hvdtrain-run --hostfile hosts.txt -- python train.py --checkpoint-dir ckpt
    hvdtrain-run --elastic --min-np 1 --hostfile hosts.txt -- python train.py --elastic

`fit` does, in order: `hvdtrain.init()` (GPU pinning, threads); `build_model()` (under the
mixed-precision policy); each of its optimizers rebuilt with the learning rate x ranks after a
warmup, wrapped by Horovod (fp16 allreduce, accumulation and loss scaling as asked) and put back
where it was found, the model set to several steps per execution (`hvdtrain.recipe.prepare`: its
`compile` is not called again); the data prepared on every rank (counted and agreed), sharded
before shuffling, the same steps on every rank; resume on rank 0 from the newest valid
checkpoint and a broadcast of weights and optimizer state; `fit` with the watchdog, averaged
non-trainable state (BatchNorm), metrics of all ranks, progress, rank-0 checkpoints and
TensorBoard, the check that every rank holds the same weights (`hvdtrain.recipe.agreement`), the
user's callbacks (`hvdtrain.recipe.usercallbacks`); evaluation of the test set (the model's own
loss and metrics, each sample once); the same check at the end; rank 0's export (`model.keras`)
and metrics JSON. With `elastic` the same under Horovod Elastic (`hvdtrain.recipe.elastic`). A
user mistake is one line and exit 2.
"""

import dataclasses
import os
import re
import sys
import time

from hvdtrain import data as datamod
from hvdtrain import exchange, frontends
from hvdtrain.data import shares
from hvdtrain.data.forms import as_data
from hvdtrain.errors import HvdtrainError, OutputsNotWritten, TrainingDiverged, one_line
from hvdtrain.optimizers import rates
from hvdtrain.recipe import (
    agreement,
    elastic,
    metrics,
    optim,
    outputs,
    precision,
    prepare,
    resume,
    summary,
    usercallbacks,
)
from hvdtrain.recipe import callbacks as cb
from hvdtrain.recipe.checkpoint import CheckpointManager
from hvdtrain.recipe.flags import make_config
from hvdtrain.recipe.resume import resume_step
from hvdtrain.runtime import process, tuning, watchdog
from hvdtrain.runtime.logs import get_logger
from hvdtrain.runtime.uncaught import report_uncaught

__all__ = ["fit", "resume_step"]


def fit(build_model, data, config=None, *, callbacks=(), class_weight=None, prog=None, **options):
    """Trains `build_model()` on `data` on every rank of the job; returns the run's figures
    on every rank, the metrics JSON as a dict (rank 0 also writes it), with, on rank 0 with a
    `checkpoint_dir`, `exported_model`: the path of the trained model, which plain Keras
    loads. Load it on rank 0 to predict or evaluate (docs/notebook.md).

    Args:
        build_model: `() -> model`, a Keras 2 (`tf.keras`) or Keras 3 (`import keras`,
            TensorFlow backend) model compiled as for one device: with its optimizer (whose
            learning rate is the single-worker one unless `lr` says otherwise), loss and
            metrics, or a model that customizes `fit` (a `train_step` of its own, a
            `compile` of its own holding several optimizers: `hvdtrain.recipe.prepare` says where
            they are found). Called once on every rank (on rank 0 once more for the export
            only under `mixed_precision`); it must build the same model each time.
        data: a `hvdtrain.Data` (`ArrayData`, `DatasetData`, `FileData`, `BatchData`), (x, y)
            arrays, ((x, y), (x_test, y_test)), batches made in Python (a Keras `PyDataset`
            or `Sequence`, a generator or generator function, alone or as (train, test)),
            or a function returning one of those, called on every rank after
            `hvdtrain.init()` (it may use collectives): `hvdtrain.as_data` says which.
        config: a `TrainConfig`, the namespace of `hvdtrain.ArgumentParser`, a dict or None.
        callbacks: Keras callbacks (Keras's own or yours), as Keras's `fit` takes them: those
            that write run on rank 0 only, those that steer (EarlyStopping,
            ReduceLROnPlateau, ...) act on every rank alike; they see the metrics of all
            ranks (`hvdtrain.recipe.usercallbacks`).
        class_weight: {class: weight}, as Keras's `fit` takes it.
        prog: the program's name in messages and the metrics JSON.
        **options: `TrainConfig` fields, over `config` (`epochs=5, checkpoint_dir="ckpt"`).
    """
    report_uncaught()  # a user mistake prints one line, not a traceback
    run = Run(make_config(config, **options), build_model, data, prog, callbacks, class_weight)
    if run.cfg.elastic:
        return elastic.run(run)
    try:
        run.setup()
        run.start()
        try:
            run.train()
            result = run.evaluate()
            ranks = run.check()
        except (TrainingDiverged, agreement.RanksDisagree) as e:
            run.write_metrics(summary.failed(run, e))
            raise
        return run.finish(result, ranks)
    finally:
        if run.guard is not None:
            run.guard.stop()
        if run.built is not None and run.built.manager is not None:
            run.built.manager.unlock()  # the folder is free for the next job


@dataclasses.dataclass(frozen=True)
class Built:
    """What `Run.setup` makes, once and before any collective: the model as it trains and
    what the recipe put around it."""

    keras: object  # the model's Keras (`hvdtrain.frontends`)
    model: object
    optimizers: prepare.Optimizers  # every optimizer of the model, distributed
    policy: str | None  # the mixed-precision policy
    steps_per_execution: int
    manager: CheckpointManager | None  # with --checkpoint-dir
    exchange: exchange.Exchange  # how the ranks exchange (--sync)
    sharing: shares.EqualShares  # how each epoch's batches are shared (--sync-balance)
    holders: dict  # what holds training state beside the model and its optimizers, by name

    def state_holders(self):
        """The optimizers and what else holds training state beside the model (DiLoCo's
        outer momentum), by name: broadcast, checkpointed and committed together."""
        return {**self.optimizers.by_name, **self.holders}

    @property
    def reported(self):
        """The optimizer the run's figures name (a GAN's first, not Keras's unused default)."""
        return self.optimizers.by_name[self.optimizers.reported]

    @property
    def schedule(self):
        """Its learning rate's `WarmupSchedule`."""
        return self.optimizers.schedules[self.optimizers.reported]

    def lr_base(self):
        """The single-worker learning rate (a number), or its schedule's name."""
        base = self.schedule.base_lr
        return base if isinstance(base, float) else type(base).__name__

    def lr_scaled(self):
        """The learning rate x ranks after the warmup (a number; None for a schedule)."""
        base = self.schedule.base_lr
        return rates.scaled_lr(base, self.schedule.size) if isinstance(base, float) else None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `Run.start` agrees with the ranks, at every (re)start: where this rank is, its
    data, and the steps from where training begins."""

    place: datamod.Placement
    data: datamod.Data
    steps: int  # per epoch: whole accumulation cycles of micro-steps
    batch_size: int  # per rank and step: --batch-size, or the data's own (`Data.batch_size`)
    global_batch: int
    warmup_steps: int
    start_step: int  # the global step training begins at
    test_ds: object  # this rank's share of the test set, or None


class Run:
    """One process's run of the recipe, in the steps `hvdtrain.recipe.elastic` also drives: `setup`
    (no collectives) makes `built`, `start` (data, resume, broadcast) makes `plan`, then
    `train`, `evaluate`, `finish`. Everything else a run holds is set here."""

    def __init__(self, cfg, build_model, data, prog=None, callbacks=(), class_weight=None):
        self.cfg, self.build_model, self.data_source = cfg, build_model, data
        self.prog = prog or os.path.basename(sys.argv[0] or "hvdtrain") or "hvdtrain"
        self.user_callbacks = list(callbacks)
        self.class_weight = class_weight
        self.built = None  # `Built`, by `setup`
        self.plan = None  # `Plan`, by `start`
        self.log = None  # this rank's logger (`setup` and `start` set it)
        self.wall = time.perf_counter()
        self.guard = None  # the watchdog of the whole run (not elastic: see `setup`)
        # What the run learns as it goes, kept across an elastic restart:
        self.history = {}  # every epoch's figures, those before a resume included
        self.history_before = {}  # the epochs before the resumed checkpoint
        self.resumed = None  # where a checkpoint put the run: epoch, step, iterations
        self.stopped = None  # the epoch after which a callback stopped training (0-based)
        self.on_stop = None  # `(epoch) -> None`, told when the ranks agree to stop
        # The callbacks of the current `train` (`callbacks` makes them):
        self.user = None  # the user's callbacks, one training for all the run's fits
        self.watchdog = self.throughput = self.steering = self.checkpointer = None
        self.bound = None  # the cores `hvdtrain.init` bound this rank to, or None

    # -- set-up: no collectives (an elastic worker that joins runs it alone) -----------
    def setup(self):
        cfg = self.cfg
        ex = exchange.for_config(cfg)  # --sync: how the ranks exchange
        process.init(
            cfg.threads, exchanges_rarely=ex.exchanges_rarely, deterministic=cfg.deterministic
        )
        self.bound = process.bound_cores()
        place = datamod.Placement.current()
        self.log = get_logger(rank := place.rank)
        # A rank stuck anywhere from here on (building the model, loading the data, in a
        # collective) ends the job: long phases get 10 stall times (50 min by default).
        # Elastic runs watch their training only (a reset restarts the set-up).
        timeout = process.stall_shutdown_seconds()
        if timeout and not cfg.elastic and self.guard is None:
            self.guard = watchdog.Watchdog(timeout, rank)
            self.guard.start("set-up: building the model", watchdog.OWN_SETUP)
        # Horovod: a seed per rank, so dropout and augmentation differ; weights are broadcast.
        # The seed and the precision policy go to each Keras the script imported (the model's
        # Keras is known once it is built; one imported inside `build_model` builds it again).
        policy = precision.policy(cfg.mixed_precision)
        prepared = frontends.loaded()
        for frontend in prepared:
            self._prepare(frontend, rank, policy)
        model = self._built()
        k = frontends.for_model(model)
        if k not in prepared:
            self._prepare(k, rank, policy)
            model = self._built()
        k.compiled(model)  # Keras 3 given Keras 2's positional metrics: one line
        prepare.check_class_weight(self.class_weight, model)
        xla = k.jit_compile(model)
        if policy:  # a plain model's outputs back to float32 for a stable loss
            model = precision.float32_outputs(model, k)
        per_step = bool(cfg.checkpoint_every or cfg.deterministic)
        spe = cfg.steps_per_execution or (1 if per_step else tuning.STEPS_PER_EXECUTION)
        sharing = shares.for_config(cfg)
        spe = ex.configure(policy, spe, sharing)  # refuses a policy it cannot train with
        if spe > 1 and usercallbacks.own_batch_hooks(self.user_callbacks):
            self.log.warning(
                "a callback of yours has batch hooks: Keras calls them once every %d steps (at "
                "each execution's end, with its last batch's index); --steps-per-execution 1 "
                "calls them at every step",
                spe,
            )
        # Horovod: every optimizer the model holds averages its gradients over the ranks, with
        # the LR x ranks after a warmup (`recipe.prepare`); the model's compile is not called again.
        optimizers = prepare.distribute(model, k, cfg, place.size, policy)
        k.configure(model, spe)
        if xla:
            self.log.warning("jit_compile turned off: Horovod's allreduce cannot be XLA-compiled")
        holders = ex.attach(model, optimizers)  # DiLoCo's outer momentum
        manager = None
        if cfg.checkpoint_dir:
            manager = CheckpointManager(
                cfg.checkpoint_dir,
                model,
                optimizers.by_name,
                keep=cfg.keep_checkpoints,
                optional=holders,
            )
        self.built = Built(k, model, optimizers, policy, spe, manager, ex, sharing, holders)

    def _built(self):
        """`build_model()`; the one-line error where one Keras refused an object of the other."""
        try:
            return self.build_model()
        except (TypeError, ValueError, AttributeError) as e:
            mixed = frontends.mixed_keras(e)
            if mixed is None:
                raise
            raise mixed from None

    def _prepare(self, frontend, rank, policy):
        """The seed and precision policy of one Keras, before the model is built."""
        cfg = self.cfg
        frontend.set_seed(cfg.seed + rank)
        if policy:
            frontend.set_policy(policy)
        if cfg.deterministic:
            frontend.deterministic()

    # -- start: data, resume, broadcast (collectives) ----------------------------------
    def start(self, position=None):
        """Prepares the data for the current ranks and the position to train from: the
        newest checkpoint (first start), or `position` = (epoch, step in epoch, its global
        batch) of an elastic state. Returns the global step."""
        cfg, b, p = self.cfg, self.built, datamod.Placement.current()
        self.log = get_logger(p.rank)  # after an elastic reset rank 0 may be another worker
        first = self.plan is None
        # A bad output path fails now, on every rank, not after the training. At every
        # start, like everything here: an elastic worker that joins must run the same
        # collectives as the others.
        watchdog.doing("set-up: checking the output paths", watchdog.OWN_SETUP)
        process.agree(self._check_outputs, root_only=True)
        watchdog.doing(
            "set-up: preparing the data (loading, counting, agreeing)",
            watchdog.OWN_SETUP,
        )
        # Every start, on every worker (one that joins an elastic job included): the same
        # collectives in the same order. A loader may use collectives itself.
        data = process.agree(lambda: as_data(self.data_source, cfg.limit_samples))
        process.agree(lambda: data.prepare(p, cfg.seed))
        b.sharing.check(data)  # --sync-balance: data it can share out unequally
        if first:
            self.log.info("data: %s", data.describe())
            if warning := data.loader_warning(p):
                self.log.warning("%s", warning)
        per_rank = data.batch_size or cfg.batch_size  # the data's own batch, if it has one
        steps = data.steps_per_epoch(per_rank * cfg.accumulate, p)
        steps *= cfg.accumulate  # whole accumulation cycles per epoch
        global_batch = per_rank * p.size
        # Horovod: the LR scale and warmup follow the number of ranks.
        warmup_steps = round(cfg.warmup_epochs * steps)  # iterations count micro-steps
        schedules = b.optimizers.schedules
        for schedule in schedules.values():
            rates.rescale_schedule(b.model, schedule, p.size, warmup_steps)
        if position is None:
            watchdog.doing("set-up: resuming from the newest checkpoint", watchdog.OWN_SETUP)
            r = resume.from_newest(b.manager, cfg, p, steps, per_rank, schedules, self.log)
            start_step, self.resumed, self.stopped = r.start_step, r.where, r.stopped
            self.history = dict(r.history)
            self.history_before = {k: list(v) for k, v in r.history.items()}
            # Horovod: start every rank from rank 0's weights and optimizer state.
            optim.broadcast_initial_state(b.model, list(b.state_holders().values()))
        else:
            epoch, step, batch = position
            saved = {"epoch": epoch, "step": step, "global_batch": batch}
            start_step = resume_step(saved, steps, global_batch)
        b.optimizers.main.iterations.assign(start_step)  # the LR schedule follows this step
        b.exchange.begin(start_step, warmup_steps, cfg.epochs * steps)  # (the ranks agree)
        watchdog.doing("set-up: preparing the test set", watchdog.OWN_SETUP)
        test_ds = data.eval_dataset(cfg.eval_batch_size, p)
        self.plan = Plan(p, data, steps, per_rank, global_batch, warmup_steps, start_step, test_ds)
        return start_step

    def _check_outputs(self):
        cfg, manager = self.cfg, self.built.manager
        if manager:  # and held by this job (not under --elastic: rank 0 may change hands)
            manager.check_writable(lock=not cfg.elastic)
        if cfg.metrics_json:
            outputs.check_writable(cfg.metrics_json, "--metrics-json")
        if cfg.log_dir:
            outputs.check_writable(cfg.log_dir, "--log-dir", folder=True)

    # -- train -------------------------------------------------------------------------
    def callbacks(self, extra=(), state_callbacks=(), commit=None):
        """The callbacks of `fit`, in the order they must run."""
        cfg, b, plan = self.cfg, self.built, self.plan
        p, steps = plan.place, plan.steps
        # A stuck rank ends the job: no hang.
        self.watchdog = cb.WatchdogCallback(watchdog=self.guard)
        self.throughput = cb.ThroughputCallback(plan.global_batch, steps, b.sharing.rank_steps)
        if self.user is None:  # one for the run: an elastic restart goes on with them
            self.user = usercallbacks.UserCallbacks(self.user_callbacks, p.rank)
        self.user.for_rank(p.rank)  # after an elastic reset rank 0 may be another worker
        self.user.run_params = {"epochs": cfg.epochs, "steps": steps}
        rates = [s.rate for s in b.optimizers.schedules.values() if s.rate is not None]
        self.steering = usercallbacks.AgreedSteering(
            rates, self.user.stops_in_epochs, on_stop=self.on_stop, agreeing=b.exchange.stop_agreed
        )
        out = [
            self.watchdog,
            # Horovod: BatchNorm statistics are per rank; average them before anything reads them.
            cb.ModelStateAverageCallback(),
            # Horovod: the metrics of all ranks' batches first, so everything after sees them.
            metrics.MetricAverageCallback(
                evaluate_fn=self.evaluate if plan.data.has_test else None
            ),
            # Every rank stops together on NaN, infinite or blown-up weights or loss, before
            # any checkpoint.
            cb.DivergenceCallback(steps, b.lr_base(), plan.start_step),
            # Every rank holds the same weights (first steps, epoch ends), or the run stops.
            agreement.WeightsAgreeCallback(first_steps=False),  # the exchange checks first
            self.throughput,
            # The user's callbacks (writers on rank 0), then their stop and LR on every rank.
            self.user,
            self.steering,
            *state_callbacks,
        ]
        # First: everything after sees the exchanged weights.
        check = lambda when: agreement.check_weights_agree(b.model, when)  # noqa: E731
        out[1:1] = b.exchange.callbacks(steps, plan.start_step, check)
        if cfg.deterministic:
            out.insert(0, cb.DeterministicRandomness(cfg.seed, p.rank, plan.start_step))
        if p.rank == 0:
            out.append(
                cb.ProgressCallback(
                    cfg.epochs,
                    steps,
                    plan.global_batch,
                    plan.start_step,
                    cfg.progress,
                    cfg.progress_seconds,
                    rank_steps=b.sharing.rank_steps,
                )
            )
        if b.manager:
            fields = {
                "size": p.size,
                "global_batch": plan.global_batch,
                "steps_per_epoch": steps,
                "prog": self.prog,
                "data": {"source": plan.data.source, "samples": plan.data.num_samples},
            }
            self.checkpointer = cb.CheckpointCallback(
                b.manager,
                fields,
                steps,
                cfg.checkpoint_every,
                plan.start_step,
                history=self.history,
                extra=lambda: resume.steering(b.optimizers.schedules, b.model, cfg.epochs),
                check=self._before_checkpoint,
                before_save=b.exchange.before_checkpoint,
            )
            out.append(self.checkpointer)
        if commit is not None:
            out.append(commit)
        return out + cb.rank0_callbacks(cfg.log_dir, b.keras.tensorboard) + list(extra)

    def train(self, **callback_args):
        import tensorflow as tf

        cfg, b, plan = self.cfg, self.built, self.plan
        steps, start, model = plan.steps, plan.start_step, b.model
        watchdog.doing(
            "starting Keras's fit (the callbacks, the data, on_train_begin)",
            watchdog.OWN_SETUP,
        )
        callbacks = self.callbacks(**callback_args)
        self.log.info("%s", summary.first_line(self))

        # Keras 3 runs whole executions (31 steps at 16 per execution ran 32): there, each
        # `fit` trains one epoch over a dataset of exactly its steps, which ends the last
        # execution early. Keras 2 trains every epoch in one `fit`, unless each epoch is
        # shared out anew (--sync-balance).
        one_epoch = b.keras.ONE_EPOCH_PER_FIT or b.sharing.per_epoch

        def fit_(first, epochs, steps_this_epoch):
            # A dataset per call: Keras starts each `fit` at the dataset's first batch. This
            # rank's share of the epochs from `first` (equal, or by its speed).
            train_ds, steps_this_epoch = b.sharing.train_dataset(
                plan.data, plan.batch_size, plan.place, seed=cfg.seed, first=first, steps=steps,
                epochs=epochs, todo=steps_this_epoch,
            )  # fmt: skip
            if one_epoch:
                train_ds = train_ds.take(steps_this_epoch)
                train_ds = train_ds.apply(tf.data.experimental.assert_cardinality(steps_this_epoch))
            model.history = None  # Keras sets it at the first epoch's end
            try:
                model.fit(
                    train_ds,
                    epochs=epochs,
                    initial_epoch=first // steps,
                    steps_per_epoch=None if one_epoch else steps_this_epoch,
                    callbacks=callbacks,
                    class_weight=self.class_weight,
                    shuffle=False,  # the dataset is shuffled
                    verbose=0,
                )
            finally:  # the epochs done, also when training stopped (diverged)
                done = getattr(model, "history", None)
                for k, vs in (done.history if done else {}).items():
                    self.history.setdefault(k, []).extend(float(v) for v in vs)

        def stopped():
            if self.steering.stopped is not None and self.stopped is None:
                self.stopped = self.steering.stopped
                self.log.info("training stopped by a callback after epoch %d", self.stopped + 1)
            return self.stopped is not None

        try:
            if self.stopped is not None:
                self.log.info(
                    "a callback stopped training after epoch %d (in the checkpoint); "
                    "evaluating only",
                    self.stopped + 1,
                )
            elif start % steps and start // steps < cfg.epochs:  # finish the interrupted epoch
                fit_(start, start // steps + 1, steps - start % steps)
                start = (start // steps + 1) * steps
            if start // steps < cfg.epochs and not one_epoch and not stopped():
                fit_(start, cfg.epochs, steps)
            for epoch in range(start // steps, cfg.epochs if one_epoch else 0):
                if stopped():
                    break
                fit_(epoch * steps, epoch + 1, steps)
            stopped()
            if start // steps >= cfg.epochs and not self.history:
                self.log.info(
                    "already trained %d of %d epochs; evaluating only", start // steps, cfg.epochs
                )
            self._end_user_callbacks()
        except Exception as e:
            raise _explained(e, plan.place.rank, plan.data) from None

    def _before_checkpoint(self):
        """Every rank, before a mid-epoch checkpoint (after the exchange's
        `before_checkpoint`): the check that the ranks agree."""
        agreement.check_weights_agree(self.built.model, "before a mid-epoch checkpoint")

    def _end_user_callbacks(self):
        """The user's callbacks' `on_train_end`; when a callback stopped training and then
        changed the weights (EarlyStopping's `restore_best_weights`), the last checkpoint is
        written again with them: a rerun of the stopped run evaluates and exports them."""
        model, before = self.built.model, None
        if self.stopped is not None and self.built.manager and self.plan.place.rank == 0:
            before = process.weights_digest(model)
        self.user.end(self.history)
        if before is not None and process.weights_digest(model) != before:
            self.checkpointer.rewrite_last()

    # -- evaluate and finish -------------------------------------------------------------
    def evaluate(self):
        """The test metrics over all ranks ({} without test data)."""
        if not self.plan.data.has_test:
            return {}
        callbacks = [self.watchdog] if self.watchdog else None
        return metrics.evaluate(self.built.model, self.plan.test_ds, callbacks=callbacks)

    def check(self):
        """Every rank's host, pid and weights digest; identical weights or an error."""
        watchdog.doing("comparing the weights of every rank", watchdog.OTHER_RANKS_SETUP)
        agreement.check_weights_agree(self.built.model, "at the end of training")
        ranks = summary.rank_report(self)
        if len({r["weights_digest"] for r in ranks}) != 1:
            raise HvdtrainError(
                "ranks ended with different weights; this is a bug, please report it"
            )
        return ranks

    def write_metrics(self, out):
        """Rank 0 writes `out` to --metrics-json (if given); returns the path or None."""
        return summary.write(self.cfg.metrics_json, out, self.plan.place.rank)

    def finish(self, result, ranks=None, **more):
        """The metrics dict; rank 0 exports the model and writes the metrics JSON.

        A write that fails here loses nothing already written: the export and the JSON are
        tried both, and `OutputsNotWritten` (exit status 4) says which were written."""
        p, b = self.plan.place, self.built
        out = summary.finished(self, result, ranks or self.check(), **more)
        if p.rank != 0:
            return out
        watchdog.doing("writing the exported model and the metrics JSON", watchdog.OWN_SETUP)
        written, failed = [], []
        if b.manager:
            path = os.path.join(b.manager.directory, "model.keras")
            try:
                exported = outputs.export_model(b.model, self.build_model, path, b.policy)
                out["exported_model"] = exported
                written.append(f"the model {out['exported_model']}")
            except (OSError, ValueError, RuntimeError) as e:
                failed.append(f"the model {path} ({one_line(e)})")
        try:
            if self.write_metrics(out):
                written.append(f"the metrics {self.cfg.metrics_json}")
        except (OSError, ValueError, TypeError) as e:
            failed.append(f"the metrics {self.cfg.metrics_json} ({one_line(e)})")
        if failed:
            kept = f"; the trained weights are in {b.manager.directory}" if b.manager else ""
            raise OutputsNotWritten(
                f"training finished, but could not write {' and '.join(failed)}; written: "
                f"{', '.join(written) or 'nothing'}{kept}. Free space or fix the path, then "
                "run the same command again: it resumes and writes them without training.",
                every_rank=False,
            )
        self.log.info("%s", summary.last_line(out))
        return out


# -- helpers ---------------------------------------------------------------------------


def _explained(error, rank, data=None):
    """A training error with what the user can do about it, or the error itself."""
    import tensorflow as tf

    text = str(error)
    explained = data.explain(error) if data is not None else None
    if explained is not None:
        return explained
    counts = re.search(r"expected to contain (\d+) elements? but contained only (\d+)", text)
    if isinstance(error, tf.errors.FailedPreconditionError) and counts:
        need, got = counts.groups()
        fn = getattr(getattr(data, "train_fn", None), "__name__", None) or "train_fn"
        return HvdtrainError(
            f"rank {rank}'s data ran out: a dataset gave {got} samples where the epoch needs "
            f"{need}; make `{fn}` give every rank at least {need} samples each epoch "
            "((num_samples // ranks // batch) x batch: shard the samples, or files only where "
            "they divide evenly among the ranks), or lower num_samples; and leave data files "
            "as they were when counted",
            every_rank=False,
        )
    return error
