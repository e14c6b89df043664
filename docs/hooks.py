"""MkDocs hooks: the reference pages generated from the code, so they cannot drift from it.

`<!-- hvdtrain:api -->` becomes one mkdocstrings entry per name in `hvdtrain.__all__`,
grouped by the module that defines it; `<!-- hvdtrain:flags -->` becomes the `--help` of
`hvdtrain.ArgumentParser`, of each entry point, of `hvdtrain-run` and of every other module a
user runs with `python -m`, as their parsers print it.
"""

import os
import subprocess
import sys

import hvdtrain

MODULES = {  # the order and titles of the API page's sections
    "recipe.trainer": "The recipe",
    "recipe.flags": "Flags",
    "launcher.notebook": "Launching a function (a notebook)",
    "data": "Data",
    "data.forms": "What a data form is",
    "data.files": "Data in files",
    "data.batches": "Batches made in Python",
    "data.mnist": "MNIST",
    "runtime.process": "Set-up",
    "errors": "Errors",
    "runtime.logs": "Logging",
    "runtime.tuning": "Performance settings",
    "optimizers.rates": "The learning rate",
    "recipe.optim": "Optimisation",
    "recipe.metrics": "Metrics",
    "recipe.callbacks": "Callbacks",
    "recipe.usercallbacks": "Your Keras callbacks",
    "recipe.agreement": "Ranks that drift apart",
    "runtime.watchdog": "Watchdog",
    "recipe.checkpoint": "Checkpoints",
    "recipe.outputs": "Files",
}

COMMANDS = [  # (title, argv after the Python)
    ("`python -m hvdtrain.mnist`", ["-m", "hvdtrain.mnist", "--help"]),
    ("`python -m hvdtrain.cifar10`", ["-m", "hvdtrain.cifar10", "--help"]),
    ("`python -m hvdtrain.images`", ["-m", "hvdtrain.images", "--help"]),
    ("`hvdtrain-run`", ["-m", "hvdtrain.launcher.cli", "--help"]),
    ("`hvdtrain-run k8s`", ["-m", "hvdtrain.launcher.cli", "k8s", "--help"]),
    ("`python -m hvdtrain.bench`", ["-m", "hvdtrain.bench", "--help"]),
    ("`python -m hvdtrain.bench.workers`", ["-m", "hvdtrain.bench.workers", "--help"]),
    ("`python -m hvdtrain.bench.allreduce`", ["-m", "hvdtrain.bench.allreduce", "--help"]),
    ("`python -m hvdtrain.bench.floor`", ["-m", "hvdtrain.bench.floor", "--help"]),
    ("`python -m hvdtrain.bench.loading`", ["-m", "hvdtrain.bench.loading", "--help"]),
    ("`python -m hvdtrain.bench.accuracy`", ["-m", "hvdtrain.bench.accuracy", "--help"]),
    ("`python -m hvdtrain.launcher.elastic`", ["-m", "hvdtrain.launcher.elastic", "--help"]),
]


def api_markdown():
    exports = hvdtrain._EXPORTS
    unknown = sorted(set(exports.values()) - set(MODULES))
    if unknown:
        raise ValueError(f"docs/hooks.py: no section for hvdtrain.{', hvdtrain.'.join(unknown)}")
    parts = []
    for module, title in MODULES.items():
        names = [name for name, where in exports.items() if where == module]
        if not names:
            continue
        parts.append(f"## {title}: `hvdtrain.{module}`\n")
        parts += [f"::: hvdtrain.{module}.{name}\n" for name in names]
    return "\n".join(parts)


def _help(argv):
    env = dict(os.environ, COLUMNS="100", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=300, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"{argv} exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def flags_markdown():
    parser = hvdtrain.ArgumentParser("python train.py")
    os.environ.setdefault("COLUMNS", "100")
    parts = [
        "## `hvdtrain.ArgumentParser`: the flags of your script\n",
        "```text\n" + parser.format_help() + "```\n",
    ]
    for title, argv in COMMANDS:
        parts += [f"## {title}\n", "```text\n" + _help(argv) + "```\n"]
    return "\n".join(parts)


def on_page_markdown(markdown, page, **kwargs):
    if "<!-- hvdtrain:api -->" in markdown:
        markdown = markdown.replace("<!-- hvdtrain:api -->", api_markdown())
    if "<!-- hvdtrain:flags -->" in markdown:
        markdown = markdown.replace("<!-- hvdtrain:flags -->", flags_markdown())
    return markdown
