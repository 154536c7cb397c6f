"""disagg: an OpenAI-compatible orchestrator for disaggregated (prefill/decode) LLM serving."""

__version__ = "0.1.0"
