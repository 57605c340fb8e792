"""The shapewise version (part of every content key)."""

__version__ = "0.1.0"
