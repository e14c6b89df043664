"""Moved to `hvdtrain.recipe.checkpoint`: this old path is that module."""

import sys

from hvdtrain.recipe import checkpoint as _module

sys.modules[__name__] = _module
