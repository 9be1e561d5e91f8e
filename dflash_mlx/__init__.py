"""dflash-mlx: DFlash block-diffusion speculative decoding for MLX."""

# The Linux CPU fast path has to run before anything imports mlx.core (see platform.py).
from .platform import preload_blas

preload_blas()

from .cache import SpeculativeCache  # noqa: E402
from .chat import apply_chat_template  # noqa: E402
from .errors import UserError  # noqa: E402
from .loading import load, load_draft, load_pair  # noqa: E402
from .models.dflash import DFlashConfig, DFlashDraftModel  # noqa: E402
from .models.targets import SUPPORTED_FAMILIES, Target  # noqa: E402
from .policy import warm_up  # noqa: E402
from .speculative import GenerationResponse, GenerationResult, generate, stream_generate  # noqa: E402

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "GenerationResponse",
    "GenerationResult",
    "SUPPORTED_FAMILIES",
    "SpeculativeCache",
    "Target",
    "UserError",
    "apply_chat_template",
    "generate",
    "load",
    "load_draft",
    "load_pair",
    "stream_generate",
    "warm_up",
]
