"""Run Megatron-LM's own ``pretrain_gpt.py`` (tag core_v0.19.0) exactly as it is, on CPU.

    torchrun --nproc_per_node=2 tests/run_megatron_lm.py [pretrain_gpt.py arguments]

The only things done before handing over: the plugin's CPU compatibility layer
(``megatron_xmod.cpu_shim.cpu_patches``, a no-op on a GPU machine), skipping the dataset
helpers' ``make`` (the pip wheel ships them built), and putting Megatron-LM's folder (for its
``gpt_builders`` / ``model_provider`` imports) and tests/ (for ``--spec spec_models ...``) on the path.
``MEGATRON_LM_DIR`` points at another checkout; by default ``../shared/reference/`` beside this
checkout, or beside the main checkout when this one is a git worktree elsewhere.
"""
import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REFERENCE = "shared/reference/megatron-lm-core_v0.19.0"


def _default_megatron_lm_dir() -> Path:
    """``../shared/reference/...`` of this checkout, else of the main checkout of a git worktree (its
    ``.git`` file reads ``gitdir: <main>/.git/worktrees/<name>``)."""
    checkout = HERE.parent
    candidates = [checkout.parent / REFERENCE]
    git = checkout / ".git"
    if git.is_file() and git.read_text().startswith("gitdir:"):
        gitdir = (checkout / git.read_text().split(":", 1)[1].strip()).resolve()
        if gitdir.parent.name == "worktrees":
            candidates.append(gitdir.parents[2].parent / REFERENCE)
    return next((path for path in candidates if (path / "pretrain_gpt.py").is_file()), candidates[0])


MEGATRON_LM_DIR = Path(os.environ.get("MEGATRON_LM_DIR") or _default_megatron_lm_dir())


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
