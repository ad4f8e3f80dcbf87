"""The fused decoder stack (kernels.fused): all layers of a row-wise step in one call of the
compiled kernels, bit for bit the layer-by-layer path's outputs (bfloat16, on the tile engine of
this CPU: AMX, AVX-512 bfloat16 or AVX2)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from epdserve.common.core_board import make_board
from epdserve.engine.config import EngineConfig
from epdserve.engine.core import EngineCore
from epdserve.engine.inputs import InputBuilder
from epdserve.hf_reference import HFReference
from epdserve.kernels import tiles
from epdserve.kernels.fused import FusedDecoder, RowWise
from epdserve.kernels.lending import CoreLender
from epdserve.kernels.tiles import load_tiles
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.models.config import ModelConfig
from tests.engine_utils import cases, drain
from tests.test_engine_oracle import engine_request

ENGINE = None if (t := load_tiles()) is None else t.engine
pytestmark = pytest.mark.skipif(ENGINE is None, reason="the fused stack needs a tile engine (AMX, AVX-512 or AVX2)")


def bf16_engine(model_dir: Path, **kw) -> EngineCore:
    cfg = EngineConfig(dtype="bfloat16", max_num_batched_tokens=64, num_kv_blocks=256, **kw)
    return EngineCore.from_pretrained(model_dir, cfg)


def compare_paths(
    eng: EngineCore, model_dir: Path, around_stack: tuple[Callable[[], None], Callable[[], None]] | None = None
) -> list[bool]:
    """Serve every case at once through ``eng``, each row-wise step twice: layer by layer, then
    through the stack (``around_stack``: called just before and just after it); whether each
    step's outputs were equal."""
    lm = eng.runner.model.language_model
    fused = lm.fused
    assert isinstance(fused, FusedDecoder) and eng.runner.decode.name == "fused stack"
    forward = lm.forward
    compared: list[bool] = []

    def both(embeds, positions, attention, deepstack=None):
        if attention.row_wise is None:
            return forward(embeds, positions, attention, deepstack)
        lm.fused = None  # the layer-by-layer path first (it writes the same k/v the fused one will)
        expected = forward(embeds, positions, attention, deepstack)
        lm.fused = fused
        if around_stack is not None:
            around_stack[0]()
        got = forward(embeds, positions, attention, deepstack)
        if around_stack is not None:
            around_stack[1]()
        compared.append(torch.equal(got, expected))
        return got

    lm.forward = both
    ref = HFReference(model_dir)
    cfg = ModelConfig.from_pretrained(model_dir)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(model_dir))
    builder = InputBuilder(ref.tok, cfg)
    eos = frozenset(ref.model.generation_config.eos_token_id)
    for req in [engine_request(n, builder, proc, m, i, v, eos) for n, m, i, v in cases()]:
        eng.add_request(req)  # all at once: decode rows of some with prompt chunks of others
    out = drain(eng)
    assert all(len(toks) > 0 for toks in out.values())
    return compared


def test_the_fused_stack_equals_the_layer_by_layer_path_bit_for_bit(model_dir: Path) -> None:
    compared = compare_paths(bf16_engine(model_dir), model_dir)
    assert len(compared) > 10 and all(compared), compared


@pytest.mark.skipif(ENGINE == "amx", reason="AMX's stack runs on one thread")
def test_the_stacks_matmuls_split_over_threads_as_the_layers_do(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the AVX-512 and AVX2 engines the stack's matmuls split over torch's threads where the
    layer-by-layer path's would (here every one, as if every weight were large), so the stack is
    taken on any thread count; a column's sums do not depend on the split: still bit for bit."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(tiles, "PARALLEL_WEIGHT", 1)
        eng = bf16_engine(model_dir)
        fused = eng.runner.model.language_model.fused
        assert fused is not None and fused.preferred() and fused.threads(1).tolist() == [2, 2, 2, 2]
        compared = compare_paths(eng, model_dir)
        assert len(compared) > 10 and all(compared), compared
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(ENGINE == "amx", reason="AMX's stack runs on one thread")
def test_cores_lent_by_a_role_that_starts_computing_are_handed_back_between_layers(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A step on a core borrowed from an idle role (an encoder's): when that role starts
    computing, the stack's next layer runs on the step's own core, and so does the rest of the
    step (torch's threads too); a step whose lender stays idle keeps both. Bit for bit either way."""
    threads = torch.get_num_threads()
    board = make_board(tmp_path)
    enc, pd = CoreLender(board, 1, cores=2), CoreLender(board, 1, cores=2)
    try:
        monkeypatch.setattr(tiles, "PARALLEL_WEIGHT", 1)  # as if every weight were large
        eng = bf16_engine(model_dir)
        fused = eng.runner.model.language_model.fused
        assert fused is not None
        fused.lender = pd
        steps: list[int] = []

        def borrow() -> None:  # every other step, the encoder starts before the stack's first layer
            enc.board.mark(1, False, 0.0)
            assert pd.refresh() == 2 and pd.loan is not None and pd.loan.own == 1
            if len(steps) % 2 == 0:
                enc.board.mark(1, True, time.monotonic())

        compared = compare_paths(eng, model_dir, (borrow, lambda: steps.append(torch.get_num_threads())))
        assert len(compared) > 10 and all(compared), compared
        assert steps == [1, 2] * (len(steps) // 2) + [1] * (len(steps) % 2), steps
    finally:
        pd.close()
        enc.close()
        torch.set_num_threads(threads)


def test_greedy_tokens_are_the_same_with_and_without_the_fused_stack(model_dir: Path) -> None:
    ref = HFReference(model_dir)
    cfg = ModelConfig.from_pretrained(model_dir)
    proc = VisionProcessor(ProcessorConfig.from_pretrained(model_dir))
    builder = InputBuilder(ref.tok, cfg)
    eos = frozenset(ref.model.generation_config.eos_token_id)
    outs = []
    for fused in (True, False):
        eng = bf16_engine(model_dir)
        if not fused:
            eng.runner.model.language_model.fused = None
        for req in [engine_request(n, builder, proc, m, i, v, eos) for n, m, i, v in cases()]:
            eng.add_request(req)
        outs.append(drain(eng))
    assert outs[0] == outs[1]


@pytest.mark.skipif(ENGINE != "amx", reason="the other engines' stacks split their matmuls")
def test_with_threads_to_split_large_matmuls_the_amx_stack_yields_to_the_layer_path(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AMX's stack runs on one thread; where torch has more and the matmuls are large enough to
    split over them (reading a large weight is the work of a decode step), the layer-by-layer
    path, whose matmuls split, runs the row-wise steps instead."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        small = bf16_engine(model_dir).runner.model.language_model.fused
        assert small is not None and not small.splits and small.preferred()  # too small to split
        monkeypatch.setattr(tiles, "PARALLEL_WEIGHT", 1)  # as if every weight were large
        eng = bf16_engine(model_dir)
        lm = eng.runner.model.language_model
        assert lm.fused is not None and lm.fused.splits and not lm.fused.preferred()
        calls: list[int] = []
        real = lm.fused.__call__
        monkeypatch.setattr(FusedDecoder, "__call__", lambda self, *a: calls.append(1) or real(*a))
        builder = InputBuilder(HFReference(model_dir).tok, ModelConfig.from_pretrained(model_dir))
        proc = VisionProcessor(ProcessorConfig.from_pretrained(model_dir))
        name, messages, images, videos = cases()[1]  # an image: a prompt, then decode steps
        eng.add_request(engine_request(name, builder, proc, messages, images, videos, frozenset()))
        assert drain(eng)[name] and not calls
        torch.set_num_threads(1)
        assert lm.fused.preferred()
    finally:
        torch.set_num_threads(threads)


def test_an_index_out_of_range_is_refused_before_the_cache_is_touched(model_dir: Path) -> None:
    eng = bf16_engine(model_dir)
    lm = eng.runner.model.language_model
    fused = lm.fused
    assert isinstance(fused, FusedDecoder)
    kv = eng.runner.kv
    before = [k.clone() for k in kv.k]
    h, d = lm.config.hidden_size, lm.config.head_dim
    x = torch.randn(2, h).to(torch.bfloat16)
    cos, sin = torch.ones(2, d, dtype=torch.bfloat16), torch.zeros(2, d, dtype=torch.bfloat16)
    slots = kv.k[0].shape[0] * kv.k[0].shape[1]
    table = torch.zeros(1, 4, dtype=torch.int64)
    one = torch.ones(2, dtype=torch.int64)
    for bad in (
        RowWise(torch.tensor([0, slots]), table, torch.zeros(2, dtype=torch.int64), one),  # slot
        RowWise(torch.tensor([0, 1]), table, torch.tensor([0, 1]), one),  # table row
        RowWise(torch.tensor([0, 1]), table, torch.zeros(2, dtype=torch.int64), one * 1000),  # ctx
    ):
        with pytest.raises(ValueError, match="out of range"):
            fused(x.clone(), cos, sin, bad)
    assert all(torch.equal(a, b) for a, b in zip(before, kv.k, strict=True))  # in no layer
    with pytest.raises(ValueError, match="int64"):
        fused(x.clone(), cos, sin, RowWise(torch.tensor([0, 1], dtype=torch.int32), table, one, one))
