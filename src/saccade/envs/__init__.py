"""Environments: single- and multi-turn episodes over OpenAI-format messages (see `base`),
run token-in/token-out against an engine (`rollout`, `trajectory`)."""

from saccade.envs.base import Environment, SingleTurnEnv, StepResult

__all__ = ["Environment", "SingleTurnEnv", "StepResult"]
