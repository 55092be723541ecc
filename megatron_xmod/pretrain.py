"""``python -m megatron_xmod.pretrain``: the entry point users launch; it lives in :mod:`megatron_xmod.training.pretrain`."""
from megatron_xmod.training.pretrain import main, run  # noqa: F401

if __name__ == "__main__":
    run()
