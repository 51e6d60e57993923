"""``python -m amp_patch``: the same as the ``amp-patch`` command."""

import sys

from amp_patch.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
