"""``python -m shardgen ...``: the ``shardgen`` command (also ``torchrun ... -m shardgen run ...``)."""

import sys

from shardgen.cli.command import main

if __name__ == "__main__":
    sys.exit(main())
