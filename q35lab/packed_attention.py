"""Moved to ``q35lab.patch.attention`` (the attention feature of the patch); this alias warns once."""

import warnings

from .patch.attention import *  # noqa: F401,F403
from .patch.attention import NAME, describe, register, varlen_attention_function  # noqa: F401

warnings.warn("q35lab.packed_attention moved to q35lab.patch.attention", DeprecationWarning, stacklevel=2)
