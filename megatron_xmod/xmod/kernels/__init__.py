"""Fused kernels of the routed layers (Triton, with the plain-torch path as reference).

:func:`routing_step` is the training routing step of a sparse layer; see
:mod:`megatron_xmod.xmod.kernels.routing_step`.
"""
from megatron_xmod.xmod.kernels.routing_step import BACKENDS, ENV_BACKEND, RoutingStep, launch_counts, routing_step

__all__ = ["routing_step", "RoutingStep", "launch_counts", "BACKENDS", "ENV_BACKEND"]
