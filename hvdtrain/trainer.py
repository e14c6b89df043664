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
warmup, wrapped by Horovod (fp16 allreduce, accumulation and loss scaling as asked) and put
back where it was found, the model set to several steps per execution (`hvdtrain.prepare`:
its `compile` is not called again); the data
prepared on every rank (counted and agreed), sharded before shuffling, the same steps on
every rank; resume on rank 0 from the newest valid checkpoint and a broadcast of weights and
optimizer state; `fit` with the watchdog, averaged non-trainable state (BatchNorm), metrics
of all ranks, progress, rank-0 checkpoints and TensorBoard, the check that every rank holds
the same weights (`hvdtrain.agreement`), the user's callbacks (`hvdtrain.usercallbacks`);
evaluation of the test set (the model's own loss and metrics, each sample once); the same
check at the end; rank 0's export (`model.keras`) and metrics JSON. With `elastic` the same
under Horovod Elastic (`hvdtrain.elastic`). A user mistake is one line and exit 2.
"""

import dataclasses
import inspect
import os
import re
import sys
import time

import numpy as np

from hvdtrain import (
    agreement,
    elastic,
    exchange,
    files,
    frontends,
    metrics,
    optim,
    prepare,
    rates,
    runtime,
    tuning,
    usercallbacks,
    watchdog,
)
from hvdtrain import batches as batchmod
from hvdtrain import callbacks as cb
from hvdtrain import data as datamod
from hvdtrain.checkpoint import CheckpointManager
from hvdtrain.errors import (
    HvdtrainError,
    OutputsNotWritten,
    TrainingDiverged,
    invalid_value,
)
from hvdtrain.flags import float16_refused, make_config
from hvdtrain.logs import get_logger

__all__ = ["fit", "resume_step"]


def fit(build_model, data, config=None, *, callbacks=(), class_weight=None, prog=None, **options):
    """Trains `build_model()` on `data` on every rank of the job; returns the run's figures
    (the metrics JSON; rank 0 also writes it).

    Args:
        build_model: `() -> model`, a Keras 2 (`tf.keras`) or Keras 3 (`import keras`,
            TensorFlow backend) model compiled as for one device: with its optimizer (whose
            learning rate is the single-worker one unless `lr` says otherwise), loss and
            metrics, or a model that customizes `fit` (a `train_step` of its own, a
            `compile` of its own holding several optimizers: `hvdtrain.prepare` says where
            they are found). Called on every rank; it must build the same model each time.
        data: a `hvdtrain.Data` (`ArrayData`, `DatasetData`, `FileData`), (x, y) arrays,
            ((x, y), (x_test, y_test)), or a function returning one of those, called on
            every rank after `hvdtrain.init()` (it may use collectives).
        config: a `TrainConfig`, the namespace of `hvdtrain.ArgumentParser`, a dict or None.
        callbacks: Keras callbacks (Keras's own or yours), as Keras's `fit` takes them: those
            that write run on rank 0 only, those that steer (EarlyStopping,
            ReduceLROnPlateau, ...) act on every rank alike; they see the metrics of all
            ranks (`hvdtrain.usercallbacks`).
        class_weight: {class: weight}, as Keras's `fit` takes it.
        prog: the program's name in messages and the metrics JSON.
        **options: `TrainConfig` fields, over `config` (`epochs=5, checkpoint_dir="ckpt"`).
    """
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
        except TrainingDiverged as e:
            run.write_metrics({**run.summary(), "status": "diverged", "error": str(e)})
            raise
        except agreement.RanksDisagree as e:
            run.write_metrics({**run.summary(), "status": "ranks_disagree", "error": str(e)})
            raise
        return run.finish(result, ranks)
    finally:
        if run.guard is not None:
            run.guard.stop()
        if run.built is not None and run.built.manager is not None:
            run.built.manager.unlock()  # the folder is free for the next job


def _check_class_weight(class_weight, model):
    """`class_weight` as Keras's `fit` takes it, or a one-line error now rather than a
    traceback at the first step: {class index: weight}, for a model of one output."""
    if class_weight is None:
        return
    if not isinstance(class_weight, dict) or not all(
        isinstance(c, (int, np.integer)) and isinstance(w, (int, float, np.number))
        for c, w in class_weight.items()
    ):
        raise invalid_value("class_weight", class_weight, "{class index: weight}")
    outputs = len(getattr(model, "outputs", None) or ())  # None: a subclass not yet called
    if outputs > 1:
        raise invalid_value(
            "class_weight",
            class_weight,
            f"a model with one output (Keras weighs the classes of one output only; this "
            f"model has {outputs}): weigh the samples instead, "
            "`hvdtrain.ArrayData(x, y, sample_weight=...)`",
        )


def resume_step(saved, steps, global_batch, accumulate=1):
    """The global step to resume at from a checkpoint's manifest (`epoch`, `step`,
    `global_batch`), for a run with `steps` per epoch and `global_batch` samples per step.

    Pure. The rule: keep the completed epochs and the samples seen in the interrupted one;
    with another global batch (another number of ranks), the step in the epoch is the
    number of whole new batches those samples fill, rounded down to a whole accumulation
    cycle. The optimizer's step (and so the LR schedule) is set to the result.
    """
    epoch, step = int(saved.get("epoch") or 0), int(saved.get("step") or 0)
    old_batch = saved.get("global_batch") or global_batch
    step = min(step * old_batch // global_batch, steps - 1) if step else 0
    step -= step % accumulate
    return epoch * steps + step


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
    exchange: exchange.Exchange | None  # with --sync local or diloco

    def state_holders(self):
        """The optimizers and what else holds training state beside the model (DiLoCo's
        outer momentum), by name: broadcast, checkpointed and committed together."""
        return {**self.optimizers.by_name, **(self.exchange.holders() if self.exchange else {})}

    @property
    def reported(self):
        """The optimizer the run's figures name (a GAN's first, not Keras's unused default)."""
        return self.optimizers.by_name[self.optimizers.reported]

    @property
    def schedule(self):
        """Its learning rate's `WarmupSchedule`."""
        return self.optimizers.schedules[self.optimizers.reported]


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
    """One process's run of the recipe, in the steps `hvdtrain.elastic` also drives: `setup`
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

    # -- set-up: no collectives (an elastic worker that joins runs it alone) -----------
    def setup(self):
        cfg = self.cfg
        runtime.init(threads=cfg.threads, sync=cfg.sync)
        place = datamod.Placement.current()
        rank = place.rank
        self.log = get_logger(rank)
        # A rank stuck anywhere from here on (building the model, loading the data, in a
        # collective) ends the job: long phases get 10 stall times (50 min by default).
        # Elastic runs watch their training only (a reset restarts the set-up).
        timeout = runtime.stall_shutdown_seconds()
        if timeout and not cfg.elastic and self.guard is None:
            self.guard = watchdog.Watchdog(timeout, rank)
            self.guard.start("set-up: building the model", timed=False)
        # Horovod: a seed per rank, so dropout and augmentation differ; weights are broadcast.
        # The seed and the precision policy go to each Keras the script imported (the model's
        # Keras is known once it is built; one imported inside `build_model` builds it again).
        policy = _policy(cfg.mixed_precision)
        prepared = frontends.loaded()
        for frontend in prepared:
            self._prepare(frontend, rank, policy)
        model = self._built()
        k = frontends.for_model(model)
        if k not in prepared:
            self._prepare(k, rank, policy)
            model = self._built()
        k.compiled(model)  # Keras 3 given Keras 2's positional metrics: one line
        _check_class_weight(self.class_weight, model)
        xla = k.jit_compile(model)
        if policy and _plain(model, k):  # outputs back to float32 for a stable loss
            model = _float32_outputs(model, k)
        per_step = bool(cfg.checkpoint_every or cfg.deterministic)
        spe = cfg.steps_per_execution or (1 if per_step else tuning.STEPS_PER_EXECUTION)
        if cfg.sync != "step":  # the ranks exchange at an execution's end
            spe = exchange.fitting_steps_per_execution(spe, cfg.sync_every or exchange.SYNC_EVERY)
            if policy == "mixed_float16":  # --mixed-precision auto on a GPU
                raise float16_refused(cfg)
        if spe > 1 and usercallbacks.own_batch_hooks(self.user_callbacks):
            self.log.warning(
                "a callback of yours has batch hooks: Keras calls them once every %d steps (at "
                "each execution's end, with its last batch's index); --steps-per-execution 1 "
                "calls them at every step",
                spe,
            )
        # Horovod: every optimizer the model holds averages its gradients over the ranks,
        # with the LR x ranks after a warmup (`hvdtrain.prepare`); the model's own compile
        # is not called again.
        optimizers = prepare.distribute(model, k, cfg, place.size, policy)
        k.configure(model, spe)
        if xla:
            self.log.warning("jit_compile turned off: Horovod's allreduce cannot be XLA-compiled")
        # --sync local/diloco: each rank steps on its own between exchanges of weights.
        ex = exchange.Exchange(cfg, model, optimizers) if cfg.sync != "step" else None
        manager = None
        if cfg.checkpoint_dir:
            manager = CheckpointManager(
                cfg.checkpoint_dir,
                model,
                optimizers.by_name,
                keep=cfg.keep_checkpoints,
                optional=ex.holders() if ex else None,
            )
        self.built = Built(k, model, optimizers, policy, spe, manager, ex)

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
        watchdog.holding("set-up: checking the output paths")
        runtime.agree(self._check_outputs, root_only=True)
        watchdog.holding("set-up: preparing the data (loading, counting, agreeing)")
        # Every start, on every worker (one that joins an elastic job included): the same
        # collectives in the same order. A loader may use collectives itself.
        data = runtime.agree(lambda: _as_data(self.data_source, cfg.limit_samples))
        runtime.agree(lambda: data.prepare(p, cfg.seed))
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
        for schedule in b.optimizers.schedules.values():
            rates.rescale_schedule(b.model, schedule, p.size, warmup_steps)
        if position is None:
            watchdog.holding("set-up: resuming from the newest checkpoint")
            start_step = self._resume(p, steps, global_batch)
            # Horovod: start every rank from rank 0's weights and optimizer state.
            optim.broadcast_initial_state(b.model, list(b.state_holders().values()))
        else:
            epoch, step, batch = position
            saved = {"epoch": epoch, "step": step, "global_batch": batch}
            start_step = resume_step(saved, steps, global_batch)
        b.optimizers.main.iterations.assign(start_step)  # the LR schedule follows this step
        if b.exchange is not None:  # the ranks hold the same weights here: the anchor
            b.exchange.begin(start_step, warmup_steps)
        watchdog.holding("set-up: preparing the test set")
        test_ds = data.eval_dataset(cfg.eval_batch_size, p)
        self.plan = Plan(p, data, steps, per_rank, global_batch, warmup_steps, start_step, test_ds)
        return start_step

    def _check_outputs(self):
        cfg, manager = self.cfg, self.built.manager
        if manager:  # and held by this job (not under --elastic: rank 0 may change hands)
            manager.check_writable(lock=not cfg.elastic)
        if cfg.metrics_json:
            files.check_writable(cfg.metrics_json, "--metrics-json")
        if cfg.log_dir:
            files.check_writable(cfg.log_dir, "--log-dir", folder=True)

    def _resume(self, place, steps, global_batch):
        manager = self.built.manager
        if not manager:
            return 0

        # Horovod: rank 0 reads the checkpoint; the broadcast hands it to every rank.
        import horovod.tensorflow as hvd

        def latest():
            found = manager.latest()  # the folder was checked by `_check_outputs`
            if found is None and self.cfg.require_resume:
                raise HvdtrainError(
                    f"nothing to resume from in --checkpoint-dir {manager.directory}: "
                    f"{manager.found()}; --require-resume refuses to start over. Point "
                    "--checkpoint-dir at the run's checkpoints, or drop --require-resume to "
                    "start from scratch."
                )
            if found is None and manager.skipped:
                self.log.warning(
                    "no usable checkpoint in %s: %s; starting from scratch and leaving them as "
                    "they are (--require-resume refuses to start over)",
                    manager.directory,
                    manager.found(),
                )
            return found and manager.restore(found).to_dict()

        saved = runtime.agree(latest, root_only=True)
        saved = hvd.broadcast_object(saved, root_rank=0, name="hvdtrain.resume")
        if not saved:
            return 0
        step = resume_step(saved, steps, global_batch, self.cfg.accumulate)
        # The metrics of the epochs done before, so the metrics JSON covers the whole job.
        done = step // steps
        self.history = {
            k: list(v)[:done] for k, v in (saved.get("history") or {}).items() if list(v)[:done]
        }
        self.history_before = {k: list(v) for k, v in self.history.items()}
        extra = saved.get("extra") or {}
        # A callback's stop holds for the same command; asking for more epochs trains on.
        if extra.get("stopped") and step % steps == 0 and self.cfg.epochs <= extra["stopped"]:
            self.stopped = step // steps - 1
        for name, rate in (extra.get("single_worker_lr") or {}).items():
            schedule = self.built.optimizers.schedules.get(name)
            if schedule is not None and schedule.rate is not None:
                schedule.set_single_worker(rate)  # what a callback set before the resume
        self.resumed = {
            "epoch": saved["epoch"],
            "step": saved["step"],
            "optimizer_iterations": step,
        }
        if saved.get("global_batch") not in (None, global_batch):
            self.log.warning(
                "the checkpoint was written with %s rank(s) x batch %d; this run has %d x %d: "
                "resuming at epoch %d step %d (the same samples seen; the LR schedule follows "
                "the step). The global batch changed: the results will differ.",
                saved.get("size"),
                saved["global_batch"] // (saved.get("size") or 1),
                place.size,
                self.cfg.batch_size,
                step // steps + 1,
                step % steps,
            )
        if step >= self.cfg.epochs * steps:  # nothing left to train: no epoch to resume at
            self.log.info(
                "the checkpoint in %s is after epoch %d: all %d epoch(s) trained",
                manager.directory,
                step // steps,
                self.cfg.epochs,
            )
            return step
        self.log.info(
            "resuming at epoch %d, step %d of %d (global step %d) from %s",
            step // steps + 1,
            step % steps,
            steps,
            step,
            manager.directory,
        )
        return step

    # -- train -------------------------------------------------------------------------
    def callbacks(self, extra=(), state_callbacks=(), commit=None):
        """The callbacks of `fit`, in the order they must run."""
        cfg, b, plan = self.cfg, self.built, self.plan
        p, steps = plan.place, plan.steps
        # A stuck rank ends the job: no hang.
        self.watchdog = watchdog.WatchdogCallback(watchdog=self.guard)
        self.throughput = cb.ThroughputCallback(plan.global_batch, steps)
        if self.user is None:  # one for the run: an elastic restart goes on with them
            self.user = usercallbacks.UserCallbacks(self.user_callbacks, p.rank)
        self.user.for_rank(p.rank)  # after an elastic reset rank 0 may be another worker
        self.user.run_params = {"epochs": cfg.epochs, "steps": steps}
        rates = [s.rate for s in b.optimizers.schedules.values() if s.rate is not None]
        self.steering = usercallbacks.AgreedSteering(
            rates, self.user.stops_in_epochs, on_stop=self.on_stop
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
            cb.DivergenceCallback(steps, self.lr_base(), plan.start_step),
            # Every rank holds the same weights (first steps, epoch ends), or the run stops.
            agreement.WeightsAgreeCallback(first_steps=b.exchange is None),
            self.throughput,
            # The user's callbacks (writers on rank 0), then their stop and LR on every rank.
            self.user,
            self.steering,
            *state_callbacks,
        ]
        if b.exchange is not None:  # first: everything after sees the exchanged weights
            check = lambda when: agreement.check_weights_agree(b.model, when)  # noqa: E731
            out.insert(1, exchange.ExchangeCallback(b.exchange, steps, plan.start_step, check))
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
                extra=self._checkpoint_extra,
                check=self._before_checkpoint,
            )
            out.append(self.checkpointer)
        if commit is not None:
            out.append(commit)
        return out + cb.rank0_callbacks(cfg.log_dir, b.keras.tensorboard) + list(extra)

    def train(self, **callback_args):
        import tensorflow as tf

        cfg, b, plan = self.cfg, self.built, self.plan
        steps, start, model = plan.steps, plan.start_step, b.model
        watchdog.holding("starting Keras's fit (the callbacks, the data, on_train_begin)")
        callbacks = self.callbacks(**callback_args)
        where = ""
        if cfg.elastic:  # where this (re)start begins
            where = f" from epoch {start // steps + 1}, step {start % steps} (global step {start})"
        self.log.info(
            "%straining on %d rank(s)%s: %d steps/epoch, batch %d/rank (%d global%s), lr %s -> "
            "%s over %d steps, %d step(s) per execution%s%s",
            "elastic: " if cfg.elastic else "",
            plan.place.size,
            where,
            steps,
            plan.batch_size,
            plan.global_batch,
            f", {cfg.accumulate} accumulated" if cfg.accumulate > 1 else "",
            f"{self.lr_base():g}" if isinstance(self.lr_base(), float) else self.lr_base(),
            f"{self.lr_scaled():g}" if self.lr_scaled() else f"x{plan.place.size}",
            plan.warmup_steps,
            min(b.steps_per_execution, steps),
            f", {b.policy}" if b.policy else "",
            f"; {b.exchange.describe()}" if b.exchange else "",
        )

        # Keras 3 runs whole executions (31 steps at 16 per execution ran 32): there, each
        # `fit` trains one epoch over a dataset of exactly its steps, which ends the last
        # execution early. Keras 2 trains every epoch in one `fit`.
        one_epoch = b.keras.ONE_EPOCH_PER_FIT

        def fit_(first, epochs, steps_this_epoch):
            # A dataset per call: Keras starts each `fit` at the dataset's first batch.
            train_ds = plan.data.train_dataset(
                plan.batch_size, plan.place, seed=cfg.seed, start_step=first, steps=steps,
                epochs=epochs,
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
        """Every rank, before a mid-epoch checkpoint: an exchange if one is due (`--sync
        local/diloco`), then the check that the ranks agree."""
        if self.built.exchange is not None:
            self.built.exchange.now(whole=True)
        agreement.check_weights_agree(self.built.model, "before a mid-epoch checkpoint")

    def _end_user_callbacks(self):
        """The user's callbacks' `on_train_end`; when a callback stopped training and then
        changed the weights (EarlyStopping's `restore_best_weights`), the last checkpoint is
        written again with them: a rerun of the stopped run evaluates and exports them."""
        model, before = self.built.model, None
        if self.stopped is not None and self.built.manager and self.plan.place.rank == 0:
            before = runtime.weights_digest(model)
        self.user.end(self.history)
        if before is not None and runtime.weights_digest(model) != before:
            self.checkpointer.rewrite_last()

    def _checkpoint_extra(self):
        """What a checkpoint records of the callbacks' steering: a stop (at this epoch's
        end), and the single-worker rates they set."""
        changed = {
            name: float(s.rate.numpy())
            for name, s in self.built.optimizers.schedules.items()
            if s.rate is not None and s.rate.numpy() != np.float32(s.base_lr)
        }
        out = {"single_worker_lr": changed} if changed else {}
        if getattr(self.built.model, "stop_training", False):
            out["stopped"] = self.cfg.epochs  # of a run that asked for this many
        return out

    def lr_base(self):
        """The single-worker learning rate (a number), or its schedule's name."""
        base = self.built.schedule.base_lr
        return base if isinstance(base, float) else type(base).__name__

    def lr_scaled(self):
        """The learning rate x ranks after the warmup (a number; None for a schedule)."""
        schedule = self.built.schedule
        base = schedule.base_lr
        return rates.scaled_lr(base, schedule.size) if isinstance(base, float) else None

    # -- evaluate and finish -------------------------------------------------------------
    def evaluate(self):
        """The test metrics over all ranks ({} without test data)."""
        if not self.plan.data.has_test:
            return {}
        callbacks = [self.watchdog] if self.watchdog else None
        return metrics.evaluate(self.built.model, self.plan.test_ds, callbacks=callbacks)

    def check(self):
        """Every rank's host, pid and weights digest; identical weights or an error."""
        watchdog.holding("comparing the weights of every rank", waiting=True)
        agreement.check_weights_agree(self.built.model, "at the end of training")
        ranks = runtime.rank_report(self.built.model)
        if len({r["weights_digest"] for r in ranks}) != 1:
            raise HvdtrainError(
                "ranks ended with different weights; this is a bug, please report it"
            )
        return ranks

    def summary(self):
        """The run's figures so far (what the metrics JSON holds before the test results)."""
        cfg, b, plan = self.cfg, self.built, self.plan
        rates = self.throughput
        steps = plan.steps or 1
        reported = b.reported
        return {
            "prog": self.prog,
            "status": "running",
            "size": plan.place.size,
            "keras": b.keras.NAME,
            "epochs": cfg.epochs,
            "initial_epoch": (self.resumed or {}).get("optimizer_iterations", 0) // steps,
            "resumed_from": self.resumed,
            "steps_per_epoch": plan.steps,
            "steps_per_execution": min(b.steps_per_execution, steps),
            "batch_size": plan.batch_size,
            "global_batch_size": plan.global_batch,
            "samples_per_epoch": plan.steps * plan.global_batch,
            "deterministic": cfg.deterministic,
            "accumulate": cfg.accumulate,
            "mixed_precision": b.policy,
            "fp16_allreduce": cfg.fp16_allreduce,
            "sync": b.exchange.summary() if b.exchange else {"mode": "step"},
            "lr_base": self.lr_base(),
            "lr_scaled": self.lr_scaled(),
            "lr_final": float(b.schedule(reported.iterations)),
            "warmup_steps": plan.warmup_steps,
            "optimizer_iterations": int(reported.iterations),
            "optimizers": {
                name: {
                    "class": b.optimizers.classes[name],
                    "iterations": int(opt.iterations),
                    "lr_single_worker": float(
                        b.optimizers.schedules[name].single_worker(opt.iterations)
                    ),
                    "lr_final": float(b.optimizers.schedules[name](opt.iterations)),
                    "loss_scale": b.keras.current_loss_scale(opt),
                }
                for name, opt in b.optimizers.by_name.items()
            },
            "stopped_early": None if self.stopped is None else self.stopped + 1,
            "data_source": plan.data.source,
            "train_samples": plan.data.num_samples,
            "train_samples_per_sec": rates.samples_per_sec if rates else None,
            "epoch_samples_per_sec": rates.epoch_samples_per_sec if rates else [],
            "wall_seconds": time.perf_counter() - self.wall,
            "history": self.history,
        }

    def write_metrics(self, out):
        """Rank 0 writes `out` to --metrics-json (if given); returns the path or None."""
        if self.plan.place.rank == 0 and self.cfg.metrics_json:
            return files.write_json(self.cfg.metrics_json, out)
        return None

    def finish(self, result, ranks=None, **more):
        """The metrics dict; rank 0 exports the model and writes the metrics JSON.

        A write that fails here loses nothing already written: the export and the JSON are
        tried both, and `OutputsNotWritten` (exit status 4) says which were written."""
        p, b = self.plan.place, self.built
        out = {
            **self.summary(),
            "status": "finished",
            "test": result,
            "test_samples": result.get("samples", 0),
            "test_loss": result.get("loss"),
            "test_accuracy": result.get("accuracy"),
            "ranks": ranks or self.check(),
            **more,
        }
        if p.rank != 0:
            return out
        watchdog.holding("writing the exported model and the metrics JSON")
        written, failed = [], []
        if b.manager:
            path = os.path.join(b.manager.directory, "model.keras")
            try:
                exported = files.export_model(b.model, self.build_model, path, b.policy)
                out["exported_model"] = exported
                written.append(f"the model {out['exported_model']}")
            except (OSError, ValueError, RuntimeError) as e:
                failed.append(f"the model {path} ({_reason(e)})")
        try:
            if self.write_metrics(out):
                written.append(f"the metrics {self.cfg.metrics_json}")
        except (OSError, ValueError, TypeError) as e:
            failed.append(f"the metrics {self.cfg.metrics_json} ({_reason(e)})")
        if failed:
            kept = f"; the trained weights are in {b.manager.directory}" if b.manager else ""
            raise OutputsNotWritten(
                f"training finished, but could not write {' and '.join(failed)}; written: "
                f"{', '.join(written) or 'nothing'}{kept}. Free space or fix the path, then "
                "run the same command again: it resumes and writes them without training.",
                every_rank=False,
            )
        shown = ", ".join(
            f"{k} {v:.4f}" for k, v in result.items() if k != "samples" and isinstance(v, float)
        )
        rate = out["train_samples_per_sec"]
        samples = f" on {result['samples']} samples" if result.get("samples") else ""
        self.log.info(
            "%s; %s samples/s; %.1f s",
            f"test: {shown}{samples}" if shown else "done (no test set)",
            f"{rate:.0f}" if rate else "n/a",
            out["wall_seconds"],
        )
        return out


# -- helpers ---------------------------------------------------------------------------
def _policy(choice):
    import tensorflow as tf

    if not choice:
        return None
    if choice == "auto":
        choice = "float16" if tf.config.list_physical_devices("GPU") else "bfloat16"
    return f"mixed_{choice}"


def _plain(model, frontend):
    """A functional or Sequential model trained by Keras's own `train_step` and `compile`."""
    base = frontend.keras.Model
    own = type(model).compile is not base.compile or prepare.trains_itself(model, frontend)
    return not own and bool(getattr(model, "outputs", None))


def _float32_outputs(model, frontend):
    """`model` (plain, compiled) with float32 outputs, compiled as it was."""
    config, opt = frontend.compiled(model)
    if not config or opt is None or all(o.dtype == "float32" for o in model.outputs):
        return model
    wrapped = frontend.float32_outputs(model)
    wrapped.compile(
        optimizer=model.optimizer,  # as compiled (under float16, the loss-scale one Keras made)
        loss=config.get("loss"),
        metrics=config.get("metrics"),
        loss_weights=config.get("loss_weights"),
        weighted_metrics=config.get("weighted_metrics"),
        run_eagerly=bool(config.get("run_eagerly")),
    )
    return wrapped


def _as_data(source, limit=None):
    # A function that returns the data, called here; a generator function is the data, and
    # so is a function that returns a generator (called again each epoch).
    if callable(source) and not isinstance(source, datamod.Data):
        if not batchmod.is_batches(source):
            made = source()
            if inspect.isgenerator(made):
                made.close()
                made = batchmod.BatchData(source)
            source = made
    d = _data_of(source)
    if limit:
        if not isinstance(d, datamod.ArrayData):
            raise invalid_value("--limit-samples", limit, "no value: it limits in-memory arrays")
        d = d.limit(limit)
    return d


def _data_of(data):
    """A `Data` from a `Data`, (x, y) or ((x, y), (x_test, y_test)) arrays, or batches made in
    Python (a `PyDataset`, a `Sequence`, a generator or generator function: `BatchData`),
    alone or as (train, test)."""
    if isinstance(data, datamod.Data):
        return data
    if batchmod.is_batches(data):
        return batchmod.BatchData(data)
    if isinstance(data, tuple | list) and len(data) == 2:
        if batchmod.is_batches(data[0]) and (data[1] is None or batchmod.is_batches(data[1])):
            return batchmod.BatchData(*data)
        if all(isinstance(part, tuple | list) and len(part) == 2 for part in data):
            (x, y), test = data
            return datamod.ArrayData(x, y, test=test)
        return datamod.ArrayData(*data)
    raise invalid_value(
        "data",
        type(data).__name__,
        "a hvdtrain.Data (ArrayData, DatasetData, FileData, BatchData), (x, y), "
        "((x, y), (x_test, y_test)), or a keras.utils.PyDataset, a Keras Sequence or a "
        "generator (alone or as (train, test))",
    )


def _reason(error):
    """An OSError's reason (`No space left on device`), else the error's first line."""
    return getattr(error, "strerror", None) or (str(error).splitlines() or [repr(error)])[0]


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
