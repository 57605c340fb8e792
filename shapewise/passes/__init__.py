"""The pass framework: ``Pass`` (frozen dataclasses whose specs parse back), ``Pipeline``,
``Instrument`` (``PrintAfter``, ``Timing``), the registry. The stages live above it
(``graph_split``, ``concretize``, ``lower``, ``dispatch``); the IR below it (``shapewise.ir``)."""

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
)
from shapewise.passes.decode_gemv import DecodeGemv
from shapewise.passes.graph_pass import GraphPass, InductorPass, Sizes, VariantSizes
from shapewise.passes.overlap import OverlapAllReduce

__all__ = ["DecodeGemv", "GraphPass", "InductorPass", "Instrument", "OverlapAllReduce", "Pass", "PassRecord",
           "Pipeline", "PrintAfter", "Sizes", "Timing", "VariantSizes", "parse_spec", "register_pass",
           "register_runnable"]
