"""The rank side of a shared job (tests/helpers/shared.py): started once on every rank of a
long-lived job, it runs the scenarios the test process sends, one after the other, each with
fresh Keras state, its own folder and environment, and answers with its result or its
traceback. Nothing of the scenarios is imported until one is asked for.

    horovodrun -np 2 -H localhost:2 python tests/helpers/scenario_runner.py 127.0.0.1:PORT
"""

import importlib
import importlib.util
import json
import os
import runpy
import socket
import sys
import traceback

MARK = "@@scenario"  # the lines around each scenario's output: "@@scenario begin|end ID"


def fresh_state():
    """What one scenario leaves behind that the next must not see: Keras's sessions and name
    counters, the mixed precision policy, op determinism."""
    importlib.import_module("hvdtrain")  # before TensorFlow: tf.keras is Keras 2, as for users
    import tensorflow as tf
    from tensorflow.python.framework import config  # op determinism's off switch is here only

    tf.keras.backend.clear_session()
    tf.keras.mixed_precision.set_global_policy("float32")
    keras3 = sys.modules.get("keras")
    if keras3 is not None and hasattr(keras3, "config"):  # Keras 3, where a scenario imported it
        keras3.backend.clear_session()
        keras3.mixed_precision.set_global_policy("float32")
    config.disable_op_determinism()


def run_one(request):
    """Runs the scenario: a script's file (`path.py`) as `__main__` with `sys.argv` set to
    `[path, *argv]`; a module as `python -m` runs it ("-m module"); or `module:function`,
    called as `function(*args)`, or with `argv` as a script's `main()` with `sys.argv` set
    to `[the module's file, *argv]`."""
    scenario = request["scenario"]
    env, cwd = dict(os.environ), os.getcwd()
    argv = list(sys.argv)
    try:
        os.environ.update(request.get("env") or {})
        if request.get("cwd"):
            os.chdir(request["cwd"])
        fresh_state()
        if scenario.endswith(".py"):  # python path.py ARGV
            sys.argv[:] = [scenario, *(request.get("argv") or [])]
            runpy.run_path(scenario, run_name="__main__")
            return {"ok": True, "result": None}
        if scenario.startswith("-m "):  # python -m module ARGV
            module = scenario[3:]
            sys.argv[:] = [importlib.util.find_spec(module).origin, *(request.get("argv") or [])]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            return {"ok": True, "result": None}
        module, function = scenario.split(":")
        target = getattr(importlib.import_module(module), function)
        if request.get("argv") is not None:
            sys.argv[:] = [sys.modules[module].__file__, *request["argv"]]
        return {"ok": True, "result": target(*request.get("args", []))}
    except SystemExit as e:  # a script's main() ending: its status
        return {"ok": e.code in (0, None), "exit": e.code, "traceback": traceback.format_exc()}
    except BaseException as e:  # noqa: BLE001 (every failure is the scenario's result)
        error = f"{type(e).__name__}: {e}"
        return {"ok": False, "error": error, "traceback": traceback.format_exc()}
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv[:] = argv


def mark(what):
    """The marker on both streams: the launcher forwards each on its own, so a scenario's
    output is whole between its first begin and its last end."""
    for stream in (sys.stdout, sys.stderr):
        stream.write(f"{MARK} {what}\n")
        stream.flush()


def main():
    host, port = sys.argv[1].rsplit(":", 1)
    rank = int(os.environ.get("HOROVOD_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
    workers = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers")
    sys.path.insert(0, workers)  # the scenarios live beside the workers
    with socket.create_connection((host, int(port)), timeout=600) as conn:
        conn.settimeout(None)
        stream = conn.makefile("rw", encoding="utf-8")
        stream.write(json.dumps({"rank": rank}) + "\n")
        stream.flush()
        for line in stream:
            request = json.loads(line)
            if request.get("exit"):
                break
            mark(f"begin {request['id']}")
            reply = run_one(request)
            mark(f"end {request['id']}")
            reply = {"id": request["id"], "rank": rank, **reply}
            stream.write(json.dumps(reply, default=str) + "\n")
            stream.flush()


if __name__ == "__main__":
    main()
