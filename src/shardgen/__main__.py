"""``python -m shardgen ...``: the ``shardgen`` command (also ``torchrun ... -m shardgen run ...``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
