"""Test support: tiny transformers checkpoints and llama.cpp's own converter as the reference.

Not part of the installed package. Needs torch and transformers (test extra); the converter
source is fetched from the llama-cpp-python sdist on first use (see convert.py).
Import it as `reference` from test modules (pytest puts tests/ on sys.path in its default
import mode, with or without `python -m`), or as `tests.reference` from the repository root.
"""
