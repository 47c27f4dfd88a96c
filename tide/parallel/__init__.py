"""Tensor parallelism on one host: the rank group the layers reduce over (`TpGroup`), and the
rank processes behind the scheduler's worker interface (`tide.parallel.tp_worker`)."""

from tide.parallel.group import TpGroup, current_tp, tp_context

__all__ = ["TpGroup", "current_tp", "tp_context"]
