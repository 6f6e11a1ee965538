"""saccade: reinforcement learning for vision-language models with a frozen, cached vision tower."""

__version__ = "0.1.0"
