"""`dflash-mlx serve`: the HTTP API (app), its request bodies (schemas), the generation worker
(scheduler), the kept prompt caches (pool), metrics; reasoning and tool calls are split by ../channels.py."""
