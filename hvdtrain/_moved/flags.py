"""Moved to `hvdtrain.recipe.flags`: this old path is that module."""

import sys

from hvdtrain.recipe import flags as _module

sys.modules[__name__] = _module
