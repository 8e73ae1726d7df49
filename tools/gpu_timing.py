"""Time the decode and verification forwards of the served architectures on a
GPU with PyTorch and transformers only, and fit sim presets from them.

    python -m tools.gpu_timing [--pairs NAME,...] [--output gpu-timing.json] [--markdown gpu-timing.md]

Why: the sim profile (sim_engine/) sleeps each forward's time from a preset;
the named presets are estimates from memory bandwidth. This tool measures the
same architectures on a machine that has a GPU but neither Triton nor
TensorRT-LLM nor access to a model hub: the configs are embedded below (each
names the config.json it copies) and the weights are random bf16.

What it measures, per model: a decode forward of ``rows`` sequences of one new
token each over a KV cache of ``context`` tokens (the cache filled by one
prefill, then repeated over the rows), and a verification forward of one
sequence carrying k+1 new tokens over the same context (what the target runs
per speculative round). Each forward is timed alone (synchronised), the cache
cropped back after it so that every repetition sees the same context; the
median of ``--repeats`` after ``--warmup`` is kept. Per pair, a sim preset is
fitted at one context (``--fit-context``): ``base_ms`` the 1-row decode,
``per_row_ms`` the least-squares slope of the decode times over rows (as
sim_engine/presets.py's StepTime; load the JSON with ``--sim-preset
FILE.json#PAIR``).

What it does not measure: acceptance (random weights agree with nothing; a
preset loaded from the table takes it from the h100-8b-1b preset), nor
TensorRT-LLM's speed. These are Hugging Face eager forwards with SDPA
attention and a DynamicCache that copies itself on every step, no fused
kernels, no CUDA graphs, no paged cache: slower than TensorRT-LLM's engines
for the same architectures, so the table is an upper bound on their step
times. The output says so too.

Time: a default run is about 2,100 forwards and 15 prefills over five models,
estimated at 2 to 4 minutes on one H100 (not yet measured); ``--budget-seconds``
(default 360) stops adding measurements once spent and keeps what it has.
``--tiny`` swaps in tiny configs of the same architectures so that the tool
runs on a CPU in seconds: for tests only, and the output says tiny.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, Qwen2Config

# -- the architectures ------------------------------------------------------------

QWEN_CODER_BASE = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False,
                       max_position_embeddings=32768)
# Qwen/Qwen2.5-Coder-0.5B-Instruct config.json (0.49B parameters, tied embeddings)
QWEN_CODER_0_5B = dict(QWEN_CODER_BASE, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
# Qwen/Qwen2.5-Coder-1.5B-Instruct config.json (1.54B parameters, tied embeddings)
QWEN_CODER_1_5B = dict(QWEN_CODER_BASE, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
# Qwen/Qwen2.5-Coder-7B-Instruct config.json (7.61B parameters, untied)
QWEN_CODER_7B = dict(QWEN_CODER_BASE, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)

LLAMA_3_BASE = dict(hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                    num_key_value_heads=8, vocab_size=128256, attention_bias=False, mlp_bias=False)
# meta-llama/Llama-3.1-8B-Instruct config.json (8.03B parameters, untied)
LLAMA_3_1_8B = dict(LLAMA_3_BASE, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, head_dim=128, tie_word_embeddings=False,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8192))
# meta-llama/Llama-3.2-1B-Instruct config.json (1.24B parameters, tied embeddings)
LLAMA_3_2_1B = dict(LLAMA_3_BASE, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, head_dim=64, tie_word_embeddings=True,
                    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8192))


@dataclass(frozen=True)
class Model:
    name: str  # the Hugging Face repository its config.json comes from
    config_class: type
    values: dict


MODELS = {m.name: m for m in (
    Model("Qwen/Qwen2.5-Coder-0.5B-Instruct", Qwen2Config, QWEN_CODER_0_5B),
    Model("Qwen/Qwen2.5-Coder-1.5B-Instruct", Qwen2Config, QWEN_CODER_1_5B),
    Model("Qwen/Qwen2.5-Coder-7B-Instruct", Qwen2Config, QWEN_CODER_7B),
    Model("meta-llama/Llama-3.1-8B-Instruct", LlamaConfig, LLAMA_3_1_8B),
    Model("meta-llama/Llama-3.2-1B-Instruct", LlamaConfig, LLAMA_3_2_1B),
)}
# Pair name -> (target, draft); the first is the pair the project serves.
PAIRS = {
    "qwen2.5-coder-1.5b-0.5b": ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
    "llama-3.1-8b-3.2-1b": ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
    "qwen2.5-coder-7b-0.5b": ("Qwen/Qwen2.5-Coder-7B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
}
SERVED_PAIR = next(iter(PAIRS))

# Tiny stand-ins (--tiny): the same config classes, rope settings and tying, a
# few layers of a narrow width, and a vocabulary wide enough that rows cost.
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=8192)

DTYPE = torch.bfloat16
NOTE = ("Hugging Face PyTorch forwards (SDPA attention, a DynamicCache copied on every step, no fused kernels, no "
        "CUDA graphs) of random bf16 weights: an upper bound on the step times of TensorRT-LLM engines of the same "
        "architectures, which are faster. Random weights say nothing about acceptance.")
TINY_NOTE = "TINY test configs, not the real architectures: these times mean nothing for serving."


def config_of(model: Model, tiny: bool = False):
    values = dict(model.values)
    if tiny:
        values.update(TINY, num_hidden_layers=max(1, values["num_hidden_layers"] // 8))
        if "head_dim" in values:
            values["head_dim"] = TINY["hidden_size"] // TINY["num_attention_heads"]
    return model.config_class(**values)


def count_parameters(config) -> int:
    """Instantiated on the meta device: the real module tree, no memory (tied weights count once)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def build(config, device: str):
    """Built on the device itself, so the random initialisation runs there (cheap on a GPU)."""
    major = int(transformers.__version__.split(".")[0])
    dtype = {"dtype" if major >= 5 else "torch_dtype": DTYPE}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **dtype)
    return model.eval()


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def cache_bytes(config, rows: int, tokens: int) -> int:
    """Keys and values of every layer, bf16."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config) * rows * tokens * 2


# -- the device ---------------------------------------------------------------------

GIB = 1024 ** 3
MARGIN = GIB // 2  # activations, the CUDA context's growth, allocator slack


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def sync(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def free_bytes(device: str) -> int | None:
    """What can still be allocated: the device's free memory plus what the allocator holds unused;
    on a CPU, MemAvailable (None where unknown: no check)."""
    if is_cuda(device):
        free, _total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


def release(device: str) -> None:
    gc.collect()
    if is_cuda(device):
        torch.cuda.empty_cache()


def machine(device: str) -> dict:
    cpu = f"CPU {platform.processor() or platform.machine()}"
    name = torch.cuda.get_device_name(device) if is_cuda(device) else cpu
    return {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "dtype": "bfloat16", "attention": "sdpa",
            "python": platform.python_version()}


# -- timing -------------------------------------------------------------------------


@dataclass
class Settings:
    device: str
    rows: list[int]
    contexts: list[int]
    drafts: list[int]
    repeats: int
    warmup: int
    fit_context: int
    budget_seconds: float
    tiny: bool


@dataclass
class Clock:
    budget: float
    start: float = field(default_factory=time.monotonic)
    stopped: bool = False

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def spent(self) -> bool:
        if not self.stopped and self.elapsed() > self.budget:
            self.stopped = True
            log(self, f"budget of {self.budget:.0f} s spent: no more measurements; what is measured is kept")
        return self.stopped


def log(clock: Clock, message: str) -> None:
    print(f"[{clock.elapsed():7.1f} s] {message}", file=sys.stderr, flush=True)


def time_forwards(model, ids, cache, settings: Settings) -> float:
    """Median milliseconds of one forward of ``ids`` over ``cache``, cropped back after each."""
    new = ids.shape[1]
    times = []
    for i in range(settings.warmup + settings.repeats):
        sync(settings.device)
        start = time.perf_counter()
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        sync(settings.device)
        if i >= settings.warmup:
            times.append(time.perf_counter() - start)
        cache.crop(-new)
    return statistics.median(times) * 1000.0


def prefill(model, context: int, device: str):
    """A batch-1 cache of ``context`` random tokens (only the last position's logits computed)."""
    ids = torch.randint(model.config.vocab_size, (1, context), device=device)
    cache = DynamicCache()
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def cache_layers(cache) -> list[tuple]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers 4.x


def decode_ms(model, base, rows: int, settings: Settings) -> float:
    """``rows`` sequences of one new token each over copies of the batch-1 cache ``base``."""
    expanded = [(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in cache_layers(base)]
    cache = DynamicCache(ddp_cache_data=expanded)
    ids = torch.randint(model.config.vocab_size, (rows, 1), device=settings.device)
    return time_forwards(model, ids, cache, settings)


def verify_ms(model, base, drafts: int, settings: Settings) -> float:
    """One sequence carrying ``drafts`` + 1 new tokens over ``base`` (cropped back after each)."""
    ids = torch.randint(model.config.vocab_size, (1, drafts + 1), device=settings.device)
    return time_forwards(model, ids, base, settings)


def point_fits(config, rows: int, tokens: int, device: str) -> tuple[bool, str]:
    free = free_bytes(device)
    need = int(cache_bytes(config, rows, tokens) * 1.1) + rows * config.vocab_size * 4 + MARGIN  # + logits
    if free is None or need <= free:
        return True, ""
    return False, f"needs {need / GIB:.1f} GiB, {free / GIB:.1f} GiB free"


def measure(fn, record: list, skipped: list, key: dict, fits: tuple[bool, str], device: str) -> None:
    """One point into ``record``, or into ``skipped`` with the reason (no room, out of memory)."""
    if not fits[0]:
        skipped.append(dict(key, reason=fits[1]))
        return
    try:
        record.append(dict(key, ms=round(fn(), 5)))
    except torch.cuda.OutOfMemoryError as error:
        skipped.append(dict(key, reason=f"out of memory: {str(error).splitlines()[0]}"))
    release(device)


def time_context(model, context: int, entry: dict, settings: Settings, clock: Clock) -> None:
    """Decode over every row count, then verification of every draft count, at one context."""
    config, device = model.config, settings.device
    try:
        base = prefill(model, context, device)
    except torch.cuda.OutOfMemoryError as error:
        entry["skipped_points"].append({"context": context, "rows": "all", "reason": f"prefill out of memory: "
                                        f"{str(error).splitlines()[0]}"})
        log(clock, f"{entry['name']}: context {context}: the prefill ran out of memory, context skipped")
        return
    before = (len(entry["decode"]), len(entry["verify"]))
    for rows in settings.rows:
        if clock.spent():
            break
        measure(lambda: decode_ms(model, base, rows, settings), entry["decode"], entry["skipped_points"],
                {"context": context, "rows": rows}, point_fits(config, rows, context + 1, device), device)
    for drafts in settings.drafts:
        if clock.spent():
            break
        measure(lambda: verify_ms(model, base, drafts, settings), entry["verify"], entry["skipped_points"],
                {"context": context, "drafts": drafts, "rows": drafts + 1},
                point_fits(config, 1, context + drafts + 1, device), device)
    decode = ", ".join(f"{p['rows']}: {p['ms']:.2f}" for p in entry["decode"][before[0]:])
    verify = ", ".join(f"k={p['drafts']}: {p['ms']:.2f}" for p in entry["verify"][before[1]:])
    log(clock, f"{entry['name']}: context {context}: decode ms by rows {{{decode}}}; verify ms {{{verify}}}")


def time_model(model_spec: Model, settings: Settings, clock: Clock) -> dict:
    config = config_of(model_spec, settings.tiny)
    name = f"tiny {model_spec.name}" if settings.tiny else model_spec.name
    parameters = count_parameters(config)
    entry = {"name": name, "config_source": f"{model_spec.name} config.json", "parameters": parameters,
             "weights_gib": round(parameters * 2 / GIB, 3), "skipped": None, "decode": [], "verify": [],
             "skipped_points": []}
    longest = max(settings.contexts) + max(settings.drafts) + 1
    free, need = free_bytes(settings.device), parameters * 2 + cache_bytes(config, 1, longest) + MARGIN
    if free is not None and need > free:
        entry["skipped"] = (f"does not fit: bf16 weights and a 1-row cache of {longest} tokens need "
                            f"{need / GIB:.1f} GiB, {free / GIB:.1f} GiB free")
        log(clock, f"{name}: skipped, {entry['skipped']}")
        return entry
    started = clock.elapsed()
    model = build(config, settings.device)
    log(clock, f"{name}: {parameters:,} parameters built in {clock.elapsed() - started:.1f} s")
    try:
        for context in sorted(settings.contexts, key=lambda c: (c != settings.fit_context, c)):
            if clock.spent():
                break
            time_context(model, context, entry, settings, clock)
    finally:
        del model
        release(settings.device)
    return entry


# -- the fit --------------------------------------------------------------------------


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of milliseconds over rows."""
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    return (sum((x - mean_x) * (y - mean_y) for x, y in points)
            / sum((x - mean_x) ** 2 for x, _ in points))


def step_time(entry: dict, context: int) -> tuple[dict | None, str]:
    """base_ms and per_row_ms of one model at ``context``, or why not (a negative slope is clamped to 0)."""
    points = sorted((p["rows"], p["ms"]) for p in entry["decode"] if p["context"] == context)
    if entry["skipped"]:
        return None, f"{entry['name']} was skipped: {entry['skipped']}"
    if not points or points[0][0] != 1 or len(points) < 2:
        return None, f"{entry['name']} lacks the 1-row decode or a second row count at context {context}"
    raw = slope(points)
    return {"base_ms": round(points[0][1], 5), "per_row_ms": round(max(raw, 0.0), 6),
            "slope_ms": round(raw, 6), "rows": [x for x, _ in points]}, ""


def fit_pairs(pairs: list[str], models: dict[str, dict], settings: Settings) -> tuple[list, list]:
    fitted, unfitted = [], []
    for pair in pairs:
        target, draft = PAIRS[pair]
        steps = [step_time(models[name], settings.fit_context) if name in models else (None, f"{name} not timed")
                 for name in (target, draft)]
        reasons = [why for step, why in steps if step is None]
        if reasons:
            unfitted.append({"name": pair, "reason": "; ".join(reasons)})
            continue
        (t, _), (d, _) = steps
        fitted.append({
            "name": pair, "target": target, "draft": draft, "served": pair == SERVED_PAIR,
            "context": settings.fit_context,
            "preset": {"target": {k: t[k] for k in ("base_ms", "per_row_ms")},
                       "draft": {k: d[k] for k in ("base_ms", "per_row_ms")}},
            "fit": {"target": t, "draft": d,
                    "method": "base_ms: the 1-row decode; per_row_ms: least-squares slope over rows, at least 0"},
        })
    return fitted, unfitted


# -- output ---------------------------------------------------------------------------


def markdown(table: dict, json_path: str | None) -> str:
    lines = [f"# Forward times by architecture (tools/gpu_timing.py){' — TINY' if table['tiny'] else ''}", ""]
    if table["tiny"]:
        lines += [f"**{TINY_NOTE}**", ""]
    m, s = table["machine"], table["settings"]
    lines += [f"{m['device']}; torch {m['torch']}, transformers {m['transformers']}, CUDA {m['cuda']}, bf16, SDPA; "
              f"{table['date']}. Median of {s['repeats']} forwards after {s['warmup']} warm-up, milliseconds.",
              "", f"> {NOTE}", ""]
    if table["stopped"]:
        lines += [f"Stopped early: {table['stopped']}.", ""]
    for entry in table["models"]:
        lines += model_markdown(entry, s)
    lines += pairs_markdown(table, json_path)
    return "\n".join(lines) + "\n"


def grid(points: list[dict], contexts: list[int], column: str, columns: list[int], label: str) -> list[str]:
    by = {(p["context"], p[column]): p["ms"] for p in points}
    lines = [f"| context \\ {label} | " + " | ".join(map(str, columns)) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for context in contexts:
        cells = [f"{by[(context, c)]:.2f}" if (context, c) in by else "—" for c in columns]
        lines.append(f"| {context} | " + " | ".join(cells) + " |")
    return lines


def model_markdown(entry: dict, settings: dict) -> list[str]:
    n = entry["parameters"]
    lines = [f"## {entry['name']} ({f'{n / 1e9:.2f}B' if n >= 1e8 else f'{n / 1e6:.1f}M'} parameters)", ""]
    if entry["skipped"]:
        return lines + [f"Skipped: {entry['skipped']}.", ""]
    contexts = sorted(settings["contexts"])
    lines += ["Decode: `rows` sequences, one new token each:", ""]
    lines += grid(entry["decode"], contexts, "rows", settings["rows"], "rows") + [""]
    lines += ["Verification: one sequence carrying k+1 new tokens:", ""]
    lines += grid(entry["verify"], contexts, "drafts", settings["drafts"], "k") + [""]
    for p in entry["skipped_points"]:
        lines.append(f"- not measured: context {p['context']}, rows {p['rows']}: {p['reason']}")
    return lines + ([""] if entry["skipped_points"] else [])


def pairs_markdown(table: dict, json_path: str | None) -> list[str]:
    where = json_path or "TABLE.json"
    lines = ["## Fitted sim presets", "", "| pair | context | target base ms | target ms/row | draft base ms | "
             "draft ms/row | as a sim preset |", "|---|---|---|---|---|---|---|"]
    for p in table["pairs"]:
        t, d = p["preset"]["target"], p["preset"]["draft"]
        lines.append(f"| {p['name']} | {p['context']} | {t['base_ms']:.3f} | {t['per_row_ms']:.4f} | "
                     f"{d['base_ms']:.3f} | {d['per_row_ms']:.4f} | `--sim-preset {where}#{p['name']}` |")
    lines += [f"- {p['name']}: not fitted: {p['reason']}" for p in table["unfitted_pairs"]]
    return lines + ["", "Acceptance is not measured: a preset loaded from this table takes the h100-8b-1b "
                        "preset's agreement and second choice."]


def write(table: dict, args) -> None:
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(table, indent=2, allow_nan=False) + "\n")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown(table, args.output))


# -- the command line -------------------------------------------------------------------

LIMITS = {"rows": (1, 256), "contexts": (1, 16384), "drafts": (1, 16)}


def int_list(option: str):
    low, high = LIMITS[option]

    def parse(text: str) -> list[int]:
        try:
            values = sorted({int(v) for v in text.split(",") if v.strip()})
        except ValueError:
            raise argparse.ArgumentTypeError(f"comma-separated integers from {low} to {high}, got {text!r}") from None
        if not values or values[0] < low or values[-1] > high:
            raise argparse.ArgumentTypeError(f"each value must be from {low} to {high}, got {text!r}")
        return values

    return parse


def bounded(kind, low, high):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a number from {low} to {high}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {text!r}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_timing", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu: with --tiny, for tests) [cuda]")
    p.add_argument("--pairs", default=",".join(PAIRS),
                   help="comma-separated pairs [%(default)s]; a model that does not fit the device is skipped "
                        "with a message")
    p.add_argument("--rows", type=int_list("rows"), default="1,2,4,8,16,32,64",
                   help="decode batch sizes (sequences, one new token each); must include 1 [%(default)s]")
    p.add_argument("--contexts", type=int_list("contexts"), default="128,1024,4096",
                   help="KV-cache lengths [%(default)s]")
    p.add_argument("--drafts", type=int_list("drafts"), default="1,2,4,8",
                   help="verification forwards: one sequence of k+1 new tokens, for each k [%(default)s]")
    p.add_argument("--fit-context", type=bounded(int, 1, LIMITS["contexts"][1]), default=None,
                   help="the context the presets are fitted at, one of --contexts [1024 if measured, else the "
                        "longest]")
    p.add_argument("--repeats", type=bounded(int, 1, 1000), default=10,
                   help="timed forwards per point, their median kept [%(default)s]")
    p.add_argument("--warmup", type=bounded(int, 0, 100), default=3, help="untimed forwards before them [%(default)s]")
    p.add_argument("--budget-seconds", type=bounded(float, 1.0, 86400.0), default=360.0,
                   help="no more measurements after this long; what is measured is kept [%(default)s]")
    p.add_argument("--output", default="gpu-timing.json", help="the JSON table; empty: none [%(default)s]")
    p.add_argument("--markdown", default="", help="also write the tables as Markdown here")
    p.add_argument("--tiny", action="store_true", help="tiny configs of the same architectures (tests, CPUs)")
    return p


def settings_of(args, p: argparse.ArgumentParser) -> Settings:
    pairs = [name.strip() for name in args.pairs.split(",") if name.strip()]
    unknown = [name for name in pairs if name not in PAIRS]
    if unknown or not pairs:
        p.error(f"argument --pairs: unknown pair(s) {', '.join(unknown) or '(none given)'}; "
                f"valid pairs: {', '.join(PAIRS)}")
    args.pairs = list(dict.fromkeys(pairs))
    if 1 not in args.rows or len(args.rows) < 2:
        p.error("argument --rows: must include 1 (base_ms is the 1-row forward) and at least one more row count "
                "(per_row_ms is a slope)")
    fit = args.fit_context or (1024 if 1024 in args.contexts else max(args.contexts))
    if fit not in args.contexts:
        p.error(f"argument --fit-context: {fit} is not one of --contexts {','.join(map(str, args.contexts))}")
    check_device(args.device, p)
    return Settings(args.device, args.rows, args.contexts, args.drafts, args.repeats, args.warmup, fit,
                    args.budget_seconds, args.tiny)


def check_device(device: str, p: argparse.ArgumentParser) -> None:
    if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        p.error(f"argument --device: cpu, cuda or cuda:N, got {device!r}")
    if is_cuda(device) and not torch.cuda.is_available():
        p.error(f"argument --device: {device} but torch {torch.__version__} sees no CUDA device "
                "(--device cpu --tiny runs the tool on a CPU)")
    if is_cuda(device) and ":" in device and int(device[5:]) >= torch.cuda.device_count():
        p.error(f"argument --device: {device}, but there are {torch.cuda.device_count()} CUDA devices")


def model_or_skip(name: str, settings: Settings, clock: Clock, timed: dict) -> dict:
    if clock.spent():
        return {"name": name, "skipped": "the budget was spent before it", "parameters": 0,
                "decode": [], "verify": [], "skipped_points": []}
    timed[name] = time_model(MODELS[name], settings, clock)
    return timed[name]


def run(settings: Settings, pairs: list[str], args) -> dict:
    clock = Clock(settings.budget_seconds)
    table = {"tool": "tools.gpu_timing", "date": time.strftime("%Y-%m-%d"), "tiny": settings.tiny,
             "note": (TINY_NOTE + " " + NOTE) if settings.tiny else NOTE, "machine": machine(settings.device),
             "settings": {k: getattr(settings, k) for k in ("rows", "contexts", "drafts", "repeats", "warmup",
                                                           "fit_context", "budget_seconds")},
             "stopped": None, "elapsed_s": 0.0, "models": [], "pairs": [], "unfitted_pairs": []}
    log(clock, f"{table['machine']['device']}: timing {', '.join(pairs)}{' (TINY configs)' if settings.tiny else ''}")
    timed: dict[str, dict] = {}
    threads = torch.get_num_threads()
    if not is_cuda(settings.device):
        torch.set_num_threads(1)  # tiny forwards: threads that wait on each other only add noise
    try:
        with torch.inference_mode():
            for name in dict.fromkeys(model for pair in pairs for model in PAIRS[pair]):
                table["models"].append(model_or_skip(name, settings, clock, timed))
                table["pairs"], table["unfitted_pairs"] = fit_pairs(pairs, timed, settings)
                table["elapsed_s"] = round(clock.elapsed(), 1)
                write(table, args)  # after every model: a run cut short keeps what it measured
    finally:
        torch.set_num_threads(threads)
    table["pairs"], table["unfitted_pairs"] = fit_pairs(pairs, timed, settings)
    table["stopped"] = f"the budget of {settings.budget_seconds:.0f} s was spent" if clock.stopped else None
    table["elapsed_s"] = round(clock.elapsed(), 1)
    return table


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    settings = settings_of(args, p)
    table = run(settings, args.pairs, args)
    write(table, args)
    print(markdown(table, args.output))
    written = [path for path in (args.output, args.markdown) if path]
    print(f"done in {table['elapsed_s']} s; written: {', '.join(written) or 'nothing'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
