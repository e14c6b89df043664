"""Which records each rank reads, epoch by epoch, through `hvdtrain.FileData` (public API):
one JSON per rank with its record ids per epoch, its steps and its test records.

    horovodrun -np 2 -H localhost:2 python tests/workers/records_cover.py DIR OUT [--per-host]

DIR holds train-*.tfrecord and test-*.tfrecord files of records {"id": int64}; with
--per-host, DIR/<host>/ holds each host's own train files (host: HOROVOD_HOSTNAME or the
machine's name).
"""

import json
import os
import sys

import tensorflow as tf

import hvdtrain

folder, out = sys.argv[1], sys.argv[2]
per_host = "--per-host" in sys.argv
EPOCHS, BATCH, SEED = 3, 4, 5
hvdtrain.init()


def parse(record):
    return tf.io.parse_single_example(record, {"id": tf.io.FixedLenFeature([], tf.int64)})["id"], 0


def mine(placement):
    host = os.path.join(folder, placement.host)
    return [os.path.join(host, f) for f in os.listdir(host)]


if per_host:
    data = hvdtrain.FileData(mine, parse, per_host=True, shuffle_buffer=8)
else:
    train, test = (os.path.join(folder, f"{s}-*.tfrecord") for s in ("train", "test"))
    data = hvdtrain.FileData(train, parse, test=test, shuffle_buffer=8)
p = hvdtrain.Placement.current()
data.prepare(p, seed=SEED)
steps = data.steps_per_epoch(BATCH, p)
ds = data.train_dataset(BATCH, p, seed=SEED, start_step=0, steps=steps, epochs=EPOCHS)
ids = [int(i) for x, _ in ds for i in x.numpy()]
# A resume at step 3 of epoch 2: the same records from there on.
resumed = data.train_dataset(BATCH, p, seed=SEED, start_step=steps + 3, steps=steps, epochs=EPOCHS)
test = data.eval_dataset(16, p)
result = {
    "rank": p.rank,
    "host": p.host,
    "steps": steps,
    "epochs": [ids[e * steps * BATCH : (e + 1) * steps * BATCH] for e in range(EPOCHS)],
    "resumed": [int(i) for x, _ in resumed for i in x.numpy()],
    "test": [int(i) for x, _ in test for i in x.numpy()] if test is not None else [],
    "total": data.num_samples,
}
with open(os.path.join(out, f"rank{p.rank}.json"), "w") as f:
    json.dump(result, f)
