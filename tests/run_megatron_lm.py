"""Run Megatron-LM's own ``pretrain_gpt.py`` (tag core_v0.19.0) exactly as it is, on CPU.

    torchrun --nproc_per_node=2 tests/run_megatron_lm.py [pretrain_gpt.py arguments]

The only things done before handing over: the plugin's CPU compatibility layer
(``megatron_xmod.cpu_shim.cpu_patches``, a no-op on a GPU machine), skipping the dataset
helpers' ``make`` (the pip wheel ships them built), and putting Megatron-LM's folder (for its
``gpt_builders`` / ``model_provider`` imports) and tests/ (for ``--spec spec_models ...``) on the path.
``MEGATRON_LM_DIR`` points at another checkout.
"""
import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MEGATRON_LM_DIR = Path(os.environ.get("MEGATRON_LM_DIR", HERE.parents[1] / "shared/reference/megatron-lm-core_v0.19.0"))


def main() -> None:
    from megatron_xmod.cpu_shim import cpu_patches
    from megatron_xmod.training import patches

    script = MEGATRON_LM_DIR / "pretrain_gpt.py"
    if not script.is_file():
        sys.exit(f"run_megatron_lm: no pretrain_gpt.py in {MEGATRON_LM_DIR}; set MEGATRON_LM_DIR to a Megatron-LM checkout")
    sys.path[:0] = [str(MEGATRON_LM_DIR), str(HERE)]
    sys.argv = [str(script)] + sys.argv[1:]
    with cpu_patches(training=True):
        patches.skip_dataset_helper_build()
        runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
