"""memwise: reverse-mode differentiation in JAX that fits in memory."""

from memwise import knobs, measure, ntk, ot, schedule
from memwise._reversible import DriftLog
from memwise._while import while_loop
from memwise.accumulate import accumulate_grad
from memwise.attention import attention, stripe, unstripe
from memwise.chunked import chunked_map, chunked_sum
from memwise.cross_entropy import linear_cross_entropy
from memwise.fit import MemoryBudgetError, fit, region
from memwise.linearize import Linearized, TaylorExpanded, linearize, taylor_expand
from memwise.measure import MemoryReport, Residual, memory_report
from memwise.pairwise import pairwise_reduce
from memwise.scan import scan
from memwise.sdpa import dot_product_attention, flax_attention_fn

__version__ = "0.3.0.dev0"

__all__ = [
    "DriftLog",
    "Linearized",
    "MemoryBudgetError",
    "MemoryReport",
    "Residual",
    "TaylorExpanded",
    "accumulate_grad",
    "attention",
    "chunked_map",
    "chunked_sum",
    "dot_product_attention",
    "fit",
    "flax_attention_fn",
    "knobs",
    "linear_cross_entropy",
    "linearize",
    "measure",
    "memory_report",
    "ntk",
    "ot",
    "pairwise_reduce",
    "region",
    "scan",
    "schedule",
    "stripe",
    "taylor_expand",
    "unstripe",
    "while_loop",
]
