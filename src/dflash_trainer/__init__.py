"""dflash-trainer: train DFlash block-diffusion drafters for a frozen target LLM."""

__version__ = "0.1.0"
