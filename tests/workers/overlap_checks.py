"""The overlapped exchange (`--sync-overlap`) on a tiny model, driven step by step with plain
SGD on a quadratic of each rank's own (its gradient w - target[rank]), for
tests/test_exchange.py, which replays the same formula in numpy:

    horovodrun -np 2 -H localhost:2 python tests/workers/overlap_checks.py --out OUT \
        --sync local --sync-every 3 --steps 10 [--sync-overlap]

Rank r writes OUT/rank<r>.json: its weights after every step (after the exchange where one
falls) and the weights after the whole exchange at the end.
"""

import argparse
import json
import os

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdtrain
from hvdtrain import exchange
from hvdtrain.data.shares import EqualShares
from hvdtrain.recipe.flags import make_config

LR = 0.1
TARGETS = np.array([[1.0, -2.0, 0.5], [-3.0, 4.0, 2.0]], "float32")  # rank 0's, rank 1's


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sync", default="local")
    parser.add_argument("--sync-every", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sync-overlap", action="store_true")
    parser.add_argument("--outer-lr", type=float)
    parser.add_argument("--outer-momentum", type=float)
    args = parser.parse_args()
    hvdtrain.init(threads=1, exchanges_rarely=True)
    rank = hvd.rank()
    model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(3, use_bias=False)])
    (weights,) = model.trainable_variables
    weights.assign(np.ones((1, 3), "float32"))
    options = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
    cfg = make_config(
        sync=args.sync,
        sync_every=args.sync_every,
        sync_warmup_steps=0,
        sync_overlap=args.sync_overlap or None,
        **({k: v for k, v in options.items() if v is not None} if args.sync == "diloco" else {}),
    )
    ex = exchange.for_config(cfg)
    ex.configure(None, 1, EqualShares())
    ex.attach(model, [tf.keras.optimizers.SGD(LR)])
    ex.begin(0, 0)
    trace = []
    for step in range(1, args.steps + 1):
        weights.assign_sub(LR * (weights - TARGETS[rank]))  # one local SGD step
        ex.after_steps(step, step, args.steps)  # one epoch of `steps`: its last is whole too
        trace.append(weights.numpy()[0].tolist())
    ex.now(whole=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"steps": trace, "end": weights.numpy()[0].tolist(), "sync": ex.summary()}, f)


if __name__ == "__main__":
    main()
