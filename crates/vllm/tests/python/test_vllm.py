"""HandoffConnector in real vLLM (CPU): P prefills, D pulls the KV and decodes; the output equals
a single engine's."""

from __future__ import annotations

import random

from conftest import BLOCK_SIZE, CORRUPT_FILE, MAX_MODEL_LEN, REPORT


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def disaggregated(cluster, ids: list[int], max_tokens: int) -> tuple[dict, dict]:
    """P with do_remote_decode (max_tokens 1, not streamed), then D with P's params."""
    p = cluster["p"].complete(ids, 1, kv_transfer_params={"do_remote_decode": True})
    params = p.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill") and params.get("handoff_id"), p
    d = cluster["d"].complete(ids, max_tokens, kv_transfer_params=params)
    return params, d


def test_decode_from_pulled_kv_equals_a_single_engine(cluster):
    lengths = [1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 17, MAX_MODEL_LEN - 16]
    mismatches = []
    for i, n in enumerate(lengths):
        ids = prompt(n, seed=i)
        params, d = disaggregated(cluster, ids, max_tokens=8)
        single = cluster["single"].complete(ids, 8)
        d_ids = d["choices"][0]["token_ids"]
        s_ids = single["choices"][0]["token_ids"]
        if d_ids != s_ids:
            mismatches.append(f"prompt of {n} tokens: D {d_ids} vs single {s_ids}")
    REPORT["prompts_compared"] = len(lengths)
    REPORT["output_mismatches"] = len(mismatches)
    assert not mismatches, mismatches


def test_negative_control_a_damaged_block_changes_the_output(cluster):
    """The comparison above has power: with part of a landed block overwritten on D (test-only
    switch), D's output is no longer the single engine's."""
    ids = prompt(3 * BLOCK_SIZE, seed=99)
    single = cluster["single"].complete(ids, 8)["choices"][0]["token_ids"]
    CORRUPT_FILE.touch()
    try:
        _, d = disaggregated(cluster, ids, max_tokens=8)
    finally:
        CORRUPT_FILE.unlink()
    detected = d["choices"][0]["token_ids"] != single
    REPORT["negative_control_detected"] = detected
    assert detected, "damaged KV blocks went unnoticed"
    # Without the switch the same prompt decodes like the single engine again.
    _, d = disaggregated(cluster, ids, max_tokens=8)
    assert d["choices"][0]["token_ids"] == single
