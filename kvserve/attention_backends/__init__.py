"""Attention backends: the per-step metadata builder and the attention forward (base.py)."""

from kvserve.attention_backends.base import AttentionBackend, ScheduledSeq, backend_name_for, make_backend

__all__ = ["AttentionBackend", "ScheduledSeq", "backend_name_for", "make_backend"]
