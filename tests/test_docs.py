"""The docs: the site builds with --strict (a broken link or anchor, a page left out of the
nav, a docstring naming a parameter that no longer exists all fail it), the reference holds
every public name and every command's flags, and the Python on the pages and in the README
parses and calls only names and keywords that hvdtrain has."""

import ast
import glob
import inspect
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

import hvdtrain

PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
README = os.path.join(ROOT, "README.md")
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def build(root, out):
    """`mkdocs build --strict` of the site at `root` (never -q: it stops counting warnings)."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    proc = build(ROOT, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    shutil.copytree(os.path.join(ROOT, "docs"), tmp_path / "docs")
    shutil.copy(os.path.join(ROOT, "mkdocs.yml"), tmp_path)
    with open(tmp_path / "docs" / "launching.md", "a") as f:
        f.write("\nSee [gone](no-such-page.md) and [here](docker.md#no-such-anchor).\n")
    proc = build(tmp_path, tmp_path / "site")
    assert proc.returncode != 0
    assert "'no-such-page.md', but the target is not found" in proc.stderr, proc.stderr
    assert "does not contain an anchor '#no-such-anchor'" in proc.stderr, proc.stderr


def test_the_api_reference_has_every_public_name(site):
    html = open(site / "reference" / "api" / "index.html").read()
    missing = [
        name
        for name, module in hvdtrain._EXPORTS.items()
        if f'id="hvdtrain.{module}.{name}"' not in html
    ]
    assert not missing, missing
    # a signature and a docstring, not just a heading
    assert "def fit(" in re.sub(r"<[^>]+>", "", html) or "fit(" in html
    assert "Placement" in html and "broadcast_initial_state" in html


def _hooks():
    sys.path.insert(0, os.path.join(ROOT, "docs"))
    import hooks

    return hooks


@pytest.mark.processes  # each command's --help, in a process of its own (docs/hooks.py)
def test_the_reference_pages_in_the_repository_are_what_the_code_gives():
    """docs/reference/*.md read in the repository are what `python docs/hooks.py` writes: the
    API page exactly (read from the source: the same text on any Python); the flags page
    exactly on the Python that printed it, and on another every flag of every command
    (argparse lays a few options out otherwise from one version to the next)."""
    hooks = _hooks()
    stale = "is not what the code gives: run `python docs/hooks.py` (make reference)"
    api = hooks.region(open(hooks.PAGES["api"]).read(), "api")
    assert api == hooks.api_text() + "\n", f"docs/reference/api.md {stale}"
    committed = hooks.region(open(hooks.PAGES["flags"]).read(), "flags")
    fresh = hooks.flags_text() + "\n"
    if committed.splitlines()[0] == fresh.splitlines()[0]:  # printed by this Python
        assert committed == fresh, f"docs/reference/flags.md {stale}"
    else:
        flags = re.compile(r"(?<![\w-])--?[a-z][\w-]*")
        missing = set(flags.findall(fresh)) - set(flags.findall(committed))
        assert not missing, f"docs/reference/flags.md {stale}: {sorted(missing)}"


def test_the_flags_reference_is_each_parser_s_help(site):
    text = re.sub(r"<[^>]+>", "", open(site / "reference" / "flags" / "index.html").read())
    for flag in ("--checkpoint-dir", "--elastic", "--mixed-precision", "--keras", "--model"):
        assert flag in text, flag
    for flag in ("--hostfile", "--backend", "--gpu", "--workers", "--gpus-per-worker"):
        assert flag in text, flag  # hvdtrain-run, its doctor and k8s
    for module in ("bench.workers", "bench.allreduce", "bench.floor", "launcher.elastic"):
        assert f"usage: python -m hvdtrain.{module}" in text, module  # run with python -m


def test_the_site_needs_no_network(site):
    """Built offline and read offline: no page loads a font, style or script from elsewhere."""
    loads = re.compile(r"<(?:link|script|img)\b[^>]*\b(?:href|src)=\"?((?:https?:)?//[^\s\">]+)")
    for page in glob.glob(str(site / "**" / "*.html"), recursive=True):
        outside = loads.findall(open(page).read())
        assert not outside, (page, outside[:5])


def test_every_page_is_in_the_nav():
    nav = open(os.path.join(ROOT, "mkdocs.yml")).read()
    for page in PAGES:
        assert os.path.relpath(page, os.path.join(ROOT, "docs")) in nav, page


def test_the_readme_links_to_pages_that_exist():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", open(README).read())
    assert links
    for link in links:
        assert os.path.exists(os.path.join(ROOT, link)), link


def _blocks():
    for path in [README, *PAGES]:
        for i, found in enumerate(FENCE.finditer(open(path).read())):
            yield f"{os.path.relpath(path, ROOT)}#{i}", found.group(1)


@pytest.mark.parametrize("where,code", list(_blocks()), ids=lambda v: v if "#" in v else "")
def test_python_on_the_pages_uses_real_names_and_keywords(where, code):
    """Each ```python block parses; every `hvdtrain.X` is a public name, every call
    `hvdtrain.X(...)` binds to X's signature (its keywords exist, not too many positionals),
    and `compile` gets its metrics by keyword (what Keras 2 reads as metrics, Keras 3 reads
    as loss_weights)."""
    tree = ast.parse(code, filename=where)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "compile":
            # Keras 3 takes compile's third positional argument as loss_weights, not metrics
            assert len(node.args) <= 2, f"{where}: pass compile's metrics by keyword"
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "hvdtrain":
            assert node.attr in hvdtrain.__all__, f"{where}: hvdtrain.{node.attr} does not exist"
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if getattr(node.func.value, "id", None) != "hvdtrain":
            continue
        target = getattr(hvdtrain, node.func.attr)
        signature = inspect.signature(target)
        if any(isinstance(a, ast.Starred) for a in node.args) or any(
            k.arg is None for k in node.keywords
        ):
            continue
        try:
            signature.bind_partial(*node.args, **{k.arg: None for k in node.keywords})
        except TypeError as e:
            pytest.fail(f"{where}: hvdtrain.{node.func.attr}{signature}: {e}")


def test_the_measurements_page_reads_as_a_table():
    """Rows short enough for a table (details go to a page section linked from the row), and
    no folder of the machine they were measured on."""
    path = os.path.join(ROOT, "docs", "measurements.md")
    rows = [line for line in open(path).read().splitlines() if line.startswith("| 20")]
    assert len(rows) > 10
    for row in rows:
        assert len(row) < 600, row[:200]
        assert not re.search(r"/tmp/|/root/|/work/|/home/", row), row[:200]
