"""Issue #31, part 5: the planner prices packed rows by the attention their documents need. The probe times
the engine's layer on rows of `docs_per_row` equal documents whose sum of squared lengths is the data's
(engine/plan/probe.py); `plan`, `bench` and `train` (once its data is read) use that timing, each for its own
rows, and a packed run whose documents were never timed says it was priced as one document per row."""

from __future__ import annotations

import json
import re

import pytest
import torch

from megatrain_cli.engine.plan import probe as pb
from megatrain_cli.engine.plan.probe import LayerTiming
from tests.engine.test_plan_predict import tiny_adapter  # noqa: F401 (the fixture)
from tests.helpers_bad_inputs import TINY, megatrain

SMALL = dict(tile_bytes=1 << 20, link_bytes=1 << 20, gemm_n=256, reps=1)  # a probe in well under a second


def _tiny_rows(seq_len: int):
    from megatrain_cli.data import build_train_data, load_examples, split_examples
    from megatrain_cli.models.tokenizer import load_tokenizer
    from megatrain_cli.recipe import load_recipe

    r = load_recipe(TINY, [f"train.seq_len={seq_len}"])
    train, _ = split_examples(load_examples(r.data), r.data)
    return build_train_data(train, load_tokenizer(r.model), r.data, seq_len, r.train.seed)


def test_a_rows_attention_pairs_are_the_flop_counts(monkeypatch):
    """attention_pairs_per_row is the FLOP count's sum(doc_len^2) (metrics/flops.attention_pairs, over the
    documents the attention sees in the rows train serves), averaged over every row."""
    from megatrain_cli.batch import MicroBatch
    from megatrain_cli.metrics.flops import attention_pairs

    data = _tiny_rows(256)
    ids, labels, pos = zip(*(data.build_row(i) for i in range(data.num_rows)))
    mb = MicroBatch(torch.stack(ids), torch.stack(labels), torch.stack(pos))
    assert data.attention_pairs_per_row() == pytest.approx(attention_pairs([mb]) / data.num_rows, rel=1e-12)
    assert 256 * 256 / 8 < data.attention_pairs_per_row() < 256 * 256 / 2  # ~4 documents of ~57 tokens a row


@pytest.mark.parametrize("seq,docs", [(4200, 1), (4200, 3), (4200, 7), (4200, 70), (64, 64)])
def test_docs_per_row_is_the_equal_documents_of_the_same_work(seq, docs):
    assert pb.docs_per_row(docs * (seq / docs) ** 2, seq) == docs


def test_docs_per_row_stays_within_a_row():
    assert pb.docs_per_row(0.0, 128) == 128 and pb.docs_per_row(10 * 128 * 128, 128) == 1


def test_the_probe_times_packed_rows_at_their_documents(tmp_path, tiny_adapter, monkeypatch):
    """Packed: the timed micro-batches carry position ids restarting every seq/docs tokens, under their own
    cache key; one document per row (docs None) is another key, timed without position ids."""
    from megatrain_cli.engine.layer_probe import measure_layer
    from megatrain_cli.engine.step import Engine

    seen = []
    real = Engine.forward_backward
    monkeypatch.setattr(Engine, "forward_backward", lambda self, mbs, *a, **k: seen.extend(mbs) or real(self, mbs, *a, **k))
    args = dict(micro_batch_size=2, seq_len=32, dtype=torch.float32, device=torch.device("cpu"), cache_dir=tmp_path,
                machine_args=SMALL, measure_layer=measure_layer)
    packed = pb.load_or_probe(tiny_adapter, **args, docs_per_row=4)
    assert packed.measured == ["machine", "layer"] and packed.layer.tokens == 64 and seen
    for mb in seen:
        assert torch.equal(mb.position_ids, (torch.arange(32) % 8).expand(2, 32))
    seen.clear()
    dense = pb.load_or_probe(tiny_adapter, **args)
    assert dense.measured == ["layer"] and seen and all(mb.position_ids is None for mb in seen)
    keys = list(json.loads(packed.path.read_text())["layers"])
    assert len(keys) == 2 and sum("-4docs-" in k for k in keys) == 1
    assert pb.load_or_probe(tiny_adapter, **args, docs_per_row=4).measured == []


def test_train_prices_packed_rows_within_documents_once_timed(tmp_path, monkeypatch):
    """train's prediction for packed rows: the docs timing when `plan` or `bench` cached it, else the one
    document per row timing, and the line says which."""
    from megatrain_cli.engine.plan.step_plan import plan_step
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.recipe import load_recipe
    from megatrain_cli.train.predicted import describe, prediction
    from megatrain_cli.train.setup import model_config

    r = load_recipe(TINY, ["engine.device=cpu"])
    assert r.data.packing
    adapter, device = ModelAdapter(model_config(r)), torch.device("cpu")
    plan = plan_step(r, adapter, device)

    def timing(adapter, *, docs_per_row=None, micro_batch_size, seq_len, **_):  # attention within 4 documents: less
        return LayerTiming(forward_s=0.02 if docs_per_row else 0.03, backward_s=0.04 if docs_per_row else 0.06,
                           tokens=micro_batch_size * seq_len, device="cpu", head_s=0.01)

    pb.load_or_probe(adapter, measure_layer=timing, machine_args=SMALL, cache_dir=tmp_path,
                     **pb.recipe_shape(r, device, plan))
    dense = prediction(r, adapter, device, plan, cache_dir=tmp_path)
    untimed = prediction(r, adapter, device, plan, cache_dir=tmp_path, docs=4)
    assert dense.packed == untimed.packed == "as one document per row" and untimed.total == dense.total
    assert describe(untimed).endswith("packed rows' attention priced as one document per row: `megatrain plan "
                                      "RECIPE` times this data's documents; docs/planner.md)")
    pb.load_or_probe(adapter, measure_layer=timing, cache_dir=tmp_path, **pb.recipe_shape(r, device, plan, 4))
    timed = prediction(r, adapter, device, plan, cache_dir=tmp_path, docs=4)
    assert timed.packed == "within documents" and timed.total < dense.total
    assert describe(timed).endswith("packed rows' attention priced within documents; docs/planner.md)")
    unpacked = load_recipe(TINY, ["engine.device=cpu", "data.packing=false"])
    assert prediction(unpacked, adapter, device, plan, cache_dir=tmp_path, docs=4).packed == ""


def test_plan_times_the_datas_packed_rows(tmp_path):
    pb.load_or_probe(cache_dir=tmp_path, machine_args=SMALL)  # the machine figures: cached, small and quick
    result = megatrain("plan", TINY, "--probe-cache", tmp_path, "train.micro_batch_size=2", "train.seq_len=128")
    assert result.exit_code == 0, result.output
    found = re.search(r"packed rows: (\d+\.\d) documents a row on average \(builtin:sample_math\); their attention "
                      r"timed as (\d+) equal documents a row", result.output)
    assert found, result.output
    docs = pb.docs_per_row(_tiny_rows(128).attention_pairs_per_row(), 128)
    assert int(found.group(2)) == docs and 1 < docs < float(found.group(1)) + 1
    keys = list(json.loads(next(tmp_path.glob("*.json")).read_text())["layers"])
    assert len(keys) == 1 and f"-2x128-{docs}docs-" in keys[0]


def test_a_packed_bench_probes_its_own_rows(tmp_path, monkeypatch):
    """bench data.packing=true: the probe times documents of the bench's rows (the equal documents of their
    mean attention work, within a fifth of the timed steps' own)."""
    from megatrain_cli.bench.runner import run_bench
    from megatrain_cli.bench.settings import BenchRun
    from megatrain_cli.engine.step import Engine
    from megatrain_cli.metrics.flops import attention_pairs
    from tests.bench.test_bench import cpu_recipe

    taken = []
    real_step = Engine.step
    monkeypatch.setattr(Engine, "step", lambda self, mbs, lr: taken.append(mbs) or real_step(self, mbs, lr))
    r = cpu_recipe("data.packing=true", "bench.doc_len_mean=12", "bench.doc_len_spread=0.5", batch=2, seq=64)
    res = run_bench(r, BenchRun(steps=2, warmup=1, predict=True, probe_cache=str(tmp_path)), log=lambda line: None)
    assert res.predicted["step_s"] > 0
    (key,) = json.loads(next(tmp_path.glob("*.json")).read_text())["layers"]
    docs = int(re.search(r"-2x64-(\d+)docs-", key).group(1))
    timed = 64 * 64 * sum(len(mb.input_ids) for mbs in taken for mb in mbs) / sum(map(attention_pairs, taken))
    assert docs == pytest.approx(timed, rel=0.2) and docs > 2
