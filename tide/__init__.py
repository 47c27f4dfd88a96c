"""tide: a compact LLM inference engine for reinforcement-learning rollouts."""

from tide.engine import Engine
from tide.sampling_params import SamplingParams
from tide.version import __version__

__all__ = ["Engine", "SamplingParams", "__version__"]
