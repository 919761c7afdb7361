"""strata.engine: reads only the flat indexes (never gguf, never json; tests/test_layering.py enforces it)."""
