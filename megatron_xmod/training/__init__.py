"""Everything that touches megatron's training loop, apart from the X-MoD core at the package root.

- :mod:`~megatron_xmod.training.flags`: the ``--xmod-*`` flags and the preset expansion;
- :mod:`~megatron_xmod.training.providers`: config, model chunks and datasets for ``pretrain``;
- :mod:`~megatron_xmod.training.step`: forward step and loss;
- :mod:`~megatron_xmod.training.log`: routing and compute scalars after megatron's log;
- :mod:`~megatron_xmod.training.patches`: every change to megatron, numbered, with the line it targets;
- :mod:`~megatron_xmod.training.hooks`: the one object naming what is handed to ``pretrain``.

The entry point that ties them together is :mod:`megatron_xmod.training.pretrain`.
"""
