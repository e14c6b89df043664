"""Moved to `hvdtrain.runtime.compat`: this old path is that module."""

import sys

from hvdtrain.runtime import compat as _module

sys.modules[__name__] = _module
