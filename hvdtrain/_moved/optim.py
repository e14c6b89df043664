"""Moved to `hvdtrain.recipe.optim`: this old path is that module."""

import sys

from hvdtrain.recipe import optim as _module

sys.modules[__name__] = _module
