"""Moved to `hvdtrain.data.mnist`: this old path is that module."""

import sys

from hvdtrain.data import mnist as _module

sys.modules[__name__] = _module
