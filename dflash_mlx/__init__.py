"""dflash-mlx: DFlash block-diffusion speculative decoding for MLX."""

from importlib import import_module as _import_module

# The Linux CPU fast path has to run before anything imports mlx.core (see platform.py).
from .platform import preload_blas

preload_blas()

# The public names load their modules (MLX, mlx-lm) when first used, so that the command line starts
# at once and a Ctrl-C while those load ends it quietly (cli/__init__.py).
_HOMES = {
    "DFlashConfig": "models.dflash",
    "DFlashDraftModel": "models.dflash",
    "GenerationResponse": "speculative",
    "GenerationResult": "speculative",
    "SUPPORTED_FAMILIES": "models.targets",
    "SpeculativeCache": "cache",
    "Target": "models.targets",
    "UserError": "errors",
    "apply_chat_template": "chat",
    "generate": "speculative",
    "load": "loading",
    "load_draft": "loading",
    "load_pair": "loading",
    "stream_generate": "speculative",
    "warm_up": "policy",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name == "__version__":  # (read from the installed package's metadata: one place for it)
        from importlib.metadata import version

        return version("dflash-mlx")
    if name not in _HOMES:
        raise AttributeError(f"module 'dflash_mlx' has no attribute {name!r}")
    value = getattr(_import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})
