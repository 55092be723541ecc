"""megatron_xmod: sparse-depth routed transformers (X-MoD, MoD) as megatron-core layer specs.

Requirements here are ranges on purpose: users bring their own torch/megatron-core (NGC containers).
The exact versions this repository is tested with live in requirements/constraints.txt.
"""
from setuptools import find_packages, setup

setup(
    name="megatron_xmod",
    version="0.1.0",
    description="X-MoD / MoD sparse-depth routing and DTop-p MoE for megatron-core",
    packages=find_packages(include=["megatron_xmod", "megatron_xmod.*"]),
    python_requires=">=3.12",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.19.2,<0.20",
        "numpy>=1.26",
    ],
    extras_require={
        "train": ["tensorboard>=2.15", "tqdm>=4.66", "sentencepiece>=0.2", "matplotlib>=3.8",
                  "emerging-optimizers>=0.3", "psutil>=5.9"],
        "export": ["transformers>=4.45", "safetensors>=0.4"],
        "scaling": ["scipy>=1.11", "matplotlib>=3.8"],
        "test": ["pytest>=8"],
    },
    entry_points={"console_scripts": ["xmod=megatron_xmod.cli:main"]},
)
