"""tide: a compact LLM inference engine for reinforcement-learning rollouts."""

from tide.engine import Engine
from tide.sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams"]
__version__ = "0.1.0"
