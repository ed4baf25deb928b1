"""A GRPO run's part of the loop (train.method grpo; docs/grpo.md): its prompts, rewards, rollouts and the state
a checkpoint keeps of them.

`prepare` reads the prompts (data/rollout_prompts.py) and imports the rewards before anything is written (every
refusal exit 2). The run then stands where the loop's training rows stand: `next_step` draws the step's prompts
(a seeded, resumable order; train.micro_batch_size x train.grad_accum / grpo.num_generations of them), samples grpo.num_generations completions of each from the weights the trainer holds
now (train/rollout.py), scores them (data/rewards.py), turns the rewards into group-relative advantages
(methods/grpo.py) and hands back the micro-batches the engine trains on, in one backward; `state_dict` is the
prompt order's position and the sampler generator's state, so a resumed run samples what the uninterrupted one
would. With grpo.beta > 0 each step's completions are also scored by the initial weights (`InitialPolicy`).
"""

from __future__ import annotations

import base64
import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch

from megatrain_cli.data.errors import DataError
from megatrain_cli.methods import GRPO, make_method
from megatrain_cli.methods.grpo import group_advantages
from megatrain_cli.data.rewards import RewardError, resolve_rewards, score
from megatrain_cli.recipe import Recipe
from megatrain_cli.train.errors import TrainingError


@dataclass
class GRPORun:
    r: Recipe
    method: GRPO
    prompts: list  # data.rollout_prompts.Prompt, the training split's
    order: object  # data.rollout_prompts.PromptOrder
    rewards: list  # (name, function)
    left_out: str  # what the data left out, said at the start ('' when nothing)
    bound: dict = field(default_factory=dict)  # engine, store, device, tokenizer, sampler, initial (bind)
    last: dict = field(default_factory=dict)  # the last step's rollout metrics (step_metrics)
    log: object = print

    # ---------------------------------------------------------------- what the loop reads of its data
    @property
    def num_rows(self) -> int:
        return len(self.prompts)

    @property
    def prompts_per_step(self) -> int:
        """train.micro_batch_size x train.grad_accum completions a step, num_generations of each prompt."""
        return self.r.train.micro_batch_size * self.r.train.grad_accum // self.r.grpo.num_generations

    def steps_per_epoch(self, micro_batch_size: int, grad_accum: int) -> int:
        return math.ceil(len(self.prompts) / self.prompts_per_step)

    def state_dict(self) -> dict:
        generator = self.bound["sampler"].generator
        return {"order": self.order.state_dict(), "sampler_device": generator.device.type,
                "sampler": base64.b64encode(generator.get_state().numpy().tobytes()).decode()}

    def load_state_dict(self, state: dict) -> None:
        if "sampler" not in state:
            raise TrainingError("the checkpoint holds no GRPO state (written by another train.method): resume a GRPO "
                                "run's checkpoint, or start without checkpoint.resume", 2)
        self.order.load_state_dict(state["order"])
        generator = self.bound["sampler"].generator
        written = state.get("sampler_device", generator.device.type)
        if written != generator.device.type:  # a CUDA generator's state is not a CPU one's (set_state raises)
            raise TrainingError(f"the checkpoint's rollout sampler ran on {written}, this run samples on "
                                f"{generator.device.type}: resume with engine.device={written} (the sampled "
                                f"completions continue exactly only there)", 2)
        raw = bytearray(base64.b64decode(state["sampler"]))
        generator.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())

    def describe(self) -> str:
        g = self.r.grpo
        return (f"grpo: {len(self.prompts)} prompts, {self.prompts_per_step} per step x {g.num_generations} completions "
                f"of up to {g.max_new_tokens} tokens (temperature {g.temperature}, top_p {g.top_p}), rewards "
                f"{' + '.join(name for name, _ in self.rewards)}, epsilon {g.epsilon}, beta {g.beta}"
                + (f"; {self.left_out}" if self.left_out else ""))

    # ---------------------------------------------------------------- the run
    def bind(self, engine, store, device: torch.device, tokenizer, log, plan) -> None:
        """What sampling needs, once the engine is built (before a resume restores the sampler's state); with
        beta > 0 the initial weights copied aside now, before a resume loads a checkpoint."""
        from megatrain_cli.data.prompts import eos_id, pad_id, stop_strings, uses_chat_template
        from megatrain_cli.data.turns import end_of_turn_id
        from megatrain_cli.eval.generate import Sampler

        g = self.r.grpo
        generator = torch.Generator(device=device)
        generator.manual_seed(self.r.train.seed)
        chat = uses_chat_template(tokenizer, self.r.data.template, self.prompts[0].example.chat)
        eos = sorted({eos_id(tokenizer), *([end_of_turn_id(tokenizer)] if chat else [])} - {None})
        self.bound = dict(engine=engine, store=store, device=device, tokenizer=tokenizer, eos=eos,
                          pad=pad_id(tokenizer), stop=stop_strings(tokenizer, self.r.data.template,
                                                                   self.prompts[0].example.chat),
                          sampler=Sampler(g.temperature, g.top_p, generator), initial=None)
        self.log = log
        if self.method.needs_reference:
            from megatrain_cli.train.initial_policy import InitialPolicy

            self.bound["initial"] = InitialPolicy(self.r, store, device, plan)

    def next_step(self, micro_batch_size: int, grad_accum: int) -> list:
        """The step's micro-batches: its prompts' completions sampled, scored and laid out in rows."""
        from megatrain_cli.train.rollout import rollout_rows, sample

        b, g = self.bound, self.r.grpo
        # Pending host updates land; resident layers and head stay on the device and are read there in place
        b["engine"].synchronize(masters=False)
        picked = [self.prompts[i] for i in self.order.take(self.prompts_per_step)]
        rollouts = sample(b["store"], b["device"], b["tokenizer"], [p.ids for p in picked], g.num_generations,
                          b["sampler"], max_new_tokens=g.max_new_tokens, eos_ids=b["eos"], pad_id=b["pad"],
                          stop=b["stop"], engine=b["engine"])
        if b["sampler"].took_nan():
            raise TrainingError("grpo: the policy's logits were NaN or infinite while sampling rollouts (training "
                                "diverged): resume from an earlier checkpoint with a lower train.lr", 1)
        if rollouts.decode_path != self.bound.get("decode_path"):  # said at the first rollout and on a change
            self.bound["decode_path"] = rollouts.decode_path
            self.log(f"grpo: rollouts decode {rollouts.decode_path}")
        t0 = time.perf_counter()
        values, errors = [], 0
        for k, text in enumerate(rollouts.texts):
            prompt = picked[k // g.num_generations]
            value, problems = score(self.rewards, prompt.example.prompt, text, prompt.example)
            for problem in problems:
                self.log(problem.describe())
            errors += len(problems)
            values.append(value)
        rewards = torch.tensor(values, dtype=torch.float64).view(len(picked), g.num_generations)
        broken = rewards.isnan().any(1, keepdim=True)  # a group with a failed score teaches nothing this step
        advantages = torch.where(broken, torch.zeros(()), group_advantages(rewards.nan_to_num(0.0)))
        mbs = rollout_rows(rollouts, advantages, micro_batch_size, b["pad"])
        scored = time.perf_counter() - t0
        reference = 0.0
        if b["initial"] is not None:
            reference = b["initial"].attach(mbs)
        lengths = torch.tensor([len(c) for c in rollouts.completion_ids], dtype=torch.float64)
        valid = rewards[~broken.expand_as(rewards)]
        self.last = {"reward": float(valid.mean()) if valid.numel() else math.nan,
                     "reward_std": float(rewards[~broken[:, 0]].std(1).mean()) if valid.numel() else math.nan,
                     "completion_length": float(lengths.mean()), "rollout_tokens": rollouts.new_tokens,
                     "rollout_tokens_per_s": rollouts.new_tokens / max(rollouts.seconds, 1e-9),
                     "time/generate": rollouts.seconds, "time/score": scored, "time/reference": reference,
                     "reward_errors": errors}
        return mbs

    def close(self) -> None:
        if self.bound.get("initial") is not None:
            self.bound["initial"].close()

    def step_metrics(self, res) -> dict:
        """The last step's rollout figures, and the engine's share of the step (forward, backward, optimizer)."""
        train = res.times.get("total_fb", 0.0) + res.times.get("optimizer", 0.0)
        return {**self.last, "time/train": train, "train_tokens_per_s": res.tokens / max(train, 1e-9)}


def prepare(r: Recipe, tokenizer, dist=None) -> GRPORun:
    """The method, its rewards and prompts, read and checked before anything is written (exit 2 on a refusal)."""
    from megatrain_cli.data.load import source_label, split_examples
    from megatrain_cli.data.rollout_prompts import PromptOrder, encode_prompts, load_prompt_examples, usable

    if dist is not None:
        raise TrainingError("train.method grpo runs in one process: drop --gpus (its rollouts sample from the "
                            "weights one process holds)", 2)
    g, t = r.grpo, r.train
    try:
        rewards = resolve_rewards(list(g.rewards))
    except RewardError as err:
        raise TrainingError(str(err), 2) from None
    label = source_label(r.data)
    room = t.seq_len - g.max_new_tokens
    if room < 1:
        raise TrainingError(f"grpo.max_new_tokens={g.max_new_tokens} leaves no room for a prompt in train.seq_len="
                            f"{t.seq_len}: raise train.seq_len or lower grpo.max_new_tokens", 2)
    try:
        examples = load_prompt_examples(r.data)
        train_ex, _test = split_examples(examples, r.data)
        kept, no_answer = usable(train_ex, label, need_answers="exact_match" in g.rewards)
        prompts, too_long = encode_prompts(kept, tokenizer, r.data, room)
        order = PromptOrder(len(prompts), t.seed)
    except DataError as err:
        raise TrainingError(str(err), 2) from None
    if r.eval.enabled:  # the end-of-training eval reads the data as `megatrain eval` does: known now, not after
        from megatrain_cli.data.load import load_examples

        try:
            load_examples(dataclasses.replace(r.data, max_samples=1))
        except DataError as err:
            raise TrainingError(f"eval.enabled: the end-of-training eval cannot read the data ({err}); set "
                                f"eval.enabled=false and evaluate final/ with `megatrain eval` on data it reads", 2) \
                from None
    left = [f"{no_answer} without a gold answer"] if no_answer else []
    if too_long:
        left.append(f"{too_long} prompts longer than train.seq_len - grpo.max_new_tokens = {room} tokens")
    left_out = f"left out of {len(train_ex)}: {', '.join(left)}" if left else ""
    return GRPORun(r, make_method("grpo", grpo=g), prompts, order, rewards, left_out)
