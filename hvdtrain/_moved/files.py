"""Moved to `hvdtrain.recipe.outputs`: this old path is that module."""

import sys

from hvdtrain.recipe import outputs as _module

sys.modules[__name__] = _module
