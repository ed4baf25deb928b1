"""More of `megatrain train`'s bad inputs (test_bad_inputs.py has the first ones): what used to be silently
wrong (exit 0 with a wrong result) or answered badly. Each: the exit code, the culprit named, no traceback,
the user's files byte-identical and nothing left behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers_bad_inputs import TINY, copy_model, make_models, megatrain, refused, snapshot

# A few short steps on the tiny preset: the runs below train for real.
SHORT = ["train.steps=4", "train.seq_len=64", "train.micro_batch_size=2", "logging.dashboard=off",
         "eval.enabled=false", "eval.every_n_steps=null", "train.warmup_steps=0"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return make_models(tmp_path_factory.mktemp("models"))


def train(tmp_path: Path, *overrides: str):
    return megatrain("train", TINY, f"output_dir={tmp_path / 'out'}", *SHORT, *overrides)


# ---------------------------------------------------------------- a diverged run (exit 1, no final/)
@pytest.mark.parametrize("limits,stopped_at,names", [
    ([], 3, ["train.max_skipped_fraction=0.5", "2 of the 3 steps so far skipped"]),
    (["train.max_skipped_fraction=1.0", "train.max_skipped_steps=2"], 4,
     ["train.max_skipped_steps=2", "3 steps in a row skipped"]),
], ids=["mostly-skipped", "in-a-row"])
def test_a_diverged_run_stops_and_exports_nothing(tmp_path, limits, stopped_at, names):
    """train.lr=1e30: step 1 sends the weights to ~1e29, every later step's loss is NaN and skipped."""
    out = refused(train(tmp_path, "train.lr=1e30", "train.max_grad_norm=null", "checkpoint.every_n_steps=1",
                        *limits), 1, f"step {stopped_at}: the run diverged", "train.nan_policy=skip", "train.lr",
                  *names)
    run = tmp_path / "out"
    assert f"(latest: {run / f'step_{stopped_at - 1}'})" in out and "without writing final/" in out
    assert not (run / "final").exists() and not (run / f"step_{stopped_at}").exists()


# ---------------------------------------------------------------- config.json values transformers takes (exit 2)
@pytest.mark.parametrize("edit,names", [
    ({"router_aux_loss_coef": float("nan")}, ["router_aux_loss_coef is nan"]),
    ({"rope_theta": float("inf")}, ["rope_theta is inf"]),
    ({"rope_scaling": {"type": "linear", "factor": float("-inf")}}, ["rope_scaling.factor is -inf"]),
    ({"num_experts": 4, "num_experts_per_tok": 8}, ["num_experts_per_tok is 8", "4 experts of num_experts"]),
    ({"num_local_experts": 2, "num_experts_per_tok": 3}, ["num_experts_per_tok is 3", "num_local_experts"]),
], ids=["nan", "inf", "nested-inf", "experts-per-token", "local-experts"])
def test_model_config_with_a_value_training_cannot_use(tmp_path, models, edit, names):
    model = copy_model(models, "one", tmp_path / "model")
    config = model / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **edit}))  # NaN, Infinity as JSON has them
    before = snapshot(model)
    refused(train(tmp_path, "model.preset=null", f"model.path={model}"), 2, "model.path", str(config), *names)
    refused(megatrain("eval", "--model", model, "engine.device=cpu"), 2, "--model", str(config), *names)
    assert snapshot(model) == before and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- examples with nothing to learn: counted, named
def chat(prompt: str, reply: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]})


def test_examples_left_out_are_counted_and_named(tmp_path):
    """Prompts longer than train.seq_len and chats whose replies are all empty used to be dropped without a
    word (or trained with no loss token); they are counted at start, with their records and the fix."""
    lines = [chat(f"What is {i} + 1?", f"The answer is: {i + 1}") for i in range(9)]
    lines[2] = lines[5] = chat("word " * 200, "The answer is: 3")  # records 2 and 5: the prompt fills seq_len
    lines[7] = json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
                                        {"role": "user", "content": "Hello?"}, {"role": "assistant", "content": " "}]})
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(lines) + "\n")
    before = snapshot(data)
    result = train(tmp_path, f"data.source={data}", "data.template=plain", "data.test_fraction=0", "train.steps=1",
                   "checkpoint.export_final=false")
    assert result.exit_code == 0, result.output
    assert ("data: 3 of 9 training examples left out: 2: the prompt fills train.seq_len=64 (lines 3, 6; raise "
            "train.seq_len); 1: every assistant reply is empty (line 8;") in result.output
    assert snapshot(data) == before


@pytest.mark.parametrize("records,names", [
    ([{"query": "What is 1 + 1?", "response": float("nan")}, {"query": "And 2 + 2?", "response": float("inf")}],
     ["2 of 2 training examples left out", "field 'response' is nan, not text (line 1", "is inf, not text (line 2"]),
    ([{"query": "word " * 200, "response": "The answer is: 3"}] * 3,
     ["3 of 3 training examples left out", "the prompt fills train.seq_len=64 (lines 1, 2, 3; raise train.seq_len)"]),
    ([{"query": "What is 1 + 1?", "response": ""}] * 2, ["every assistant reply is empty (lines 1, 2"]),
], ids=["nan-values", "prompts-too-long", "empty-replies"])
def test_data_with_nothing_left_to_learn_is_refused(tmp_path, records, names):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))  # NaN, Infinity as Python's JSON writes them
    before = snapshot(data)
    refused(train(tmp_path, f"data.source={data}", "data.test_fraction=0"), 2, str(data), "nothing left to train on",
            *names)
    assert snapshot(data) == before and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the disk: the dry run asks what the writer asks
def test_dry_run_asks_the_disk_space_the_checkpoint_writer_asks(tmp_path, monkeypatch):
    """The dry run said "fits" for 13 MiB where the writer then asked 41.8 MiB (its room for the side files)."""
    import torch

    from megatrain_cli.checkpoint.layout import checkpoint_bytes
    from megatrain_cli.models.loader import build_store
    from megatrain_cli.models.tokenizer import load_bundled_tokenizer
    from megatrain_cli.recipe import load_recipe
    from megatrain_cli.store.tiles import HostStore
    from megatrain_cli.train import preflight
    from megatrain_cli.train.setup import model_config

    store = build_store(model_config(load_recipe(TINY), load_bundled_tokenizer()), torch.float32, seed=0)
    need = checkpoint_bytes(store)  # what save_checkpoint asks before it writes
    assert need == checkpoint_bytes(HostStore(store.adapter, torch.float32, allocate=False))
    args = ["train", TINY, "--dry-run", "checkpoint.export_final=false", "eval.enabled=false",
            f"output_dir={tmp_path / 'out'}"]
    monkeypatch.setattr(preflight, "free_bytes", lambda path: need - 1)
    dry = megatrain(*args)
    assert dry.exit_code == 3 and f"needs about {need / 2**20:.1f} MiB" in dry.output, dry.output
    monkeypatch.setattr(preflight, "free_bytes", lambda path: need)
    assert megatrain(*args).exit_code == 0
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- a setting one process has, refused with --gpus
@pytest.mark.parametrize("dry", [[], ["--dry-run"]], ids=["run", "dry-run"])
def test_resident_layers_with_several_ranks_is_refused(tmp_path, dry):
    """Planned and printed as 2, run as 0 before: the sharded store keeps no layer on the device."""
    refused(train(tmp_path, "--gpus", "2", "engine.resident_layers=2", "train.grad_accum=2", *dry), 2,
            "engine.resident_layers=2", "--gpus 2", "engine.resident_layers=0")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- megatrain plan: the probe checked before it runs
def test_plan_refuses_a_probe_the_host_cannot_hold(tmp_path, monkeypatch):
    """The 7B preset's layer timed on a CPU machine ran until the kernel's OOM killer ended it (exit 137)."""
    from tests.helpers_bad_inputs import fake_cgroup

    fake_cgroup(tmp_path, monkeypatch, 2 * 2**30)
    cache = tmp_path / "probe"
    out = refused(megatrain("plan", TINY, "model.preset=7b", "engine.device=cpu", "--probe-cache", cache), 3,
                  "host memory", "timing one layer of this model on cpu", "GiB are free under cgroup v2 memory.max",
                  "nothing was probed", "engine.device=cuda")
    need = float(out.split("needs about ")[1].split(" GiB")[0])
    assert need > 10  # the embedding and LM head at full size (0.5 G params each) and a 7B layer, with Adam
    assert not cache.exists()


# ---------------------------------------------------------------- paths a setting writes: named, not a raw [Errno N]
@pytest.mark.parametrize("sink,taken,key", [
    ("logging.tensorboard=true", "tensorboard", "logging.tensorboard"),
    ("logging.jsonl=true", "metrics.jsonl", "logging.jsonl"),
    ("logging.mlflow=true", "mlruns", "logging.mlflow"),
], ids=["tensorboard-is-a-file", "metrics-is-a-folder", "mlruns-is-a-file"])
def test_a_sinks_path_taken_by_the_wrong_kind(tmp_path, sink, taken, key):
    out = tmp_path / "out"
    out.mkdir()
    if taken.endswith(".jsonl"):
        (out / taken).mkdir()
        (out / taken / "mine.txt").write_text("mine")
    else:
        (out / taken).write_text("mine")
    before = snapshot(out)
    for dry in ([], ["--dry-run"]):
        refused(train(tmp_path, sink, *dry), 2, key, str(out / taken))
        assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == [taken]


def test_an_mlflow_server_that_does_not_answer_is_refused_at_once(tmp_path):
    """4 min of MLflow's own retries, then exit 2 with files left in output_dir, before."""
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    refused(train(tmp_path, "logging.mlflow=true", f"logging.mlflow_tracking_uri={uri}"), 2,
            "logging.mlflow_tracking_uri", uri, "does not answer", "logging.mlflow=false")
    assert time.monotonic() - t0 < 60 and not (tmp_path / "out").exists()


def test_data_cache_dir_that_cannot_be_written(tmp_path):
    if not Path("/sys/kernel").is_dir():
        pytest.skip("needs Linux sysfs")
    refused(train(tmp_path, "data.cache_dir=/sys/kernel/megatrain-tokens"), 2, "data.cache_dir", "/sys/kernel",
            "data.cache_dir=off")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cache", ["file", "read-only"])
def test_plan_probe_cache_that_cannot_be_written_is_refused_before_probing(tmp_path, cache):
    if cache == "file":
        path = tmp_path / "probe"
        path.write_text("mine")
    elif Path("/sys/kernel").is_dir():
        path = Path("/sys/kernel/megatrain-probe")
    else:
        pytest.skip("needs Linux sysfs")
    out = refused(megatrain("plan", TINY, "engine.device=cpu", "--probe-cache", path), 2, "--probe-cache",
                  str(path if cache == "file" else "/sys/kernel"))
    assert "probing this machine" not in out
    if cache == "file":
        assert path.read_text() == "mine"


# ---------------------------------------------------------------- data as other tools write it
def test_a_llama_factory_alpaca_entry_reads_as_llama_factory_writes_it(tmp_path, models):
    """No `formatting` (LLaMA-Factory's default: alpaca), columns prompt / query / response / system / history:
    refused before, with `prompt` listed as unsupported."""
    from megatrain_cli.data import load_examples
    from megatrain_cli.recipe import DataConfig

    (tmp_path / "alpaca.json").write_text(json.dumps([
        {"instruction": "Add 1 and 2.", "input": "", "output": "The answer is: 3", "system": "Be brief.",
         "history": [["Hi", "Hello!"]]},
        {"instruction": "Add 2 and 2.", "input": "in numbers", "output": "The answer is: 4", "history": []}]))
    registry = tmp_path / "dataset_info.json"
    registry.write_text(json.dumps({"my_alpaca": {"file_name": "alpaca.json", "columns": {
        "prompt": "instruction", "query": "input", "response": "output", "system": "system", "history": "history"}}}))
    before = snapshot(tmp_path)
    first, second = load_examples(DataConfig(source="registry:my_alpaca", registry=str(registry)))
    assert (first.prompt, first.response, second.prompt) == ("Add 1 and 2.", "The answer is: 3",
                                                              "Add 2 and 2.\n\nin numbers")
    assert first.history == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello!"}]
    result = megatrain("eval", "--model", models / "one", "engine.device=cpu", "--split", "all",
                       "data.source=registry:my_alpaca", f"data.registry={registry}", "eval.max_new_tokens=2",
                       "--output-dir", tmp_path / "ev")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "ev" / "results.json").read_text())["total"] == 2
    assert {k: v for k, v in snapshot(tmp_path).items() if "/ev/" not in k} == before


def parts_chat(*parts) -> str:
    return json.dumps({"messages": [{"role": "user", "content": list(parts)},
                                    {"role": "assistant", "content": [{"type": "text", "text": "The answer is: 2"}]}]})


def test_chat_content_given_as_parts(tmp_path):
    """OpenAI's content parts: the text parts read, joined; said 'missing field' while listing it as present."""
    from megatrain_cli.data import load_examples
    from megatrain_cli.recipe import DataConfig

    data = tmp_path / "chats.jsonl"
    data.write_text(parts_chat({"type": "text", "text": "What is "}, {"type": "text", "text": "1 + 1?"}) + "\n")
    (ex,) = load_examples(DataConfig(source=str(data)))
    assert (ex.prompt, ex.response, ex.chat) == ("What is 1 + 1?", "The answer is: 2", True)
    data.write_text(parts_chat({"type": "text", "text": "What is this?"},
                               {"type": "image_url", "image_url": {"url": "x.png"}}) + "\n")
    before = snapshot(data)
    out = refused(train(tmp_path, f"data.source={data}", "data.template=plain"), 2, str(data), "record 0",
                  "messages[0].content[1]", "'image_url'", "only text parts")
    assert "missing field" not in out and snapshot(data) == before and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- text that is not UTF-8: the file and line named
def test_not_utf8_names_the_file_and_line(tmp_path, models):
    good = chat("What is 1 + 1?", "The answer is: 2").encode()
    chats = tmp_path / "chats.jsonl"
    chats.write_bytes(good + b"\n" + good + b"\n" + json.dumps({"messages": [{"role": "user", "content": "Caf\u00e9?"}], "x": 1}, ensure_ascii=False).encode("latin-1") + b"\n")
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes(TINY.read_bytes().replace(b"model:", "# r\u00e9sum\u00e9\nmodel:".encode("latin-1"), 1))
    garbled = tmp_path / "test.json"
    garbled.write_bytes(b'[{"question": "1 + 1?",\n  "answer": "#### 2 \xff\xfe"}]')
    before = snapshot(tmp_path)
    refused(train(tmp_path, f"data.source={chats}", "data.template=plain"), 2, f"{chats} line 3", "not UTF-8",
            "0xe9")
    refused(megatrain("train", recipe, f"output_dir={tmp_path / 'out'}"), 2, f"{recipe} line 6", "not UTF-8")
    refused(megatrain("eval", "--model", models / "one", f"data.test_source={garbled}", "engine.device=cpu",
                      "--output-dir", tmp_path / "ev"), 2, f"{garbled} line 2", "not UTF-8", "0xff")
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------- a refused run writes nothing
def corrupt(tile: Path) -> None:
    """Bytes changed in the middle of a tile file, its size kept: found only when the data is read (CRC)."""
    data = bytearray(tile.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 16):  # in the masters (the moments of step_1 are zeros)
        data[i] ^= 0xFF
    tile.write_bytes(bytes(data))


@pytest.mark.parametrize("resume", ["auto", "path"])
def test_a_refused_resume_leaves_the_old_run_as_it_was(tmp_path, models, resume):
    """The old run's recipe.yaml was rewritten (and metrics.jsonl touched) before the resume was refused."""
    import shutil

    old = Path(shutil.copytree(models / "run", tmp_path / "old"))
    (old / "recipe.yaml").write_text("# the old run's recipe\n")
    (old / "metrics.jsonl").write_text('{"step": 1, "loss": 6.0}\n')
    corrupt(old / "step_1" / "tiles" / "layers.0.safetensors")
    before = snapshot(old)
    where = old if resume == "auto" else tmp_path / "new"
    refused(megatrain("train", TINY, *SHORT, f"output_dir={where}",
                      f"checkpoint.resume={'auto' if resume == 'auto' else old / 'step_1'}"), 2, "step_1")
    assert snapshot(old) == before and not (tmp_path / "new").exists()


# ---------------------------------------------------------------- what a path is, what would work
def test_a_recipe_path_that_is_not_a_file_says_what_it_is(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone.yaml")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "mine.yaml").write_text("model: {preset: tiny}\n")
    for path, what in [(tmp_path / "recipes", "is a folder, not a recipe file; give a YAML file in it (mine.yaml)"),
                       (tmp_path / "loop", "is a symbolic link loop"),
                       (tmp_path / "dangling", f"is a symbolic link to {tmp_path / 'gone.yaml'}, which does not exist")]:
        out = refused(megatrain("train", path), 2, f"{path} {what}")
        assert "not found" not in out


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_a_model_the_engine_cannot_stream_suggests_nothing_that_fails(tmp_path, family):
    """GPT-2 (learned positions) and BERT (a biased LM head) suggested model.allow_unverified=true, which then
    failed too."""
    import transformers

    from megatrain_cli.models.tokenizer import load_bundled_tokenizer

    tok = load_bundled_tokenizer()
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=32, n_head=2, vocab_size=len(tok), n_positions=512, bos_token_id=0, eos_token_id=0))
    else:
        model = transformers.BertLMHeadModel(transformers.BertConfig(
            num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=len(tok),
            is_decoder=True))
    model.save_pretrained(tmp_path / family)
    tok.save_pretrained(tmp_path / family)
    before = snapshot(tmp_path / family)
    for allow in ("false", "true"):
        out = refused(train(tmp_path, "model.preset=null", f"model.path={tmp_path / family}",
                            f"model.allow_unverified={allow}"), 2, f"model type '{family}'",
                      "with or without model.allow_unverified")
        assert "model.allow_unverified=true trains it" not in out
    assert snapshot(tmp_path / family) == before and not (tmp_path / "out").exists()


def test_inodes_used_up_are_named_not_a_full_disk(tmp_path, monkeypatch):
    """'the disk is full' with 100 MiB free, before."""
    import os

    from megatrain_cli.checkpoint import format as ckpt_format

    real = os.statvfs

    def no_inodes(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, st.f_bfree, st.f_bavail, st.f_files,
                                  0, 0, st.f_flag, st.f_namemax))

    monkeypatch.setattr(ckpt_format.os, "statvfs", no_inodes)
    out = refused(train(tmp_path, "train.steps=1", "checkpoint.export_final=false"), 1, "no free inodes",
                  "inode table is full", "are free", "checkpoint.resume=auto")
    assert "disk is full" not in out and not (tmp_path / "out" / "step_1").exists()
    err = OSError(28, "No space left on device")
    with pytest.raises(ckpt_format.CheckpointWriteError, match="no free inodes left, though"):
        with ckpt_format.removed_on_failure(tmp_path / "tmp", "step_2", where=tmp_path):
            raise err
