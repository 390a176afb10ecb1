"""``python -m trainmesh.ps ...``: run one parameter server (see ``serve.py``)."""

import sys

from .serve import main

sys.exit(main())
