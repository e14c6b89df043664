"""Checkpoints: atomic, validated, restored with the optimizer state (single process)."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.errors import HvdtrainError
from hvdtrain.recipe.checkpoint import CheckpointManager


def _model_and_optimizer(width=8, seed=0):
    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.Sequential(
        [tf.keras.Input((4,)), tf.keras.layers.Dense(width), tf.keras.layers.Dense(2)]
    )
    optimizer = tf.keras.optimizers.Adam(0.01)
    model.compile(optimizer, loss="mse")
    optimizer.build(model.trainable_variables)
    return model, optimizer


def _train(model, steps=3):
    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    model.fit(x, x[:, :2], batch_size=8, epochs=1, steps_per_epoch=steps, verbose=0)


def test_save_and_restore_round_trip_weights_and_optimizer_state(tmp_path):
    model, optimizer = _model_and_optimizer()
    _train(model)
    manager = CheckpointManager(tmp_path, model, optimizer)
    manager.save(1)
    saved_w = [w.copy() for w in model.get_weights()]
    saved_opt = [v.numpy().copy() for v in optimizer.variables]
    assert int(optimizer.iterations) == 3

    fresh, fresh_opt = _model_and_optimizer(seed=1)
    found = CheckpointManager(tmp_path, fresh, fresh_opt).latest()
    assert found.epoch == 1 and found.step == 0 and found.path.endswith("epoch-0001")
    assert CheckpointManager(tmp_path, fresh, fresh_opt).restore(found) == found
    for a, b in zip(saved_w, fresh.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(saved_opt) == len(fresh_opt.variables) > 1
    for a, b in zip(saved_opt, fresh_opt.variables, strict=True):
        np.testing.assert_array_equal(a, b.numpy())


def test_half_written_or_damaged_checkpoints_are_never_latest(tmp_path, caplog):
    model, optimizer = _model_and_optimizer()
    manager = CheckpointManager(tmp_path, model, optimizer, keep=5)
    manager.save(1)
    manager.save(2)
    # A crash mid-write leaves only a hidden temporary folder.
    (tmp_path / ".epoch-0003.tmp-999").mkdir()
    (tmp_path / ".epoch-0003.tmp-999" / "state.index").write_bytes(b"partial")
    # A truncated data file in a newer checkpoint.
    damaged = tmp_path / "epoch-0004"
    os.rename(manager.save(4), damaged)
    data = next(p for p in damaged.iterdir() if p.name.startswith("state.data"))
    data.write_bytes(data.read_bytes()[:10])
    # A checkpoint folder without a manifest.
    (tmp_path / "epoch-0005").mkdir()
    assert manager.latest().epoch == 2
    assert "skipping damaged checkpoint" in caplog.text
    manager.check_writable()  # cleans the temporary leftovers
    assert not (tmp_path / ".epoch-0003.tmp-999").exists()


def test_keeps_the_last_k_and_never_deletes_before_the_new_one_is_complete(tmp_path):
    model, optimizer = _model_and_optimizer()
    manager = CheckpointManager(tmp_path, model, optimizer, keep=2)
    for epoch in range(1, 5):
        manager.save(epoch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-0003", "epoch-0004"]
    manifest = json.loads((tmp_path / "epoch-0004" / "manifest.json").read_text())
    assert manifest["epoch"] == 4 and manifest["files"]


def test_a_checkpoint_of_a_different_model_is_refused(tmp_path):
    model, optimizer = _model_and_optimizer(width=8)
    CheckpointManager(tmp_path, model, optimizer).save(1)
    other, other_opt = _model_and_optimizer(width=16)
    manager = CheckpointManager(tmp_path, other, other_opt)
    with pytest.raises(HvdtrainError, match="different model"):
        manager.restore(manager.latest())


def test_unwritable_checkpoint_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    model, optimizer = _model_and_optimizer()
    with pytest.raises(HvdtrainError, match="expected a writable directory"):
        CheckpointManager(blocker / "ckpt", model, optimizer).check_writable()


def test_the_manifest_has_a_format_version_and_an_unknown_one_is_refused(tmp_path):
    """Format 3 is written; 2 and 1 (hvdtrain 0.1's, fields at the top level) are read;
    any other version is refused with both versions named, never skipped as damaged."""
    model, optimizer = _model_and_optimizer()
    manager = CheckpointManager(tmp_path, model, optimizer)
    manager.save(1, size=2, global_batch=64, steps_per_epoch=10, extra={"note": "x"})
    path = tmp_path / "epoch-0001" / "manifest.json"
    written = json.loads(path.read_text())
    assert written["format"] == 3 and written["size"] == 2 and written["extra"] == {"note": "x"}
    found = manager.latest()
    assert (found.size, found.global_batch, found.global_step) == (2, 64, 10)
    old = {k: v for k, v in written.items() if k not in ("data", "extra")}  # as 0.1 wrote it
    path.write_text(json.dumps({**old, "format": 1, "note": "x"}))
    found = manager.latest()
    assert found.format == 1 and found.size == 2 and found.extra == {"note": "x"}
    path.write_text(json.dumps({**written, "format": 4}))
    with pytest.raises(HvdtrainError, match="it has format 4; this hvdtrain reads formats 1, 2, 3"):
        manager.latest()


def test_only_recognised_checkpoints_count_and_are_deleted(tmp_path):
    """A folder renamed or put there by hand (`epoch-9999`) or a damaged one neither takes
    a place among the kept checkpoints nor gets deleted; good ones are never lost to it."""
    model, optimizer = _model_and_optimizer()
    manager = CheckpointManager(tmp_path, model, optimizer, keep=2)
    os.rename(manager.save(1), tmp_path / "epoch-9999")  # a manifest that names epoch 1
    (tmp_path / "epoch-8888").mkdir()
    (tmp_path / "epoch-8888" / "notes.txt").write_text("mine")
    for epoch in (2, 3, 4):
        manager.save(epoch, history={"loss": [1.0] * epoch})
    assert sorted(os.listdir(tmp_path)) == ["epoch-0003", "epoch-0004", "epoch-8888", "epoch-9999"]
    found = manager.latest()
    assert found.epoch == 4 and found.history == {"loss": [1.0] * 4}
    assert manager.skipped == ["epoch-9999", "epoch-8888"]


def test_every_checkpoint_damaged_is_said_in_one_line(tmp_path, caplog):
    model, optimizer = _model_and_optimizer()
    manager = CheckpointManager(tmp_path, model, optimizer)
    manager.save(1)
    (tmp_path / "epoch-0001" / "manifest.json").write_text("{broken")
    caplog.clear()
    assert manager.latest() is None
    assert manager.found() == (
        "1 checkpoint folder(s), each damaged or not hvdtrain's (epoch-0001)"
    )
    assert caplog.records == []  # the caller says what it does about it
    assert manager.restore_latest() is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"no usable checkpoint in {tmp_path}: {manager.found()}; starting from scratch"
    ]
    empty = CheckpointManager(tmp_path / "new", model, optimizer)
    assert empty.latest() is None and "no checkpoint folder" in empty.found()


def test_a_rerun_of_a_finished_job_says_it_is_trained_not_resuming(tmp_path):
    """A second run of a 2-epoch job evaluates only: it said "resuming at epoch 3" once."""
    import hvdtrain

    hvdtrain.init(threads=1)

    def build():
        model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    x = np.ones((16, 2), "float32")
    hvdtrain.fit(build, (x, x[:, 0]), epochs=2, batch_size=8, checkpoint_dir=str(tmp_path))
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hvdtrain").addHandler(handler)  # its own: it does not propagate
    try:
        out = hvdtrain.fit(build, (x, x[:, 0]), epochs=2, batch_size=8,
                           checkpoint_dir=str(tmp_path))  # fmt: skip
    finally:
        logging.getLogger("hvdtrain").removeHandler(handler)
    lines = [r.getMessage() for r in records]
    assert not [line for line in lines if line.startswith("resuming")], lines
    assert any("is after epoch 2: all 2 epoch(s) trained" in line for line in lines), lines
    assert out["optimizer_iterations"] == 4


def test_one_numbering_in_names_and_lines():
    """`epoch-000E-step-00000S` is after step S of epoch E, both from 1, as the lines say;
    `epoch-000E` the end of epoch E."""
    from hvdtrain.recipe import names

    assert names.folder_name(1, 6) == "epoch-0002-step-000006"
    assert names.folder_name(2) == "epoch-0002"
    assert names.position_of("epoch-0002-step-000006") == (1, 6)
    assert names.position_of("epoch-0001-step-000006", format=2) == (1, 6)  # as 2 named it
    assert names.position_of("epoch-0002") == names.position_of("epoch-0002", format=2) == (2, 0)
    assert names.position_of("epoch-0000-step-000001") is None  # no epoch 0 to be in
    assert names.position_of("notes") is None
    assert names.describe(16, 10) == "epoch 2, step 6 of 10" and names.describe(20, 10) == "epoch 2"
    assert names.human(16, 10) == (2, 6) and names.human(20, 10) == (2, 10)


def test_checkpoints_named_the_old_way_are_still_found_ordered_and_resumed(tmp_path):
    """A folder of format 2 named a mid-epoch checkpoint by the epochs done
    (`epoch-0001-step-000006`: 6 steps into epoch 2): still the latest after `epoch-0001`,
    and older than a new `epoch-0002`; a new mid-epoch one beside it sorts by its own."""
    model, optimizer = _model_and_optimizer()
    manager = CheckpointManager(tmp_path, model, optimizer, keep=10)
    manager.save(1, steps_per_epoch=10)
    new = manager.save(1, step=6, steps_per_epoch=10)
    assert os.path.basename(new) == "epoch-0002-step-000006"
    old = tmp_path / "epoch-0001-step-000006"  # the same checkpoint, as format 2 named it
    os.rename(new, old)
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "format": 2}))
    found = manager.latest()
    assert (found.path, found.epoch, found.step, found.global_step) == (str(old), 1, 6, 16)
    assert manager.restore(found) == found
    manager.save(1, step=8, steps_per_epoch=10)  # new: epoch 2, step 8
    assert manager.latest().path == str(tmp_path / "epoch-0002-step-000008")
    manager.save(2, steps_per_epoch=10)
    assert manager.latest().path == str(tmp_path / "epoch-0002")
    assert [os.path.basename(p) for p in manager._recognized()] == [
        "epoch-0002", "epoch-0002-step-000008", "epoch-0001-step-000006", "epoch-0001"
    ]  # fmt: skip


def test_a_damaged_folder_where_a_checkpoint_goes_is_renamed_in_one_line(tmp_path):
    """A later run reaching epoch 2 over a damaged epoch-0002 keeps it aside, and says so."""
    import logging

    model, optimizer = _model_and_optimizer()
    manager = CheckpointManager(tmp_path, model, optimizer)
    manager.save(2)
    (tmp_path / "epoch-0002" / "manifest.json").write_text("junk")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hvdtrain").addHandler(handler)
    try:
        manager.save(2)
    finally:
        logging.getLogger("hvdtrain").removeHandler(handler)
    (aside,) = [p for p in os.listdir(tmp_path) if p.startswith("epoch-0002.damaged-")]
    assert (tmp_path / aside / "manifest.json").read_text() == "junk"  # kept as it was
    assert [r.getMessage() for r in records] == [
        f"a damaged checkpoint was where this one goes: {tmp_path / 'epoch-0002'} is now "
        f"{tmp_path / aside} (kept as it was)"
    ]
