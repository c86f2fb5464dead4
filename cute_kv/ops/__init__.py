"""Torch entry points. Importing the package registers the ``torch.ops.cute_kv`` custom ops (``library.py``) that
the cache-writing entry points call."""

from cute_kv.ops import library  # noqa: F401
