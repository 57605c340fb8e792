"""The pass framework: ``Pass`` (frozen dataclasses whose specs parse back), ``Pipeline``,
``Instrument`` (``PrintAfter``, ``Timing``), the registry, and the graph-level passes
(``GraphPass``, ``InductorPass``: passes too, one level down). The stages live above it
(``graph_split``, ``concretize``, ``rewrite``, ``lower``, ``dispatch``), the built-in passes
further up (``shapewise.library``); the IR below it (``shapewise.ir``)."""

from shapewise.passes.base import (
    Instrument,
    Pass,
    PassRecord,
    Pipeline,
    PrintAfter,
    Timing,
    parse_spec,
    register_pass,
    register_runnable,
    registered_passes,
    source_hash,
)
from shapewise.passes.graph_pass import GraphPass, InductorPass, PassResult, Sizes, VariantSizes

__all__ = ["GraphPass", "InductorPass", "Instrument", "Pass", "PassRecord", "PassResult", "Pipeline", "PrintAfter",
           "Sizes", "Timing", "VariantSizes", "parse_spec", "register_pass", "register_runnable", "registered_passes",
           "source_hash"]
