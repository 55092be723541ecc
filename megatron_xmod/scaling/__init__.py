"""The practical scaling law (Eq.10-31, 37-39) of the X-MoD paper: evaluate, plan K and A, refit.

X-MoD paper: "X-MoD: Practical Scaling Laws for Sparse-Depth Routing Beyond Mixture-of-Depths",
arXiv:2609.34212.
"""
from megatron_xmod.scaling.law import TABLE8, LawParams, asymptotic_exponents, omega, predict_delta, predict_loss

__all__ = ["TABLE8", "LawParams", "asymptotic_exponents", "omega", "predict_delta", "predict_loss"]
