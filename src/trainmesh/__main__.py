"""``python -m trainmesh ...`` is the same as the ``trainmesh`` console script."""

import sys

from trainmesh.launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
