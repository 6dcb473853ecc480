"""kimik3: train Kimi-style hybrid KDA + MLA + MoE language models with one Hydra command."""

__version__ = "0.1.0"
