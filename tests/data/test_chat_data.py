"""Chat data: every assistant turn supervised, checked token by token against the chat template's own
rendering, for a ChatML template (Qwen 2.5's) and Llama 3's; the layouts (OpenAI, ShareGPT), system
prompts, the plain template, and the refusals (no chat template; a template that rewrites history).

The tokenizers are the bundled one plus each template's special tokens and `chat_template` string:
no downloads. The oracle is independent of the code under test: the whole conversation rendered by
`apply_chat_template` and tokenised in one call, each reply located in it as the template writes it
(content, then its end-of-turn token).
"""

from __future__ import annotations

import pytest
import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.data import DataError, build_train_data, encode_prompt, render_prompt
from megatrain_cli.data.formats import records_to_examples
from megatrain_cli.data.load import with_system_prompt
from megatrain_cli.data.turns import end_of_turn_id
from megatrain_cli.recipe import DataConfig

# Qwen2.5-Instruct's template without its tool branches (ChatML; a default system turn when none is given).
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
TEMPLATES = {  # name: (template, special tokens, end-of-turn token, BOS the tokenizer adds by default)
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>", None),
    "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>", "<|begin_of_text|>"),
}
CHAT = [
    {"role": "system", "content": "You are a careful math tutor."},
    {"role": "user", "content": "Ivy has 4 kites and gets 3 more. How many kites does she have?"},
    {"role": "assistant", "content": "4 + 3 = 7. The answer is: 7"},
    {"role": "user", "content": "And if she then gives away 2?"},
    {"role": "assistant", "content": " 7 - 2 = 5. The answer is: 5\n"},  # Llama 3 trims it; ChatML keeps it
    {"role": "user", "content": "Double that?"},
    {"role": "assistant", "content": "5 * 2 = 10. The answer is: 10"},
]
SHAREGPT_ROLES = {"user": "human", "assistant": "gpt", "system": "system"}


def chat_tokenizer(name: str):
    """The bundled tokenizer with a template's special tokens (and default BOS, as Llama's adds one)."""
    from tokenizers import AddedToken, Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from megatrain_cli.models.tokenizer import BUNDLED_TOKENIZER_PATH

    template, specials, _, bos = TEMPLATES[name]
    inner = Tokenizer.from_file(str(BUNDLED_TOKENIZER_PATH))
    inner.add_special_tokens([AddedToken(t, special=True) for t in specials + ([bos] if bos else [])])
    if bos:
        inner.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                             special_tokens=[(bos, inner.token_to_id(bos))])
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                  bos_token=bos, additional_special_tokens=specials)
    tok.chat_template = template
    return tok


def examples_of(messages: list[dict]):
    return records_to_examples([{"messages": messages}], "auto", {}, "test")


def rows(tok, exs, **cfg) -> tuple[list[int], list[int]]:
    """ids and labels of the first example, through the trainer's own path (one example per row)."""
    data = build_train_data(exs, tok, DataConfig(packing=False, cache_dir="off", **cfg), seq_len=512, seed=0)
    ids, labels, _ = data.build_row(0)
    n = int(data.offsets[1])
    assert (labels[n:] == IGNORE_INDEX).all() and (ids[n:] == tok.pad_token_id).all()
    return ids[:n].tolist(), labels[:n].tolist()


def oracle(tok, name: str, messages: list[dict], supervised: list[int]) -> tuple[list[int], list[int]]:
    """The template's rendering tokenised whole, and labels on exactly the replies `supervised` (indices into
    messages), each as the template writes it: its content, then its end-of-turn token."""
    _, _, end, _ = TEMPLATES[name]
    ids = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    labels = [IGNORE_INDEX] * len(ids)
    at = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        content = m["content"].strip() if name == "llama3" else m["content"]
        reply = tok(content + end, add_special_tokens=False)["input_ids"]
        start = next(s for s in range(at, len(ids)) if ids[s:s + len(reply)] == reply)
        if i in supervised:
            labels[start:start + len(reply)] = reply
        at = start + len(reply)
    return ids, labels


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_every_assistant_turn_is_supervised_token_by_token(name):
    tok = chat_tokenizer(name)
    exs = examples_of(CHAT)
    assert exs[0].chat and [t["role"] for t in exs[0].history] == ["system", "user", "assistant", "user", "assistant"]
    replies = [i for i, m in enumerate(CHAT) if m["role"] == "assistant"]
    ids, labels = rows(tok, exs)
    want_ids, want_labels = oracle(tok, name, CHAT, replies)
    assert ids == want_ids  # exactly the rendering's tokens (one BOS: the template's)
    assert labels == want_labels  # each reply and its end-of-turn token; IGNORE elsewhere
    end = tok.convert_tokens_to_ids(TEMPLATES[name][2])
    assert labels.count(end) == 3 and ids.count(end) == len(CHAT)  # every turn closes with it; 3 are learnt
    if name == "llama3":
        assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    # last_assistant: the same tokens, loss on the last reply only.
    ids_last, labels_last = rows(tok, exs, train_on="last_assistant")
    assert (ids_last, labels_last) == oracle(tok, name, CHAT, replies[-1:])
    # Eval asks exactly what training taught: the prompt ids are the training ids up to the last reply.
    prompt = encode_prompt(tok, render_prompt(tok, exs[0].prompt, "auto", exs[0].history, exs[0].chat))
    last_start = next(i for i, lab in enumerate(labels_last) if lab != IGNORE_INDEX)
    assert ids[:last_start] == prompt
    assert end_of_turn_id(tok) == end


def test_sharegpt_and_openai_layouts_read_the_same_chat_with_system_prompts():
    sharegpt = {"conversations": [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in CHAT[1:]],
                "system": CHAT[0]["content"]}  # LLaMA-Factory's ShareGPT keeps the system prompt in a field
    openai, = examples_of(CHAT)
    from_sharegpt, = records_to_examples([sharegpt], "auto", {}, "test")
    assert from_sharegpt == openai
    # data.system_prompt fills in a system turn only where a chat has none.
    bare, = examples_of(CHAT[1:])
    default = with_system_prompt([bare, openai], "Be brief.")
    assert default[0].history[0] == {"role": "system", "content": "Be brief."} and default[1] == openai
    assert bare.history[0]["role"] == "user"  # a copy: the example read is unchanged
    tok = chat_tokenizer("chatml")
    ids, _ = rows(tok, default[:1])
    assert ids == oracle(tok, "chatml", [{"role": "system", "content": "Be brief."}, *CHAT[1:]], [])[0]
    with pytest.raises(DataError, match="unknown role 'narrator'"):
        examples_of([{"role": "narrator", "content": "x"}, *CHAT[1:]])
    with pytest.raises(DataError, match=r"messages\[2\] is a system message"):
        examples_of([*CHAT[1:3], {"role": "system", "content": "x"}, *CHAT[3:]])


def test_plain_template_supervises_each_reply_and_ends_with_eos(tok):
    exs = examples_of(CHAT)
    ids, labels = rows(tok, exs, template="plain")
    text = tok.decode(ids)
    assert text.startswith("You are a careful math tutor.\n\nQuestion: Ivy has 4 kites")
    supervised = [tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX])]
    assert supervised == ["4 + 3 = 7. The answer is: 7 7 - 2 = 5. The answer is: 5\n"
                          "5 * 2 = 10. The answer is: 10<|endoftext|>"]
    assert labels[-1] == ids[-1] == tok.eos_token_id
    _, last = rows(tok, exs, template="plain", train_on="last_assistant")
    assert tok.decode([i for i, lab in zip(ids, last) if lab != IGNORE_INDEX]) == \
        "5 * 2 = 10. The answer is: 10<|endoftext|>"


def test_chat_data_without_a_chat_template_is_refused_naming_the_key_and_tokenizer(tok, tmp_path):
    with pytest.raises(DataError, match=r"data.template: chat data .* needs the tokenizer's chat template, and the "
                                        r"bundled tokenizer .* has none.*data.template=plain"):
        rows(tok, examples_of(CHAT))
    plain = chat_tokenizer("chatml")
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "base-model")
    from megatrain_cli.models.tokenizer import load_tokenizer_dir

    with pytest.raises(DataError, match=f"the tokenizer of {tmp_path / 'base-model'} has none"):
        rows(load_tokenizer_dir(tmp_path / "base-model"), examples_of(CHAT))


def test_a_template_that_rewrites_earlier_turns_is_refused_unless_last_assistant():
    tok = chat_tokenizer("chatml")
    # Earlier replies shortened once later turns exist (as Qwen3's template drops old reasoning).
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not "
                         "loop.last %}{{ m.content.split('.')[-1] }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(DataError, match="differently once later turns follow.*train_on=last_assistant"):
        rows(tok, examples_of(CHAT))
    ids, labels = rows(tok, examples_of(CHAT), train_on="last_assistant")
    assert tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX]) == \
        "5 * 2 = 10. The answer is: 10<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    from megatrain_cli.models.tokenizer import load_bundled_tokenizer

    return load_bundled_tokenizer()


def test_packed_rows_keep_each_chats_mask():
    tok = chat_tokenizer("chatml")
    exs = [*examples_of(CHAT), *examples_of(CHAT[1:3])]
    data = build_train_data(exs, tok, DataConfig(cache_dir="off"), seq_len=512, seed=0)
    assert data.num_rows == 1 and data.loss_tokens == sum(
        sum(lab != IGNORE_INDEX for lab in oracle(tok, "chatml", m, range(len(m)))[1]) for m in (CHAT, CHAT[1:3]))
    ids, labels, pos = data.build_row(0)
    assert int((labels != IGNORE_INDEX).sum()) == data.loss_tokens and torch.equal(
        labels[labels != IGNORE_INDEX], ids[labels != IGNORE_INDEX])
