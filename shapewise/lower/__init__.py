"""Lower: compile every variant with a backend (Inductor, aot_eager, eager or a callable),
dedupe identical pieces by content key, and keep Inductor artifacts in the on-disk cache."""

from shapewise.lower.cache import ArtifactCache, resolve_cache
from shapewise.lower.compile import lower_variant
from shapewise.lower.lower import BACKENDS, COMPILE_MODES, CompileSession, Lower, summary_line
from shapewise.lower.parallel import PendingVariant

__all__ = ["BACKENDS", "COMPILE_MODES", "ArtifactCache", "CompileSession", "Lower", "PendingVariant", "lower_variant",
           "resolve_cache", "summary_line"]
