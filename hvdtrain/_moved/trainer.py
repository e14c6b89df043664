"""Moved to `hvdtrain.recipe.trainer`: this old path is that module."""

import sys

from hvdtrain.recipe import trainer as _module

sys.modules[__name__] = _module
