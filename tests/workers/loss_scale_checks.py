"""Runs under `horovodrun -np 2`: loss scaling where only rank 1's gradients are infinite,
applied with `apply_gradients` as a `train_step` of the user's own applies them; each rank
writes what was decided and what the update did. --keras 2 or 3.

horovodrun -np 2 -H localhost:2 python tests/workers/loss_scale_checks.py OUT_DIR --keras 3
"""

import json
import os
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdtrain

out, keras_version = sys.argv[1], sys.argv[sys.argv.index("--keras") + 1]
hvdtrain.init()
rank = hvd.rank()
if keras_version == "3":
    import keras

    from hvdtrain.frontends import keras3 as frontend

    w = keras.Variable(np.ones(3, "float32"))
    opt = frontend.loss_scale(hvdtrain.distributed_optimizer(keras.optimizers.SGD(0.1)))
else:
    from hvdtrain.frontends import keras2 as frontend

    w = tf.Variable(np.ones(3, "float32"))
    opt = frontend.loss_scale(hvdtrain.distributed_optimizer(tf.keras.optimizers.SGD(0.1)))
opt.build([w])
grads = [tf.constant([np.inf if rank == 1 else 1.0] * 3, tf.float32)]
finite = bool(opt.check_finite(grads)) if keras_version == "3" else None
# Skipped on every rank (a rank applying alone would hang the other).
opt.apply_gradients([(grads[0], w)])
opt.apply_gradients([(tf.constant([float(rank)] * 3), w)])  # finite: averaged, applied
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"finite": finite, "w": np.asarray(w.numpy()).tolist(),
               "scale": frontend.current_loss_scale(opt),
               "iterations": int(np.asarray(opt.iterations))}, f)  # fmt: skip
