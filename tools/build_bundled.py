#!/usr/bin/env python
"""Builds the bundled code target `src/pdflash/models/pdflash-moe-code/`.

A small Qwen3-MoE pre-trained on Python source that every pdflash install has: the running
Python's standard library and the Python sources of the installed `torch` (pinned by pdflash).
Stages (each a subcommand, `all` runs them in order):

  data       list the .py files, split off a deterministic ~2% held-out set of stdlib files
  tokenizer  train a byte-level BPE (`tokenizers`) with the ChatML / DFlash special tokens
  target     pre-train the Qwen3-MoE with `transformers` (time-boxed by --minutes), export
             float16 in the Hugging Face layout pdflash loads, check pdflash == transformers
  eval       held-out bits per byte, greedy continuations (pdflash) of tools/prompts.py,
             repeated-4-gram share
  drafter    train the DFlash drafter with `pdflash train-drafter` on the target's continuations
  bench      benchmarks/bench_bundled.py: τ and DFlash / AR speedup on HumanEval headers
  card       write docs/model-card.md from the figures the stages left under --work

This is a build-time tool: it uses `transformers` for training; pdflash itself never does.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "src" / "pdflash" / "models" / "pdflash-moe-code"
DEFAULT_WORK = Path("/tmp/pdflash-build")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Directory names skipped anywhere: test suites, third-party packages, caches, and data tables
# dressed as code (codec maps, pydoc's topic dump, generated argument tables).
EXCLUDED_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "__pycache__",
    "turtledemo",
    "encodings",
    "pydoc_data",
    "generated",
}
MAX_FILE_BYTES = 500_000  # larger .py files are generated tables (op databases, kernel configs)
HELDOUT_PER_MILLE = 20  # ~2% of files, chosen by a hash of the relative path (stable across runs)


# --------------------------------------------------------------------------------------- data


def source_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        files += [
            Path(dirpath) / f
            for f in sorted(filenames)
            if f.endswith(".py") and (Path(dirpath) / f).stat().st_size <= MAX_FILE_BYTES
        ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def source_roots(args) -> dict[str, Path]:
    """Corpus roots by label: the stdlib, then each of --packages (an installed package's directory)."""
    import importlib.util

    roots = {"stdlib": Path(args.stdlib or sysconfig.get_paths()["stdlib"])}
    for name in args.packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"--packages: {name!r} is not an installed package")
        roots[name] = Path(list(spec.submodule_search_locations)[0])
    return roots


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 1000 < HELDOUT_PER_MILLE


def stage_data(args) -> dict:
    """Entries are "label/relative path". Held-out files come from the stdlib only (a hash of the
    path picks them), so held-out figures compare across corpora; package files all train."""
    roots = source_roots(args)
    versions = {"stdlib": sys.version.split()[0]} | {name: _version(name) for name in args.packages}
    split = {"roots": {k: str(v) for k, v in roots.items()}, "versions": versions, "train": [], "heldout": []}
    nbytes = {"train": 0, "heldout": 0}
    for label, root in roots.items():
        for path in tqdm(source_files(root), desc=f"listing {label}"):
            rel = path.relative_to(root).as_posix()
            text = path.read_bytes().decode("utf-8", errors="replace")
            if not text.strip():
                continue
            part = "heldout" if label == "stdlib" and is_heldout(rel) else "train"
            split[part].append(f"{label}/{rel}")
            nbytes[part] += len(text.encode("utf-8"))
    split["bytes"] = nbytes
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "split.json").write_text(json.dumps(split, indent=1))
    print(
        f"data: {len(split['train'])} train files ({nbytes['train']:,} B), "
        f"{len(split['heldout'])} held-out files ({nbytes['heldout']:,} B) from {', '.join(roots)}"
    )
    return split


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def load_split(args) -> dict:
    path = args.work / "split.json"
    return json.loads(path.read_text()) if path.is_file() else stage_data(args)


def split_paths(split: dict, part: str) -> list[Path]:
    roots = {label: Path(root) for label, root in split["roots"].items()}
    return [roots[label] / rel for label, rel in (entry.split("/", 1) for entry in split[part])]


def read_texts(split: dict, part: str) -> list[str]:
    return [path.read_bytes().decode("utf-8", errors="replace") for path in split_paths(split, part)]


# ---------------------------------------------------------------------------------- tokenizer


def stage_tokenizer(args) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    split = load_split(args)
    texts = read_texts(split, "train")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    started = time.perf_counter()
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHAT_TEMPLATE,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "additional_special_tokens": SPECIAL_TOKENS[1:],
                "model_max_length": args.max_positions,
            },
            indent=2,
        )
    )
    heldout = read_texts(split, "heldout")
    n_tok = sum(len(e.ids) for e in tokenizer.encode_batch(heldout))
    n_bytes = sum(len(t.encode()) for t in heldout)
    stats = {
        "vocab_size": tokenizer.get_vocab_size(),
        "heldout_bytes_per_token": n_bytes / n_tok,
        "train_s": time.perf_counter() - started,
    }
    (args.work / "tokenizer_stats.json").write_text(json.dumps(stats, indent=1))
    print(f"tokenizer: vocab {stats['vocab_size']}, {stats['heldout_bytes_per_token']:.3f} held-out bytes/token")


def load_tokenizer(args):
    from tokenizers import Tokenizer

    path = args.out / "tokenizer.json"
    if not path.is_file():
        stage_tokenizer(args)
    return Tokenizer.from_file(str(path))


def token_stream(args, part: str, seed: int | None) -> np.ndarray:
    """All files of `part` tokenized, each followed by <|endoftext|>, in a seeded shuffled order
    (held-out: listed order, stream starts with <|endoftext|>). Cached under --work."""
    cache = args.work / f"{part}-{args.vocab_size}.npy"
    if cache.is_file():
        return np.load(cache)
    tokenizer = load_tokenizer(args)
    eot = tokenizer.token_to_id("<|endoftext|>")
    texts = read_texts(load_split(args), part)
    encoded = [e.ids for e in tokenizer.encode_batch(texts)]
    order = list(range(len(encoded)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    stream = [eot] if part == "heldout" else []
    for i in order:
        stream += encoded[i] + [eot]
    array = np.asarray(stream, dtype=np.uint16)
    np.save(cache, array)
    return array


# ------------------------------------------------------------------------------------- target


def model_config_dict(args, vocab_size: int, eot: int) -> dict:
    return {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,  # dense MLP width (unused: every layer is MoE)
        "moe_intermediate_size": args.expert_width,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": args.max_positions,
        "tie_word_embeddings": args.tie,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "router_aux_loss_coef": args.aux_coef,
        "output_router_logits": False,
        "initializer_range": 0.02,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "bos_token_id": None,
        "torch_dtype": args.dtype,
    }


def build_model(cfg: dict, experts_impl: str):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype")})
    config.output_router_logits = True  # training: router load-balancing aux loss on
    model = Qwen3MoeForCausalLM(config)
    try:
        model.set_experts_implementation(experts_impl)
    except Exception:  # older API: set on the config
        config._experts_implementation = experts_impl
    with contextlib.suppress(Exception):
        model.set_attn_implementation("sdpa")
    return model


def export(model, cfg: dict, out: Path, dtype: torch.dtype, extra: dict | None = None) -> None:
    """Hugging Face Qwen3-MoE layout with one tensor per expert projection (what pdflash and hub
    checkpoints use), stored in `dtype`."""
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().to(torch.float32)
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name[: -len("gate_up_proj")], cfg["moe_intermediate_size"]
            for e in range(tensor.shape[0]):
                tensors[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :inter]
                tensors[f"{prefix}{e}.up_proj.weight"] = tensor[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                tensors[f"{prefix}{e}.down_proj.weight"] = tensor[e]
        elif name.endswith("mlp.gate.weight") or not name.endswith("rotary_emb.inv_freq"):
            tensors[name] = tensor
    if cfg["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    tensors = {k: v.to(dtype).contiguous() for k, v in sorted(tensors.items())}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg | (extra or {}), indent=2))


def lr_at(step: int, progress: float, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = min(1.0, progress)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def count_params(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    cfg = model.config
    per_expert = experts // max(1, cfg.num_experts * cfg.num_hidden_layers)
    active = total - experts + per_expert * cfg.num_experts_per_tok * cfg.num_hidden_layers
    return {"total": total, "experts": experts, "active_per_token": active}


def stage_target(args) -> dict:
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args)
    eot = tokenizer.token_to_id("<|endoftext|>")
    vocab = tokenizer.get_vocab_size()
    vocab = (vocab + 63) // 64 * 64  # round up: tidier matmuls; spare rows are never produced by the tokenizer
    cfg = model_config_dict(args, vocab, eot)
    data = torch.from_numpy(token_stream(args, "train", args.seed).astype(np.int64))
    model = build_model(cfg, args.experts_impl)
    params = count_params(model)
    print(
        f"target: {params['total']:,} params ({params['active_per_token']:,} active/token), "
        f"train stream {len(data):,} tokens"
    )
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    ctx, bs = args.context, args.batch
    budget = args.minutes * 60.0
    started = time.perf_counter()
    last_ckpt = started
    log = []
    ema = None
    step = 0
    tokens = 0
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    bar = tqdm(total=args.steps or None, desc="training target", unit="step", mininterval=5)
    model.train()
    while True:
        elapsed = time.perf_counter() - started
        progress = max(elapsed / budget if budget > 0 else 0.0, step / args.steps if args.steps else 0.0)
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - ctx - 1, (bs,), generator=gen)
        batch = torch.stack([data[s : s + ctx + 1] for s in starts.tolist()])
        out = model(input_ids=batch[:, :-1])
        lm_loss = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), batch[:, 1:].reshape(-1))
        aux = out.aux_loss if out.aux_loss is not None else torch.zeros(())
        loss = lm_loss + args.aux_coef * aux
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        step += 1
        tokens += bs * ctx
        value = lm_loss.item()
        ema = value if ema is None else 0.98 * ema + 0.02 * value
        if step % args.log_every == 0 or step == 1:
            now = time.perf_counter() - started
            entry = {
                "step": step,
                "tokens": tokens,
                "elapsed_s": round(now, 1),
                "lr": lr,
                "loss": value,
                "loss_ema": ema,
                "aux": float(aux),
                "grad_norm": gnorm,
                "tokens_per_second": tokens / now,
            }
            log.append(entry)
            print(json.dumps(entry), flush=True)
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.2e}", tps=f"{tokens / (time.perf_counter() - started):.0f}")
        if args.ckpt_minutes and time.perf_counter() - last_ckpt > args.ckpt_minutes * 60:
            export(model, cfg, args.out, dtype)
            last_ckpt = time.perf_counter()
            print(f"checkpoint exported at step {step}", flush=True)
    bar.close()
    wall = time.perf_counter() - started
    export(model, cfg, args.out, dtype)
    stats = {
        "steps": step,
        "tokens": tokens,
        "train_stream_tokens": len(data),
        "epochs": tokens / len(data),
        "wall_s": wall,
        "tokens_per_second": tokens / wall,
        "final_loss_ema": ema,
        "final_loss": log[-1]["loss"] if log else None,
        "params": params,
        "config": cfg,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"},
        "log": log,
    }
    (args.work / "train_stats.json").write_text(json.dumps(stats, indent=1))
    print(
        f"target: {step} steps, {tokens:,} tokens in {wall / 60:.1f} min ({tokens / wall:.0f} tok/s), "
        f"final loss (EMA) {ema:.3f}"
    )
    verify(args)
    return stats


def load_hf(out: Path):
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.eval()
    return model


def verify(args) -> float:
    """pdflash's loader reads the export and its logits equal transformers' on a held-out snippet."""
    from pdflash.target.loader import load_target

    config = json.loads((args.out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe", config["model_type"]
    loaded = load_target(args.out, dtype="float32")
    tok = loaded.tokenizer
    assert config["eos_token_id"] == tok.token_id("<|endoftext|>")
    snippet = read_texts(load_split(args), "heldout")[0][:1500]
    ids = tok.encode(snippet)[:256]
    ours = loaded.model.forward([torch.tensor(ids)], [loaded.model.new_cache()]).logits
    hf = load_hf(args.out)
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([ids])).logits[0]
    diff = float((ours - theirs).abs().max())
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    print(
        f"verify: pdflash vs transformers on {len(ids)} held-out tokens: max |Δlogit| {diff:.2e}, "
        f"argmax agreement {agree:.4f}"
    )
    assert diff < 1e-2 * max(1.0, float(theirs.abs().max())), diff
    (args.work / "verify.json").write_text(
        json.dumps({"tokens": len(ids), "max_abs_logit_diff": diff, "argmax_agreement": agree})
    )
    return diff


# --------------------------------------------------------------------------------------- eval


def repeated_ngram_share(ids: list[int], n: int = 4) -> tuple[int, int]:
    """(n-grams that already occurred earlier in the same sequence, total n-grams)."""
    seen, repeated = set(), 0
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated, len(grams)


def code_repetition(tokenizer, texts: list[str], window: int, seed: int, per_file: int = 10) -> float:
    """The repeated-4-gram share of real code: `per_file` random windows of `window` tokens per text."""
    rng, repeated, total = random.Random(seed), 0, 0
    for text in texts:
        ids = tokenizer.encode(text).ids
        for _ in range(per_file):
            start = rng.randrange(max(1, len(ids) - window))
            r, t = repeated_ngram_share(ids[start : start + window])
            repeated, total = repeated + r, total + t
    return repeated / max(1, total)


def stage_eval(args) -> dict:
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from prompts import PROMPTS

    from pdflash.sampling import SamplingParams
    from pdflash.target.generate import generate_autoregressive
    from pdflash.target.loader import load_target

    split = load_split(args)
    heldout_bytes = sum(len(t.encode("utf-8")) for t in read_texts(split, "heldout"))
    stream = torch.from_numpy(token_stream(args, "heldout", None).astype(np.int64))
    tokenizer = load_tokenizer(args)
    eot = tokenizer.token_to_id("<|endoftext|>")
    hf = load_hf(args.out)
    ctx, stride = args.context, args.eval_stride or args.context
    nats, scored = 0.0, 0
    done = 0  # stream index of the last target scored
    with torch.no_grad():
        for s in tqdm(range(0, len(stream) - 1, stride), desc="held-out bits/byte"):
            # window [s, s+ctx]: predicts targets s+1..s+ctx; each target is scored once, in the
            # first window that contains it (stride == ctx: disjoint windows overlapping by one token)
            w = stream[s : s + ctx + 1]
            first_new = max(done + 1, s + 1) - (s + 1)
            if len(w) < 2 or s + len(w) - 1 <= done:
                continue
            logits = hf(input_ids=w[None, :-1]).logits[0]
            losses = F.cross_entropy(logits, w[1:], reduction="none")[first_new:]
            keep = w[1 + first_new :] != eot  # separators are not source bytes
            nats += float(losses[keep].sum())
            scored += int(keep.sum())
            done = s + len(w) - 1
    bpb = nats / math.log(2) / heldout_bytes
    print(
        f"eval: held-out {heldout_bytes:,} bytes, {scored:,} tokens, {nats / scored:.4f} nats/token, "
        f"{bpb:.4f} bits/byte (window {ctx}, stride {stride})"
    )

    loaded = load_target(args.out, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens)
    t0 = time.perf_counter()
    runs = {}
    # "as_written": the prompts verbatim (ending in a bare newline, which this BPE rarely sees at a line
    # start: in training the newline is merged with the next line's indentation). "stripped": trailing
    # whitespace removed, so the model writes the newline + indentation token itself.
    for variant in ("as_written", "stripped"):
        samples, rep, total = [], 0, 0
        for prompt in tqdm(PROMPTS, desc=f"greedy continuations ({variant})"):
            text = prompt if variant == "as_written" else prompt.rstrip(" \n")
            result = generate_autoregressive(loaded.model, loaded.tokenizer.encode(text), params)
            r, t = repeated_ngram_share(list(result.token_ids))
            rep, total = rep + r, total + t
            samples.append(
                {
                    "prompt": text,
                    "completion": loaded.tokenizer.decode(list(result.token_ids)),
                    "tokens": len(result.token_ids),
                    "finish_reason": result.finish_reason,
                    "repeated_4grams": r,
                    "total_4grams": t,
                }
            )
        runs[variant] = {"share": rep / max(1, total), "repeated": rep, "total": total, "samples": samples}
        print(
            f"eval: repeated 4-gram share over {len(PROMPTS)} greedy continuations ({variant}): "
            f"{rep / max(1, total):.4f} ({rep}/{total})"
        )
    gen_s = time.perf_counter() - t0
    reference = code_repetition(tokenizer, read_texts(split, "heldout"), args.gen_tokens, args.seed)
    print(f"eval: repeated 4-gram share of held-out code itself ({args.gen_tokens}-token windows): {reference:.4f}")
    main_run = runs["as_written"]
    share, rep, total, samples = main_run["share"], main_run["repeated"], main_run["total"], main_run["samples"]
    for s in runs["stripped"]["samples"][:3]:
        print("-" * 60 + "\n" + s["prompt"] + s["completion"])
    result = {
        "window": ctx,
        "stride": stride,
        "heldout_bytes": heldout_bytes,
        "heldout_tokens_scored": scored,
        "nats_per_token": nats / scored,
        "bits_per_byte": bpb,
        "bytes_per_token": heldout_bytes / scored,
        "repeated_4gram_share": share,
        "repeated_4grams": rep,
        "total_4grams": total,
        "generation_s": gen_s,
        "samples": samples,
        "stripped": runs["stripped"],
        "heldout_code_share": reference,
    }
    (args.work / "eval.json").write_text(json.dumps(result, indent=1))
    return result


# ------------------------------------------------------------------------------------ drafter


def drafter_dir(args) -> Path:
    return args.drafter_out or args.out.with_name(args.out.name + "-dflash")


def stage_drafter(args) -> dict:
    """`pdflash train-drafter` on the target's own greedy continuations of training-split windows."""
    from pdflash import cli

    torch.set_num_threads(args.threads)
    files = [str(p) for p in split_paths(load_split(args), "train")]
    options = [
        "--layers",
        str(args.drafter_layers),
        "--block-size",
        str(args.block_size),
        "--tap-layers",
        *map(str, args.drafter_taps),
        "--steps",
        str(args.drafter_steps),
        *(["--minutes", f"{args.drafter_minutes:g}"] if args.drafter_minutes else []),
        "--sequences",
        str(args.drafter_sequences),
        "--prompt-tokens",
        str(args.drafter_prompt_tokens),
        "--response-tokens",
        str(args.drafter_response_tokens),
        "--batch",
        str(args.drafter_batch),
        "--anchors",
        str(args.drafter_anchors),
        "--lr",
        f"{args.drafter_lr:g}",
        "--seed",
        str(args.seed),
    ]
    cache = args.work / "drafter-data.pt"  # a rerun with other training flags reuses the continuations
    stats_path = args.work / "drafter_stats.json"
    if cli.main(
        [
            "train-drafter",
            "--target",
            str(args.out),
            "--data",
            *files,
            "--out",
            str(drafter_dir(args)),
            *options,
            "--data-cache",
            str(cache),
            "--stats",
            str(stats_path),
        ]
    ):
        raise SystemExit("train-drafter failed")
    stats = json.loads(stats_path.read_text())
    stats["train_flags"] = " ".join(options)
    stats["threads"] = args.threads
    stats["build_flags"] = (
        " ".join(
            f"--{name.replace('_', '-')} {' '.join(map(str, value)) if isinstance(value, list) else value}"
            for name, value in sorted(vars(args).items())
            if name.startswith("drafter_") and name != "drafter_out"
        )
        + f" --block-size {args.block_size}"
    )
    stats_path.write_text(json.dumps(stats, indent=1))
    return stats


def stage_bench(args) -> dict:
    """benchmarks/bench_bundled.py on the pair: τ and DFlash/AR speedup, side by side."""
    import subprocess

    out = args.work / "bench.json"
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "bench_bundled.py"),
        "--target",
        str(args.out),
        "--drafter",
        str(drafter_dir(args)),
        "--prompts",
        str(args.bench_prompts),
        "--block-size",
        str(args.block_size),
        "--threads",
        str(args.threads),
        "--json",
        str(out),
    ]
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


# --------------------------------------------------------------------------------------- card


def cost_model_lines(bench: dict) -> list[str]:
    """Why the speedup is what it is: a round's cost in AR steps against τ."""
    ms, tau = bench["median_ms"], bench["greedy_tau"]
    steps = ms["dflash_round"] / ms["ar_step"]
    needed = 1.8 * steps
    return [
        f"A DFlash round costs {steps:.1f} AR steps here (median round {ms['dflash_round']:.2f} ms: the target verifies "
        f"{bench['block_size']} tokens in {ms['dflash_verify'] / ms['ar_forward']:.1f}× the time of one,",
        f"and the drafter and the round's bookkeeping take {ms['dflash_round'] - ms['dflash_verify']:.2f} ms), "
        f"so a 1.8× speedup would need τ ≈ {needed:.1f}; τ is {tau:.2f}.",
        "On this CPU a forward's cost follows the operators it launches and the weight bytes it streams (the",
        "pair's float32 weights do not stay in cache), not its arithmetic. An 8-token block of this model routes",
        "to a median of 11 of the 32 experts of a layer where one token routes to 4, and the 2-layer drafter",
        "streams about as many weight bytes per round as a whole AR step of the target ([target.md](target.md)",
        "breaks a forward down). On an accelerator, where verifying 8 tokens costs about as much as 1, the same",
        "τ would pay far more; no accelerator was available.",
        "",
    ]


def _shown(path: Path) -> str:
    return str(path.resolve().relative_to(REPO) if path.resolve().is_relative_to(REPO) else path)


def drafter_card_lines(args) -> list[str]:
    """The card's drafter section: architecture, training figures and the measured τ / speedup."""
    from safetensors import safe_open

    stats_path, bench_path = args.work / "drafter_stats.json", args.work / "bench.json"
    if not stats_path.is_file():
        return ["## Drafter", "", "_Not built yet: run the `drafter` and `bench` stages._", ""]
    stats, directory = json.loads(stats_path.read_text()), drafter_dir(args)
    cfg = json.loads((directory / "config.json").read_text())
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (safe_open has no __iter__)
    size = (directory / "model.safetensors").stat().st_size
    pair = size + (args.out / "model.safetensors").stat().st_size
    st = stats["settings"]
    lines = [
        "## Drafter",
        "",
        f"`{directory.name}`: a DFlash drafter in the published layout (loads in the reference `dflash` package):",
        f"{cfg['num_hidden_layers']} decoder layer(s) at hidden {cfg['hidden_size']} ({cfg['num_attention_heads']}/"
        f"{cfg['num_key_value_heads']} heads, SwiGLU width {cfg['intermediate_size']}), block size {cfg['block_size']},",
        f"conditioned on the residual stream after target layers {cfg['dflash_config']['target_layer_ids']}, sharing the",
        f"target's embedding and tied head; mask token `<|mask|>`. {params / 1e6:.2f}M parameters, {size / 1e6:.1f} MB",
        f"{cfg.get('torch_dtype', 'float16')}; the pair is {pair / 1e6:.1f} MB.",
        "",
        f"Trained on {stats['sequences']:,} windows of the training split, each continued greedily by the target, "
        f"{stats['steps']:,} AdamW steps",
        f"of {st['batch_sequences']} sequences × {st['anchors_per_sequence']} random anchors in {stats['seconds'] / 60:.1f} min "
        f"({stats['threads']} CPU thread{'s' if stats['threads'] > 1 else ''}); position-weighted loss "
        f"{stats['first_loss']:.2f} → {stats['final_loss']:.2f}",
        f"(mean of the last {stats['final_loss_steps']} steps). How the depth was chosen (on validation prompts, not the",
        "benchmark's): [speculative.md](speculative.md#training-a-drafter-what-mattered-for-the-bundled-pair).",
        "The command (`tools/build_bundled.py drafter` runs it):",
        "",
        "```",
        f"pdflash train-drafter --target {_shown(args.out)} --data <the training split's files> \\",
        f"    --out {_shown(directory)} {stats['train_flags']}",
        "```",
        "",
    ]
    if bench_path.is_file():
        b = json.loads(bench_path.read_text())
        spec, ar, ratios = b["dflash_tokens_per_second"], b["ar_tokens_per_second"], b["speedups"]
        lines += [
            "### Measured: τ and speedup",
            "",
            "```",
            f"python benchmarks/bench_bundled.py --prompts {b['prompts']} --threads {b['threads']}"
            '      # pip install -e ".[bench]" for the HumanEval prompts',
            "```",
            "",
            f"First {b['prompts']} HumanEval prompts (never trained on), {b['max_tokens']} new tokens, block "
            f"{b['block_size']}, both decoders",
            f"alternating per prompt in one run (each prompt {b['repeats']} times per decoder, medians), "
            f"{b['cpu_cores']} CPU cores, {b['threads']} threads, no accelerator:",
            "",
            "| | value |",
            "| --- | --- |",
            f"| greedy τ (mean tokens per verify round, bonus included) | **{b['greedy_tau']:.2f}** ({b['greedy_rounds']:,} rounds) |",
            f"| greedy τ of rounds begun while the output was not repeating a 4-gram | {b['greedy_tau_fresh']:.2f} "
            f"({b['greedy_rounds_fresh']:,} rounds) |",
            f"| greedy τ of rounds begun inside a repeat (the drafter only has to copy) | "
            f"{b['greedy_tau_repeating']:.2f} ({b['greedy_rounds_repeating']:,} rounds) |",
            f"| sampled τ at temperature {b['sampled_temperature']:g} | {b['sampled_tau']:.2f} ({b['sampled_rounds']:,} rounds) |",
            f"| decode tokens/s, DFlash, median [min–max] | {statistics.median(spec):.1f} [{min(spec):.1f}–{max(spec):.1f}] |",
            f"| decode tokens/s, autoregressive | {statistics.median(ar):.1f} [{min(ar):.1f}–{max(ar):.1f}] |",
            f"| speedup DFlash / AR, per-prompt median [min–max] | **{b['speedup_median']:.2f}×** [{min(ratios):.2f}–{max(ratios):.2f}] |",
            f"| greedy outputs different from AR | {b['greedy_mismatches']} of {b['prompts']} |",
            f"| one DFlash round (draft + verify of {b['block_size']} tokens), median | {b['median_ms']['dflash_round']:.2f} ms "
            f"(verify {b['median_ms']['dflash_verify']:.2f} ms) |",
            f"| one AR step, median | {b['median_ms']['ar_step']:.2f} ms (target forward {b['median_ms']['ar_forward']:.2f} ms) |",
            "",
            f"Loops carry the mean: {b['greedy_rounds_repeating'] / b['greedy_rounds']:.0%} of the greedy rounds began while the "
            "output was repeating a 4-gram it had",
            f"already produced, and those accept {b['greedy_tau_repeating']:.2f} tokens against "
            f"{b['greedy_tau_fresh']:.2f} for the rest. Where the target writes code that",
            f"does not repeat, this drafter gets about {b['greedy_tau_fresh']:.1f} tokens per round.",
            "",
            *cost_model_lines(b),
        ]
    return lines


def stage_card(args) -> Path:
    """Writes docs/model-card.md from the stats the other stages left under --work."""
    work = args.work
    split = json.loads((work / "split.json").read_text())
    tok = json.loads((work / "tokenizer_stats.json").read_text())
    train = json.loads((work / "train_stats.json").read_text())
    ev = json.loads((work / "eval.json").read_text())
    ver = json.loads((work / "verify.json").read_text())
    cfg = train["config"]
    a = train["args"]
    size = (args.out / "model.safetensors").stat().st_size
    params = train["params"]
    heldout_tokens = ev["heldout_tokens_scored"]
    log = train["log"]
    curve = [log[round(i * (len(log) - 1) / 9)] for i in range(10)] if len(log) >= 10 else log
    rebuild = (
        f"python tools/build_bundled.py all --packages {' '.join(a['packages'])} --seed {a['seed']} "
        f"--vocab-size {a['vocab_size']} "
        f"--context {a['context']} --hidden {a['hidden']} --layers {a['layers']} --heads {a['heads']} "
        f"--kv-heads {a['kv_heads']} --experts {a['experts']} --expert-width {a['expert_width']} "
        f"--top-k {a['top_k']} {'--tie' if a['tie'] else '--no-tie'} --dtype {a['dtype']} "
        f"--minutes {a['minutes']:g} --batch {a['batch']} --lr {a['lr']:g} --warmup {a['warmup']} "
        f"--aux-coef {a['aux_coef']:g} --threads {a['threads']}"
    )
    if (work / "drafter_stats.json").is_file():
        rebuild += " " + json.loads((work / "drafter_stats.json").read_text())["build_flags"]
    if (work / "bench.json").is_file():
        rebuild += f" --bench-prompts {json.loads((work / 'bench.json').read_text())['prompts']}"
    lines = [
        "# Model card: pdflash-moe-code (bundled target)",
        "",
        "A small Qwen3-MoE causal LM pre-trained from scratch on Python source: the standard library and torch.",
        "It is the bundled *target* of pdflash's DFlash pair: big enough to write plausible Python and to",
        "route a verify block over a strict subset of its experts; small enough to ship in the wheel.",
        "Built by `tools/build_bundled.py`; files in `src/pdflash/models/pdflash-moe-code/`.",
        "",
        "## Data",
        "",
        "- Source: every `.py` file of "
        + " and of ".join(
            f"the CPython {split['versions'][label]} standard library (`{root}`)"
            if label == "stdlib"
            else f"`{label}` {split['versions'][label]} (`{root}`)"
            for label, root in split["roots"].items()
        )
        + ",",
        f"  skipping directories named {', '.join(f'`{d}`' for d in sorted(EXCLUDED_DIRS))}",
        f"  (test suites, third-party packages, codec tables, generated code) and files over {MAX_FILE_BYTES:,} bytes",
        "  (generated tables). Empty files are dropped. Every pdflash install has both sources: torch is pinned.",
        f"- Held-out split: stdlib files whose `sha1(relative path)` mod 1000 < {HELDOUT_PER_MILLE} (deterministic, ~2%):",
        f"  {len(split['heldout'])} files, {split['bytes']['heldout']:,} bytes, {heldout_tokens:,} tokens:",
        "  " + ", ".join(f"`{r}`" for r in split["heldout"]) + ".",
        f"- Training split: {len(split['train'])} files, {split['bytes']['train']:,} bytes, "
        f"{train['train_stream_tokens']:,} tokens (files in a seeded shuffled order, each followed by `<|endoftext|>`).",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE trained with `tokenizers` on the training files: vocab {tok['vocab_size']} (GPT-2 byte",
        "alphabet + merges, GPT-2 pre-tokenizer regex), special tokens `<|endoftext|>` (eos), `<|im_start|>`,",
        f"`<|im_end|>`, `<|mask|>` (the DFlash mask token), ids 0-3. {tok['heldout_bytes_per_token']:.2f} held-out bytes per",
        "token. `tokenizer_config.json` carries a ChatML `chat_template` and `eos_token`.",
        "",
        "## Architecture",
        "",
        "| field | value |",
        "|---|---|",
        "| model_type | `qwen3_moe` (Hugging Face layout, one tensor per expert projection) |",
        f"| layers / hidden | {cfg['num_hidden_layers']} / {cfg['hidden_size']} |",
        f"| attention | {cfg['num_attention_heads']} query heads, {cfg['num_key_value_heads']} KV heads (GQA), head_dim {cfg['head_dim']}, RoPE θ {cfg['rope_theta']:g}, q/k norm |",
        f"| MoE (every layer) | {cfg['num_experts']} experts × SwiGLU width {cfg['moe_intermediate_size']}, top-{cfg['num_experts_per_tok']}, norm_topk_prob true |",
        f"| vocab / head | {cfg['vocab_size']}, {'tied to the embedding' if cfg['tie_word_embeddings'] else 'untied'} |",
        f"| context | trained on {a['context']}-token windows; max_position_embeddings {cfg['max_position_embeddings']} |",
        f"| parameters | {params['total']:,} total ({params['experts']:,} in experts), {params['active_per_token']:,} active per token |",
        f"| storage | {cfg['torch_dtype']}, `model.safetensors` {size / 1e6:.2f} MB |",
        "",
        f"pdflash's loader reads the export, and its logits equal `transformers`' on {ver['tokens']} held-out tokens",
        f"(max |Δlogit| {ver['max_abs_logit_diff']:.1e}, argmax agreement {ver['argmax_agreement']:.4f}, both float32).",
        "",
        "## Training",
        "",
        f"`transformers` `Qwen3MoeForCausalLM`, float32 on {a['threads']} CPU threads (shared 2-core machine, no GPU).",
        f"AdamW (β 0.9/0.95, weight decay {a['weight_decay']:g} on matrices), peak lr {a['lr']:g}, {a['warmup']} warmup steps,",
        f"cosine to {a['min_lr_frac']:g}× over the wall-time budget ({a['minutes']:g} min), grad clip 1.0, router",
        f"load-balancing aux loss × {a['aux_coef']:g}, batch {a['batch']} × {a['context']} tokens of randomly placed",
        f"windows over the packed stream, seed {a['seed']}.",
        "",
        f"- Steps: {train['steps']:,}; tokens: {train['tokens']:,} ({train['epochs']:.2f} epochs); wall time "
        f"{train['wall_s'] / 60:.1f} min; {train['tokens_per_second']:.0f} tokens/s on average.",
        f"- Final train loss: {train['final_loss']:.3f} nats/token (last batch), {train['final_loss_ema']:.3f} (EMA 0.98).",
        "- The schedule follows wall time, so a rebuild on another machine takes a different number of steps.",
        "",
        "| step | tokens | min | lr | train loss (EMA) |",
        "|---|---|---|---|---|",
        *[
            f"| {e['step']} | {e['tokens']:,} | {e['seconds'] / 60:.1f} | {e['lr']:.2e} | {e['loss_ema']:.3f} |"
            for e in curve
        ],
        "",
        "## Evaluation",
        "",
        f"- Held-out code cross-entropy: **{ev['bits_per_byte']:.3f} bits/byte** ({ev['nats_per_token']:.3f} nats/token; total nats",
        f"  over the held-out token stream / ln 2 / {ev['heldout_bytes']:,} UTF-8 bytes; {a['context']}-token windows, separators not scored).",
        f"- Greedy continuations ({a['gen_tokens']} tokens, pdflash `generate_autoregressive`, float32) of the",
        f"  {len(ev['samples'])} function headers in `tools/prompts.py`: repeated-4-gram share **{ev['repeated_4gram_share']:.3f}**",
        f"  ({ev['repeated_4grams']} of {ev['total_4grams']} token 4-grams already occurred earlier in the same continuation).",
        "",
        "- The same prompts with their trailing newline stripped (the model then writes the newline +",
        f"  indentation token itself, as in training): repeated-4-gram share **{ev['stripped']['share']:.3f}**",
        f"  ({ev['stripped']['repeated']} of {ev['stripped']['total']}). With the bare trailing newline the model",
        "  mostly starts a new top-level statement instead of the function body (the BPE merges a newline with",
        '  the next line\'s indentation, so a lone newline token means "column 0 next").',
        "",
        f"- For scale, real code repeats too: {a['gen_tokens']}-token windows of the held-out files themselves have a",
        f"  repeated-4-gram share of {ev['heldout_code_share']:.3f}.",
        "",
        *(
            [
                "- **Greedy decoding loops.** At this size and training budget the greedy continuations start",
                "  plausibly (a `def`, a docstring, an on-topic `return`) and then often repeat a phrase or a line until",
                f"  the token limit: {ev['repeated_4gram_share']:.2f} against real code's {ev['heldout_code_share']:.2f}.",
                "  The held-out cross-entropy target is met; the model is not free of loops.",
                "",
            ]
            if ev["repeated_4gram_share"] > 2 * ev["heldout_code_share"]
            else []
        ),
        "Samples (prompt, then the greedy continuation; first as written, then stripped):",
        "",
    ]
    for s in ev["samples"][:2] + ev["stripped"]["samples"][:2]:
        lines += ["```python", (s["prompt"] + s["completion"]).rstrip(), "```", ""]
    lines += [
        *drafter_card_lines(args),
        "## Rebuild",
        "",
        "```bash",
        rebuild,
        "```",
        "",
        "Stages can be run one at a time (`data`, `tokenizer`, `target`, `verify`, `eval`, `drafter`, `bench`, `card`);",
        "see `--help`.",
        "",
    ]
    path = REPO / "docs" / "model-card.md"
    path.write_text("\n".join(lines))
    print(f"card: wrote {path}")
    return path


def stage_all(args) -> None:
    stage_data(args)
    stage_tokenizer(args)
    stage_target(args)
    stage_eval(args)
    stage_drafter(args)
    stage_bench(args)
    stage_card(args)


# glibc returns large freed blocks to the OS and page-faults them back every step; on this kind of
# VM that costs 10-20 s per training step at random. Keep the heap instead (set before start-up).
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "100000000000", "MALLOC_TOP_PAD_": "1000000000"}


def main(argv: list[str] | None = None) -> None:
    if argv is None and sys.platform.startswith("linux") and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | MALLOC_ENV)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="stage", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, default=DEFAULT_OUT, help="bundled model directory (default: %(default)s)")
    common.add_argument("--work", type=Path, default=DEFAULT_WORK, help="scratch: split, token caches, stats")
    common.add_argument("--stdlib", help="stdlib directory (default: sysconfig.get_paths()['stdlib'])")
    common.add_argument(
        "--packages",
        nargs="*",
        default=["torch"],
        help="installed packages whose .py sources join the training data (default: torch)",
    )
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    common.add_argument("--vocab-size", type=int, default=4096)
    common.add_argument("--context", type=int, default=512, help="training / evaluation window (tokens)")
    common.add_argument("--max-positions", type=int, default=2048, help="max_position_embeddings")
    g = common.add_argument_group("model")
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=4)
    g.add_argument("--experts", type=int, default=32)
    g.add_argument("--expert-width", type=int, default=64, help="moe_intermediate_size")
    g.add_argument("--top-k", type=int, default=4)
    g.add_argument("--tie", action=argparse.BooleanOptionalAction, default=True, help="tie embedding and LM head")
    g.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16", help="stored dtype")
    g = common.add_argument_group("training")
    g.add_argument("--minutes", type=float, default=62.0, help="wall-time budget; the cosine schedule spans it")
    g.add_argument("--steps", type=int, default=0, help="step budget (0: time only); the first budget hit ends")
    g.add_argument("--batch", type=int, default=8)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--min-lr-frac", type=float, default=0.1)
    g.add_argument("--warmup", type=int, default=100)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--aux-coef", type=float, default=0.01, help="router load-balancing loss weight")
    g.add_argument("--experts-impl", default="eager", help="transformers experts implementation for training")
    g.add_argument("--log-every", type=int, default=25)
    g.add_argument("--ckpt-minutes", type=float, default=5.0, help="export the model every N minutes (0: never)")
    g = common.add_argument_group("eval")
    g.add_argument("--gen-tokens", type=int, default=128)
    g.add_argument("--eval-stride", type=int, default=0, help="held-out window stride (0: = --context, disjoint)")
    g = common.add_argument_group("drafter")
    g.add_argument("--drafter-out", type=Path, help="drafter directory (default: --out with a -dflash suffix)")
    g.add_argument("--block-size", type=int, default=8)
    g.add_argument("--drafter-layers", type=int, default=2)
    g.add_argument(
        "--drafter-taps", type=int, nargs="+", default=[0, 1, 2, 3], help="target layers feeding the drafter"
    )
    g.add_argument(
        "--drafter-minutes",
        type=float,
        default=50.0,
        help="training wall-time budget (0: none, the step budget alone decides)",
    )
    g.add_argument("--drafter-steps", type=int, default=100_000, help="step budget (the first budget hit ends)")
    g.add_argument("--drafter-sequences", type=int, default=12288, help="target continuations to train on")
    g.add_argument("--drafter-prompt-tokens", type=int, default=64)
    g.add_argument("--drafter-response-tokens", type=int, default=96)
    g.add_argument("--drafter-batch", type=int, default=8)
    g.add_argument("--drafter-anchors", type=int, default=16, help="random blocks per sequence per step")
    g.add_argument("--drafter-lr", type=float, default=1e-3)
    g.add_argument("--bench-prompts", type=int, default=20, help="HumanEval prompts for the τ / speedup benchmark")
    for name, func, help_ in (
        ("data", stage_data, "list files and split off the held-out set"),
        ("tokenizer", stage_tokenizer, "train the byte-level BPE"),
        ("target", stage_target, "train + export + verify the target"),
        ("verify", verify, "check pdflash logits == transformers logits"),
        ("eval", stage_eval, "held-out bits/byte, greedy continuations"),
        ("drafter", stage_drafter, "train the DFlash drafter with pdflash train-drafter"),
        ("bench", stage_bench, "τ and speedup of the pair (benchmarks/bench_bundled.py)"),
        ("card", stage_card, "write docs/model-card.md from the stats"),
        ("all", stage_all, "data, tokenizer, target, eval, drafter, bench, card"),
    ):
        p = sub.add_parser(name, parents=[common], help=help_)
        p.set_defaults(func=func)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
