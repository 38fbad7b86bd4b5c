"""Model engines, the MLX worker thread, the batched runner and output streams."""
