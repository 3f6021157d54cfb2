"""Heads split over ranks in real vLLM (CPU): a tiny Llama (model/config.json: two layers, two
KV heads of 64 values) with weights drawn from a fixed seed (make_model.py), between engines of
TP 2 (one KV head a rank) and TP 1 (both heads). vLLM's CPU page of a block is one chunk per
head, its K and V rows as the attention kernel keeps them: handoff moves each head's chunk whole
from the P rank that holds it to the D rank that needs it. Pull from P at TP 2 to D at TP 1 and
from P at TP 1 to D at TP 2, prompts of one to several blocks, then push both ways behind
handoff's proxy: D's KV digest matched P's for every handoff (the heads arrived whole and in
place), and every answer equals one engine's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (IN_PROCESS, REPORT, Server, completion_via, connector, disaggregated,
                      free_port, handoff_proxy, matched_digests, prompt, serving)

HERE = Path(__file__).resolve().parent
# 64 blocks of vLLM's 128 tokens on the CPU (8,192 token slots, 16 MiB of this model's KV)
# instead of the 1 GiB every server reserves and touches otherwise.
ARGS = ["--num-gpu-blocks-override", "64"]
DEBUG = "info,handoff_core::machine::transfers=debug"
# A prompt goes to one D once (a second time D's prefix cache holds it): one set a direction.
# Lengths: inside one block, one block and one token, several blocks with a partial last one.
TP_2_TO_1 = [prompt(n, seed=900 + n) for n in (17, 129, 700)]
TP_1_TO_2 = [prompt(n, seed=950 + n) for n in (17, 129, 700)]
PUSH_2_TO_1 = [prompt(n, seed=800 + n) for n in (17, 700)]
PUSH_1_TO_2 = [prompt(n, seed=850 + n) for n in (17, 700)]
ANSWER_TOKENS = 6


def engine(ckpt: Path, name: str, conn: dict | None, tp: int = 1, **kw) -> Server:
    return Server(name, conn, real=False, tiny_model=ckpt,
                  extra_args=ARGS + ["--tensor-parallel-size", str(tp)] + kw.pop("args", []),
                  **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model-tp")
    subprocess.run([sys.executable, str(HERE / "make_model.py"), str(HERE / "model"),
                    str(path)], check=True, capture_output=True, timeout=300)
    return path


@pytest.fixture(scope="module")
def engines(ckpt):
    """An engine at TP 1 and one at TP 2, each in both roles (P for the other, then D for
    it), the TP 2 one on the second core only, as on a host of its own (its two workers spin on
    vLLM's shared-memory queue after each step); and, started beside them and stopped once
    asked, the single engine whose greedy tokens every answer is compared against."""
    servers = {
        "single": engine(ckpt, "tp-single", None, env_extra=IN_PROCESS),
        "tp1": engine(ckpt, "tp1", connector("tp1", kv_digest=True),
                      env_extra={"RUST_LOG": DEBUG}),
        "tp2": engine(ckpt, "tp2", connector("tp2", kv_digest=True), tp=2, cpus="1",
                      env_extra={"RUST_LOG": DEBUG}),
    }
    with serving(servers, warm=True):
        one = servers["single"]
        answers = {tuple(ids): tokens(one.complete(ids, ANSWER_TOKENS))
                   for ids in TP_2_TO_1 + TP_1_TO_2 + PUSH_2_TO_1 + PUSH_1_TO_2}
        servers.pop("single").stop()
        yield dict(servers, answers=answers, ckpt=ckpt)


def tokens(answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


def pull_all(engines: dict, p: str, d: str, prompts: list[list[int]]) -> dict[int, bool]:
    """Each prompt prefilled on P and decoded on D from P's KV: D's digest matched P's for
    each; what D answered against the single engine, by prompt length."""
    pair = {"p": engines[p], "d": engines[d]}
    same = {}
    for ids in prompts:
        matched = matched_digests(pair["d"])
        params, answer = disaggregated(pair, ids, ANSWER_TOKENS)
        assert params["tp_size"] == (2 if p == "tp2" else 1), params
        assert len(tokens(answer)) == ANSWER_TOKENS
        assert matched_digests(pair["d"]) == matched + 1, \
            f"{len(ids)} tokens: D did not check P's KV (computed it itself, or failed)"
        same[len(ids)] = tokens(answer) == engines["answers"][tuple(ids)]
    return same


def test_pull_from_p_at_tp_2_into_d_at_tp_1_lands_each_head_and_answers_like_one_engine(
        engines):
    same = pull_all(engines, "tp2", "tp1", TP_2_TO_1)
    REPORT.setdefault("tp_heads_split", {})["tp_2_to_1_same_answers"] = same
    assert all(same.values()), same


def test_pull_from_p_at_tp_1_into_d_at_tp_2_lands_each_head_and_answers_like_one_engine(
        engines):
    same = pull_all(engines, "tp1", "tp2", TP_1_TO_2)
    REPORT.setdefault("tp_heads_split", {})["tp_1_to_2_same_answers"] = same
    assert all(same.values()), same


@pytest.fixture
def push(engines):
    """A push engine at TP 1 and one at TP 2, each in both roles behind handoff's proxy (P's
    info from its HandoffInfo middleware); the pull engines are stopped first."""
    engines["tp1"].stop()
    engines["tp2"].stop()
    ckpt = engines["ckpt"]
    info = ["--middleware", "handoff_vllm.HandoffInfo"]
    debug = {"RUST_LOG": "info,handoff_core::machine::push_digest=debug"}

    def push_engine(name: str, tp: int, **kw) -> Server:
        conn = connector(name, mode="push", kv_digest=True, side_channel_port=free_port())
        return engine(ckpt, name, conn, tp=tp, args=info, env_extra=debug, **kw)

    with serving({"tp1": push_engine("push-tp1", 1),
                  "tp2": push_engine("push-tp2", 2, cpus="1")}, warm=True) as servers:
        yield servers


def push_all(engines: dict, push: dict, p: str, d: str, prompts: list[list[int]]) -> dict:
    """Each prompt through `handoff proxy --mode push` (P writes into D's blocks): D's digest
    matched P's for each; what D answered against the single engine, by prompt length."""
    same = {}
    with handoff_proxy("push", push[p], push[d]) as url:
        for ids in prompts:
            matched = matched_digests(push[d])
            got = completion_via(url, ids, ANSWER_TOKENS, "tiny")
            assert matched_digests(push[d]) == matched + 1, \
                f"{len(ids)} tokens: D did not check P's KV (computed it itself, or failed)"
            same[len(ids)] = got == engines["answers"][tuple(ids)]
    return same


def test_push_between_tp_2_and_tp_1_writes_each_head_and_answers_like_one_engine(engines, push):
    same = {"tp_2_to_1": push_all(engines, push, "tp2", "tp1", PUSH_2_TO_1),
            "tp_1_to_2": push_all(engines, push, "tp1", "tp2", PUSH_1_TO_2)}
    REPORT.setdefault("tp_heads_split", {})["push_same_answers"] = same
    assert all(all(v.values()) for v in same.values()), same
