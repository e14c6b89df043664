"""Moved to `hvdtrain.recipe.usercallbacks`: this old path is that module."""

import sys

from hvdtrain.recipe import usercallbacks as _module

sys.modules[__name__] = _module
