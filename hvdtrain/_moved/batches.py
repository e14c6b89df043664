"""Moved to `hvdtrain.data.batches`: this old path is that module."""

import sys

from hvdtrain.data import batches as _module

sys.modules[__name__] = _module
