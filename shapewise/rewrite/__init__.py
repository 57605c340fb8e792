"""Rewrite: user graph passes per (compute piece, variant), gated by the variant's sizes."""

from shapewise.rewrite.rewrite import Rewrite, variant_sizes

__all__ = ["Rewrite", "variant_sizes"]
