"""Caches keyed by media content hash."""
