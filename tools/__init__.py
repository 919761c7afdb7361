"""strata.tools: owns ALL GGUF and JSON parsing; writes the flat indexes the engine reads."""
