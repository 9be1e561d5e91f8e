"""`dflash-mlx serve`: the HTTP API (app), its request bodies (schemas), the generation worker
(scheduler), the kept prompt caches (pool), reasoning and tool-call splitting (channels), metrics."""
