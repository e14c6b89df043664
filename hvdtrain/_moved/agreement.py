"""Moved to `hvdtrain.recipe.agreement`: this old path is that module."""

import sys

from hvdtrain.recipe import agreement as _module

sys.modules[__name__] = _module
