"""Moved to `hvdtrain.runtime.orphan`: this old path is that module."""

import sys

from hvdtrain.runtime import orphan as _module

sys.modules[__name__] = _module
