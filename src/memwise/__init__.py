"""memwise: reverse-mode differentiation in JAX that fits in memory."""

from memwise import knobs, measure
from memwise.measure import MemoryReport, Residual, memory_report
