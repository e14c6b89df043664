"""The reference pages, generated from the code so that they cannot drift from it, readable
in the repository and on the site.

`python docs/hooks.py` (`make reference`) writes, between the markers of each page, what the
code gives: docs/reference/api.md one entry per name in `hvdtrain.__all__` (its signature and
docstring, read from the source with griffe, nothing imported), grouped by the module that
defines it; docs/reference/flags.md the `--help` of `hvdtrain.ArgumentParser`, of each entry
point, of `hvdtrain-run` and of every other module a user runs with `python -m`, as their
parsers print it. tests/test_docs.py fails when a page is not what the code gives now.

As an MkDocs hook (mkdocs.yml), it shows the API page's entries with mkdocstrings instead of
the plain text (a docstring naming a parameter that does not exist fails `--strict`).
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere: this checkout's hvdtrain

import hvdtrain  # noqa: E402

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


PAGES = {
    "api": os.path.join(ROOT, "docs", "reference", "api.md"),
    "flags": os.path.join(ROOT, "docs", "reference", "flags.md"),
}
_BEGIN = "<!-- hvdtrain:{} begin: written by `python docs/hooks.py`; do not edit by hand -->\n"
_END = "<!-- hvdtrain:{} end -->"


def api_markdown():
    """The API page's entries for the site: one mkdocstrings entry per public name."""
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


def _signature(obj):
    """`(a, b=1, *, c=None, **options)` of a griffe function or class (its `__init__`)."""
    params = getattr(obj, "parameters", None)
    if obj.is_class:
        init = obj.members.get("__init__")
        params = init.parameters if init is not None else params
    if params is None:
        return ""
    words, star = [], False
    for p in params:
        kind = p.kind.value
        if p.name in ("self", "cls") and not words:
            continue
        if kind == "variadic positional":
            words.append(f"*{p.name}")
            star = True
        elif kind == "variadic keyword":
            words.append(f"**{p.name}")
        else:
            if kind == "keyword-only" and not star:
                words.append("*")
                star = True
            words.append(p.name if p.default is None else f"{p.name}={p.default}")
        following = [q.kind.value for q in list(params)[list(params).index(p) + 1 :]]
        if kind == "positional-only" and "positional-only" not in following:
            words.append("/")
    return f"({', '.join(words)})"


def api_text():
    """The API page's entries as plain Markdown: each name's signature and docstring, read
    from the source (griffe: no import, the same text on any Python)."""
    import griffe

    package = griffe.load("hvdtrain", search_paths=[ROOT], resolve_aliases=True)
    exports = hvdtrain._EXPORTS
    parts = []
    for module, title in MODULES.items():
        names = [name for name, where in exports.items() if where == module]
        if not names:
            continue
        parts.append(f"## {title}: `hvdtrain.{module}`\n")
        for name in names:
            obj = package[f"{module}.{name}"]
            kind = "class " if obj.is_class else ""
            doc = obj.docstring.value if obj.docstring else "(no docstring)"
            parts.append(
                f"### `hvdtrain.{name}`\n\n```text\n{kind}{name}{_signature(obj)}\n```\n\n"
                f"```text\n{doc}\n```\n"
            )
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
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # the width argparse wraps at, whatever the terminal's
    try:
        usage = parser.format_help()
    finally:
        if columns is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = columns
    parts = ["## `hvdtrain.ArgumentParser`: the flags of your script\n", f"```text\n{usage}```\n"]
    for title, argv in COMMANDS:
        parts += [f"## {title}\n", "```text\n" + _help(argv) + "```\n"]
    return "\n".join(parts)


def flags_text():
    """The flags page's text: each command's `--help`, and the Python that printed them
    (argparse lays a few options out otherwise from one version to the next)."""
    version = ".".join(map(str, sys.version_info[:2]))
    return f"(Printed by Python {version}.)\n\n" + flags_markdown()


def region(text, name):
    """The generated text between page `name`'s markers in `text`, or None."""
    begin, end = _BEGIN.format(name), _END.format(name)
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0]


def with_region(text, name, body):
    """`text` with the generated text between page `name`'s markers replaced by `body`."""
    begin, end = _BEGIN.format(name), _END.format(name)
    head, rest = text.split(begin, 1)
    return head + begin + body + end + rest.split(end, 1)[1]


def write():
    """Writes both pages' generated text (`make reference`)."""
    for name, make in (("api", api_text), ("flags", flags_text)):
        with open(PAGES[name]) as f:
            text = f.read()
        with open(PAGES[name], "w") as f:
            f.write(with_region(text, name, make() + "\n"))


def on_page_markdown(markdown, page, **kwargs):
    if region(markdown, "api") is not None:  # the site: mkdocstrings' entries instead
        markdown = with_region(markdown, "api", api_markdown() + "\n")
    return markdown


if __name__ == "__main__":
    write()
