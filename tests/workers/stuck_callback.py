"""Rank 1 stops in a user's epoch-end callback (sleeps 120 s) while rank 0 waits for it in
the next collective (issue 51): the launcher's summary must name rank 1.

    HVDTRAIN_STALL_SHUTDOWN_SECONDS=5 hvdtrain-run --backend gloo -np 2 -- \
        python tests/workers/stuck_callback.py
"""

import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdtrain


class Sleepy(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if hvd.rank() == 1 and epoch == 0:
            time.sleep(120)


def build():
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


x = np.ones((256, 4), "float32")
args = hvdtrain.ArgumentParser(epochs=3).parse_args()
hvdtrain.fit(build, (x, x[:, 0]), args, callbacks=[Sleepy()])
