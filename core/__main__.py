"""``python -m hookllm``: the ``hookllm`` command."""

import sys

from hookllm.entrypoints.cli import main

sys.exit(main())
