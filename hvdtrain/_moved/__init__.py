"""The module paths of hvdtrain before its modules moved into concept folders (2026-12-02):
`import hvdtrain.records` and `from hvdtrain.flags import make_config` keep working, each the
module it moved to (docs/development.md has the map). `hvdtrain/__init__.py` puts this folder
on the package's path; nothing here runs until such an import.
"""
