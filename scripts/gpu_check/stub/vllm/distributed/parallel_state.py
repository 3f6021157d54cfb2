"""The tensor-parallel rank the next register_kv_caches runs as (a vLLM worker process knows
its own; the check holds several ranks in one process and sets it before each)."""

RANK = 0


def get_tensor_model_parallel_rank() -> int:
    return RANK
