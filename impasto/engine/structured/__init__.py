"""Structured outputs: constraints compiled to grammars (`grammar.py`) and the per-request
matchers that turn them into token masks step by step (`manager.py`)."""
