"""The practical scaling law of X-MoD (seed 000, Eq.10-31, 37-39): evaluate, plan K and A, refit."""
from megatron_xmod.scaling.law import TABLE8, LawParams, asymptotic_exponents, omega, predict_delta, predict_loss

__all__ = ["TABLE8", "LawParams", "asymptotic_exponents", "omega", "predict_delta", "predict_loss"]
