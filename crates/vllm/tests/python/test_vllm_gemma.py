"""A real sliding-window model in real vLLM (CPU): Gemma 3 270M (``scripts/fetch-model gemma3``:
18 layers, a window of 512 tokens in five of every six, one KV head), on prompts three to five
times longer than the window. Pull behind vllm-router, push behind handoff's proxy, and pull
between engines of different TP sizes (2 to 1 and 1 to 2: the one KV head is replicated on every
rank, so a page of P at TP 2 is byte for byte a page of D at TP 1, read once from P's first
rank; each D rank gets its own copy). Every answer equals one engine's, and D's KV digest
matched P's for each handoff.

handoff declares ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on with it (the
tests assert vLLM did not turn it off): each KV cache group has its own blocks, and a handoff
moves every block of the three full-attention layers and only the window's last blocks of the
fifteen sliding ones. The report's ``gemma`` puts the bytes moved beside what every block of
every layer would be (the manager off)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import (IN_PROCESS, REPORT, Server, completion_via, connector, disaggregated,
                      free_port, handoff_proxy, matched_digests, prompt, router, serving)

HERE = Path(__file__).resolve().parent
GEMMA = (Path(os.environ.get("HANDOFF_VLLM_GEMMA", HERE.parents[3] / ".model-gemma3")), "gemma3")


def host_has_fast_bf16() -> bool:
    """Whether this CPU computes bfloat16 in hardware (AVX512-BF16 or AMX): without it PyTorch
    emulates it, five times slower than float32 (an AVX2 host took 64 s to prefill 2,600 tokens
    in bfloat16, 13 s in float32, longer than D's 30 s push watchdog)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# The model's window is 512 tokens; the longest prompt plus the answer must fit. bfloat16 (the
# checkpoint's dtype) where the CPU computes it, else float32; 256 blocks of 128 tokens (below)
# and at most 8 sequences: 4.7 GB of memory a server at its peak in bfloat16 instead of 6.8
# (float32, 1 GiB of KV): three at that beside the session's SmolLM2 engine ran the 23 GiB CI
# host out of memory. In float32 (its KV 384 MiB) at most three Gemma servers run at once, as in
# bfloat16.
DTYPE, DTYPE_BYTES = ("bfloat16", 2) if host_has_fast_bf16() else ("float32", 4)
ARGS = ["--max-model-len", "4096", "--dtype", DTYPE, "--max-num-seqs", "8"]
# A block of the hybrid manager holds one layer of each of its six groups (three layers a
# group): it needs more of them for one 4,096-token request than blocks of all 18 layers.
BLOCKS = "256"
# Token ids drawn below 4,000 (of Gemma's 262,144): a prompt the model reads as text.
# A prompt goes to one D once: a second time D's prefix cache holds its blocks (no handoff).
LONG = prompt(2600, seed=2600)
ROUTED = [prompt(1600, seed=1600), LONG]
TP_2_TO_1, TP_1_TO_2 = prompt(1600, seed=1601), prompt(1700, seed=1701)
PROMPTS = ROUTED + [TP_2_TO_1, TP_1_TO_2]
ANSWER_TOKENS = 6


def gemma(name: str, conn: dict | None, tp: int = 1, **kw) -> Server:
    return Server(name, conn, real_model=GEMMA,
                  extra_args=ARGS + ["--num-gpu-blocks-override", BLOCKS,
                                     "--tensor-parallel-size", str(tp)] + kw.pop("args", []),
                  **kw)


def tokens(answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def pull():
    """P and D (pull, TP 1) for the module, and, started beside them and stopped once asked,
    the single engine (no connector): its greedy tokens for each prompt are what every answer
    below is compared against. Three Gemma servers at once at most (~5 GB each at their peak)
    beside the session's SmolLM2 engine: later tests stop what they no longer need."""
    assert (GEMMA[0] / "config.json").exists(), \
        f"no Gemma 3 at {GEMMA[0]}: run scripts/fetch-model gemma3"
    servers = {
        # Its engine core in the API server's process: one Python start fewer (conftest's
        # start_single); it only computes the reference answers.
        "single": gemma("gemma-single", None, env_extra=IN_PROCESS),
        # P is D too in the TP test (its connector takes both roles): it logs its digests.
        "p": gemma("gemma-p", connector("gemma-p", kv_digest=True),
                   env_extra={"RUST_LOG": "info,handoff_core::machine::transfers=debug"}),
        # D's /metrics carries handoff's (HandoffOps): the bytes each handoff moved.
        "d": gemma("gemma-d", connector("gemma-d", kv_digest=True),
                   args=["--middleware", "handoff_vllm.HandoffOps"],
                   env_extra={"RUST_LOG": "info,handoff_core::machine::transfers=debug"}),
    }
    with serving(servers, warm=True):
        one = servers["single"]
        answers = {tuple(ids): tokens(one.complete(ids, ANSWER_TOKENS)) for ids in PROMPTS}
        servers.pop("single").stop()
        yield dict(servers, answers=answers)


def hma_off(server: Server) -> bool:
    return "Turning off hybrid kv cache manager" in server.log_path.read_text(errors="replace")


def report(**facts) -> None:
    REPORT.setdefault("gemma", {}).update(facts)


# Gemma 3 270M's KV: 18 layers (15 of them sliding), one KV head of 256 values, in DTYPE,
# vLLM's CPU blocks of 128 tokens.
LAYERS, SLIDING, HEAD_DIM, WINDOW, BLOCK = 18, 15, 256, 512, 128
PAGE_BYTES = 2 * BLOCK * HEAD_DIM * DTYPE_BYTES  # K and V of one block of one layer


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_pull_behind_vllm_router_answers_like_one_engine(pull):
    """A client's completions through vllm-router (P/D mode) in front of handoff's P and D:
    D decodes from P's KV (one matched digest per request) and answers what one engine does.
    vLLM's hybrid manager stays on in both; a handoff moves the full layers' every block and
    the sliding layers' blocks from the one holding token n - 512 (what the prompt's last
    token, computed again on D, attends back to): the bytes per handoff are exactly that, and
    the report puts them beside every block of every layer."""
    assert not hma_off(pull["p"]) and not hma_off(pull["d"]), \
        "vLLM turned its hybrid KV cache manager off"
    bytes_metric = "handoff_transfer_bytes_total"
    with router(pull["p"].url, pull["d"].url, "gemma") as url:
        for ids in ROUTED:
            matched, before = matched_digests(pull["d"]), pull["d"].metric(bytes_metric)
            got = completion_via(url, ids, ANSWER_TOKENS, GEMMA[1], timeout_s=300)
            assert got == pull["answers"][tuple(ids)], f"{len(ids)} tokens"
            assert matched_digests(pull["d"]) == matched + 1, "D computed the prompt itself"
            moved_bytes = pull["d"].metric(bytes_metric) - before
    # The last (longest) prompt's handoff.
    n = len(ROUTED[-1])
    every_block = cdiv(n, BLOCK) * LAYERS * PAGE_BYTES
    window_blocks = cdiv(n, BLOCK) - max(0, n - WINDOW) // BLOCK
    with_windows = (SLIDING * window_blocks + (LAYERS - SLIDING) * cdiv(n, BLOCK)) * PAGE_BYTES
    assert moved_bytes == with_windows, \
        f"{moved_bytes} bytes moved; the windows' blocks and every full layer's are {with_windows}"
    report(hybrid_kv_cache_manager=True, dtype=DTYPE,
           prompt_tokens=[len(ids) for ids in ROUTED], window=WINDOW,
           bytes_per_handoff={"prompt_tokens": n, "moved": moved_bytes,
                              "sliding_layers_share": round(SLIDING / LAYERS, 3),
                              "sliding_blocks_moved": window_blocks,
                              "every_block_of_every_layer": every_block,
                              "moved_vs_every_block": round(moved_bytes / every_block, 3)})


@pytest.fixture
def tp2(pull):
    """One engine at TP 2 (both roles: P for the engine at TP 1, then D for it), on the second
    core only, as on a host of its own (its two workers spin on vLLM's shared-memory queue after
    each step). The pull D is stopped first: the TP 1 engine here is the pull P, in both roles."""
    pull["d"].stop()
    with serving({"e": gemma("gemma-tp2", connector("gemma-tp2", kv_digest=True), tp=2,
                             cpus="1",
                             env_extra={"RUST_LOG": "info,handoff_core::machine::transfers=debug"}
                             )}, warm=True) as own:
        yield own["e"]


def test_pull_between_tp_2_and_tp_1_answers_like_one_engine(pull, tp2):
    """P at TP 2 to D at TP 1, then P at TP 1 to D at TP 2: the one KV head is on every rank;
    D reads it once per D rank and checks its digest against P's (each counts the head once)."""
    one = pull["p"]
    assert not hma_off(tp2), "vLLM turned its hybrid KV cache manager off at TP 2"
    matched = matched_digests(one)
    params, d = disaggregated({"p": tp2, "d": one}, TP_2_TO_1, ANSWER_TOKENS)
    assert params["tp_size"] == 2, params
    assert tokens(d) == pull["answers"][tuple(TP_2_TO_1)], "P at TP 2, D at TP 1"
    assert matched_digests(one) == matched + 1
    matched = matched_digests(tp2)
    params, d = disaggregated({"p": one, "d": tp2}, TP_1_TO_2, ANSWER_TOKENS)
    assert params["tp_size"] == 1, params
    assert tokens(d) == pull["answers"][tuple(TP_1_TO_2)], "P at TP 1, D at TP 2"
    assert matched_digests(tp2) == matched + 1
    report(tp_2_to_1=True, tp_1_to_2=True)


def test_push_behind_handoffs_proxy_answers_like_one_engine(pull):
    """A push pair behind `handoff proxy --mode push`: P writes each layer into D's blocks as
    its forward pass saves it, D answers what one engine does, its digest matched P's. The
    pull P is stopped first (memory)."""
    pull["p"].stop()
    side_port = free_port()
    servers = {
        "p": gemma("gemma-push-p", connector("gemma-push-p", mode="push", kv_digest=True,
                                             side_channel_port=side_port),
                   args=["--middleware", "handoff_vllm.HandoffInfo"]),
        "d": gemma("gemma-push-d", connector("gemma-push-d", mode="push", kv_digest=True),
                   env_extra={"RUST_LOG": "info,handoff_core::machine::push_digest=debug"}),
    }
    with serving(servers, warm=True), handoff_proxy("push", servers["p"], servers["d"]) as url:
        assert not any(hma_off(s) for s in servers.values()), \
            "vLLM turned its hybrid KV cache manager off"
        ids = LONG
        matched = matched_digests(servers["d"])
        got = completion_via(url, ids, ANSWER_TOKENS, GEMMA[1], timeout_s=300)
        assert got == pull["answers"][tuple(ids)]
        assert matched_digests(servers["d"]) == matched + 1, "D computed the prompt itself"
    report(push=True)
