"""examples/notebook.ipynb on a real Jupyter kernel (nbclient, ipykernel), cell by cell as a
user runs it: TensorFlow imported in an early cell, `hvdtrain.ArgumentParser().parse_args()`
in the kernel, `hvdtrain.launch(train, args, np=2)` training the README's model on 2 ranks
(short here: 1 epoch of 512 digits), its figures back, the export loaded in the kernel; then
a rank that fails raises `JobFailed` in its cell with one line naming the cell and line, the
kernel's interrupt ends every rank (none left) and the next cell still runs."""

import asyncio
import json
import os
import re
import time

import nbformat
import psutil
import pytest
from conftest import ROOT, job_env
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell

from hvdtrain.runtime.processes import alive

NOTEBOOK = os.path.join(ROOT, "examples", "notebook.ipynb")

FIGURES = """\
import json
print(json.dumps({
    "ranks": [r["rank"] for r in metrics["ranks"]],
    "digests": sorted({r["weights_digest"] for r in metrics["ranks"]}),
    "epochs": len(metrics["history"]["loss"]),
    "test_samples": metrics["test_samples"],
    "exported": metrics["exported_model"],
}))"""

FAILS = """\
def fails(samples):
    from hvdtrain.errors import env_rank
    if env_rank() == 1:
        raise ValueError(f"no digits beyond {samples}")
    import time; time.sleep(60)

hvdtrain.launch(fails, 512, np=2)"""

SLEEPS = """\
def sleeps(folder):
    import os, time
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, str(os.getpid())), "w").close()
    time.sleep(600)

hvdtrain.launch(sleeps, "pids", np=2)"""


def _text(cell, name=None):
    """The cell's stream output, without colours (a kernel's ranks colour tracebacks)."""
    text = "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o["output_type"] == "stream" and name in (None, o["name"]))  # fmt: skip
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _error(cell):
    return next((o for o in cell.get("outputs", []) if o["output_type"] == "error"), None)


async def _run(client, nb, interrupted, folder):
    """Every cell in turn; cell `interrupted` is interrupted once its 2 ranks run. Returns
    the ranks' pids and the kernel's processes left after the interrupt."""
    async with client.async_setup_kernel(env=job_env()):
        kernel = psutil.Process(client.km.provisioner.pid)
        pids, left = [], None
        for index, cell in enumerate(nb.cells):
            if index != interrupted:
                await client.async_execute_cell(cell, index)
                continue
            running = asyncio.ensure_future(client.async_execute_cell(cell, index))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and len(os.listdir(folder)) < 2:
                await asyncio.sleep(0.2)
            pids = [int(name) for name in os.listdir(folder)]
            started = time.monotonic()
            await client.km.interrupt_kernel()
            await running
            while time.monotonic() - started < 15 and (
                kernel.children(recursive=True) or any(map(alive, pids))
            ):  # the ranks may outlive their launcher by a moment, reparented: waited for too
                await asyncio.sleep(0.2)
            left = kernel.children(recursive=True)
    return pids, left, time.monotonic() - started


@pytest.mark.timeout(600)
def test_the_notebook_trains_on_two_ranks_from_its_cells_and_fails_and_stops_cleanly(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "ArgumentParser(" in c.source)
    nb.cells.insert(at + 1, new_code_cell("args.epochs, args.limit_samples = 1, 512"))
    nb.cells += [new_code_cell(FIGURES), new_code_cell(FAILS), new_code_cell(SLEEPS),
                 new_code_cell("print('the kernel goes on')")]  # fmt: skip
    figures, fails, sleeps, after = range(len(nb.cells) - 4, len(nb.cells))
    (tmp_path / "pids").mkdir()
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
    )  # fmt: skip
    pids, left, seconds = asyncio.run(_run(client, nb, sleeps, tmp_path / "pids"))
    for cell in nb.cells[:figures]:  # the notebook's own cells: no error
        assert _error(cell) is None, (cell.source, _error(cell), _text(cell)[-3000:])

    code = [c for c in nb.cells if c.cell_type == "code"]
    launched = next(c for c in code if "hvdtrain.launch(train" in c.source)
    err = _text(launched, "stderr")
    assert "hvdtrain: training on 2 rank(s)" in err, err[-3000:]  # rank 0's lines, untagged
    assert "<stdout>:" not in err + _text(launched) and "[rank 1]" not in err
    got = json.loads(_text(nb.cells[figures]))
    assert got["ranks"] == [0, 1] and len(got["digests"]) == 1 and got["epochs"] == 1
    assert got["test_samples"] == 500  # the embedded digits' test set
    assert got["exported"] == str(tmp_path / "ck" / "notebook" / "model.keras")
    evaluated = next(c for c in code if "load_model(" in c.source)
    loss, accuracy = json.loads(evaluated.outputs[-1]["data"]["text/plain"])
    assert loss > 0 and 0 <= accuracy <= 1

    error = _error(nb.cells[fails])
    assert error["ename"] == "JobFailed", error
    assert error["evalue"] == (
        f"rank 1 failed: ValueError: no digits beyond 512 (raised in fails, Cell "
        f"In[{nb.cells[fails].execution_count}], line 4); exit status 1"
    )
    assert "[rank 1] ValueError: no digits beyond 512" in _text(nb.cells[fails], "stderr")

    assert _error(nb.cells[sleeps])["ename"] == "KeyboardInterrupt"
    assert len(pids) == 2, "the ranks did not start"
    assert left == [] and seconds < 15, (left, seconds)
    assert not any(map(alive, pids))
    assert _text(nb.cells[after]) == "the kernel goes on\n"
