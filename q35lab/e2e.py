"""``python -m q35lab.e2e``: whole training steps, measured. The harness is ``q35lab.bench.e2e``;
this is the name the command line and notebook 06 use (``from q35lab import e2e``): its public
names, and ``main``."""

import sys

from .bench.e2e import *  # noqa: F401,F403
from .bench.e2e import __all__, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
