"""Moved to `hvdtrain.runtime.logs`: this old path is that module."""

import sys

from hvdtrain.runtime import logs as _module

sys.modules[__name__] = _module
