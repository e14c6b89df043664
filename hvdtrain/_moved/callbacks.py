"""Moved to `hvdtrain.recipe.callbacks`: this old path is that module."""

import sys

from hvdtrain.recipe import callbacks as _module

sys.modules[__name__] = _module
