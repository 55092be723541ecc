import sys

from megatron_xmod.hf.eval_tasks import main

sys.exit(main())
