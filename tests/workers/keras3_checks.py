"""Runs under `horovodrun -np 2`: Keras 3 loss scaling where only rank 1's gradients are
infinite; each rank writes what its check decided and what `apply` did.

horovodrun -np 2 -H localhost:2 python tests/workers/keras3_checks.py OUT_DIR
"""

import json
import os
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import hvdtrain
from hvdtrain.frontends import keras3

hvdtrain.init()
rank = hvd.rank()
w = keras.Variable(np.ones(3, "float32"))
opt = keras3.loss_scale(hvdtrain.distributed_optimizer(keras.optimizers.SGD(0.1)))
opt.build([w])
grads = [tf.constant([np.inf if rank == 1 else 1.0] * 3, tf.float32)]
finite = bool(opt.check_finite(grads))
opt.apply(grads, [w])  # skipped on every rank (a rank applying alone would hang the other)
opt.apply([tf.constant([float(rank)] * 3)], [w])  # finite: unscaled, averaged, applied
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"finite": finite, "w": np.asarray(w.numpy()).tolist(),
               "scale": float(opt.dynamic_scale.numpy()),
               "iterations": int(np.asarray(opt.iterations))}, f)  # fmt: skip
