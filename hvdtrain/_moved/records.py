"""Moved to `hvdtrain.data.files`: this old path is that module."""

import sys

from hvdtrain.data import files as _module

sys.modules[__name__] = _module
