"""A model whose weight records every learning rate applied to it, through `hvdtrain.fit`:
one weight w (from 0), inputs 1, targets -1000 and the mean absolute error, so that every
step's gradient is exactly 1 on every rank and plain SGD moves w by exactly the rate it
applied: after the run, w is minus the sum of those rates. The optimizer's rate is the
user's own schedule (an exponential decay), which hvdtrain puts under its warmup.

    horovodrun -np 2 -H localhost:2 python tests/workers/sgd_steps.py --keras 3 \
        --record OUT --checkpoint-dir ck --epochs 3 [--mixed-precision float16 --poison-step 2]

--poison-step K: rank 1's batch K of the first epoch holds one input of 1e4, whose scaled
float16 gradient overflows on that rank alone (its loss stays finite): under
`--mixed-precision float16` every rank must skip that step together and halve the loss
scale. Each rank writes OUT.rank<r>.json: w, the optimizer's step and the loss scale.
"""

import json

import numpy as np
import tensorflow as tf

import hvdtrain

SAMPLES, DECAY_STEPS = 256, 4


def main():
    parser = hvdtrain.ArgumentParser(description=__doc__, epochs=3, batch_size=16)
    parser.add_argument("--keras", choices=["2", "3"], default="2", help="the model's Keras")
    parser.add_argument("--record", required=True, help="each rank writes RECORD.rank<r>.json")
    parser.add_argument("--poison-step", type=int, default=-1, help="rank 1's bad batch")
    args = parser.parse_args()
    if args.keras == "3":
        import keras as k
    else:
        k = tf.keras

    def build_model():
        model = k.Sequential(
            [k.Input((1,)), k.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
        )
        decay = k.optimizers.schedules.ExponentialDecay(0.1, DECAY_STEPS, 0.5)
        model.compile(optimizer=k.optimizers.SGD(decay), loss="mean_absolute_error")
        return model

    def make_dataset(rank, size, seed, epoch):
        x = np.ones((SAMPLES // size, 1), np.float32)
        if rank == 1 and epoch == 0 and args.poison_step >= 0:
            x[args.poison_step * args.batch_size] = 1e4
        return tf.data.Dataset.from_tensor_slices((x, np.full((len(x), 1), -1000, np.float32)))

    trained = k.callbacks.LambdaCallback()  # its `model`: the one fit trains
    hvdtrain.fit(
        build_model, hvdtrain.DatasetData(make_dataset, SAMPLES), args, callbacks=[trained]
    )
    import horovod.tensorflow as hvd

    model, opt = trained.model, trained.model.optimizer
    scale = getattr(opt, "loss_scale", None)  # Keras 2's LossScaleOptimizer
    scale = getattr(opt, "dynamic_scale", scale)  # Keras 3's
    record = {
        "w": float(np.ravel(model.get_weights()[0])[0]),
        "iterations": int(opt.iterations),
        "loss_scale": None if scale is None else float(scale),
    }
    with open(f"{args.record}.rank{hvd.rank()}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
