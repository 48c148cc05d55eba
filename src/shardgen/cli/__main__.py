"""``python -m shardgen.cli ...``: the ``shardgen`` command, as before the cli became a package."""

import sys

from shardgen.cli.command import main

if __name__ == "__main__":
    sys.exit(main())
