"""A user's mistake that every rank makes, rank 0 reaching it last (issue 49): the others
reach it at once and end, rank 0 only after --delay seconds. Its one line must still reach
the user whatever the launcher.

    mpirun -np 2 python tests/workers/late_line.py --phase args --delay 4 --bogus
    horovodrun -np 2 --mpi python tests/workers/late_line.py --phase setup --delay 4

--phase args: an unknown flag to hvdtrain.ArgumentParser (before hvd.init()); setup: a
HvdtrainError every rank raises after hvdtrain.init() (as a set-up check agreed by all).
"""

import sys
import time

import hvdtrain
from hvdtrain.errors import env_rank

phase = sys.argv[sys.argv.index("--phase") + 1]
delay = float(sys.argv[sys.argv.index("--delay") + 1])
if phase == "setup":
    hvdtrain.init(threads=1)
if env_rank() == 0:
    time.sleep(delay)  # rank 0 slow to reach the mistake (a loaded machine, a slow import)
if phase == "args":
    hvdtrain.ArgumentParser(description=__doc__).parse_args()  # --bogus: one line, exit 2
raise hvdtrain.HvdtrainError("the same mistake on every rank; fix it so")
