"""Tests against the real vLLM engine (its CPU build); see conftest.py. A package, so that its conftest is imported
as real_vllm.conftest and does not replace tests/conftest.py as `conftest` (which 40-odd test files import from)."""
