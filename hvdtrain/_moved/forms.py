"""Moved to `hvdtrain.data.forms`: this old path is that module."""

import sys

from hvdtrain.data import forms as _module

sys.modules[__name__] = _module
