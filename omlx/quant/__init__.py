"""oQ: data-driven mixed-precision quantization into plain mlx-lm model folders.

levels / planner / names / estimate are pure; sensitivity / quality / job use
MLX; tasks runs jobs in child processes (worker) for the server.
"""
