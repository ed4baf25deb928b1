"""The recipe's typed schema: every setting of `train`, `bench` and `eval`, with its type, default and doc.

Every field is a dataclass field with a `doc` in its metadata; validation, `--help`, the resolved print
and the commented example YAML all come from these classes (recipe/load.py); the rules their values obey
beyond their types are in recipe/checks.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union


def doc(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING):
    """A dataclass field carrying its documentation (the schema's single source of truth)."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass
class ModelConfig:
    path: Optional[str] = doc("Local Hugging Face model directory (config.json, *.safetensors, tokenizer). "
                              "Exactly one of path / preset.", None)
    preset: Optional[str] = doc("Named random-init shape instead of a path: tiny, 0.5b, 1.5b, 3b, 7b, 14b, "
                                "32b, 72b (Qwen2.5-shaped), llama3-8b, gemma2-9b, gemma3-12b (text), phi4-14b, "
                                "olmo2-7b; mixture of experts: qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b, "
                                "gpt-oss-20b, gpt-oss-120b.", None)
    dtype: Literal["bf16", "fp32"] = doc("Compute dtype on the device (master weights: train.master_weights).", "bf16")
    trust_remote_code: bool = doc("Allow model code shipped inside the model directory. Off unless you trust it.",
                                  False)
    tokenizer: Optional[str] = doc("Tokenizer directory; default: the model path, or the bundled offline "
                                   "tokenizer for presets.", None)
    seed: int = doc("Seed for random init of presets.", 0)
    allow_unverified: bool = doc("Train a decoder-only model type that has no parity test here (the list: "
                                 "models/families.py), with a warning. Off: such a model is refused.", False)
    freeze_vision: bool = doc("A vision-language model: keep its vision tower (patch embedding and layers) as it "
                              "is; off: the tower trains with the rest (docs/vlm.md).", False)
    freeze_projector: bool = doc("A vision-language model: keep its projector (Qwen2-VL's merger) as it is.", False)


@dataclass
class DataConfig:
    source: str = doc("A dataset: 'builtin:sample_math' (bundled), a local .json/.jsonl/.parquet file, a "
                      "directory saved by `datasets`, a Hugging Face dataset name, or 'registry:NAME' (an entry "
                      "of data.registry).", "builtin:sample_math")
    format: Literal["auto", "metamathqa", "gsm8k", "alpaca", "messages", "preference", "unpaired_preference"] = doc(
        "Record format; 'auto' detects it from the fields. 'messages' reads OpenAI (messages: role/content) and "
        "ShareGPT (conversations: from/value, human/gpt) chats. The preference methods (train.method) read TRL's "
        "'preference' ({prompt, chosen, rejected}, as text or as chat messages) and 'unpaired_preference' "
        "({prompt, completion, label}: KTO's); docs/preference.md.", "auto")
    fields: dict = doc("Field-name overrides, e.g. {query: question, response: answer}; `system` names a field "
                       "holding each record's system prompt.", factory=dict)
    template: Literal["auto", "chat", "plain"] = doc(
        "Prompt template: the tokenizer's chat template when it has one ('auto'), or the plain 'Question: ... "
        "Answer: ' one. Chat data (format messages) and 'chat' need a tokenizer with a chat template: without "
        "one the run is refused unless this is 'plain'.", "auto")
    train_on: Literal["all_assistant", "last_assistant"] = doc(
        "Which replies of a multi-turn chat carry loss: every assistant turn (with its end-of-turn token, as the "
        "template renders it), or only the last one (earlier turns are context).", "all_assistant")
    system_prompt: Optional[str] = doc("A system message given to every example that has none of its own "
                                       "(training and eval alike); null: none.", None)
    registry: Optional[str] = doc("A dataset registry file (YAML or JSON, like LLaMA-Factory's dataset_info): "
                                  "name -> {path or hub, format, columns, split, max_samples}; paths in it are "
                                  "relative to its folder. Needed by 'registry:NAME' and data.datasets.", None)
    datasets: list = doc("Registry datasets mixed into one: [{name: a, weight: 3}, {name: b, weight: 1}] (or bare "
                         "names). With weights, each dataset's share of the examples is its weight's share; without "
                         "any, every example of each. Replaces data.source.", factory=list)
    mix_size: Optional[int] = doc("Examples in a weighted mixture; null: the most that repeats no example (the "
                                  "first dataset to run out decides). Larger: smaller datasets repeat, each "
                                  "example once per pass.", None)
    split: Optional[str] = doc("Dataset split to read (for hub / saved datasets); None takes 'train'.", None)
    test_fraction: float = doc("Held-out fraction for the seeded random train/test split (paper: 0.3).", 0.3)
    test_source: Optional[str] = doc("An explicit test set instead of the random split (a data.source value, "
                                     "'registry:NAME' included; its 'test' split where it has splits); data.source "
                                     "is then all train split (eval's few-shot pool). GSM8K's own test set: "
                                     "data.source=openai/gsm8k:main data.test_source=openai/gsm8k:main.", None)
    split_seed: int = doc("Seed of the train/test split and of a mixture's draw (data.datasets).", 1234)
    max_samples: Optional[int] = doc("Use at most this many records (before splitting; a mixture's total).", None)
    packing: bool = doc("Pack several examples per row (positions reset; each example attends only to itself, "
                        "through the varlen attention kernel on CUDA: no mask, at any train.seq_len) so no FLOPs "
                        "go to padding. Chats with images pack too, each with its own multimodal positions "
                        "(docs/vlm.md); Gemma 3's are refused (its image tokens attend both ways).", True)
    num_proc: int = doc("Processes for tokenisation.", 1)
    cache_dir: Union[Literal["auto", "off"], str] = doc(
        "Cache of tokenised examples (keyed by the data, tokenizer, template and train_on): 'auto' (the user's "
        "cache directory: ~/.cache/megatrain/tokenized), a directory, or off.", "auto")


@dataclass
class TrainConfig:
    steps: Optional[int] = doc("Optimizer steps; exactly one of steps / epochs.", None)
    epochs: Optional[float] = doc("Passes over the training split; exactly one of steps / epochs.", None)
    micro_batch_size: int = doc("Sequences per micro-batch.", 1)
    grad_accum: int = doc("Micro-batches per optimizer step.", 1)
    seq_len: int = doc("Tokens per sequence (packed rows are this long).", 2048)
    lr: float = doc("Peak learning rate.", 1e-5)
    min_lr_ratio: float = doc("Final learning rate as a fraction of lr (cosine / linear schedules).", 0.0)
    weight_decay: float = doc("AdamW weight decay, applied to matrices only (not norms or biases).", 0.0)
    betas: list = doc("AdamW betas.", factory=lambda: [0.9, 0.999])
    eps: float = doc("AdamW epsilon.", 1e-8)
    warmup_steps: int = doc("Linear warm-up steps.", 0)
    schedule: Literal["cosine", "linear", "constant"] = doc("Learning-rate schedule after warm-up.", "cosine")
    max_grad_norm: Optional[float] = doc("Global gradient-norm clip; None disables clipping.", 1.0)
    seed: int = doc("Seed for data order.", 42)
    nan_policy: Literal["skip", "stop"] = doc("On a NaN/Inf loss or gradient: skip the step (counted) or stop.",
                                              "skip")
    max_skipped_fraction: float = doc(
        "nan_policy=skip: the largest share of the steps run so far that may be skipped, checked after every "
        "step; past it the run has diverged (a learning rate far too high, broken data or model config) and "
        "stops with exit 1, the last checkpoint kept and no final/ written. 1.0: no limit.", 0.5)
    max_skipped_steps: Optional[int] = doc(
        "nan_policy=skip: the most steps skipped in a row; one more stops the run as max_skipped_fraction does "
        "(a run that diverged late). null: no limit.", 10)
    max_wall_time: Optional[str] = doc("Stop cleanly after this much wall time (e.g. '3h50m', '90s'): checkpoint "
                                       "after the step in flight and exit with the preemption code; null: no limit.",
                                       None)
    master_weights: Literal["fp32", "bf16"] = doc(
        "Master weights on the host: 'fp32' (14 bytes/param of host state with bf16 compute) or 'bf16' (12: the "
        "Adam moments stay fp32; what lets a ~117B model such as gpt-oss-120b fit a 1.5 TB host). With bf16 each "
        "update is computed in fp32 and stored as bf16 as train.master_rounding says (stochastic by default: round "
        "to nearest loses every update below half a bf16 step of its weight, about 0.4% of it; measured on "
        "SmolLM2-135M in docs/precision.md). It also turns off engine.speculate_optimizer (a rounded weight "
        "cannot be corrected exactly): every update waits for the step's gradient norm. Needs model.dtype bf16; "
        "a checkpoint resumes only with the setting it was written with.", "fp32")
    master_rounding: Literal["nearest", "stochastic"] = doc(
        "How an update's fp32 result is stored in a bf16 master (train.master_weights bf16; fp32 masters store it "
        "as it is, whatever this says): 'nearest' (round to "
        "nearest even: an update below half a bf16 step of its weight is lost) or 'stochastic' (rounded up with "
        "probability (dropped part) / (one bf16 step), so small updates survive on average; the random bits a "
        "hash of train.seed, tile, step and element: runs and resumes reproduce bit for bit). Host and "
        "resident layers alike. The default since SmolLM2-135M's SFT measured it: nearest stalled at a loss "
        "of 0.17 where fp32 masters and stochastic rounding reached 0.0003 (docs/precision.md).", "stochastic")
    optimizer_state: Literal["fp32", "bf16", "int8"] = doc(
        "Adam moments on the host (and on the device for resident layers): 'fp32' (8 bytes/param, torch's AdamW "
        "bit for bit), 'bf16' (4: written back with stochastic rounding seeded by train.seed), 'int8' (~2.03: "
        "8-bit codes in 64-element blocks, the second moment coded as its square root). With "
        "train.master_weights bf16 and int8 moments the host holds ~6 bytes/param with bf16 compute. The "
        "narrower formats turn off engine.speculate_optimizer and deferred moments (a coded moment cannot be "
        "corrected exactly); checkpoints hold the moments as fp32 and resume under any setting "
        "(docs/precision.md).", "fp32")
    method: Literal["sft", "dpo", "ipo", "simpo", "orpo", "kto", "grpo"] = doc(
        "What the loss is: 'sft' the token-mean cross-entropy on the replies; the preference methods train on "
        "preference data (data.format preference / unpaired_preference) with the loss averaged over pairs (KTO: "
        "examples): 'dpo' (with a reference), 'ipo' (reference, per-token means), 'simpo' and 'orpo' (no "
        "reference), 'kto' (reference, unpaired labelled examples). Their settings: the preference section. "
        "'grpo': online RL on prompts with a gold answer, completions sampled from the weights being trained and "
        "scored by rewards (the grpo section; docs/grpo.md).",
        "sft")


@dataclass
class PreferenceConfig:
    beta: float = doc("beta of DPO, IPO (the paper's tau), SimPO and KTO: how far the policy may move from the "
                      "reference (TRL's DPOConfig / CPOConfig / KTOConfig beta). SimPO's paper uses 2 to 10.", 0.1)
    label_smoothing: float = doc("Conservative DPO (cDPO): the probability that a pair's labels are flipped, in "
                                 "[0, 0.5); DPO and SimPO only (TRL's label_smoothing).", 0.0)
    simpo_gamma: float = doc("SimPO's target reward margin gamma (TRL's CPOConfig.simpo_gamma); the loss "
                             "subtracts gamma / beta from the mean log-prob margin.", 0.5)
    orpo_lambda: float = doc("ORPO's lambda: the weight of the odds-ratio term next to the chosen NLL (TRL's "
                             "ORPOConfig.beta).", 0.1)
    desirable_weight: float = doc("KTO: the weight of desirable examples' losses (TRL's KTOConfig); keep "
                                  "desirable_weight * n_desirable / (undesirable_weight * n_undesirable) in "
                                  "[1, 4/3].", 1.0)
    undesirable_weight: float = doc("KTO: the weight of undesirable examples' losses (TRL's KTOConfig).", 1.0)
    reference_cache: Union[Literal["auto", "off"], str] = doc(
        "Cache of the reference's per-sequence log-probs (keyed by the data, tokenizer, template and model "
        "files), reused by a rerun or a resume: 'auto' (the user's cache directory: "
        "~/.cache/megatrain/reference), a directory, or off.", "auto")


@dataclass
class GRPOConfig:
    num_generations: int = doc("Completions sampled per prompt each step (the group G its advantages are relative "
                               "to); >= 2. A step trains on train.micro_batch_size x train.grad_accum completions "
                               "(one per row), which must be a multiple of it: that many / G prompts a step (TRL's "
                               "rule).", 8)
    max_new_tokens: int = doc("The longest completion, in tokens; a prompt plus it must fit train.seq_len.", 256)
    temperature: float = doc("Sampling temperature (> 0).", 1.0)
    top_p: float = doc("Nucleus sampling: the smallest set of tokens whose probability reaches top_p, in (0, 1]; "
                       "1 samples from the whole distribution.", 1.0)
    epsilon: float = doc("The ratio clip of the objective: min(r A, clip(r, 1 - epsilon, 1 + epsilon) A) (TRL's "
                         "GRPOConfig.epsilon). With one policy update per batch of rollouts (what runs: TRL's "
                         "num_iterations 1) the ratio is 1 and nothing clips, so it changes nothing yet.", 0.2)
    beta: float = doc("The weight of the KL term to the initial policy (k3 estimator); 0 (TRL's default) runs no "
                      "reference pass. > 0: the initial weights' log-probs of every completion, from a streamed pass "
                      "over a host copy of them (4 bytes/param more host memory, no second copy on the device).",
                      0.0)
    rewards: list = doc("Rewards, summed: 'exact_match' (1 when the completion's final answer, as the eval reads it, "
                        "matches the example's gold answer), 'format' (1 when the answer is after a marker: 'The "
                        "answer is', '####', \\boxed{}), or 'module:function' (a Python function of (prompt, "
                        "completion, example) -> float, imported at start).", factory=lambda: ["exact_match"])


@dataclass
class EngineConfig:
    device: Literal["auto", "cpu", "cuda"] = doc("Where layers compute; 'auto' takes cuda when present.", "auto")
    checkpoint_interval: int = doc("Keep an activation checkpoint every N layers; backward recomputes each "
                                   "block of N layers from it.", 4)
    grad_slabs: int = doc("K pinned gradient slabs between the GPU and the host optimizer.", 12)
    loss_chunk_tokens: int = doc("Tokens per chunk of the LM-head loss, so full logits never exist.", 4096)
    max_gpu_mem: Optional[str] = doc("Device-memory budget (e.g. '24GiB'); None: what the device has.", None)
    double_buffer: bool = doc("Prefetch the next layer's weights while this one computes (CUDA).", True)
    overlap_optimizer: bool = doc("Run host AdamW in a background thread, overlapping the GPU (CUDA).", True)
    speculate_optimizer: bool = doc("Update each layer as its gradients land, before the global gradient norm "
                                    "is known; when the step turns out clipped they are corrected (exact to fp32 "
                                    "rounding), when it is not finite rolled back. Needs overlap_optimizer.", True)
    keep_activations: Union[int, str] = doc("Memory-adaptive recompute: how many of the last blocks keep their "
                                            "activations instead of being recomputed; 'auto' = as many as fit "
                                            "the device budget (0 on CPU).", "auto")
    resident_layers: Union[int, str] = doc("The first N decoder layers, and with them the head, keep their master "
                                           "weights, Adam moments and gradients on the device and are updated there: "
                                           "no transfers and no host AdamW for them, 16 bytes/param of device memory "
                                           "(bf16); 'auto' = as many as fit the device budget before kept "
                                           "activations take the rest, or more on the memory-lean path when it "
                                           "fits them at the same recompute and offloads nothing (0 on CPU, on "
                                           "the long-context path and when the step itself needs the memory-lean "
                                           "path). One process only.",
                                           "auto")
    kernels: Literal["auto", "torch", "triton"] = doc("Fused kernels: 'auto' uses Triton on CUDA, PyTorch on "
                                                      "CPU.", "auto")
    host_adamw: Literal["auto", "torch", "cpp"] = doc("Host AdamW code: 'cpp' (C++ compiled at first use: one "
                                                      "pass that reads bf16 gradients as they are), 'torch' (torch's "
                                                      "fused CPU AdamW over fp32-widened gradients), 'auto' = cpp "
                                                      "where it compiles, else torch with one warning.", "auto")
    update_on_read: bool = doc("With deferred moments: the packer applies a clipped step's weight update to each "
                               "tile as the next forward streams it, casting the new weights straight into pinned "
                               "staging (20 instead of 24 bytes/param of host memory traffic where the forward "
                               "waits). One process, host casts. Bit-identical either way.", True)
    defer_moments: bool = doc("With the C++ kernel: an update that waits for the gradient norm (a clipped step) "
                              "stores the new weights first and the Adam moments later, off the next forward's "
                              "critical path. Bit-identical either way.", True)
    layer_slots: int = doc("Device weight buffers for decoder layers (>= 2): one computes while the next "
                           "arrives; more let a block's backward reuse recomputed weights.", 2)
    sdpa: Literal["auto", "flash", "cudnn", "efficient", "math"] = doc(
        "SDPA backends on CUDA: 'auto' leaves PyTorch's choice on the short-context path and allows cuDNN, "
        "flash and memory-efficient (never math) on the long-context one; a name forces that backend.", "auto")
    long_context_min_seq: Optional[int] = doc(
        "train.seq_len from which the long-context path runs (checkpoint interval 1, MLP chunked over the "
        "sequence, checkpoints offloaded to pinned host memory as needed); null: never.", 32768)
    memory_fallback: bool = doc("When the short-context plan does not fit the device budget, take the "
                                "memory-lean path (the long-context machinery at any length) instead of "
                                "refusing the run.", True)
    packer_threads: Optional[int] = doc("Intra-op threads of the packer's fp32 -> bf16 casts (CUDA); null: "
                                        "torch's default, every core.", None)
    adamw_threads: Optional[int] = doc("Intra-op threads of host AdamW in its background thread; null: "
                                       "torch's default, every core.", None)
    overlap_ranks: bool = doc("With several ranks on CUDA: overlap each rank's shard transfers and collectives "
                              "with compute; false runs the synchronous reference path.", True)


@dataclass
class StoreConfig:
    disk: Optional[str] = doc(
        "A folder on a local disk (an NVMe) for the disk tier: part of the optimizer state (store.disk_state) lives "
        "in per-layer files there, read ahead of the host AdamW and written behind it on their own threads, so "
        "the host holds a few layers of it at a time. The files are scratch (removed when the run ends, killed or "
        "not; checkpoints are unchanged and resume with or without the tier). Needs free space for that state; "
        "docs/precision.md prices it. null: all state in host memory.", None)
    disk_state: Literal["auto", "moments", "moments+masters"] = doc(
        "What the disk tier holds: 'moments' (the Adam moments: read and written once a step, by the update), "
        "'moments+masters' (the master weights too: also read by every layer transfer, through the page cache), "
        "or 'auto': none while the host holds everything, else the least of the two that fits the host "
        "(engine.memory_fallback on; the plan says which). Needs store.disk.", "auto")
    disk_in_flight: int = doc("Layers the disk tier reads ahead of the host AdamW (>= 1): what it holds in host "
                              "memory is about this many layers' state plus those being written behind.", 2)


@dataclass
class CheckpointConfig:
    every_n_steps: Optional[int] = doc("Write a resumable checkpoint every N steps (>= 1); null: only at the "
                                       "end (every run ends with one, which `megatrain export` reads).", None)
    keep_last_n: int = doc("Keep this many step checkpoints.", 2)
    resume: Optional[str] = doc("'auto' (latest in output_dir), a checkpoint path, or None.", None)
    export_final: bool = doc("Write output_dir/final/ in Hugging Face format at the end.", True)


@dataclass
class LoggingConfig:
    every_n_steps: int = doc("Log a metrics line every N steps.", 1)
    dashboard: Literal["auto", "rich", "plain", "off"] = doc("Live view: 'auto' = rich on a terminal, plain "
                                                             "lines otherwise.", "auto")
    jsonl: bool = doc("Append every logged step to output_dir/metrics.jsonl.", True)
    tensorboard: bool = doc("Also write TensorBoard scalars to output_dir/tensorboard/ (needs the tensorboard "
                            "package: `pip install 'megatrain[tensorboard]'`; a run that asks without it is "
                            "refused).", False)
    wandb: Literal["off", "offline", "online"] = doc(
        "Weights & Biases: 'offline' writes run files under output_dir/wandb/ (`wandb sync` uploads them "
        "later), 'online' logs to the W&B server (after `wandb login`). Needs the wandb package: `pip install "
        "'megatrain[wandb]'`.", "off")
    mlflow: bool = doc("Also log to MLflow at logging.mlflow_tracking_uri (needs the mlflow package: `pip "
                       "install 'megatrain[mlflow]'`).", False)
    mlflow_tracking_uri: Optional[str] = doc(
        "MLflow tracking URI: a local folder (a file store), sqlite:///FILE or http(s)://SERVER; null: "
        "output_dir/mlruns.", None)
    project: str = doc("The W&B project and the MLflow experiment the run is logged under.", "megatrain")
    run_name: Optional[str] = doc("The run's name in W&B and MLflow; null: the name of output_dir's folder.", None)


@dataclass
class EvalConfig:
    enabled: bool = doc("Run exact-match eval on the held-out split at the end of training (a preference method: "
                        "the held-out pairs' loss, rewards and accuracy instead, in output_dir/eval/results.json).",
                        False)
    limit: Optional[int] = doc("Evaluate at most N examples (the first N of the split); null: all of them.", 64)
    batch_size: int = doc("Prompts per generation batch (streamed generation: tokens/s grows with it, each step "
                          "streams the whole model once).", 8)
    max_new_tokens: int = doc("Generation length limit.", 256)
    num_fewshot: int = doc("Solved examples put before each question (GSM8K protocol: 5 in lm-evaluation-harness, "
                           "8 for chain of thought), drawn from the train split, seeded per question.", 0)
    fewshot_seed: int = doc("Seed of the few-shot draw (lm-evaluation-harness: 1234).", 1234)
    prompt: Literal["auto", "chat", "plain"] = doc("How questions are put: 'auto' as data.template says; 'chat' the "
                                                   "tokenizer's chat template (few-shot examples as earlier turns); "
                                                   "'plain' 'Question: ... Answer: ' text.", "auto")
    extract: Literal["strict", "flexible"] = doc("Reading the model's answer: 'strict' only after a marker ('The "
                                                 "answer is', '####', \\boxed{}); 'flexible' also the last number. "
                                                 "results.json gives both scores.", "flexible")
    every_n_steps: Optional[int] = doc("Validation loss on the held-out split every N steps and after the last "
                                       "(forward only, layers streamed; those steps are logged whatever "
                                       "logging.every_n_steps says; a preference method: the held-out pairs' "
                                       "loss and val_rewards/*); null: off.", None)
    val_batches: int = doc("Micro-batches of the held-out split each validation pass runs (the same rows every "
                           "time; fewer when the split has fewer rows).", 8)


@dataclass
class BenchConfig:
    doc_lengths: Literal["synthetic", "data"] = doc(
        "`megatrain bench` with data.packing=true: where its packed rows' documents come from. 'synthetic': "
        "lengths drawn from a log-normal (bench.doc_len_mean, bench.doc_len_spread), random tokens; 'data': "
        "data.source's training rows exactly as `train` builds them (tokenised, cut to train.seq_len, packed). "
        "Read by bench only; without packing its rows are one synthetic document each.", "synthetic")
    doc_len_mean: int = doc("Mean length in tokens of the synthetic documents (each cut to train.seq_len).", 512)
    doc_len_spread: float = doc("Sigma of the log-normal of the synthetic lengths: 0 makes every document "
                                "bench.doc_len_mean tokens long; 1 is the long tail of chat and instruction data.",
                                1.0)
    images_per_row: int = doc("A vision-language model's bench rows: synthetic images per row (bench/vision_rows.py); "
                              "with data.packing, per document (bench.doc_len_mean sets the documents' text).", 1)
    image_size: int = doc("A vision-language model's bench images: pixels a side (448: 1024 patches, 256 tokens for "
                          "Qwen2-VL).", 448)


@dataclass
class Recipe:
    model: ModelConfig = doc("What to train.", factory=ModelConfig)
    data: DataConfig = doc("What to train on.", factory=DataConfig)
    train: TrainConfig = doc("Optimisation.", factory=TrainConfig)
    preference: PreferenceConfig = doc("The preference methods' hyper-parameters (train.method; TRL's names and "
                                       "defaults).", factory=PreferenceConfig)
    grpo: GRPOConfig = doc("GRPO's settings (train.method grpo): sampling, the objective, the rewards.",
                           factory=GRPOConfig)
    engine: EngineConfig = doc("How layers stream.", factory=EngineConfig)
    store: StoreConfig = doc("Where the training state lives beside host memory: the disk tier.", factory=StoreConfig)
    checkpoint: CheckpointConfig = doc("Checkpoints and resume.", factory=CheckpointConfig)
    logging: LoggingConfig = doc("Metrics and the live view.", factory=LoggingConfig)
    eval: EvalConfig = doc("Held-out exact-match eval.", factory=EvalConfig)
    bench: BenchConfig = doc("What `megatrain bench` times besides the training settings: its packed rows' "
                             "documents.", factory=BenchConfig)
    output_dir: str = doc("Where checkpoints, metrics and final/ go.", "runs/default")


class RecipeError(ValueError):
    """All problems found in a recipe, one per line, each with its dotted path."""

    def __init__(self, problems: list[str], source: str = "recipe"):
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))
