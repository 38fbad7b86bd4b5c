"""Embedding and rerank models: folder spec, MLX encoder, batching engine, built-in model."""
