"""``python -m pagedkv.entrypoints.cli ...``: the ``pagedkv`` command (tests and benchmarks start
servers this way, without relying on the console script being installed)."""

import sys

from pagedkv.entrypoints.cli.main import main

sys.exit(main())
