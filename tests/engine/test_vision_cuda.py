"""Vision-language models on the CUDA pipeline (run on the H200 with `pytest -m cuda`): every verified family's
tiny config (tests/engine/test_vision.py's, real images through the family's processor) trains three steps on
the GPU, fp32, as the CPU path does: the same losses and every weight (vision tower, projector, decoder) after
the steps; and a packed row of image examples (tests/engine/test_packed_vision.py's) gives on the GPU the
per-token losses it gives on the CPU. The CPU paths themselves equal plain HF (those two files).

Deterministic kernels for the comparison: SDPA's math backend, no TF32 in cuDNN's convolutions (the patch
embedding is a Conv3d / Conv2d; cuDNN takes TF32 by default) nor in matmuls.
"""

from __future__ import annotations

import pytest
import torch

from megatrain_cli.models.loader import build_store
from megatrain_cli.optim.host_adamw import lr_at
from megatrain_cli.recipe import TrainConfig
from tests.engine.test_packed_vision import FAMILIES as PACKED_FAMILIES
from tests.engine.test_packed_vision import examples, one_label_each, packed_batch
from tests.engine.test_vision import ACCUM, FAMILIES, STEPS, tiny_vlm_config, vlm_batches
from tests.engines import make_engine

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.fixture(autouse=True)
def exact_kernels(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        yield


def train(family: str, device: str):
    config = tiny_vlm_config(family)
    store = build_store(config, torch.float32, seed=3)
    cfg = TrainConfig(steps=STEPS, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, grad_accum=ACCUM,
                      eps=1e-5)
    engine = make_engine(store, cfg, device=device, checkpoint_interval=1, loss_chunk_tokens=7,
                         frozen=store.adapter.vision.frozen_tiles(False, False))
    results = [engine.step(mbs, lr_at(s, cfg, STEPS)) for s, mbs in enumerate(vlm_batches(family))]
    engine.close()  # the optimizer thread's last updates land before the store is read
    return store, results


@pytest.mark.parametrize("family", FAMILIES)
def test_vlm_trains_on_the_gpu_as_on_the_cpu(family):
    gpu, gpu_res = train(family, "cuda")
    cpu, cpu_res = train(family, "cpu")
    for step, (g, c) in enumerate(zip(gpu_res, cpu_res)):
        assert g.losses == pytest.approx(c.losses, rel=1e-5), f"step {step} losses"
        assert g.grad_norm == pytest.approx(c.grad_norm, rel=1e-4) and c.grad_norm > 0.5  # clipping active
    ours, theirs = gpu.hf_state_dict(), cpu.hf_state_dict()
    assert any(gpu.adapter.vision.owns(n) for n in ours)
    for name, expected in theirs.items():
        torch.testing.assert_close(ours[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", PACKED_FAMILIES)
def test_a_packed_row_of_image_examples_on_the_gpu(family):
    config = tiny_vlm_config(family)
    mbs = one_label_each(packed_batch(examples(family)))
    per_token = {}
    for device in ("cuda", "cpu"):
        store = build_store(config, torch.float32, seed=5)
        engine = make_engine(store, TrainConfig(steps=1, max_grad_norm=None), device=device, checkpoint_interval=1,
                             loss_chunk_tokens=7, overlap_optimizer=False,
                             frozen=store.adapter.vision.frozen_tiles(False, False))
        per_token[device] = engine.forward_backward(mbs).losses
        engine.close()
    assert len(per_token["cpu"]) == len(mbs) > 3
    assert per_token["cuda"] == pytest.approx(per_token["cpu"], rel=1e-5, abs=1e-6)
