"""Moved to `hvdtrain.runtime.watchdog`: this old path is that module."""

import sys

from hvdtrain.runtime import watchdog as _module

sys.modules[__name__] = _module
