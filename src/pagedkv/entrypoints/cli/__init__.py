"""The ``pagedkv`` command: `main.build_parser` / `main.main`, one module per subcommand.

    main.py      build_parser, main (the console script ``pagedkv``)
    common.py    CLIError, read_model_config: what every subcommand shares
    plan.py      pagedkv plan          generate.py  pagedkv generate      chat.py  pagedkv chat
    bench.py     pagedkv bench         serve.py     pagedkv serve         proxy.py pagedkv proxy
    router.py    pagedkv router        events.py    pagedkv events
    (``pagedkv simulate`` is `pagedkv.sim.cli`)

``python -m pagedkv.entrypoints.cli ...`` runs the command (``__main__.py``). The top of the
house: every other package of pagedkv sits below it and never imports it.
"""

from pagedkv.entrypoints.cli.common import CLIError, read_model_config
from pagedkv.entrypoints.cli.main import build_parser, main

__all__ = ["CLIError", "build_parser", "main", "read_model_config"]
