"""Batched greedy generation for exact-match eval: left padding, stop at eos or at a stop string; and the
sampler GRPO's rollouts draw their tokens with (`Sampler`: temperature, top-p, a seeded generator).

One batch runs either on an HF model that sits whole on one device (`hf_greedy_batch`: HF
`generate`) or on a `streamed.StreamedModel`, whose weights stay in host memory and stream to the
device layer by layer (its `greedy_batch`). Both take the same left-padded batch and the same
stopping rules from here, and give the same token ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch


@dataclass
class Generation:
    text: str  # the answer text, cut before eos / the first stop string
    new_tokens: int  # tokens the model produced for it (up to and including the one that ended it)


class StopOnStrings:
    """A `generate` stopping criterion: marks each row done once its new text contains a stop string."""

    def __init__(self, tokenizer, stop: list[str], prompt_len: int):
        self.tokenizer, self.stop, self.prompt_len = tokenizer, stop, prompt_len
        # A stop string spans at most one token per character (plus a partial one either side), so
        # decoding that many trailing tokens is enough and keeps each check O(1) in the output length.
        self.tail = max((len(s) for s in stop), default=0) + 2

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        new = input_ids[:, self.prompt_len:]
        tails = self.tokenizer.batch_decode(new[:, -self.tail:], skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stop) for t in tails], device=input_ids.device)


class Sampler:
    """Temperature / nucleus (top-p) sampling of the next token, drawn from a seeded `torch.Generator` on the
    logits' device (its state is what a GRPO checkpoint saves, so a resumed run draws the same tokens).

    top-p keeps the most probable tokens up to and including the first whose cumulative probability reaches
    `top_p` (HF's TopPLogitsWarper keeps the same set), then renormalises; 1.0 keeps every token."""

    def __init__(self, temperature: float, top_p: float, generator: torch.Generator):
        if temperature <= 0 or not 0 < top_p <= 1:
            raise ValueError(f"sampling needs temperature > 0 and top_p in (0, 1], got {temperature}, {top_p}")
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self._nan: torch.Tensor | None = None  # on the logits' device: a NaN row seen since the last `took_nan`

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] logits -> [B] sampled ids."""
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        # NaN or +inf logits (a diverged policy) give NaN probabilities, which the race below would turn into a token:
        # flagged on the device, read once a rollout (`took_nan`), not with a sync a token.
        nan = probs.isnan().any()
        self._nan = nan if self._nan is None else self._nan | nan
        if self.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p  # the mass of the more probable tokens
            sorted_p = torch.where(before < self.top_p, sorted_p, torch.zeros((), device=probs.device))
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        # The exponential race torch.multinomial runs for one draw (argmax of p / Exp(1)): the same draws from the
        # same generator state, without multinomial's checks of its input (host reads in some torch versions).
        race = torch.empty_like(probs).exponential_(1, generator=self.generator)
        return (probs / race).argmax(-1)

    def took_nan(self) -> bool:
        """Whether any row's logits were NaN or +inf since the last call (one host read)."""
        nan, self._nan = self._nan, None
        return nan is not None and bool(nan)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] logits -> [B] the most probable ids (the eval's decoding)."""
    return logits.float().argmax(-1)


def left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for i, ids in enumerate(batch):
        input_ids[i, width - len(ids):] = torch.tensor(ids, dtype=torch.int64)
        mask[i, width - len(ids):] = 1
    return input_ids, mask


def generate_greedy(model, tokenizer, prompts: list[list[int]], *, eos_ids: list[int], pad_id: int,
                    stop: list[str], max_new_tokens: int, batch_size: int,
                    progress=None) -> tuple[list[Generation], float]:
    """Greedy answers for token-id prompts (in their order) and the seconds spent generating.

    `model` is an HF causal LM on its device, or anything with a `greedy_batch` like `hf_greedy_batch`
    (a `StreamedModel`). Prompts are batched by length so that little of each batch is padding.
    """
    run_batch = getattr(model, "greedy_batch", None) or partial(hf_greedy_batch, model)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    results: list[Generation | None] = [None] * len(prompts)
    seconds = 0.0
    for lo in range(0, len(order), batch_size):
        idx = order[lo:lo + batch_size]
        input_ids, mask = left_pad([prompts[i] for i in idx], pad_id)
        stop_criteria = [StopOnStrings(tokenizer, stop, input_ids.shape[1])] if stop else []
        t0 = time.perf_counter()
        with torch.inference_mode():
            new = run_batch(input_ids, mask, max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id,
                            stop_criteria=stop_criteria)
        seconds += time.perf_counter() - t0  # new ids are on the host: the device work is done
        for row, i in enumerate(idx):
            results[i] = _finish(tokenizer, new[row].tolist(), eos_ids, pad_id, stop)
        if progress is not None:
            progress(min(lo + batch_size, len(order)), len(order))
    return results, seconds


def hf_greedy_batch(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                    eos_ids: list[int], pad_id: int, stop_criteria: list) -> torch.Tensor:
    """One left-padded batch through HF `generate`: the new ids (on the host), rows that ended early
    filled with pad ids. HF adds the eos criterion itself from the generation config."""
    from transformers import GenerationConfig, StoppingCriteriaList

    device = next(model.parameters()).device
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_ids,
                              pad_token_id=pad_id)
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         generation_config=config,
                         stopping_criteria=StoppingCriteriaList(stop_criteria) if stop_criteria else None)
    return out[:, input_ids.shape[1]:].cpu()


def stopping_rules(eos_ids: list[int], stop_criteria: list):
    """What ends a row, for a decoding loop of our own: the criteria HF `generate` applies (its eos
    criterion plus ours), called on the whole sequence after each new token."""
    from transformers import EosTokenCriteria, StoppingCriteriaList

    return StoppingCriteriaList([EosTokenCriteria(eos_ids), *stop_criteria])


def _finish(tokenizer, new_ids: list[int], eos_ids: list[int], pad_id: int, stop: list[str],
            length: int | None = None) -> Generation:
    """Cut one row's new ids at eos, decode, and cut the text at the first stop string.

    Rows that finish early are filled with pad ids by `generate`; those are not the model's tokens. `length`:
    how many the model produced, where the decoder counted them (StreamedModel.decode_batch): the ids past it
    are filler even when the pad id is an eos id.
    """
    new_ids = new_ids if length is None else new_ids[:length]
    end = len(new_ids)
    for j, t in enumerate(new_ids):
        if t in eos_ids:
            end = j + 1
            break
    ids = new_ids[:end]
    while length is None and ids and ids[-1] == pad_id and pad_id not in eos_ids:
        ids.pop()
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for s in stop:
        cut = text.find(s)
        if cut >= 0:
            text = text[:cut]
    return Generation(text.strip(), len(ids))
