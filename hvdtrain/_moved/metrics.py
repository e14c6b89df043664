"""Moved to `hvdtrain.recipe.metrics`: this old path is that module."""

import sys

from hvdtrain.recipe import metrics as _module

sys.modules[__name__] = _module
