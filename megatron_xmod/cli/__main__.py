"""``python -m megatron_xmod.cli``: the ``xmod`` command."""
import sys

from megatron_xmod.cli import main

sys.exit(main())
