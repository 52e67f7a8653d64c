"""The package version (one place; files written by kvpress record it)."""

__version__ = "0.1.0"
