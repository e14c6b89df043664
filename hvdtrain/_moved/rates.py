"""Moved to `hvdtrain.optimizers.rates`: this old path is that module."""

import sys

from hvdtrain.optimizers import rates as _module

sys.modules[__name__] = _module
