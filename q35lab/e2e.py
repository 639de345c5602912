"""``python -m q35lab.e2e``: whole training steps, measured — the harness in ``q35lab.bench.e2e``,
under the name the command line, notebook 06 and the tests use (``from q35lab import e2e``)."""

import sys

from .bench.e2e import *  # noqa: F401,F403
from .bench.e2e import __all__, _axolotl_patches, _longest_asked, _one_variant, _parser, _sizes, _Stamp, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
