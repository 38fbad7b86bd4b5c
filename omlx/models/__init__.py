"""Model discovery, loading through mlx-lm, GGUF import and the built-in model."""
