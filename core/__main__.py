"""``python -m hookllm``: the ``hookllm`` command."""

import sys

from hookllm.cli import main

sys.exit(main())
