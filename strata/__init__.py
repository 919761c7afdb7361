"""Strata: huge MoE GGUF models on one machine.

The code lives in three rooms with one-way doors, each its own top-level folder:
`tools/` (strata.tools) -> `engine/` (strata.engine) -> `index_format/` (strata.index_format).
"""

__version__ = "0.1.0"
