"""Moved to `hvdtrain.runtime.tracebacks`: this old path is that module."""

import sys

from hvdtrain.runtime import tracebacks as _module

sys.modules[__name__] = _module
