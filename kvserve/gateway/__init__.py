"""`kvserve gateway`: one OpenAI-compatible endpoint over many backends (HTTP only; never imports
the engine)."""
