"""Crucible: simulate pipelined, SparseLoCo-synchronised LLM training under stage failures."""
__version__ = "0.1.0"
