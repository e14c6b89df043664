"""Moved to `hvdtrain.runtime.tuning`: this old path is that module."""

import sys

from hvdtrain.runtime import tuning as _module

sys.modules[__name__] = _module
