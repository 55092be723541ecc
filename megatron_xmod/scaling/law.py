"""The matched-FLOPs residual law and its readouts (Eq.12, 13, 20-23; Eq.31, 37) of the X-MoD paper,
"X-MoD: Practical Scaling Laws for Sparse-Depth Routing Beyond Mixture-of-Depths" (arXiv:2609.34212).

    Delta = e - u R_N + v P_D + w P_L - z R_AK                                  (Eq.22)
    R_N  = N_act^-eta_N [1 - (N/N_act)^-rho_N]                                  (Eq.12)
    P_L  = L^-eta_L [K^rho_L - 1]               (Eq.13 with L_s = L/K)
    P_D  = D_dense^-eta_D [((D_sparse/K)/D_dense)^-rho_D - 1]                   (Eq.23)
    R_AK = (K^rho_K - 1) [omega(A)^rho_A - 1],  omega(A) = 2A/(A+1)             (Eq.19-20)

The paper's practical law (Eq.21) is this with v = 0. Units: N_act and N in parameters, L and D in
tokens; the fitted u, w, v absorb them. Two conventions the paper leaves implicit, fixed here; with
them Table 8 gives Eq.(21)'s own optima K^ = 3, 5, 9, 14, 21, 32 for L = 2k..64k at 556M:

- N/N_act is the capacity ratio of Eq.(4)/(5), i.e. of the transformer layer stack, so embeddings are
  left out of both (they would otherwise dilute the ratio at small backbones);
- the prefactor N_act^-eta_N takes the backbone's activated parameter count as the user states it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

EXPONENTS = ("eta_N", "rho_N", "eta_L", "rho_L", "eta_D", "rho_D", "rho_K", "rho_A")
LINEAR = ("e", "u", "v", "w", "z")


@dataclass(frozen=True)
class LawParams:
    e: float
    u: float
    eta_N: float
    rho_N: float
    w: float
    eta_L: float
    rho_L: float
    z: float
    rho_K: float
    rho_A: float
    # The exposure term of Eq.(22)-(23); v = 0 is the practical law. The paper never reported
    # eta_D/rho_D, so with v = 0 they are placeholders that do not change any prediction.
    v: float = 0.0
    eta_D: float = 0.5
    rho_D: float = 0.5

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> LawParams:
        return replace(self, **changes)


# Table 8 of the X-MoD paper: the shipped default.
TABLE8 = LawParams(e=0.01848, u=0.93519, eta_N=0.07784, rho_N=1.19538, w=105.21108, eta_L=0.92624,
                   rho_L=0.48494, z=0.07455, rho_K=0.79900, rho_A=0.28293)


def omega(A):
    """Eq.(19): the sparse share of the activated path, normalised to A = 1 (1 at A = 1, -> 2 as A -> inf)."""
    A = np.asarray(A, dtype=float)
    return 2 * A / (A + 1)


def capacity_reward(n_act, capacity_ratio, eta_N, rho_N):
    return np.asarray(n_act, float) ** -eta_N * (1 - np.asarray(capacity_ratio, float) ** -rho_N)


def context_penalty(L, K, eta_L, rho_L):
    return np.asarray(L, float) ** -eta_L * (np.asarray(K, float) ** rho_L - 1)


def exposure_penalty(K, d_sparse, d_dense, eta_D, rho_D):
    d_dense = np.asarray(d_dense, float)
    exposure = np.asarray(d_sparse, float) / np.asarray(K, float) / d_dense  # Eq.(27)
    return d_dense ** -eta_D * (exposure ** -rho_D - 1)


def anchor_interaction(K, A, rho_K, rho_A):
    return (np.asarray(K, float) ** rho_K - 1) * (omega(A) ** rho_A - 1)


def features(p: LawParams, n_act, capacity_ratio, L, K, A, d_sparse=None, d_dense=None) -> np.ndarray:
    """Columns [-R_N, P_D, P_L, -R_AK], signed so that every linear coefficient (u, v, w, z) is >= 0."""
    K = np.asarray(K, float)
    cols = [
        -capacity_reward(n_act, capacity_ratio, p.eta_N, p.rho_N),
        np.zeros_like(K) if d_sparse is None else exposure_penalty(K, d_sparse, d_dense, p.eta_D, p.rho_D),
        context_penalty(L, K, p.eta_L, p.rho_L),
        -anchor_interaction(K, A, p.rho_K, p.rho_A),
    ]
    return np.stack([np.broadcast_to(c, np.broadcast(*cols).shape) for c in cols], axis=-1)


def predict_delta(p: LawParams, n_act, capacity_ratio, L, K, A=1.0, d_sparse=None, d_dense=None):
    """Eq.(22) (Eq.(21) when p.v == 0): the loss change against the FLOP-matched dense model."""
    if p.v != 0 and d_sparse is None:
        raise ValueError("tokens: the full law (v > 0) needs the tokens seen by the sparse and dense runs")
    X = features(p, n_act, capacity_ratio, L, K, A, d_sparse, d_dense)
    return p.e + X @ np.array([p.u, p.v, p.w, p.z])


def predict_loss(p: LawParams, dense_loss, n_act, capacity_ratio, L, K, A=1.0, d_sparse=None, d_dense=None):
    """Eq.(37): raw loss = matched dense reference + predicted residual."""
    return np.asarray(dense_loss, float) + predict_delta(p, n_act, capacity_ratio, L, K, A, d_sparse, d_dense)


def asymptotic_exponents(p: LawParams) -> dict:
    """Eq.(31): K^ ~ L^(eta_L/(rho_N+rho_L)) N_act^(-eta_N/(rho_N+rho_L)), from the large-K limit at A = 1."""
    s = p.rho_N + p.rho_L
    return {"L": p.eta_L / s, "N_act": -p.eta_N / s}
