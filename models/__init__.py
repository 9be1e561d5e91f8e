"""MLX model ports: the DFlash drafter and the target adapters (imported as dflash_mlx.models)."""
